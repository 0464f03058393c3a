"""The meta-llama layout: Meta's own Llama checkpoint (consolidated.*.pth), and its params.json reader.

| layout            | foreign key (defaults; {role} names overridable)  | canonical                  | form   |
|-------------------|---------------------------------------------------|----------------------------|--------|
| meta-llama        | [P]layers.{L}.attention.{wq,wk,wv,wo}.weight      | query ... output           | linear |
|   (Llama 4)       | [P]layers.{L}.attention.wqkv.weight, wo.weight    | query+key+value, output    | linear |

A decoder: its config file (params.json) is required (write.py says what
that brings); interleaved RoPE pairs. Llama 4's params.json (a file with
one of LLAMA4_KEYS) also gives the NoPE layers (nope_layer_interval), the
QK-norm (use_qk_norm), the local chunks (attention_chunk_size) and the NoPE
layers' query temperature (attn_temperature_tuning, floor_scale,
attn_scale), with the defaults of llama-models' models/llama4/args.py;
Meta's Llama 4 checkpoints fuse the projections as wqkv = [wq; wk; wv].
A key neither read nor on IGNORED (not attention, with the reason) is refused
by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .table import LINEAR, Layout, R, Table, Tie

# params.json keys (Meta's llama-models: models/llama3/args.py and models/llama4/args.py ModelArgs) that cannot
# change a block's attention, each with why; every other key is read below or refused by name.
IGNORED = {
    "n_layers": "the number of blocks (the layer picks one)",
    "vocab_size": "the embedding and output sizes",
    "multiple_of": "rounds the feed-forward width", "ffn_dim_multiplier": "the feed-forward width",
    "ffn_exp": "the MoE feed-forward width (Llama 4)",
    "moe_args": "the feed-forward experts (Llama 4)",
    "max_batch_size": "the size of Meta's preallocated cache", "max_seq_len": "the size of Meta's preallocated cache",
    "vision_args": "the vision encoder (Llama 4)", "vision_chunk_size": "the vision encoder (Llama 3.2)",
    "vision_max_num_chunks": "the vision encoder (Llama 3.2)",
    "vision_num_cross_attention_layers": "the vision encoder (Llama 3.2)", "vision_model": "the vision encoder",
    "quantization_args": "how Meta's loader quantizes weights, not what the block computes",
    "lora_args": "adapter weights merged before the checkpoint is read",
}
# Keys only Llama 4's ModelArgs has: one of them present makes the file a Llama 4 one (models/llama4 defaults).
LLAMA4_KEYS = ("head_dim", "ffn_exp", "attention_chunk_size", "rope_high_freq_factor", "nope_layer_interval",
               "use_qk_norm", "attn_temperature_tuning", "floor_scale", "attn_scale", "vision_args", "moe_args")
READ = ("dim", "n_heads", "n_kv_heads", "rope_theta", "use_scaled_rope", "rope_scaling_factor", "norm_eps",
        *LLAMA4_KEYS[:-2])


def _meta_config(params: Mapping[str, Any], layer: int | None) -> dict[str, Any]:
    """Meta's params.json (Llama 1-4: llama-models' ModelArgs) -> sizes, rope and Llama 4's fields of block
    `layer`; Meta rotates interleaved pairs. A key this reader does not know is refused by name."""
    if isinstance(params.get("model"), Mapping):  # some releases nest the model's args (as transformers reads it)
        params = params["model"]
    unknown = sorted(set(params) - set(READ) - set(IGNORED))
    if unknown:
        raise ValueError(f"hf_config: meta-llama does not read params.json's {', '.join(unknown)} (read: "
                         f"{', '.join(READ)}; ignored as not attention: {', '.join(IGNORED)})")
    heads, dim = params.get("n_heads"), params.get("dim")
    if not heads or not dim:
        raise ValueError("hf_config: Meta's params.json needs n_heads and dim")
    llama4 = any(key in params for key in LLAMA4_KEYS)
    head_dim = dim // heads  # Meta's Attention: args.dim // args.n_heads, whatever head_dim says
    if params.get("head_dim") not in (None, head_dim):
        raise ValueError(f"hf_config: params.json's head_dim must be dim // n_heads = {head_dim} (Meta's Attention "
                         f"uses that): got {params['head_dim']!r}")
    layer = 0 if layer is None else layer
    scaling = None
    if params.get("use_scaled_rope"):
        if llama4:  # models/llama4/args.py: factor 16 and high_freq_factor 1 unless given (Scout); low 1, 8192
            factor, high = params.get("rope_scaling_factor") or 16.0, params.get("rope_high_freq_factor") or 1.0
        else:  # Llama 3.1's apply_scaling: factor 8 (3.2: rope_scaling_factor), 1, 4, 8192
            factor, high = params.get("rope_scaling_factor") or 8.0, 4.0
        scaling = {"type": "llama3", "factor": float(factor), "low_freq_factor": 1.0,
                   "high_freq_factor": float(high), "original_max_position_embeddings": 8192}
    theta = float(params.get("rope_theta", 500000.0 if llama4 else 10000.0))
    rope = {"theta": theta, "rotary_dim": None, "interleaved": True, "scaling": scaling}
    modern: dict[str, Any] = {"rope": rope}
    if llama4:  # models/llama4/model.py: TransformerBlock, Attention, create_chunked_attention_mask
        interval = params.get("nope_layer_interval")
        nope = interval is not None and (layer + 1) % interval == 0
        if nope:
            modern["rope"] = None
            if params.get("attn_temperature_tuning", False):  # 1 + attn_scale ln(1 + floor((p + 1) / floor_scale))
                # p: the query's cache index (Meta's start_pos + arange(seqlen)), as transformers' llama4 reads it
                modern["query_temperature"] = {"beta": float(params.get("attn_scale", 0.1)),
                                               "floor": float(params.get("floor_scale", 8192.0)), "offset": 1,
                                               "position": "cache_index"}
        else:
            if params.get("use_qk_norm", False):  # rmsnorm(x, norm_eps) without a weight, after the rotation
                modern["qk_norm"] = {"type": "rms", "eps": float(params.get("norm_eps", 1e-5)), "scope": "head",
                                     "weight": False, "after_rope": True}
            if params.get("attention_chunk_size"):  # the local mask: the RoPE layers only
                modern["local_chunk"] = int(params["attention_chunk_size"])
    return {"num_heads": heads, "num_kv_heads": params.get("n_kv_heads") or heads, "head_dim": head_dim,
            "hidden": dim, "dropout": None, "scale": None, "scale_by_layer": False, "modern": modern,
            "norm_offset": 0.0, "table": 0, "model_type": "meta-llama"}


# the sizes both tables tie (separate wq/wk/wv, and Llama 4's fused wqkv)
_SHARED_TIES = (
    Tie("query_dim", "num_heads*head_dim", "Meta's head_dim is dim // n_heads"),
    Tie("key_dim", "num_heads*head_dim", "keys are projected from the hidden states"),
    Tie("value_dim", "num_heads*head_dim", "values are projected from the hidden states"),
    Tie("out_dim", "num_heads*head_dim", "wo maps back to dim"),
)

FAMILY = (
    Layout(
        "meta-llama", "Meta's Llama checkpoint (consolidated.*.pth): layers.{L}.attention.{wq,wk,wv,wo}.weight "
        "(Llama 4: wqkv = [wq; wk; wv]); params.json beside it gives the sizes and rope (Llama 4: NoPE layers, "
        "QK-norm, chunks, temperature; an unknown key is refused); interleaved RoPE pairs; causal",
        sep=".", scope="layers.{layer}.attention.", select=True, hf=_meta_config, pairing="interleaved",
        needs_hf_config=True,
        tables=(Table((
            R("wq.weight", "query.kernel", LINEAR), R("wk.weight", "key.kernel", LINEAR),
            R("wv.weight", "value.kernel", LINEAR), R("wo.weight", "output.kernel", LINEAR),
        ), ties=(Tie("value_head_dim", "head_dim", "wv splits into heads of head_dim"), *_SHARED_TIES)), Table((
            R("wqkv.weight", "query.kernel key.kernel value.kernel", LINEAR),  # ((N+2K)*H, D) = [wq; wk; wv]
            R("wo.weight", "output.kernel", LINEAR),
        ), ties=(Tie("value_head_dim", "head_dim", "wqkv's v rows split into heads of head_dim"), *_SHARED_TIES),
            note="Llama 4: fused wqkv = [wq; wk; wv] (Attention.load_hook splits it)")),
    ),
)
