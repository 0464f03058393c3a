"""DeepSeek V4's attention (transformers' deepseek_v4, 5.23.0; DeepSeek's own inference names) <-> the contract's
config.compressed layer.

v4_config(hf_config, layer) gives one layer's AttentionConfig from a transformers config.json, v4_args_config(args,
layer) from DeepSeek's own ModelArgs JSON (its inference/config.json); v4_tensors(config, state, prefix, names) the
canonical tensors from a state dict, v4_state(config, tensors, base, names) the way back; read_v4 and write_v4 are
the readers and writers of the hf-deepseek (transformers' names) and deepseek (DeepSeek's names) layouts
(weights.layouts.to_canonical / from_canonical("hf-deepseek" | "deepseek", ...)). docs/spec-frontier.md#deepseek-v4
names each source line.

| canonical                      | hf-deepseek ([P]layers.{L}.self_attn.)          | deepseek (layers.{L}.attn.)       |
|--------------------------------|-------------------------------------------------|-----------------------------------|
| query.down.kernel (D, Qr)      | q_a_proj.weight (Qr, D)                         | wq_a.weight                       |
| query.down.norm.scale (Qr,)    | q_a_norm.weight                                 | q_norm.weight                     |
| query.kernel (Qr, N, H)        | q_b_proj.weight (N*H, Qr)                       | wq_b.weight                       |
| key.kernel (D, 1, H)           | kv_proj.weight (H, D)                           | wkv.weight                        |
| key.norm.scale (H,)            | kv_norm.weight                                  | kv_norm.weight                    |
| output.group.kernel (G, NH/G, R)| o_a_proj.weight (G*R, NH/G)                    | wo_a.weight                       |
| output.kernel (G*R, O)         | o_b_proj.weight (O, G*R)                        | wo_b.weight                       |
| sinks (N,)                     | sinks                                           | attn_sink                         |
| compressor.kernel (D, cH)      | compressor.kv_proj.weight (cH, D)               | compressor.wkv.weight             |
| compressor.gate.kernel (D, cH) | compressor.gate_proj.weight (cH, D)             | compressor.wgate.weight           |
| compressor.position_bias (m, cH)| compressor.position_bias                       | compressor.ape                    |
| compressor.norm.scale (H,)     | compressor.kv_norm.weight                       | compressor.norm.weight            |
| indexer.compressor.* (at J)    | compressor.indexer.{kv_proj,gate_proj,...}      | indexer.compressor.{wkv,wgate,...}|
| indexer.query.kernel (Qr, I, J)| compressor.indexer.q_b_proj.weight (I*J, Qr)    | indexer.wq_b.weight               |
| indexer.weights.kernel (D, I)  | compressor.indexer.scorer.weights_proj.weight   | indexer.weights_proj.weight       |

DeepSeek's names are transformers' own reading of the released checkpoint (conversion_mapping.py:649-682 renames
each of them to the module names above) and are those of deepseek-ai's DeepSeek-V4 inference/model.py (Attention,
Compressor, Indexer), read in third-party copies of it (the original ships in the Hugging Face model repositories'
inference/ folder, outside the GitHub index this was searched in). Both store nn.Linear weights (out, in) of the
same shapes: the two layouts differ in names alone. FP8 / FP4 checkpoints (a `.scale` beside a weight) are not
dequantized here: their `.scale` keys are unexpected.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from weights.config import AttentionConfig
from weights.format import WeightsFormatError, validate_tensors

# transformers' layer_types -> Compressed.kind (configuration_deepseek_v4.py:21-25)
V4_KINDS = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa",
            "heavily_compressed_attention": "hca"}


def _rope(cfg: Mapping[str, Any], table: str, rotary_dim: int) -> dict[str, Any]:
    """config.rope from rope_parameters[table] ("main" for sliding layers, "compress" for csa / hca:
    modeling_deepseek_v4.py:788). YaRN's truncate is read from the table itself; transformers reads it from the
    top-level dict (modeling_rope_utils.py:475), so a table that sets it false is refused (the two disagree)."""
    params = (cfg.get("rope_parameters") or {}).get(table)
    if not isinstance(params, Mapping):
        raise ValueError(f"hf_config: rope_parameters.{table} must be an object (transformers' DeepseekV4Config "
                         f"nests main / compress): got {params!r}")
    rope: dict[str, Any] = {"theta": float(params["rope_theta"]), "rotary_dim": rotary_dim, "interleaved": True}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "yarn":
        if params.get("truncate", True) is not True:
            raise ValueError(f"hf_config: rope_parameters.{table}.truncate must be true or absent: transformers reads "
                             f"truncate from the top-level rope_parameters (modeling_rope_utils.py:475), not from the "
                             f"{table} table, so it computes with true: got {params['truncate']!r}")
        rope["scaling"] = {"type": "yarn", "factor": params["factor"],
                           "original_max_position_embeddings": params["original_max_position_embeddings"],
                           "beta_fast": params.get("beta_fast") or 32.0, "beta_slow": params.get("beta_slow") or 1.0,
                           # configuration_deepseek_v4.py:318-319 forces 1.0 where the config has none
                           "attention_factor": params.get("attention_factor", 1.0)}
    elif kind != "default":
        raise ValueError(f"hf_config: rope_parameters.{table}.rope_type must be default or yarn for deepseek_v4: "
                         f"got {kind!r}")
    return rope


def v4_config(cfg: Mapping[str, Any], layer: int) -> AttentionConfig:
    """Layer `layer`'s attention of a deepseek_v4 config.json (or DeepseekV4Config.to_dict())."""
    if cfg.get("model_type") != "deepseek_v4":
        raise ValueError(f"hf_config: model_type must be deepseek_v4: got {cfg.get('model_type')!r}")
    if cfg.get("attention_bias"):
        raise ValueError("hf_config: attention_bias must be false for deepseek_v4 (its projections have no bias): "
                         "got true")
    layer_type = cfg["layer_types"][layer]
    if layer_type not in V4_KINDS:
        raise ValueError(f"hf_config: layer_types[{layer}] must be one of {', '.join(V4_KINDS)}: got {layer_type!r}")
    kind = V4_KINDS[layer_type]
    head_dim = cfg["head_dim"]
    rotary_dim = int(head_dim * cfg["partial_rotary_factor"])  # configuration_deepseek_v4.py:291
    compressed: dict[str, Any] = {"kind": kind, "query_rank": cfg["q_lora_rank"], "output_groups": cfg["o_groups"],
                                  "output_rank": cfg["o_lora_rank"], "eps": cfg["rms_norm_eps"]}
    if kind != "sliding":
        compressed.update(ratio=cfg["compress_rates"][layer_type], overlap=kind == "csa")
    if kind == "csa":
        compressed.update(index_heads=cfg["index_n_heads"], index_head_dim=cfg["index_head_dim"],
                          index_topk=cfg["index_topk"])
    return AttentionConfig(
        num_heads=cfg["num_attention_heads"], query_dim=cfg["hidden_size"], head_dim=head_dim, num_kv_heads=1,
        use_query_bias=False, use_key_bias=False, use_value_bias=False, use_output_bias=False, use_sinks=True,
        window_left=cfg["sliding_window"] - 1, rope=_rope(cfg, "main" if kind == "sliding" else "compress", rotary_dim),
        compressed=compressed)


