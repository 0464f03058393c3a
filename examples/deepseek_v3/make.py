"""Regenerate examples/deepseek_v3: a tiny random DeepSeek V3 and its own attention numbers.

A 2-layer DeepSeek V3 (hidden 16, 4 heads; latent attention: q_lora_rank 5,
kv_lora_rank 6, each head 4 features without position + 4 rotary, values of
3; interleaved RoPE pairs (rope_interleave); YaRN with factor 4 and
mscale_all_dim 0.5, so the softmax scale is not 1/sqrt(8)) built with
transformers from a config, every parameter random, saved with
save_pretrained into model/. A forward hook on layer 1's attention keeps its
input (the hidden states) and its output (after o_proj) for 9 tokens:
inputs.safetensors (query, positions) and expected.safetensors (output).
Needs torch and transformers:

    python examples/deepseek_v3/make.py [--out DIR]   (default: beside this file)
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
    config = transformers.DeepseekV3Config(
        hidden_size=16, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=5, kv_lora_rank=6,
        qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=3, num_hidden_layers=2, first_k_dense_replace=2,
        intermediate_size=16, vocab_size=64, max_position_embeddings=16, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4,
                         "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 32.0, "beta_slow": 1.0})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.3)  # random weights, norm scales around 1
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
    parser.add_argument("--out", type=Path, default=HERE, help="folder to write (default: examples/deepseek_v3)")
    main(parser.parse_args().out)
