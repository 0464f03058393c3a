"""mlx-lm's attention ports, judged against the spec and transformers (a table of `mha check --conventions`).

mlx-lm (Apple's MLX language-model package) ships its own attention for each model type, written by hand
from transformers' code. For every model type whose attention block our layouts reproduce (weights/layouts:
hf-llama, hf-deepseek, hf-minimax, hf-gpt-neox, hf-gptj, hf-gpt2) that mlx-lm also ships, this module:

1. builds a tiny randomly initialised transformers model (eager attention, float32; the features its
   family uses turned on: windows, softcap, QK-norm, sinks, partial or scaled RoPE, NoPE layers, chunks,
   latent attention), saves it with save_pretrained, and captures each block's attention input and
   output (forward hooks) on a causal batch of B = 2 rows of T tokens;
2. loads the same folder as mlx-lm loads a checkpoint (mlx_lm.utils.load_model: config.json -> its
   ModelArgs.from_dict, the Model, its sanitize(), its key names), and runs mlx-lm's own model on the
   same token ids, with each attention module's input replaced by transformers' captured input (so both
   judge the same x: the rest of the model, MLP and norms, is not what is judged), in float32:
   prefill (the whole causal call, mlx-lm's own mask) and decode (a prefix of P tokens into mlx-lm's own
   KV cache, mlx_lm.models.cache.make_prompt_cache, then one token at a time);
3. judges mlx-lm's outputs against the float64 NumPy reference (impl_numpy) run on the block's weights as
   our layout converts them, and against transformers' own output, under the project's tolerance policy
   (conformance/suite/tolerance.py: float32, each element's allowance from the magnitudes of the terms it
   is summed from, impl_numpy.magnitudes, as `mha check` judges a backend);
4. where mlx-lm differs, names the first stage that differs: its projections (q_proj, k_proj, v_proj),
   its QK-norms, its RoPE (the rope module's output), the scale, mask and softmax through what reached
   mx.fast.scaled_dot_product_attention (q, k, v, scale, mask, sinks), the merged heads (o_proj's input)
   and the output, each against the reference's trace of the same stage, under the policy's stage
   tolerance (conformance.suite.compare.localise's rule); a decode that differs, step by step on mlx-lm's
   cache against the reference's row of each step (mlx_lm_stages.py);
5. calls mlx-lm's rope module alone at positions FAR.. against the contract's rotation there (rope_far:
   a frequency a little off hides under a T-token output's allowance and shows far out);
6. for a model with a lightning indexer (deepseek_v32, glm_moe_dsa, minimax_m3_vl), captures the keys or
   blocks mlx-lm's own top-k keeps in the prefill call and judges them against the reference's selection
   under the policy's top-k rule (mlx_lm_selection.py; conformance/suite/selection.py); a block whose
   selection differs names "indexer selection" as its first differing stage.

Each model runs twice: with config.json as transformers 5 saves it, and in the Hub's (transformers 4.x)
form that mlx-lm reads (hub_form, hub_weights); the port's verdict is the second's, the first a column.

Shape letters as in impl_numpy: B batch, T query length, S key length, N heads, K key/value heads, H head
dim, D model width.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from conformance.native.mlx_lm_harness import (  # noqa: F401 (re-exported: the tests and mlx_lm_stages read them)
    B,
    P,
    T,
    _get,
    _mlx_layers,
    judge,
    recording,
    reference,
    run_mlx,
    token_ids,
)

FAR, FAR_L = 4096, 8  # the rotation alone at positions FAR..FAR+FAR_L-1: where a frequency's error shows

_SMALL = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=2,
              intermediate_size=32, vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              max_position_embeddings=64)
_GATED_TEXT = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=32,
                   vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=64)
_LINEAR = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
               linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
_DEEPSEEK = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=6, qk_nope_head_dim=4,
                 qk_rope_head_dim=4, v_head_dim=3, num_hidden_layers=2, first_k_dense_replace=2, intermediate_size=16,
                 moe_intermediate_size=8, n_routed_experts=2, num_experts_per_tok=1, vocab_size=64,
                 max_position_embeddings=64, rms_norm_eps=0.25, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_INDEXER = dict(q_lora_rank=5, index_n_heads=4, index_head_dim=8, index_topk=3)
_MINIMAX = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=8, index_n_heads=2,
                index_head_dim=8, index_block_size=2, index_topk_blocks=2, index_local_blocks=1, num_hidden_layers=2,
                layer_types=["minimax_m3_sparse", "full_attention"], vocab_size=64, rms_norm_eps=1e-6,
                intermediate_size=16, eos_token_id=2, pad_token_id=0, bos_token_id=1, max_position_embeddings=64,
                rotary_dim=4, rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5})
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4,
         "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 32.0, "beta_slow": 1.0}


@dataclasses.dataclass(frozen=True)
class Port:
    """One row: a model type (and its variant), the config's kwargs, our layout, where its blocks are."""
    model_type: str
    kwargs: dict
    layout: str = "hf-llama"
    blocks: str = "model.layers"  # transformers' path to the blocks
    attribute: str = "self_attn"  # the block's attention (transformers and mlx-lm alike, unless mlx_attribute)
    mlx_attribute: str | None = None
    layers: tuple[int, ...] = (0, 1)
    multimodal: bool = False
    wrap: str | None = None  # the Hub's checkpoints wrap this text model as model_type `wrap` (text_config,
    # weights under wrap_keys[1] instead of wrap_keys[0]): the Hub form loads that way (mlx-lm's module for it)
    wrap_keys: tuple[str, str] = ("", "language_model.")
    hub_model_type: str | None = None  # the Hub form's model_type where the released configs say another
    note: str = ""  # what the variant turns on, for the table
    hub_renames: tuple[tuple[str, str], ...] = ()  # the Hub form's key names: (transformers 5's part, the release's)