def is_v4_config(cfg: Mapping[str, Any]) -> bool:
    """A config file of a V4 model: transformers' (model_type deepseek_v4) or DeepSeek's ModelArgs JSON (no
    model_type; compress_ratios, one entry per layer, is V4's alone)."""
    return cfg.get("model_type") == "deepseek_v4" or ("model_type" not in cfg and "compress_ratios" in cfg)


# DeepSeek-V4 inference/model.py ModelArgs defaults taken for fields a config file may leave out; the sizes,
# compress_ratios and the compress table's YaRN (compress_rope_theta, original_seq_len, rope_factor: whose
# ModelArgs defaults differ between the copies read) are required
_V4_ARGS_DEFAULTS = {"norm_eps": 1e-6, "rope_theta": 10000.0, "beta_fast": 32, "beta_slow": 1}


def v4_args_config(args: Mapping[str, Any], layer: int) -> AttentionConfig:
    """Layer `layer`'s attention of DeepSeek's own V4 ModelArgs JSON (inference/config.json). What its
    inference/model.py computes, read in copies of it: compress_ratios[layer] 0 is a sliding layer, 4 a csa layer
    (Compressor with overlap = compress_ratio == 4, and an Indexer), any other ratio an hca layer; a sliding
    layer turns by rope_theta without YaRN ("disable YaRN ... in pure sliding-window attention"), a compressed
    one by compress_rope_theta with YaRN when original_seq_len > 0 (precompute_freqs_cis; cos and sin not
    scaled: attention factor 1); the window (get_window_topk_idxs) holds window_size keys, the query's own
    included; the softmax scale head_dim^-0.5; every RMS norm norm_eps."""
    def need(*keys):
        missing = [key for key in keys if args.get(key) is None]
        if missing:
            raise ValueError(f"hf_config: DeepSeek's V4 ModelArgs config needs {', '.join(missing)}: got none")

    need("dim", "n_heads", "head_dim", "rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "window_size",
         "compress_ratios")
    a = {**_V4_ARGS_DEFAULTS, **args}
    ratios = a["compress_ratios"]
    if not 0 <= layer < len(ratios):
        raise ValueError(f"layer must be in [0, {len(ratios)}) (compress_ratios): got {layer}")
    ratio = int(ratios[layer])
    kind = "sliding" if ratio == 0 else "csa" if ratio == 4 else "hca"
    compressed: dict[str, Any] = {"kind": kind, "query_rank": a["q_lora_rank"], "output_groups": a["o_groups"],
                                  "output_rank": a["o_lora_rank"], "eps": a["norm_eps"]}
    rope: dict[str, Any] = {"theta": float(a["rope_theta"]), "rotary_dim": int(a["rope_head_dim"]),
                            "interleaved": True}
    if kind != "sliding":
        need("compress_rope_theta", "original_seq_len", "rope_factor")
        compressed.update(ratio=ratio, overlap=kind == "csa")
        rope["theta"] = float(a["compress_rope_theta"])
        if a["original_seq_len"] > 0:
            rope["scaling"] = {"type": "yarn", "factor": float(a["rope_factor"]),
                               "original_max_position_embeddings": int(a["original_seq_len"]),
                               "beta_fast": float(a["beta_fast"]), "beta_slow": float(a["beta_slow"]),
                               "attention_factor": 1.0}
    if kind == "csa":
        need("index_n_heads", "index_head_dim", "index_topk")
        compressed.update(index_heads=a["index_n_heads"], index_head_dim=a["index_head_dim"],
                          index_topk=a["index_topk"])
    return AttentionConfig(
        num_heads=a["n_heads"], query_dim=a["dim"], head_dim=a["head_dim"], num_kv_heads=1, use_query_bias=False,
        use_key_bias=False, use_value_bias=False, use_output_bias=False, use_sinks=True,
        window_left=a["window_size"] - 1, rope=rope, compressed=compressed)


