"""Regenerate examples/qwen3: a tiny random Qwen3 and its own attention numbers.

A 2-layer Qwen3 (hidden 32, GQA 4 query heads on 2 kv heads, head_dim 8,
per-head QK-norm, RoPE, a window of 4 keys on layer 1) built with
transformers from a config, every parameter random, saved with
save_pretrained into model/. A forward hook on layer 1's attention keeps its
input (the hidden states) and its output (after o_proj) for 9 tokens:
inputs.safetensors (query, positions) and expected.safetensors (output), the
numbers `mha run --expect` holds a converted block to (README, "Porting a
modern checkpoint"). Needs torch and transformers:

    python examples/qwen3/make.py [--out DIR]   (default: beside this file)
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.numpy import save_file

HERE = Path(__file__).resolve().parent
TOKENS = 9


def main(out: Path = HERE) -> None:
    config = transformers.Qwen3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      num_hidden_layers=2, intermediate_size=32, vocab_size=64,
                                      use_sliding_window=True, sliding_window=4, max_window_layers=1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2)  # random weights, norm scales around 1
    shutil.rmtree(out / "model", ignore_errors=True)
    model.save_pretrained(out / "model")

    seen = {}

    def hook(module, args, kwargs, output):
        seen["query"], seen["output"] = kwargs["hidden_states"].numpy().copy(), output[0].numpy().copy()

    model.model.layers[1].self_attn.register_forward_hook(hook, with_kwargs=True)
    with torch.no_grad():
        model(input_ids=torch.arange(3, 3 + TOKENS)[None], position_ids=torch.arange(TOKENS)[None])
    save_file({"query": seen["query"], "positions": np.arange(TOKENS, dtype=np.int64)},
              str(out / "inputs.safetensors"))
    save_file({"output": seen["output"]}, str(out / "expected.safetensors"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help="folder to write (default: examples/qwen3)")
    main(parser.parse_args().out)