# name -> Port. Each model type with the features its family uses turned on, at T tokens (longer than every
# window and chunk below, so decode crosses them).
PORTS: dict[str, Port] = {
    "llama": Port("llama", dict(_SMALL, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}), note="llama3 RoPE scaling"),
    "mistral": Port("mistral", dict(_SMALL, sliding_window=3), note="sliding_window 3"),
    "qwen2": Port("qwen2", dict(_SMALL, use_sliding_window=True, sliding_window=4, max_window_layers=1),
                  note="layer 1 slides (window 4)"),
    "qwen3": Port("qwen3", dict(_SMALL), note="QK-norm per head"),
    "qwen3 attention_bias": Port("qwen3", dict(_SMALL, attention_bias=True), note="QK-norm per head, biases"),
    "gemma2": Port("gemma2", dict(_SMALL, sliding_window=3, attn_logit_softcapping=3.0, query_pre_attn_scalar=12),
                   note="softcap 3, window 3, query_pre_attn_scalar 12"),
    # model_type gemma3, the multimodal checkpoints' (mlx-lm's gemma3.py around gemma3_text.py): the text
    # model's keys under language_model. as Google's released checkpoints (transformers 4.x) have them
    "gemma3": Port("gemma3_text", dict(_SMALL, sliding_window=4, query_pre_attn_scalar=12,
                                       layer_types=["sliding_attention", "full_attention"]),
                   wrap="gemma3", note="model_type gemma3: QK-norm, layer 0 window 4"),
    "gemma3_text": Port("gemma3_text", dict(_SMALL, sliding_window=4, query_pre_attn_scalar=12,
                                            layer_types=["sliding_attention", "full_attention"]),
                        note="QK-norm, layer 0 window 4"),
    "olmo2": Port("olmo2", dict(_SMALL), note="QK-norm over the whole projection"),
    "gpt_oss": Port("gpt_oss", dict(_SMALL, sliding_window=3, num_local_experts=2, num_experts_per_tok=1),
                    note="sinks, window 3"),
    "phi3": Port("phi3", dict(_SMALL, partial_rotary_factor=0.5, sliding_window=5),
                 note="partial RoPE (half), window 5"),
    "phi3 longrope": Port("phi3", dict(_SMALL, original_max_position_embeddings=4, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.5, 2.0, 3.0],
        "long_factor": [1.0, 4.0, 9.0, 16.0]}), note="longrope, T past original_max_position_embeddings 4"),
    "llama4_text": Port("llama4_text", dict(_SMALL, no_rope_layers=[1, 0], attention_chunk_size=4, floor_scale=4,
                                            attn_scale=0.5, use_qk_norm=True, num_local_experts=2,
                                            intermediate_size_mlp=32, rms_norm_eps=1e-2),
                        note="layer 0 RoPE + chunks of 4 + L2 norm; layer 1 NoPE + temperature"),
    # model_type llama4, as Meta's released checkpoints carry it (mlx-lm's llama4.py; llama4_text.py above is
    # what a bare text config gets): 4 blocks, block 3 NoPE (no_rope_layer_interval 4); rms_norm_eps 1e-5 as
    # Llama 4 Scout's config.json (the L2 QK-norm's eps in transformers)
    "llama4": Port("llama4_text", dict(_SMALL, num_hidden_layers=4, attention_chunk_size=4, floor_scale=4,
                                       attn_scale=0.5, use_qk_norm=True, num_local_experts=2,
                                       intermediate_size_mlp=32, rms_norm_eps=1e-5), layers=(0, 3), wrap="llama4",
                   note="model_type llama4: block 0 RoPE + chunks of 4 + L2 norm; block 3 NoPE + temperature"),
    "smollm3": Port("smollm3", dict(_SMALL, no_rope_layers=[1, 0], use_sliding_window=True, sliding_window=4),
                    note="layer 1 NoPE"),
    "ministral3": Port("ministral3", dict(_SMALL, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0, "original_max_position_embeddings": 4,
        "llama_4_scaling_beta": 0.5}), note="YaRN, llama_4_scaling_beta"),
    "granite": Port("granite", dict(_SMALL, attention_multiplier=0.3), note="attention_multiplier 0.3"),
    "cohere": Port("cohere", dict(_SMALL, use_qk_norm=True, layer_norm_eps=1e-2),
                   note="interleaved RoPE, QK LayerNorm"),
    "cohere2": Port("cohere2", dict(_SMALL, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
                    note="layer 0 RoPE + window 4, layer 1 NoPE"),
    "qwen3_next": Port("qwen3_next", dict(_GATED_TEXT, **_LINEAR, num_experts=2, num_experts_per_tok=1,
                                          moe_intermediate_size=16, shared_expert_intermediate_size=16),
                       layers=(1,), note="output gate, partial RoPE"),
    "gemma4_text": Port("gemma4_text", dict(_GATED_TEXT, num_hidden_layers=2,
                                            layer_types=["sliding_attention", "full_attention"], sliding_window=3,
                                            attention_k_eq_v=True, global_head_dim=32, num_global_key_value_heads=1,
                                            hidden_size_per_layer_input=8, vocab_size_per_layer_input=64),
                        note="window 3; layer 1 k = v, proportional RoPE"),
    # model_type gemma4 (mlx-lm's gemma4.py): the text model's keys under model.language_model. (transformers 5's
    # form, which mlx-lm's sanitize reads)
    "gemma4": Port("gemma4_text", dict(_GATED_TEXT, num_hidden_layers=2,
                                       layer_types=["sliding_attention", "full_attention"], sliding_window=3,
                                       attention_k_eq_v=True, global_head_dim=32, num_global_key_value_heads=1,
                                       hidden_size_per_layer_input=8, vocab_size_per_layer_input=64),
                   wrap="gemma4", wrap_keys=("model.", "model.language_model."),
                   note="model_type gemma4: window 3; layer 1 k = v, proportional RoPE"),
    # the multimodal Qwen3.5 (vision tower included, as released): mlx-lm's qwen3_5.py drops the tower
    "qwen3_5": Port("qwen3_5", dict(text_config=dict(_GATED_TEXT, **_LINEAR, attention_bias=True),
                                    vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                                                       out_hidden_size=32, patch_size=4, num_position_embeddings=16),
                                    image_token_id=60, video_token_id=61, vision_start_token_id=62,
                                    vision_end_token_id=63),
                    multimodal=True, blocks="model.language_model.layers", layers=(1,),
                    note="output gate with its bias, partial RoPE"),
    "deepseek_v2": Port("deepseek_v2", dict(_DEEPSEEK, q_lora_rank=5, rope_parameters=_YARN), layout="hf-deepseek",
                        layers=(1,), note="MLA, YaRN"),
    "deepseek_v3": Port("deepseek_v3", dict(_DEEPSEEK, q_lora_rank=5, rope_interleave=True, rope_parameters=_YARN),
                        layout="hf-deepseek", layers=(1,), note="MLA, YaRN (mscale_all_dim 0.5)"),
    # the lightning indexer (docs/sparse-attention.md): index_topk 3 of T = 9 keys, so late queries drop keys
    "deepseek_v32": Port("deepseek_v32", dict(_DEEPSEEK, **_INDEXER), layout="hf-deepseek",
                         layers=(0, 1), note="MLA + lightning indexer (top-3 of 9, half-split RoPE)"),
    # GLM-5: every layer runs its indexer (config.json without index_topk_pattern / indexer_types)
    "glm_moe_dsa": Port("glm_moe_dsa", dict(_DEEPSEEK, **_INDEXER, mlp_layer_types=["dense", "dense"]),
                        layout="hf-deepseek", note="MLA + indexer (top-3 of 9, interleaved RoPE)"),
    # transformers' shared layers: layer 1 takes layer 0's selection (index_topk_pattern "FS")
    # (this model's layer 0 has an exact tie at the k-th score of one query, both keys ReLU'd to 0 on every
    # index head, which mlx-lm's argpartition may break the other way: an admissible swap, after which the
    # policy judges the output on mlx-lm's own selection, _own_selection_references)
    "glm_moe_dsa shared": Port("glm_moe_dsa", dict(_DEEPSEEK, **_INDEXER, index_topk_pattern="FS",
                                                   mlp_layer_types=["dense", "dense"]), layout="hf-deepseek",
                               note="index_topk_pattern FS: layer 1 shares layer 0's selection"),
    # MiniMax M3's text model (model_type minimax_m3_vl_text), loaded as the released VL checkpoint
    # (mlx-lm's minimax_m3_vl.py: text_config, keys under language_model.): layer 0 sparse, blocks of 2
    # keys, 2 blocks kept of 5 (one of them the query's local block), layer 1 dense
    "minimax_m3_vl": Port("minimax_m3_vl_text", _MINIMAX, layout="hf-minimax", wrap="minimax_m3_vl",
                          wrap_keys=("", "language_model."), hub_renames=(("self_attn.indexer.", "self_attn.index_"),),
                          note="model_type minimax_m3_vl: layer 0 block-sparse (2 blocks of 2 kept, 1 local)"),
    # intermediate_size 4 * hidden_size: mlx-lm's GPT-NeoX MLP has that width whatever config.json says
    # Kimi K2's released config.json: model_type kimi_k2 (mlx-lm remaps it to deepseek_v3), YaRN with betas 1, 1
    "kimi_k2": Port("deepseek_v3", dict(_DEEPSEEK, q_lora_rank=5, rope_interleave=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0, "original_max_position_embeddings": 4,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 1.0, "beta_slow": 1.0}), layout="hf-deepseek",
                    layers=(1,), hub_model_type="kimi_k2", note="model_type kimi_k2: MLA, YaRN betas 1, 1"),
    "gpt_neox": Port("gpt_neox", dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                                      intermediate_size=128, vocab_size=64, max_position_embeddings=64,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1000.0,
                                                       "partial_rotary_factor": 0.5}),
                     layout="hf-gpt-neox", blocks="gpt_neox.layers", attribute="attention",
                     note="fused qkv, partial RoPE"),
    "gptj": Port("gptj", dict(n_embd=32, n_head=4, n_layer=2, rotary_dim=4, vocab_size=64, n_positions=64),
                 layout="hf-gptj", blocks="transformer.h", attribute="attn", note="interleaved partial RoPE"),
    "gpt2": Port("gpt2", dict(n_embd=32, n_head=4, n_layer=2, vocab_size=64, n_positions=64,
                              scale_attn_by_inverse_layer_idx=True),
                 layout="hf-gpt2", blocks="transformer.h", attribute="attn", note="scale_attn_by_inverse_layer_idx"),
}