# canonical tensor -> (transformers' key, DeepSeek's key) under the layer's attention scope; "{c}" is one of
# COMPRESSORS' prefixes
V4_NAMES = {
    "query.down.kernel": ("q_a_proj.weight", "wq_a.weight"),
    "query.down.norm.scale": ("q_a_norm.weight", "q_norm.weight"),
    "query.kernel": ("q_b_proj.weight", "wq_b.weight"),
    "key.kernel": ("kv_proj.weight", "wkv.weight"),
    "key.norm.scale": ("kv_norm.weight", "kv_norm.weight"),
    "output.group.kernel": ("o_a_proj.weight", "wo_a.weight"),
    "output.kernel": ("o_b_proj.weight", "wo_b.weight"),
    "sinks": ("sinks", "attn_sink"),
    "{c}.kernel": ("kv_proj.weight", "wkv.weight"),
    "{c}.gate.kernel": ("gate_proj.weight", "wgate.weight"),
    "{c}.position_bias": ("position_bias", "ape"),
    "{c}.norm.scale": ("kv_norm.weight", "norm.weight"),
    "indexer.query.kernel": ("compressor.indexer.q_b_proj.weight", "indexer.wq_b.weight"),
    "indexer.weights.kernel": ("compressor.indexer.scorer.weights_proj.weight", "indexer.weights_proj.weight"),
}
# canonical compressor prefix -> (transformers' module scope, DeepSeek's)
COMPRESSORS = {"compressor": ("compressor.", "compressor."),
               "indexer.compressor": ("compressor.indexer.", "indexer.compressor.")}
NAME_SETS = ("hf", "deepseek")  # V4_NAMES' columns: hf-deepseek's names, deepseek's


def v4_names(config: AttentionConfig, names: str = "hf") -> dict[str, str]:
    """{canonical tensor: key under the layer's attention scope} for this config, in `names` (hf | deepseek)."""
    column = NAME_SETS.index(names)
    out = {}
    for canonical in config.tensor_shapes():
        prefix = next((p for p in COMPRESSORS if canonical.startswith(p + ".")), None)
        if prefix is not None:
            out[canonical] = COMPRESSORS[prefix][column] + V4_NAMES["{c}" + canonical[len(prefix):]][column]
        else:
            out[canonical] = V4_NAMES[canonical][column]
    return out


def v4_keys(config: AttentionConfig, names: str = "hf") -> list[str]:
    """The module keys (under the layer's attention scope) that v4_tensors reads for this config."""
    return list(v4_names(config, names).values())


def _to_canonical(config: AttentionConfig, name: str, value: np.ndarray) -> np.ndarray:
    """One foreign array -> its canonical tensor. nn.Linear weights are (out, in): the kernels are their
    transposes; o_a_proj / wo_a (G*R, N*H/G) is G blocks of (R, N*H/G) (DeepseekV4GroupedLinear, M:340)."""
    c, N, H, D = config.compressed, config.num_heads, config.head_dim, config.query_dim
    if name == "query.kernel":
        return value.T.reshape(c.query_rank, N, H)
    if name == "indexer.query.kernel":
        return value.T.reshape(c.query_rank, c.index_heads, c.index_head_dim)
    if name == "key.kernel":
        return value.T.reshape(D, 1, H)
    if name == "output.group.kernel":
        G, R = c.output_groups, c.output_rank
        return value.reshape(G, R, N * H // G).transpose(0, 2, 1)
    return value.T if name.endswith(".kernel") else value


def _from_canonical(name: str, value: np.ndarray) -> np.ndarray:
    """The inverse of _to_canonical: one canonical tensor -> its foreign array."""
    if name in ("query.kernel", "indexer.query.kernel", "key.kernel"):
        return value.reshape(value.shape[0], -1).T  # (N*H, Qr), (I*J, Qr), (H, D)
    if name == "output.group.kernel":
        G, F, R = value.shape
        return value.transpose(0, 2, 1).reshape(G * R, F)  # (G*R, N*H/G)
    return value.T if name.endswith(".kernel") else value


def v4_tensors(config: AttentionConfig, state: Mapping[str, Any], prefix: str = "", names: str = "hf"
               ) -> dict[str, np.ndarray]:
    """The canonical tensors of one V4 attention from a state dict (arrays or tensors with .numpy()) whose
    keys are `prefix` + the layout's module names (`names`: hf | deepseek)."""
    def get(key):
        value = state[prefix + key]
        return value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)

    return {name: np.ascontiguousarray(_to_canonical(config, name, get(key)))
            for name, key in v4_names(config, names).items()}


def v4_state(config: AttentionConfig, tensors: Mapping[str, np.ndarray], base: str = "", names: str = "hf"
             ) -> dict[str, np.ndarray]:
    """One V4 attention's canonical tensors -> {base + the layout's key: array} (the inverse of v4_tensors)."""
    return {base + key: np.array(_from_canonical(name, np.asarray(tensors[name])), order="C", copy=True)
            for name, key in v4_names(config, names).items()}