KEYS = ("transformers_config", "verdict", "prefill", "decode", "vs_transformers", "far", "selection", "first_stage")
COLUMNS = (("model type", "api"), ("config.json as transformers 5 saves it", "transformers_config"),
           ("mlx-lm's port (config.json in the Hub's 4.x form)", "verdict"),
           ("prefill: max err (margin)", "prefill"), ("decode: max err (margin)", "decode"),
           ("vs transformers: max err (margin)", "vs_transformers"),
           (f"RoPE alone at positions {FAR}+: max err (margin)", "far"),
           ("indexer's prefill selection vs the spec's (top-k policy)", "selection"), ("first stage that differs, and why", "first_stage"))
SETUP = (f"tiny random transformers models, B={B}, T={T}, decode: {P} tokens then {T - P} steps on mlx-lm's own "
         "cache; mlx-lm in float32 on transformers' attention input, against the float64 reference on our "
         "converted block and against transformers' output, float32 policy with allowances from magnitudes; "
         "margin = error / allowance (<= 1 agrees), worst block of the model")
MLX_EXTRA = "pip install -c constraints/cpu.txt '.[mlx-lm]'"
MODULES = ("mlx", "mlx_lm", "torch", "transformers")  # what a row needs; a row without one says "not installed"


# -- transformers' side ------------------------------------------------------------------------------