def read_v4(layout: str, cfg: Mapping[str, Any], state: Mapping[str, Any], base: str, layer: int,
            names: str = "hf"):
    """(config, canonical tensors) of layer `layer` whose keys start with `base`; one WeightsFormatError lists
    every missing or unexpected key (and validate_tensors every mis-shaped one). cfg: a transformers config.json
    (model_type deepseek_v4) or, for DeepSeek's names, its ModelArgs JSON (compress_ratios)."""
    try:
        config = v4_config(cfg, layer) if "model_type" in cfg else v4_args_config(cfg, layer)
    except (KeyError, IndexError, TypeError) as err:
        raise ValueError(f"hf_config: deepseek_v4 needs {err} for layer {layer}") from None
    expected = [base + key for key in v4_keys(config, names)]
    problems = []
    missing = [key for key in expected if key not in state]
    if missing:
        problems.append(f"missing {', '.join(missing)}")
    unexpected = sorted(k for k in state if k.startswith(base) and k not in expected)
    if unexpected:
        problems.append(f"unexpected {', '.join(unexpected)} (config file: layer {layer} is "
                        f"{config.compressed.kind})")
    if problems:
        raise WeightsFormatError(f"{layout}: " + "; ".join(problems))
    try:
        tensors = v4_tensors(config, state, base, names)
    except ValueError as err:  # a reshape of a mis-shaped weight
        raise WeightsFormatError(f"{layout}: {err}") from None
    validate_tensors(config, tensors, source=layout)
    return config, tensors


def v4_cannot_express(layout: str, config: AttentionConfig) -> list[str]:
    """Why a V4 layer of hf-deepseek / deepseek cannot hold config (the fields config.compressed leaves free that
    transformers' DeepseekV4Attention and DeepSeek's Attention fix), one line each."""
    c, problems = config.compressed, []
    if not config.use_sinks:
        problems.append(f"use_sinks=False ({layout}: every V4 layer has its sinks, M:744-752)")
    if config.out_dim != config.query_dim:
        problems.append(f"out_dim={config.out_dim} (needs out_dim == query_dim={config.query_dim}: o_b_proj maps "
                        "back to hidden_size)")
    if c.kind != "sliding" and c.overlap != (c.kind == "csa"):
        problems.append(f"compressed.overlap={c.overlap} with kind {c.kind} (V4's csa compressors always overlap "
                        "and its hca compressor never does: configuration_deepseek_v4.py, inference/model.py's "
                        "overlap = compress_ratio == 4)")
    if layout == "deepseek" and c.kind != "sliding" and (c.ratio == 4) != (c.kind == "csa"):
        problems.append(f"compressed.ratio={c.ratio} with kind {c.kind} (DeepSeek's ModelArgs names a layer by its "
                        "compress_ratios entry alone: 4 is csa, any other positive ratio hca)")
    return problems


def write_v4(catalogue, lay, config: AttentionConfig, tensors: Mapping[str, np.ndarray], prefix: str, layer: int,
             cfg: Mapping[str, Any] | None) -> dict[str, np.ndarray]:
    """from_canonical of a V4 layer (config.compressed) for hf-deepseek and deepseek: the tensors under the
    layout's names; with the destination's config file (cfg) the block is read back under it and must mean what
    config says (the same kind, sizes, window, RoPE tables and eps)."""
    from .write import _behaviour_differences

    problems = v4_cannot_express(lay.id, config)
    if problems:
        raise ValueError(f"{lay.id} cannot express " + "; ".join(problems))
    validate_tensors(config, tensors, source="canonical tensors")
    names = "deepseek" if lay.id == "deepseek" else "hf"
    base = prefix + lay.scope.format(layer=layer)
    state = v4_state(config, tensors, base, names)
    if cfg is not None:
        read, _ = read_v4(lay.id, cfg, state, base, layer, names)
        differ = _behaviour_differences(config, read)
        if differ:
            raise ValueError(f"hf_config disagrees with config for {lay.id} block {layer}: " + "; ".join(differ))
    return state