def build_hf(port: Port):
    """The tiny transformers model of `port`, every parameter random (norms, sinks and biases too); the
    global torch RNG is left as it was."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(port.model_type, **port.kwargs)
    auto = transformers.AutoModelForImageTextToText if port.multimodal else transformers.AutoModelForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = auto.from_config(config, attn_implementation="eager", dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if port.layout == "hf-deepseek":
                    param.normal_(1.0 if "norm" in name else 0.0, 0.3)
                else:
                    big = "norm" in name or "sinks" in name or "bias" in name or "ln" in name
                    param.normal_(0.0, 0.5 if big else 0.2)
    return model.eval()


def capture_hf(model, port: Port) -> dict[int, dict]:
    """{layer: {"x": attention input (B, T, D), "out": attention output (B, T, D)}} of the model's causal
    forward on token_ids()."""
    import torch

    blocks = _get(model, port.blocks)
    seen: dict[int, dict] = {}
    hooks = []
    for index in port.layers:
        def hook(module, args, kwargs, output, index=index):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            out = output[0] if isinstance(output, tuple) else output
            seen[index] = {"x": hidden.detach().numpy().copy(), "out": out.detach().numpy().copy()}
        hooks.append(getattr(blocks[index], port.attribute).register_forward_hook(hook, with_kwargs=True))
    ids = torch.tensor(token_ids())
    try:
        with torch.no_grad():
            model(input_ids=ids, position_ids=torch.arange(T).expand(B, T), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def references(port: Port, blocks: dict, seen: dict) -> dict:
    """{layer: the float64 reference of block `layer` on transformers' input}; a layer without an indexer of
    its own in a model whose earlier layer has one (GLM-5's shared layers, index_topk_pattern S) attends to
    that layer's selection, as transformers' model does (the reference's indexer on the earlier layer's input)."""
    from impl_numpy.indexer import lightning_indexer

    refs, selection = {}, None
    for layer in sorted(port.layers):
        config, tensors = blocks[layer]
        x = seen[layer]["x"]
        if config.indexer is not None:
            wide = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
            selection = lightning_indexer(config, wide, np.asarray(x, np.float64), positions=np.arange(T),
                                          is_causal=True)["topk_indices"]
            refs[layer] = reference(config, tensors, x)
        else:
            shared = port.model_type == "glm_moe_dsa" and selection is not None
            refs[layer] = reference(config, tensors, x, selection if shared else None)
    return refs


def convert(model, folder: Path, port: Port, layer: int):

    """(AttentionConfig, canonical tensors) of block `layer`, read by our layout from the model's state dict
    and the config.json save_pretrained wrote."""
    from weights import layouts

    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return layouts.to_canonical(port.layout, state, hf_config=json.loads((folder / "config.json").read_text()),
                                layer=layer)


# -- mlx-lm's side -----------------------------------------------------------------------------------

def hub_form(cfg: dict) -> dict:
    """config.json in the form the Hub's checkpoints carry, transformers 4.x's: the RoPE fields that
    transformers 5 writes inside rope_parameters also at the top level (rope_theta, rope_scaling with its
    "type", partial_rotary_factor; GPT-NeoX's rotary_pct and rotary_emb_base), GPT-2's n_ctx, and the
    periodic sliding_window_pattern that Gemma 3 and Cohere 2 configs carried beside layer_types, Qwen3-Next's
    full_attention_interval, and Gemma 4's global_head_dim and num_global_key_value_heads (per_layer_config
    in transformers 5)."""
    out = dict(cfg)
    text = out.get("text_config") if isinstance(out.get("text_config"), dict) else None
    if text is not None:
        out["text_config"] = hub_form(text)
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict):
        if "rope_theta" in rope:
            out.setdefault("rope_theta", rope["rope_theta"])
        if "partial_rotary_factor" in rope:
            out.setdefault("partial_rotary_factor", rope["partial_rotary_factor"])
        kind = rope.get("rope_type", "default")
        out.setdefault("rope_scaling", None if kind == "default" else  # 4.x wrote null for the default rule
                       {**{k: v for k, v in rope.items() if k != "rope_theta"}, "type": kind})
    if cfg.get("model_type") == "gpt_neox":
        out.setdefault("rotary_pct", out.get("partial_rotary_factor", 1.0))
        out.setdefault("rotary_emb_base", out.get("rope_theta", 10000.0))
    if cfg.get("model_type") == "glm_moe_dsa":  # fields mlx-lm's ModelArgs requires (the MoE router's: not attention)
        out.setdefault("topk_method", "noaux_tc")
        out.setdefault("scoring_func", "sigmoid")
        out.setdefault("moe_layer_freq", 1)
    if cfg.get("model_type") == "gpt2":
        out.setdefault("n_ctx", cfg.get("n_positions", 1024))
    kinds = cfg.get("layer_types")
    if isinstance(kinds, list) and "full_attention" in kinds and "sliding_attention" in kinds:
        out.setdefault("sliding_window_pattern", kinds.index("full_attention") + 1)
    overrides = cfg.get("per_layer_config")
    if isinstance(kinds, list) and isinstance(overrides, dict) and "full_attention" in kinds:
        # Gemma 4: transformers 5 keeps global_head_dim and num_global_key_value_heads as per-layer overrides
        first = overrides.get(str(kinds.index("full_attention")), overrides.get(kinds.index("full_attention"), {}))
        if "head_dim" in first:
            out.setdefault("global_head_dim", first["head_dim"])
        if "num_key_value_heads" in first:
            out.setdefault("num_global_key_value_heads", first["num_key_value_heads"])
    if isinstance(kinds, list) and "full_attention" in kinds and "linear_attention" in kinds:
        out.setdefault("full_attention_interval", kinds.index("full_attention") + 1)
    return out


def hub_weights(folder: Path, prefix: tuple[str, str] | None = None,
                rename: tuple[tuple[str, str], ...] = ()) -> None:
    """model.safetensors in the Hub's form. prefix None: GPT-2's (openai-community/gpt2: GPT2Model's keys,
    h.{L}..., no "transformer." prefix, which save_pretrained of GPT2LMHeadModel writes and mlx-lm's sanitize
    does not strip); else (old, new): every key's leading `old` replaced by `new` (a text model inside a
    multimodal checkpoint)."""
    from safetensors.numpy import load_file, save_file

    path = folder / "model.safetensors"
    state = load_file(path)
    if prefix is None:
        state = {k.removeprefix("transformer."): v for k, v in state.items() if k != "lm_head.weight"}
    else:
        old, new = prefix
        state = {new + k.removeprefix(old): v for k, v in state.items()}
    for part, released in rename:  # e.g. MiniMax M3's self_attn.indexer.q_proj -> self_attn.index_q_proj
        state = {k.replace(part, released): v for k, v in state.items()}
    save_file(state, path, metadata={"format": "pt"})


def load_mlx(folder: Path, cfg: dict) -> tuple[Any, str]:
    """mlx-lm's model of the folder with `cfg` as its config.json, loaded as mlx-lm loads a checkpoint
    (mlx_lm.utils.load_model: config.json -> ModelArgs.from_dict, the Model, its sanitize(), strict key
    names), and a note: "" where the strict load took every key; else what it refused, after which the
    folder is loaded non-strict (the keys mlx-lm does not read are left at its own initialisation: a
    block whose attention keys it refused is then judged on random weights and differs)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    mx.random.seed(0)  # what a non-strict load leaves at mlx-lm's initialisation: the same in every run
    (folder / "config.json").write_text(json.dumps(cfg))
    try:
        return load_model(folder)[0], ""
    except ValueError as err:
        if "parameters not in model" not in str(err) and "Missing" not in str(err):
            raise
        note = " ".join(str(err).split())
    return load_model(folder, strict=False)[0], note


def rope_far(model, port: Port, layer: int, config, attribute: str | None = None):
    """mlx-lm's rope module of block `layer` alone, called with offset FAR on x (1, 2, FAR_L, W) (W the head
    dim, a latent layer's rotary width), against the contract's rotation at positions FAR.. (impl_numpy's rope
    with weights.rope's tables) under the policy's stage allowance there (its RoPE term grows with the
    position: conformance.suite.tolerance.modern_length). None where the block has no rope or mlx-lm's has
    no rope(x, offset=) module. At T tokens a frequency off by a little moves the output by position x
    error: a YaRN ramp rounded where the config says not to is within the output's allowance at position 8
    and not at 4096."""
    import mlx.core as mx

    from conformance.suite.tolerance import compare, policy_for
    from impl_numpy.functional import rope, rope_angles
    from weights.rope import rope_tables

    attention = _mlx_layers(model)[layer][attribute or port.mlx_attribute or port.attribute]
    module = attention.get("rope") if isinstance(attention, dict) else None
    if config.rope is None or module is None:
        return None
    width = config.rope.rotary_dim if config.latent is not None else config.head_dim
    x = np.random.default_rng(11).standard_normal((1, 2, FAR_L, width)).astype(np.float32)
    try:
        got = np.array(module(mx.array(x), offset=FAR).astype(mx.float32))
    except TypeError:
        return None
    positions = np.arange(FAR, FAR + FAR_L)[None]
    inv_freq, factor = rope_tables(config.rope, FAR + FAR_L - 1)
    angles = rope_angles(positions, inv_freq, np.dtype(np.float64))
    want = rope(x.astype(np.float64), angles, config.rope.rotary_dim or width, config.rope.interleaved, factor)
    tol = policy_for(config, dtype="float32", quantity="stage", B=1, T=FAR_L, S=FAR_L, reference=want,
                     max_position=FAR + FAR_L - 1, magnitude=np.abs(x).astype(np.float64) * max(factor, 1.0))
    return compare(f"{port.model_type}[{layer}] mlx-lm rope at {FAR}..", got, want, tol)


@dataclasses.dataclass
class BlockResult:
    layer: int
    prefill: Any  # Comparison against the reference
    decode: Any
    vs_transformers: Any  # mlx-lm's prefill against transformers' output
    transformers: Any  # transformers' output against the reference (the layout's own check)
    far: Any = None  # mlx-lm's rope alone at positions FAR.. (rope_far); None without one

    @property
    def ok(self) -> bool:
        return bool(self.prefill.ok and self.decode.ok and self.vs_transformers.ok and
                    (self.far is None or self.far.ok))


FORMS = ("transformers", "hub")  # config.json as transformers 5 saves it; in the Hub's (4.x) form


def measure_port(name: str, *, mutate=None) -> dict:
    """One row's cells and evidence for PORTS[name]. mutate: applied to mlx-lm's loaded model before it
    runs (a planted porting bug: tests/test_mlx_lm_ports.py)."""
    port = PORTS[name]
    with warnings.catch_warnings(), tempfile.TemporaryDirectory() as tmp:
        warnings.simplefilter("ignore")
        folder = Path(tmp)
        hf = build_hf(port)
        hf.save_pretrained(folder)
        saved = json.loads((folder / "config.json").read_text())
        seen = capture_hf(hf, port)
        blocks = {layer: convert(hf, folder, port, layer) for layer in port.layers}
        refs = references(port, blocks, seen)
        runs = {}
        for form in FORMS:
            try:
                cfg = saved if form == "transformers" else hub_form(saved)
                if form == "hub" and port.model_type == "gpt2":
                    hub_weights(folder)
                if form == "hub" and port.wrap:
                    hub_weights(folder, prefix=port.wrap_keys, rename=port.hub_renames)
                    cfg = {"model_type": port.wrap, "text_config": cfg, "vocab_size": cfg.get("vocab_size")}
                if form == "hub" and port.hub_model_type:
                    cfg = {**cfg, "model_type": port.hub_model_type}
                model, note = load_mlx(folder, cfg)
                if mutate is not None:
                    mutate(model)
                with _capturing(port) as records:
                    got = run_mlx(model, port, seen)
                selections = _selections(model, port, records, blocks, seen, form)
                owns = _own_selection_references(model, port, records, blocks, seen, selections)
            except Exception as err:  # noqa: BLE001 (a port that cannot load or run is this row's finding)
                runs[form] = {"error": _short(err)}
                continue
            results = []
            for layer in port.layers:
                config, ref, label = blocks[layer][0], refs[layer], f"{name}[{layer}] {form} config"
                far = rope_far(model, port, layer, config)
                own, theirs = owns.get(layer, ({"prefill": ref, "decode": ref}, seen[layer]["out"]))
                results.append(BlockResult(
                    layer,
                    judge(f"{label} mlx-lm prefill", got[layer]["prefill"], own["prefill"], config),
                    judge(f"{label} mlx-lm decode", got[layer]["decode"], own["decode"], config, rows=slice(P, T)),
                    judge(f"{label} mlx-lm vs transformers", got[layer]["prefill"], own["prefill"], config,
                          expected=theirs),
                    judge(f"{label} transformers", seen[layer]["out"], ref, config), far))
            runs[form] = {"results": results, "model": model, "note": note, "selections": selections}
    return summarise(port, runs, seen, blocks, refs)


def _capturing(port: Port):
    """mlx-lm's indexer selections recorded while its model runs (mlx_lm_selection), for a port with one."""
    import contextlib

    from conformance.native import mlx_lm_selection

    if port.model_type not in mlx_lm_selection.HOOKS:
        return contextlib.nullcontext([])
    return mlx_lm_selection.capturing(port.model_type)


def _selections(model, port: Port, records, blocks, seen, form: str) -> dict:
    """{layer: SelectionComparison or None (no top-k run)} of the blocks whose selection mlx-lm computes
    itself: the first (prefill) call of each selecting module."""
    from conformance.native import mlx_lm_selection

    if port.model_type not in mlx_lm_selection.HOOKS:
        return {}
    ids = mlx_lm_selection.selector_ids(model, port.model_type, port.layers)
    first: dict[int, Any] = {}
    for module, selection in records:
        if module in ids and ids[module] not in first:
            first[ids[module]] = selection
    out = {}
    for layer, selection in sorted(first.items()):
        config, tensors = blocks[layer]
        if config.indexer is None:  # a block the spec gives no indexer of its own (GLM-5's shared layers)
            out[layer] = "runs an indexer the model does not have"
            continue
        out[layer] = mlx_lm_selection.judge(port.model_type, config, tensors, seen[layer]["x"], selection,
                                            name=f"{port.model_type}[{layer}] {form} config mlx-lm selection")
    return out


def _own_selection_references(model, port: Port, records, blocks, seen, selections) -> dict:
    """{layer: (references on mlx-lm's own selections, transformers' output to judge against)} for each block
    whose selection agrees with the spec's only up to admissible swaps (an exact tie at the k-th score broken
    the other way: conformance/suite/selection.py): the policy judges such a port's output against the
    reference computed with its own selection. transformers' output (its own tie-break) stands on the
    queries where mlx-lm kept the spec's keys; on a swapped query the reference on mlx-lm's selection does."""
    from conformance.native import mlx_lm_selection
    from impl_numpy.indexer import lightning_indexer

    ids = {layer: module for module, layer in mlx_lm_selection.selector_ids(model, port.model_type, port.layers).items()}
    out = {}
    for layer, c in selections.items():
        if isinstance(c, str) or c is None or not c.ok or not c.swaps:
            continue
        config, tensors = blocks[layer]
        x = seen[layer]["x"]
        calls = [selection for module, selection in records if module == ids[layer]]
        own = mlx_lm_selection.own_references(port.model_type, config, tensors, x, calls, T=T, P=P)
        wide = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
        spec = lightning_indexer(config, wide, np.asarray(x, np.float64), positions=np.arange(T),
                                 is_causal=True)["topk_indices"]
        swapped = mlx_lm_selection.swapped_queries(own["prefill_keys"], spec if spec.ndim == 4 else spec[:, None])
        theirs = np.where(swapped[..., None], own["prefill"]["output"], seen[layer]["out"])
        out[layer] = (own, theirs)
    return out


def _selection_differs(c) -> bool:
    return isinstance(c, str) or (c is not None and not c.ok)


def _selection_cell(selections: dict, port: Port, blocks: dict) -> tuple[str, dict]:
    if not any(blocks[layer][0].indexer is not None for layer in port.layers) and not selections:
        return "- (no indexer)", {}
    parts, ev = [], {}
    for layer in port.layers:
        c = selections.get(layer)
        if isinstance(c, str):
            parts.append(f"block {layer} {c}")
            ev[str(layer)] = c
        elif c is None:
            if blocks[layer][0].indexer is not None:
                parts.append(f"block {layer}: no top-k run")
                ev[str(layer)] = "no top-k run"
        else:
            parts.append(f"block {layer} {'agrees' if c.ok else 'differs'}: {c.rows} queries, {c.swaps} swaps "
                         f"(margin {c.margin:.3g})")
            ev[str(layer)] = {"ok": bool(c.ok), "rows": c.rows, "swaps": c.swaps, "margin": float(c.margin),
                              "problems": list(c.problems)}
    return "; ".join(parts) or "-", ev


def _short(err: BaseException) -> str:
    from conformance.native.conventions.modern import _short as short

    return " ".join(short(err).split())


def _cell(results: list[BlockResult], field: str) -> tuple[str, dict]:
    worst = max(results, key=lambda r: getattr(r, field).margin)
    c = getattr(worst, field)
    return f"{c.max_abs_error:.1e} ({c.margin:.3g}, block {worst.layer})", {
        str(r.layer): {"ok": bool(getattr(r, field).ok), "margin": float(getattr(r, field).margin),
                       "max_abs_error": float(getattr(r, field).max_abs_error)} for r in results}


def _form_label(run: dict) -> str:
    if "error" in run:
        return f"fails: {run['error']}"
    results = run["results"]
    worst = max(results, key=lambda r: max(r.prefill.margin, r.decode.margin))
    margin = max(worst.prefill.margin, worst.decode.margin)
    err = max(worst.prefill.max_abs_error, worst.decode.max_abs_error)
    return ("agrees" if all(r.ok for r in results) else "differs") + f" (err {err:.1e}, margin {margin:.3g})" + (
        f"; {_refused(run['note'])}" if run["note"] else "")


def _refused(note: str) -> str:
    """mlx-lm's strict-load refusal, short: how many keys and the first (the evidence keeps the whole)."""
    import re

    found = re.search(r"Received (\d+) parameters not in model: ([^,\s]+)", note)
    if found:
        return f"strict load refused {found.group(1)} keys not in its model (first: {found.group(2)})"
    return f"strict load refused: {note[:120]}"


def summarise(port, runs, seen, blocks, refs) -> dict:
    row: dict[str, Any] = {"evidence": {form: ({"error": run["error"]} if "error" in run else {"note": run["note"]})
                                        for form, run in runs.items()}}
    row["transformers_config"] = _form_label(runs["transformers"])
    hub = runs["hub"]
    if "error" in hub:
        row["verdict"] = f"fails: {hub['error']}"
        for key in ("prefill", "decode", "vs_transformers", "far", "selection", "first_stage"):
            row[key] = "-"
        return row
    results = hub["results"]
    for field in ("prefill", "decode", "vs_transformers", "transformers"):
        cell, ev = _cell(results, field)
        row["evidence"][field] = ev
        if field != "transformers":
            row[field] = cell
    with_far = [r for r in results if r.far is not None]
    if with_far:
        cell, ev = _cell(with_far, "far")
        row["far"], row["evidence"]["far"] = cell, ev
    else:
        row["far"] = "- (no rope(x, offset) module)" if any(blocks[r.layer][0].rope for r in results) else "- (no RoPE)"
    row["selection"], row["evidence"]["selection"] = _selection_cell(hub.get("selections", {}), port, blocks)
    agrees = all(r.ok for r in results)
    row["verdict"] = ("agrees" if agrees else "differs") + (f" ({port.note})" if port.note else "")
    if hub["note"]:
        row["verdict"] += f"; {_refused(hub['note'])}"
    if not all(r.transformers.ok for r in results):
        row["verdict"] += "; transformers itself leaves the policy (our layout's fault: see evidence)"
    if agrees:
        row["first_stage"] = "-"
        return row
    stages = []
    for r in results:
        if r.ok:
            continue
        config = blocks[r.layer][0]
        if r.prefill.ok and r.vs_transformers.ok and r.decode.ok:  # only the rotation far out differs
            where, stage = f"rope at {FAR}+", "query.rope, key.rope"
            why = f"err {r.far.max_abs_error:.1e}, margin {r.far.margin:.3g}; " + _far_why(hub["model"], port, r.layer,
                                                                                              config)
        elif _selection_differs(hub.get("selections", {}).get(r.layer)):
            where, stage = "prefill", "indexer selection"
            picked = hub["selections"][r.layer]
            why = (f"mlx-lm {picked}: its block builds an Indexer for every layer and, the checkpoint holding none "
                   "for this layer, runs it on weights of its own initialisation (strict load: missing keys) "
                   "instead of taking the previous full layer's selection" if isinstance(picked, str) else
                   f"{picked.swaps} keys swapped across the k-th score, margin {picked.margin:.3g}: "
                   + "; ".join(picked.problems[:2]))
        else:
            where = "prefill" if not (r.prefill.ok and r.vs_transformers.ok) else "decode"
            stage, why = localise(hub["model"], port, seen, r.layer, config, refs[r.layer], where)
        stages.append(f"block {r.layer} {where}: {stage}: {why}")
        row["evidence"][f"stage[{r.layer}]"] = {"where": where, "stage": stage, "why": why}
    row["first_stage"] = "; ".join(stages)
    return row


# -- the first stage that differs ------------------------------------------------------------------

def _far_why(model, port: Port, layer: int, config) -> str:
    """Which rotation mlx-lm's rope at positions FAR.. matches: the contract's with one choice changed."""
    import dataclasses

    scaling = config.rope.scaling
    variants = {}
    if scaling is not None and scaling.type == "yarn":
        variants[f"truncate={not scaling.truncate}"] = dataclasses.replace(
            config, rope=dataclasses.replace(config.rope, scaling=dataclasses.replace(scaling, truncate=not scaling.truncate)))
    if scaling is not None:
        variants["no scaling"] = dataclasses.replace(config, rope=dataclasses.replace(config.rope, scaling=None))
    variants["the other pairing"] = dataclasses.replace(
        config, rope=dataclasses.replace(config.rope, interleaved=not config.rope.interleaved))
    for label, variant in variants.items():
        try:
            c = rope_far(model, port, layer, variant)
        except Exception:  # noqa: BLE001 (a variant the contract refuses explains nothing)
            continue
        if c is not None and c.ok:
            return f"mlx-lm's rotation is the model's with {label} (err {c.max_abs_error:.1e})"
    return "no single changed choice explains it"



def localise(model, port, seen, layer, config, ref, where) -> tuple[str, str]:
    """(stage, why with numbers): mlx-lm's intermediates of block `layer`'s prefill call against the
    reference's trace."""
    from conformance.native import mlx_lm_stages

    return mlx_lm_stages.first_difference(model, port, seen, layer, config, ref, where)


# -- the table -------------------------------------------------------------------------------------

def _api_name(name: str) -> str:
    return f"mlx-lm {name}"


def _measure_row(name: str) -> dict:
    from conformance.native.conventions import modern

    api = modern.ModernApi(_api_name(name), "mlx", MODULES, MLX_EXTRA, lambda: measure_port(name))
    return modern.measure_row(api, KEYS, _json_safe)


def _json_safe(evidence):
    from conformance.native.conventions.packed import _json_safe as safe

    return safe(evidence)


APIS = tuple(PORTS)


def measure(apis: tuple[str, ...] | None = None) -> list[dict]:
    """Every port's row (default: all of PORTS); never raises (modern.measure_row's rule)."""
    from conformance.logs import quiet_python_loggers

    rows = []
    for name in APIS if apis is None else apis:
        rows.append(_measure_row(name))
        quiet_python_loggers()
    return rows


def cells(rows: list[dict]) -> list[list[str]]:
    from conformance.native.conventions import modern

    return modern.cells(rows, COLUMNS)


def notes(rows: list[dict]) -> list[str]:
    from conformance.native.conventions import modern

    return modern.notes(rows)[:1]  # one "not installed" note says it for every row


def versions(rows: list[dict]) -> dict[str, str]:
    """mlx's and mlx-lm's versions where a row was measured."""
    import importlib.metadata

    if not any(row.get("status") == "measured" for row in rows):
        return {}
    return {name: importlib.metadata.version(name) for name in ("mlx", "mlx-lm")}


def to_markdown(rows: list[dict]) -> str:
    """This table alone, in Markdown (docs/conventions.md's "mlx-lm's ports" section)."""
    out = ["| " + " | ".join(title for title, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    out += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in cells(rows)]
    out += ["", f"Setup: {SETUP}.", ""] + [f"- {note}" for note in notes(rows)]
    found = versions(rows)
    if found:
        out += ["Versions: " + ", ".join(f"{k} {v}" for k, v in found.items()) + "."]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    """python -m conformance.native.mlx_lm_ports [--json] [NAME ...]: this table alone."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m conformance.native.mlx_lm_ports",
                                     description="Judge mlx-lm's attention ports against the spec and transformers.")
    parser.add_argument("names", nargs="*", help=f"ports to measure (default: all): {', '.join(PORTS)}")
    parser.add_argument("--json", action="store_true", help="print the rows, evidence included, as JSON")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in PORTS]
    if unknown:
        parser.error(f"names must be among {', '.join(PORTS)}: got {', '.join(map(repr, unknown))}")
    rows = measure(tuple(args.names) or None)
    print(json.dumps(rows, indent=1) if args.json else to_markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
