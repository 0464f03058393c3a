"""AttentionConfig: the one statement of a layer's shape and behaviour.

Shape letters (see impl_numpy for the full list): N query heads, K key/value
heads, H head dim, V value head dim, O output features.

The modern fields (rope, logit_softcap, window_left, window_right, qk_norm,
use_sinks) and the frontier ones (alibi, alibi_bias_dtype, local_chunk, query_temperature,
qkv_clip, output_gate) default to the behaviour of a plain layer. A config file holds
them only where they differ from that default (`to_json`), so a file of a
plain layer reads the same as before they existed, and a reader that
predates them refuses a file that uses one (as an unknown field) instead of
silently computing without it. `to_dict` gives every field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

MASKED_ROW_POLICIES = ("zero", "uniform", "nan")
ROPE_SCALING_TYPES = ("linear", "llama3", "yarn", "longrope", "proportional")
QK_NORM_TYPES = ("rms", "layer")
QK_NORM_SCOPES = ("head", "all")
OUTPUT_GATE_SCOPES = ("element", "head")


def _check_positive_int(name: str, value: Any) -> None:
    # bool is an int subclass; True as a head count is always a mistake.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer: got {value!r}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false: got {value!r}")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _finite_number(name: str, value: Any, *, positive: bool = False) -> float:
    """value as a float; ValueError naming `name` unless it is a finite number (> 0 when positive)."""
    bad = isinstance(value, bool) or not isinstance(value, (int, float))
    try:
        bad = bad or not math.isfinite(float(value))
    except OverflowError:  # an int beyond float range
        bad = True
    if bad or (positive and float(value) <= 0):
        kind = "a finite number > 0" if positive else "a finite number"
        raise ValueError(f"{name} must be {kind}: got {_shown(value)}")
    return float(value)


def _object(name: str, value: Any, allowed: tuple[str, ...]) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object or null: got {_shown(value)}")
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise ValueError(f"{name} has unknown fields: {', '.join(map(repr, unknown))}; accepted: {', '.join(allowed)}")
    return value


# The keys each rope scaling type reads (names as in the models' config.json rope_scaling); None = required.
_SCALING_KEYS: dict[str, dict[str, Any]] = {
    "linear": {"factor": None},
    "llama3": {"factor": None, "low_freq_factor": None, "high_freq_factor": None,
               "original_max_position_embeddings": None},
    # YaRN: beta_fast / beta_slow 32 / 1 and truncate true are the paper's and transformers' defaults;
    # attention_factor, when absent, follows from factor (and mscale / mscale_all_dim when both are given).
    "yarn": {"factor": None, "original_max_position_embeddings": None, "beta_fast": 32.0, "beta_slow": 1.0,
             "attention_factor": None, "mscale": None, "mscale_all_dim": None, "truncate": True},
    # LongRoPE (Phi-3.5, Phi-4-mini): factor is max_position_embeddings / original_max_position_embeddings (what
    # transformers computes when the config has no factor); attention_factor, when absent, follows from it.
    "longrope": {"factor": None, "original_max_position_embeddings": None, "short_factor": None,
                 "long_factor": None, "attention_factor": None},
    # Gemma 4's "proportional": the first partial_rotary_factor of the head's pairs turn at theta^(-2i/H), the
    # rest not at all, every pair half-split over the whole head; factor divides the frequencies.
    "proportional": {"factor": 1.0, "partial_rotary_factor": None},
}


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention-factor rule (Peng et al. 2023, as transformers' _compute_yarn_parameters): 0.1 m ln(s) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Frequency rescaling for long contexts. Only the fields of `type` are set (the others None)."""

    type: str  # "linear" | "llama3" | "yarn"
    factor: float  # linear: positions / factor; llama3: low frequencies / factor; yarn: interpolated ones / factor
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    original_max_position_embeddings: int | None = None  # llama3, yarn: the pre-training context length
    beta_fast: float | None = None  # yarn: rotations at which the ramp starts (32)
    beta_slow: float | None = None  # yarn: rotations at which it ends (1)
    attention_factor: float | None = None  # yarn, longrope: multiplies cos and sin (resolved: never None there)
    truncate: bool | None = None  # yarn: round the ramp's ends to whole dimensions (true)
    short_factor: tuple[float, ...] | None = None  # longrope: per pair, divides the frequencies for short calls
    long_factor: tuple[float, ...] | None = None  # longrope: ... for calls past original_max_position_embeddings
    partial_rotary_factor: float | None = None  # proportional: the share of the head's pairs that turn

    @classmethod
    def from_value(cls, value: Any) -> RopeScaling | None:
        if value is None or isinstance(value, RopeScaling):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"rope.scaling must be an object or null: got {_shown(value)}")
        kind = value.get("type")
        if kind not in _SCALING_KEYS:
            raise ValueError(f"rope.scaling.type must be one of {', '.join(ROPE_SCALING_TYPES)}: got {_shown(kind)}")
        keys = _SCALING_KEYS[kind]
        data = _object(f"rope.scaling ({kind})", value, ("type", *keys))
        missing = [key for key, default in keys.items() if default is None and key not in data
                   and key not in ("attention_factor", "mscale", "mscale_all_dim")]
        if missing:
            raise ValueError(f"rope.scaling ({kind}) is missing {', '.join(missing)}")
        fields = {key: data.get(key, default) for key, default in keys.items()}
        resolved: dict[str, Any] = {"type": kind, "factor": _finite_number("rope.scaling.factor", fields["factor"],
                                                                           positive=True)}
        if "original_max_position_embeddings" in keys:
            _check_positive_int("rope.scaling.original_max_position_embeddings",
                                fields["original_max_position_embeddings"])
            resolved["original_max_position_embeddings"] = fields["original_max_position_embeddings"]
        if kind == "llama3":
            low = _finite_number("rope.scaling.low_freq_factor", fields["low_freq_factor"], positive=True)
            high = _finite_number("rope.scaling.high_freq_factor", fields["high_freq_factor"], positive=True)
            if high < low:  # equal factors: no interpolation band, a step at original / low (Llama 4 Scout: 1, 1)
                raise ValueError(f"rope.scaling.high_freq_factor must be at least low_freq_factor: got {high} < {low}")
            resolved.update(low_freq_factor=low, high_freq_factor=high)
        if kind == "yarn":
            resolved["beta_fast"] = _finite_number("rope.scaling.beta_fast", fields["beta_fast"], positive=True)
            resolved["beta_slow"] = _finite_number("rope.scaling.beta_slow", fields["beta_slow"], positive=True)
            _check_bool("rope.scaling.truncate", fields["truncate"])
            resolved["truncate"] = fields["truncate"]
            factor = resolved["factor"]
            if fields["attention_factor"] is not None:
                attention = _finite_number("rope.scaling.attention_factor", fields["attention_factor"], positive=True)
            elif fields["mscale"] is not None and fields["mscale_all_dim"] is not None:
                m = _finite_number("rope.scaling.mscale", fields["mscale"])
                m_all = _finite_number("rope.scaling.mscale_all_dim", fields["mscale_all_dim"])
                attention = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if m and m_all else _yarn_mscale(factor)
            else:
                attention = _yarn_mscale(factor)
            resolved["attention_factor"] = float(attention)
        if kind == "longrope":
            for key in ("short_factor", "long_factor"):
                values = fields[key]
                if not isinstance(values, (list, tuple)) or not values:
                    raise ValueError(f"rope.scaling.{key} must be a list of numbers > 0: got {_shown(values)}")
                resolved[key] = tuple(_finite_number(f"rope.scaling.{key}", v, positive=True) for v in values)
            factor, original = resolved["factor"], resolved["original_max_position_embeddings"]
            if fields["attention_factor"] is not None:
                attention = _finite_number("rope.scaling.attention_factor", fields["attention_factor"], positive=True)
            else:  # transformers' _compute_longrope_parameters, as the LongRoPE paper suggests
                attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
            resolved["attention_factor"] = float(attention)
        if kind == "proportional":
            share = _finite_number("rope.scaling.partial_rotary_factor", fields["partial_rotary_factor"])
            if not 0 <= share <= 1:
                raise ValueError(f"rope.scaling.partial_rotary_factor must lie in [0, 1]: got {share}")
            resolved["partial_rotary_factor"] = share
        return cls(**resolved)

    def factor_lists_fit(self, rotary_dim: int) -> None:
        """longrope: each factor list has one entry per rotating pair (rotary_dim / 2); ValueError otherwise."""
        for key in ("short_factor", "long_factor"):
            values = getattr(self, key)
            if values is not None and len(values) != rotary_dim // 2:
                raise ValueError(f"rope.scaling.{key} must have rotary_dim / 2 = {rotary_dim // 2} entries: got "
                                 f"{len(values)}")

    def to_dict(self) -> dict[str, Any]:
        """Only the keys of this type (the resolved form: yarn's and longrope's attention_factor included)."""
        data = {"type": self.type, **{key: getattr(self, key) for key in _SCALING_KEYS[self.type]
                                      if key not in ("mscale", "mscale_all_dim")}}
        return {key: list(value) if isinstance(value, tuple) else value for key, value in data.items()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rope:
    """Rotary position embedding of q and k (never v)."""

    theta: float = 10000.0  # base of the frequencies theta^(-2i/rotary_dim)
    rotary_dim: int | None = None  # features rotated per head, from the first; None means H (resolved by the config)
    interleaved: bool = False  # False: i pairs with i + rotary_dim/2 (half-split); True: 2i with 2i+1
    scaling: RopeScaling | None = None
    # Multimodal RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): how many of the rotary_dim/2 pairs each of the three
    # position axes (temporal, height, width) turns; positions then have shape (3, L) or (3, B, L). None: one
    # position per token, as before. weights.rope.mrope_axes gives each pair's axis.
    mrope_section: tuple[int, int, int] | None = None
    # False: the sections are contiguous runs of pairs, t then h then w (Qwen2-VL, Qwen2.5-VL); True: pairs
    # 1, 4, 7, ... below 3 * h turn by h, pairs 2, 5, 8, ... below 3 * w by w, the rest by t (Qwen3-VL).
    mrope_interleaved: bool = False

    @classmethod
    def from_value(cls, value: Any) -> Rope | None:
        if value is None or isinstance(value, Rope):
            return value
        data = _object("rope", value, ("theta", "rotary_dim", "interleaved", "scaling", "mrope_section",
                                       "mrope_interleaved"))
        theta = _finite_number("rope.theta", data.get("theta", 10000.0), positive=True)
        interleaved = data.get("interleaved", False)
        _check_bool("rope.interleaved", interleaved)
        section = data.get("mrope_section")
        if section is not None:
            if (not isinstance(section, (list, tuple)) or len(section) != 3
                    or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in section)):
                raise ValueError(f"rope.mrope_section must be a list of 3 integers >= 0 (rotary pairs turned by the "
                                 f"temporal, height and width positions) or null: got {_shown(section)}")
            section = tuple(section)
        mrope_interleaved = data.get("mrope_interleaved", False)
        _check_bool("rope.mrope_interleaved", mrope_interleaved)
        if mrope_interleaved and section is None:
            raise ValueError("rope.mrope_interleaved needs rope.mrope_section (the sections it interleaves): got "
                             "mrope_interleaved true with mrope_section null")
        return cls(theta=theta, rotary_dim=data.get("rotary_dim"), interleaved=interleaved,
                   scaling=RopeScaling.from_value(data.get("scaling")), mrope_section=section,
                   mrope_interleaved=mrope_interleaved)

    def to_dict(self) -> dict[str, Any]:
        data = {"theta": self.theta, "rotary_dim": self.rotary_dim, "interleaved": self.interleaved,
                "scaling": None if self.scaling is None else self.scaling.to_dict()}
        if self.mrope_section is not None:  # only where set: a file without multimodal RoPE reads as before
            data.update(mrope_section=list(self.mrope_section), mrope_interleaved=self.mrope_interleaved)
        return data

    def mrope_fits(self, rotary_dim: int) -> None:
        """The sections count every rotating pair once (interleaved: each section's pairs all lie below
        rotary_dim / 2); ValueError naming rope.mrope_section otherwise."""
        section = self.mrope_section
        if section is None:
            return
        pairs = rotary_dim // 2
        if sum(section) != pairs:
            raise ValueError(f"rope.mrope_section must sum to rotary_dim / 2 = {pairs} (the rotary pairs): got "
                             f"{list(section)}, sum {sum(section)}")
        if self.mrope_interleaved:
            for axis, name in ((1, "height"), (2, "width")):
                if len(range(axis, min(3 * section[axis], pairs), 3)) != section[axis]:
                    raise ValueError(f"rope.mrope_section's {name} section must fit interleaved in rotary_dim / 2 = "
                                     f"{pairs} pairs (pairs {axis}, {axis + 3}, ... below 3 x {section[axis]}): got "
                                     f"{list(section)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class QKNorm:
    """Normalisation of q and k after projection, before RoPE (after it with after_rope); value_norm's too."""

    type: str  # "rms" (x / sqrt(mean x^2 + eps) * scale) | "layer" ((x - mean) / sqrt(var + eps) * scale + bias)
    eps: float = 1e-6  # inside the square root
    scope: str = "head"  # "head": over H of each head (Qwen3, Gemma 3); "all": over the whole N*H or K*H (OLMo 2)
    weight: bool = True  # False: no scale (nor bias) tensor (Llama 4's L2 norm, Gemma 3n's value norm)
    per_head: bool = False  # scope "head" with one scale per head: tensors (N, H) / (K, H) (Cohere)
    after_rope: bool = False  # the norm runs after RoPE (Llama 4's rope layers); q and k only

    # The keys added after the first three: written only where they differ from these defaults, so a file
    # that does not use them reads byte for byte as before.
    LATER_KEYS = {"weight": True, "per_head": False, "after_rope": False}

    @classmethod
    def from_value(cls, value: Any, name: str = "qk_norm") -> QKNorm | None:
        if value is None or isinstance(value, QKNorm):
            return value
        data = _object(name, value, ("type", "eps", "scope", *cls.LATER_KEYS))
        if data.get("type") not in QK_NORM_TYPES:
            raise ValueError(f"{name}.type must be one of {', '.join(QK_NORM_TYPES)}: got {_shown(data.get('type'))}")
        if data.get("scope", "head") not in QK_NORM_SCOPES:
            raise ValueError(f"{name}.scope must be one of {', '.join(QK_NORM_SCOPES)}: "
                             f"got {_shown(data.get('scope'))}")
        eps = _finite_number(f"{name}.eps", data.get("eps", 1e-6), positive=True)
        flags = {key: data.get(key, default) for key, default in cls.LATER_KEYS.items()}
        for key, flag in flags.items():
            _check_bool(f"{name}.{key}", flag)
        if flags["per_head"] and data.get("scope", "head") != "head":
            raise ValueError(f"{name}.per_head needs scope head (scope all already has one scale per feature of "
                             "every head)")
        if flags["per_head"] and not flags["weight"]:
            raise ValueError(f"{name}.per_head needs weight true (per-head scales are weights)")
        return cls(type=data["type"], eps=eps, scope=data.get("scope", "head"), **flags)

    def to_dict(self) -> dict[str, Any]:
        data = {"type": self.type, "eps": self.eps, "scope": self.scope}
        data.update({key: getattr(self, key) for key, default in self.LATER_KEYS.items() if getattr(self, key) != default})
        return data


# Where a query temperature reads its query's position (QueryTemperature.position).
TEMPERATURE_POSITIONS = ("positions", "cache_index")


@dataclasses.dataclass(frozen=True, kw_only=True)
class QueryTemperature:
    """q <- q * (1 + beta * ln(1 + floor((pos_q + offset) / floor))), after RoPE: a query scale that grows
    with the position (Llama 4's NoPE layers: offset 1, transformers' Llama4TextAttention `attn_scales`;
    Ministral 3 / Mistral 4: offset 0, `get_llama_4_attn_scale`)."""

    beta: float  # Llama 4's attn_scale (0.1), Ministral 3's llama_4_scaling_beta
    floor: float  # Llama 4's floor_scale (8192), Ministral 3's original_max_position_embeddings
    offset: int = 0  # 0 | 1: added to the position before the division
    # Where pos_q comes from: "positions", the call's query positions (the default); "cache_index", the
    # query's index in the cache, P + t, whatever the positions (transformers' Llama 4: arange plus the
    # past length, left pads included, modeling_llama4.py:360-361, while its RoPE and chunks read
    # position_ids). The two agree wherever the positions are the default P + arange(T).
    position: str = "positions"

    @classmethod
    def from_value(cls, value: Any) -> QueryTemperature | None:
        if value is None or isinstance(value, QueryTemperature):
            return value
        data = _object("query_temperature", value, ("beta", "floor", "offset", "position"))
        missing = [key for key in ("beta", "floor") if key not in data]
        if missing:
            raise ValueError(f"query_temperature is missing {', '.join(missing)}")
        offset = data.get("offset", 0)
        if isinstance(offset, bool) or offset not in (0, 1):
            raise ValueError(f"query_temperature.offset must be 0 or 1: got {_shown(offset)}")
        position = data.get("position", "positions")
        if position not in TEMPERATURE_POSITIONS:
            raise ValueError(f"query_temperature.position must be one of {', '.join(TEMPERATURE_POSITIONS)}: "
                             f"got {_shown(position)}")
        return cls(beta=_finite_number("query_temperature.beta", data["beta"]),
                   floor=_finite_number("query_temperature.floor", data["floor"], positive=True), offset=int(offset),
                   position=position)

    def to_dict(self) -> dict[str, Any]:
        """Its fields; position only where it is not the default (so a default config's JSON is unchanged)."""
        data = {"beta": self.beta, "floor": self.floor, "offset": self.offset}
        if self.position != "positions":
            data["position"] = self.position
        return data


@dataclasses.dataclass(frozen=True, kw_only=True)
class OutputGate:
    """The context multiplied by sigmoid(query_input . gate.kernel + gate.bias) before merge_heads: one gate per
    feature of each head ("element", Qwen3-Next / Qwen3.5) or one per head ("head")."""

    scope: str  # "element": gate.kernel (query_dim, N, V); "head": (query_dim, N)
    bias: bool = False  # a gate.bias tensor, (N, V) or (N,)

    @classmethod
    def from_value(cls, value: Any) -> OutputGate | None:
        if value is None or isinstance(value, OutputGate):
            return value
        data = _object("output_gate", value, ("scope", "bias"))
        if data.get("scope") not in OUTPUT_GATE_SCOPES:
            raise ValueError(f"output_gate.scope must be one of {', '.join(OUTPUT_GATE_SCOPES)}: "
                             f"got {_shown(data.get('scope'))}")
        _check_bool("output_gate.bias", data.get("bias", False))
        return cls(scope=data["scope"], bias=data.get("bias", False))

    def to_dict(self) -> dict[str, Any]:
        return {"scope": self.scope, "bias": self.bias}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Latent:
    """Multi-head latent attention (MLA: DeepSeek V2/V3, Kimi K2, MiniCPM3, Mistral 4). Queries through a
    low-rank down-projection, an RMS norm and an up-projection (or one projection without query_rank); keys
    and values from one down-projection of the key input to kv_rank + rope_dim features: an RMS norm on the
    kv_rank latent features, up-projected to each head's H - rope_dim key features and V value features, and
    rope_dim features that RoPE turns as one key shared by every head. Each q/k head is [H - rope_dim
    features without position | rope_dim rotary features] (DeepSeek's order)."""

    query_rank: int | None  # Qr (q_lora_rank); None: one query projection (DeepSeek V2-Lite)
    kv_rank: int  # C (kv_lora_rank): the latent's width, what the cache holds besides the rotary key
    rope_dim: int  # R (qk_rope_head_dim): the rotary features of each head, last in the head
    eps: float = 1e-6  # of both latent norms (DeepSeek's fixed 1e-6, not rms_norm_eps)

    @classmethod
    def from_value(cls, value: Any) -> Latent | None:
        if value is None or isinstance(value, Latent):
            return value
        data = _object("latent", value, ("query_rank", "kv_rank", "rope_dim", "eps"))
        missing = [key for key in ("kv_rank", "rope_dim") if key not in data]
        if missing:
            raise ValueError(f"latent is missing {', '.join(missing)}")
        if data.get("query_rank") is not None:
            _check_positive_int("latent.query_rank", data["query_rank"])
        _check_positive_int("latent.kv_rank", data["kv_rank"])
        _check_positive_int("latent.rope_dim", data["rope_dim"])
        if data["rope_dim"] % 2:
            raise ValueError(f"latent.rope_dim must be even (features rotate in pairs): got {data['rope_dim']}")
        return cls(query_rank=data.get("query_rank"), kv_rank=data["kv_rank"], rope_dim=data["rope_dim"],
                   eps=_finite_number("latent.eps", data.get("eps", 1e-6), positive=True))

    def to_dict(self) -> dict[str, Any]:
        return {"query_rank": self.query_rank, "kv_rank": self.kv_rank, "rope_dim": self.rope_dim, "eps": self.eps}


# Where the indexer's query comes from (Indexer.query_source) and which end of its head RoPE turns.
INDEXER_QUERY_SOURCES = ("latent", "input")
INDEXER_ROPE_ENDS = ("first", "last")
# How a block of keys is scored (Indexer.block_pool): "max", its keys' largest score (MiniMax M3); "gated", one
# pooled key per block, a softmax gate per feature over the block's keys (GLM-5.3-Flash's k-pool, glm5_next).
INDEXER_BLOCK_POOLS = ("max", "gated")
# The indexer's scoring precision (Indexer.scoring_precision): None, the storage dtype's; "fp8_e4m3", DeepSeek's
# inference scoring (Hadamard, then e4m3 with one scale per head vector; docs/sparse-attention.md "fp8 scoring"),
# its scales as computed ("float") or rounded up to a power of two ("ue8m0": DeepSeek's scale_fmt).
INDEXER_SCORING_PRECISIONS = (None, "fp8_e4m3")
INDEXER_FP8_SCALE_FORMATS = ("float", "ue8m0")
INDEXER_FP8_BLOCK = 128  # DeepSeek's act_quant block: one scale per head vector needs head_dim <= it


@dataclasses.dataclass(frozen=True, kw_only=True)
class Indexer:
    """A lightning indexer (DeepSeek V3.2's DSA, GLM-5's glm_moe_dsa, MiniMax M3): a small multi-head scorer
    that picks, for every query, the keys (or blocks of keys) the attention may see. docs/sparse-attention.md
    states each stage; impl_numpy/indexer.py is its executable form. Shape letters: I index heads, J index
    head_dim. Tensors (AttentionConfig.tensor_shapes): indexer.query.kernel (Qsrc, I, J), Qsrc the query
    rank (query_source "latent": the layer's normed query latent, DeepSeek's `qr`) or query_dim ("input");
    indexer.query.norm.scale (J,) with query_norm; indexer.key.kernel (key_dim, J); indexer.key.norm.scale
    (J,) and .bias (J,) (a "layer" norm); indexer.weights.kernel (query_dim, I) with head_weights; with
    block_pool "gated" indexer.pool.gate.kernel (key_dim, J) and indexer.pool.position (block_size, J). The
    indexer keeps its own cache: one key of J features per token after norm and RoPE (past_index_keys /
    present_index_keys, (B, P, J)); with block_pool "gated" each token's J gate logits after them (B, P, 2J):
    cache_width."""

    heads: int  # I: index heads (index_n_heads)
    head_dim: int  # J: index head_dim (index_head_dim)
    topk: int  # k: keys kept per query (index_topk), or blocks with block_size (index_topk_blocks)
    query_source: str = "latent"  # "latent": from the normed query latent (needs latent.query_rank); "input"
    query_norm: QKNorm | None = None  # a norm of each index query head (MiniMax M3: rms), scope head
    key_norm: QKNorm | None = None  # the index key's norm (DeepSeek V3.2 / GLM-5: layer, eps 1e-6; M3: rms)
    rope: Rope | None = None  # RoPE on rope.rotary_dim features of q and k (theta, pairing, scaling); None: none
    rope_end: str = "first"  # which end of the J features turns: "first" (V3.2, GLM-5, M3) or "last"
    head_weights: bool = True  # score = sum_i w_i(x) relu(.): per-head weights from the query input
    weight_scale: float | None = None  # multiplies the head weights; None: I ** -0.5 (DeepSeek)
    score_scale: float | None = None  # multiplies q.k before the ReLU; None: J ** -0.5 (DeepSeek); M3: 1
    relu: bool = True  # ReLU on each head's scaled q.k before the weighted sum (M3: none)
    per_kv_head: bool = False  # one selection per kv head (index head i selects for kv head i; M3) or one
    block_size: int | None = None  # None: keys are selected; an int: blocks of block_size keys (block_pool)
    local_blocks: int = 0  # blocks always kept: the query's own and the local_blocks - 1 before it (M3: 1)
    block_pool: str = "max"  # a block's score: "max" of its keys' (M3) or "gated": one pooled key (GLM-5.3)
    open_block: bool = False  # gated: the query's own block, while not all visible, kept beyond the top-k (GLM-5.3)
    scoring_precision: str | None = None  # None: scores in the storage dtype; "fp8_e4m3": DeepSeek's fp8 scoring
    fp8_scale_format: str = "float"  # with fp8_e4m3: its scales "float" (amax / 448) or "ue8m0" (a power of two)

    @classmethod
    def from_value(cls, value: Any) -> Indexer | None:
        if value is None or isinstance(value, Indexer):
            return value
        fields = tuple(f.name for f in dataclasses.fields(cls))
        data = _object("indexer", value, fields)
        missing = [key for key in ("heads", "head_dim", "topk") if key not in data]
        if missing:
            raise ValueError(f"indexer is missing {', '.join(missing)}")
        for key in ("heads", "head_dim", "topk"):
            _check_positive_int(f"indexer.{key}", data[key])
        if data.get("query_source", "latent") not in INDEXER_QUERY_SOURCES:
            raise ValueError(f"indexer.query_source must be one of {', '.join(INDEXER_QUERY_SOURCES)}: "
                             f"got {_shown(data.get('query_source'))}")
        if data.get("rope_end", "first") not in INDEXER_ROPE_ENDS:
            raise ValueError(f"indexer.rope_end must be one of {', '.join(INDEXER_ROPE_ENDS)}: "
                             f"got {_shown(data.get('rope_end'))}")
        for key in ("head_weights", "relu", "per_kv_head"):
            _check_bool(f"indexer.{key}", data.get(key, getattr(cls, key)))
        scales = {key: None if data.get(key) is None else _finite_number(f"indexer.{key}", data[key], positive=True)
                  for key in ("weight_scale", "score_scale")}
        block_size = data.get("block_size")
        if block_size is not None:
            _check_positive_int("indexer.block_size", block_size)
        local_blocks = data.get("local_blocks", 0)
        if isinstance(local_blocks, bool) or not isinstance(local_blocks, int) or local_blocks < 0:
            raise ValueError(f"indexer.local_blocks must be an integer >= 0: got {_shown(local_blocks)}")
        if local_blocks and block_size is None:
            raise ValueError(f"indexer.local_blocks needs block_size (local blocks are blocks): got local_blocks="
                             f"{local_blocks} with block_size null")
        if local_blocks > data["topk"]:
            raise ValueError(f"indexer.local_blocks must be at most indexer.topk (the local blocks take top-k "
                             f"slots): got local_blocks={local_blocks}, topk={data['topk']}")
        block_pool = data.get("block_pool", "max")
        if block_pool not in INDEXER_BLOCK_POOLS:
            raise ValueError(f"indexer.block_pool must be one of {', '.join(INDEXER_BLOCK_POOLS)}: "
                             f"got {_shown(block_pool)}")
        _check_bool("indexer.open_block", data.get("open_block", False))
        if block_pool == "gated" and (block_size is None or local_blocks):
            raise ValueError(f"indexer.block_pool gated needs block_size and local_blocks 0 (its query keeps its "
                             f"open block instead: open_block): got block_size={_shown(block_size)}, "
                             f"local_blocks={local_blocks}")
        if data.get("open_block", False) and block_pool != "gated":
            raise ValueError(f"indexer.open_block needs block_pool gated (a max-pooled block is a candidate while "
                             f"open): got block_pool={_shown(block_pool)}")
        scoring_precision = data.get("scoring_precision")
        if scoring_precision not in INDEXER_SCORING_PRECISIONS:
            raise ValueError(f"indexer.scoring_precision must be null or fp8_e4m3: got {_shown(scoring_precision)}")
        fp8_scale_format = data.get("fp8_scale_format", "float")
        if fp8_scale_format not in INDEXER_FP8_SCALE_FORMATS:
            raise ValueError(f"indexer.fp8_scale_format must be one of {', '.join(INDEXER_FP8_SCALE_FORMATS)}: "
                             f"got {_shown(fp8_scale_format)}")
        if fp8_scale_format != "float" and scoring_precision is None:
            raise ValueError(f"indexer.fp8_scale_format needs scoring_precision fp8_e4m3 (it formats fp8 scales): "
                             f"got fp8_scale_format={_shown(fp8_scale_format)} with scoring_precision null")
        if scoring_precision is not None:
            J = data["head_dim"]
            if J & (J - 1) or J > INDEXER_FP8_BLOCK:
                raise ValueError(f"indexer.scoring_precision fp8_e4m3 needs indexer.head_dim a power of two <= "
                                 f"{INDEXER_FP8_BLOCK} (DeepSeek's Hadamard transform and one quantisation block "
                                 f"per head): got head_dim={J}")
            if block_pool != "max":
                raise ValueError(f"indexer.scoring_precision fp8_e4m3 needs block_pool max (DeepSeek's fp8 scoring "
                                 f"is of token keys): got block_pool={_shown(block_pool)}")
        norms = {key: QKNorm.from_value(data.get(key), f"indexer.{key}") for key in ("query_norm", "key_norm")}
        for key, norm in norms.items():
            if norm is not None and (norm.scope != "head" or norm.per_head or norm.after_rope):
                raise ValueError(f"indexer.{key} must be a norm over each head's J features before RoPE (scope "
                                 f"head, per_head false, after_rope false): got {_shown(norm.to_dict())}")
        rope = Rope.from_value(data.get("rope"))
        if rope is not None:
            rotary_dim = data["head_dim"] if rope.rotary_dim is None else rope.rotary_dim
            if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim < 2 or rotary_dim % 2:
                raise ValueError(f"indexer.rope.rotary_dim must be an even integer >= 2 or null: "
                                 f"got {_shown(rotary_dim)}")
            if rotary_dim > data["head_dim"]:
                raise ValueError(f"indexer.rope.rotary_dim must be at most indexer.head_dim: got rotary_dim="
                                 f"{rotary_dim}, head_dim={data['head_dim']}")
            if rope.scaling is not None:
                rope.scaling.factor_lists_fit(rotary_dim)
            rope = dataclasses.replace(rope, rotary_dim=rotary_dim)
        return cls(heads=data["heads"], head_dim=data["head_dim"], topk=data["topk"],
                   query_source=data.get("query_source", "latent"), rope=rope,
                   rope_end=data.get("rope_end", "first"), head_weights=data.get("head_weights", True),
                   relu=data.get("relu", True), per_kv_head=data.get("per_kv_head", False), block_size=block_size,
                   local_blocks=local_blocks, block_pool=block_pool, open_block=data.get("open_block", False),
                   scoring_precision=scoring_precision, fp8_scale_format=fp8_scale_format, **norms, **scales)

    @property
    def cache_width(self) -> int:
        """The index cache's features per token: J, or 2J with block_pool "gated" (the key, then its gate
        logits: a block's pooled key needs every one of its tokens' gates)."""
        return 2 * self.head_dim if self.block_pool == "gated" else self.head_dim

    @property
    def effective_weight_scale(self) -> float:
        return self.heads ** -0.5 if self.weight_scale is None else self.weight_scale

    @property
    def effective_score_scale(self) -> float:
        return self.head_dim ** -0.5 if self.score_scale is None else self.score_scale

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        # the k-pool's and the scoring precision's options only where set: every earlier config (and vector file) serialises as it did
        for key, default in (("block_pool", "max"), ("open_block", False), ("scoring_precision", None),
                             ("fp8_scale_format", "float")):
            if data[key] == default:
                del data[key]
        for key in ("query_norm", "key_norm", "rope"):
            if data[key] is not None:
                data[key] = data[key].to_dict()
        return data


@dataclasses.dataclass(frozen=True, kw_only=True)
class Differential:
    """Differential attention (Ye et al. 2024, "Differential Transformer"; transformers' diffllama): the query
    heads in two halves, n and n + N/2 (n < N/2) one differential head; its value the kv head pair (g, g + K/2),
    g = n // G, features joined (2V wide); its context (w_n - lambda w_{n+N/2}) @ [v_g | v_{g+K/2}], then an RMS
    norm over those 2V features (no weight, eps inside the root) times (1 - lambda_init). lambda = exp(lambda_q1 .
    lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init, the four vectors tensors differential.lambda_* (H,).
    lambda_init is a number of the layer (a reader computes it from the layer index: diffllama's 0.8 - 0.6
    exp(-0.3 layer)), never derived here."""

    lambda_init: float  # added to lambda and in the (1 - lambda_init) scale after the norm
    eps: float = 1e-5  # the RMS norm's, inside the root (diffllama: rms_norm_eps)

    @classmethod
    def from_value(cls, value: Any) -> Differential | None:
        if value is None or isinstance(value, Differential):
            return value
        data = _object("differential", value, ("lambda_init", "eps"))
        if "lambda_init" not in data:
            raise ValueError("differential is missing lambda_init (a number of the layer: diffllama's 0.8 - 0.6 "
                             "exp(-0.3 layer_index))")
        return cls(lambda_init=_finite_number("differential.lambda_init", data["lambda_init"]),
                   eps=_finite_number("differential.eps", data.get("eps", 1e-5), positive=True))

    def to_dict(self) -> dict[str, Any]:
        return {"lambda_init": self.lambda_init, "eps": self.eps}


# The differential attention's tensors, each (H,): lambda = exp(q1 . k1) - exp(q2 . k2) + lambda_init.
DIFFERENTIAL_TENSORS = ("differential.lambda_q1", "differential.lambda_k1", "differential.lambda_q2",
                        "differential.lambda_k2")


# DeepSeek V4's layer kinds (issue 41; docs/spec-frontier.md#deepseek-v4).
COMPRESSED_KINDS = ("sliding", "csa", "hca")
# The cache of a V4 layer beyond past_key (the last W - 1 keys): the entries emitted so far, each compressor's
# open window (its buffered projections and raw gates) and, with overlap, the last closed window's first half.
# A call takes them as past_<name> and returns them as present_<name> (impl_numpy.compressed).
COMPRESSED_CACHE = ("entries", "window_kv", "window_gate", "overlap_kv", "overlap_gate")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Compressed:
    """A DeepSeek V4 attention layer (transformers' deepseek_v4; docs/spec-frontier.md#deepseek-v4 states each
    stage, impl_numpy/compressed.py is its executable form). One kv head read as key and as value (key.kernel,
    key.norm.scale), a low-rank query (query.down.kernel, query.down.norm.scale, query.kernel) with a weightless
    RMS norm per head, interleaved RoPE (config.rope) on the LAST rope.rotary_dim features, a sink per head, a
    window of window_left + 1 keys, the context's rotary features turned back by the query's position, and a
    grouped low-rank output projection (output.group.kernel (G, N*H/G, R), output.kernel (G*R, O)). kind "csa" and
    "hca" add compressed entries: windows of `ratio` tokens aligned to position 0, each closed window one entry
    (compressor.*); "csa" keeps the top index_topk visible entries per query by its own indexer (indexer.*)."""

    kind: str  # "sliding" | "csa" (compressed sparse attention) | "hca" (heavily compressed attention)
    query_rank: int  # Qr (q_lora_rank)
    output_groups: int  # G (o_groups)
    output_rank: int  # R (o_lora_rank): each group's width after output.group.kernel
    ratio: int | None = None  # m: tokens per entry (compress_rates[kind]); csa, hca only
    overlap: bool = False  # each entry also pools the previous window's first-half projections (2m slots; V4's csa)
    index_heads: int | None = None  # I (index_n_heads); csa only
    index_head_dim: int | None = None  # J (index_head_dim); csa only
    index_topk: int | None = None  # k (index_topk): entries kept per query; csa only
    eps: float = 1e-6  # of every RMS norm of the layer (rms_norm_eps)

    @classmethod
    def from_value(cls, value: Any) -> Compressed | None:
        if value is None or isinstance(value, Compressed):
            return value
        fields = ("kind", "query_rank", "output_groups", "output_rank", "ratio", "overlap", "index_heads",
                  "index_head_dim", "index_topk", "eps")
        data = _object("compressed", value, fields)
        kind = data.get("kind")
        if kind not in COMPRESSED_KINDS:
            raise ValueError(f"compressed.kind must be one of {', '.join(COMPRESSED_KINDS)}: got {_shown(kind)}")
        for name in ("query_rank", "output_groups", "output_rank"):
            _check_positive_int(f"compressed.{name}", data.get(name))
        overlap = data.get("overlap", False)
        _check_bool("compressed.overlap", overlap)
        index = ("index_heads", "index_head_dim", "index_topk")
        if kind == "sliding":
            for name in ("ratio", *index):
                if data.get(name) is not None:
                    raise ValueError(f"compressed.{name} must be null with kind sliding (a sliding layer has no "
                                     f"compressor): got {_shown(data[name])}")
            if overlap:
                raise ValueError("compressed.overlap must be false with kind sliding (a sliding layer has no "
                                 "compressor): got true")
        else:
            _check_positive_int("compressed.ratio", data.get("ratio"))
            for name in index:
                if kind == "csa":
                    _check_positive_int(f"compressed.{name}", data.get(name))
                elif data.get(name) is not None:
                    raise ValueError(f"compressed.{name} must be null with kind hca (HCA keeps every visible "
                                     f"entry, it has no indexer): got {_shown(data[name])}")
        return cls(kind=kind, query_rank=data["query_rank"], output_groups=data["output_groups"],
                   output_rank=data["output_rank"], ratio=data.get("ratio"), overlap=overlap,
                   index_heads=data.get("index_heads"), index_head_dim=data.get("index_head_dim"),
                   index_topk=data.get("index_topk"),
                   eps=_finite_number("compressed.eps", data.get("eps", 1e-6), positive=True))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "query_rank": self.query_rank, "output_groups": self.output_groups,
                "output_rank": self.output_rank, "ratio": self.ratio, "overlap": self.overlap,
                "index_heads": self.index_heads, "index_head_dim": self.index_head_dim,
                "index_topk": self.index_topk, "eps": self.eps}

    @property
    def slots(self) -> int:
        """c: each token's compressor projections hold c * H features (2 with overlap: both halves)."""
        return 2 if self.overlap else 1


# The modern fields and their defaults: `to_json` leaves a field out while it holds its default.
MODERN_DEFAULTS: dict[str, Any] = {"rope": None, "logit_softcap": None, "window_left": -1, "window_right": -1,
                                   "qk_norm": None, "use_sinks": False, "alibi": False, "local_chunk": None,
                                   "query_temperature": None, "qkv_clip": None, "output_gate": None,
                                   "value_norm": None, "latent": None, "alibi_bias_dtype": None,
                                   "indexer": None}
MODERN_DEFAULTS["differential"] = None  # differential attention (its own line: merged beside other new fields)
# Issue 42's fields (kept apart so the issue's other parts merge beside them).
MODERN_DEFAULTS.update(key_multiplier=1.0, value_scale=1.0, kv_shared=False)
MODERN_DEFAULTS["compressed"] = None  # issue 41: DeepSeek V4's layer (its own line)
# The dtypes alibi_bias_dtype may name: Falcon-RW builds its bias in bfloat16 whatever the model's dtype.
ALIBI_BIAS_DTYPES = ("bfloat16", "float16", "float32")
# The fields that are objects (a dict converts; to_dict gives their dict form).
_OBJECT_FIELDS = ("rope", "qk_norm", "query_temperature", "output_gate", "value_norm", "latent", "indexer")
_OBJECT_FIELDS += ("differential",)
_OBJECT_FIELDS += ("compressed",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """A multi-head attention layer. Defaults resolve in __post_init__, so a
    constructed config never holds None except in `scale`."""

    num_heads: int  # N
    query_dim: int  # features of the query input
    head_dim: int  # H, per-head width of queries and keys
    key_dim: int | None = None  # features of the key input; default query_dim
    value_dim: int | None = None  # features of the value input; default key_dim
    value_head_dim: int | None = None  # V; default head_dim
    out_dim: int | None = None  # O; default query_dim (a residual-friendly width)
    num_kv_heads: int | None = None  # K; default num_heads (plain MHA); 1 is MQA
    use_query_bias: bool = True
    use_key_bias: bool = True
    use_value_bias: bool = True
    use_output_bias: bool = True
    scale: float | None = None  # multiplies q.k; None means 1/sqrt(head_dim)
    dropout: float = 0.0  # probability of dropping an attention weight in training
    masked_row: str = "zero"  # a query row with no allowed key: "zero" | "uniform" | "nan"
    rope: Rope | None = None  # rotary position embedding of q and k (a dict converts); None: no positions
    logit_softcap: float | None = None  # c: logits <- c * tanh(logits / c), after the scale, before mask and bias
    window_left: int = -1  # key j visible to query i only if j >= p_i - window_left; -1: unbounded
    window_right: int = -1  # ... and only if j <= p_i + window_right; -1: unbounded (p_i: i aligned as causal is)
    qk_norm: QKNorm | None = None  # normalise q and k after projection (a dict converts)
    use_sinks: bool = False  # a learned logit per query head joins every softmax (tensor `sinks`, (N,))
    alibi: bool = False  # ALiBi: -slope_n * |pos_q - pos_k| added after the softcap (tensor `alibi.slopes`, (N,))
    local_chunk: int | None = None  # C: key j visible to query i only if pos_q // C == pos_k // C (Llama 4)
    query_temperature: QueryTemperature | None = None  # a position-dependent query scale after RoPE (a dict converts)
    qkv_clip: float | None = None  # c: q, k, v clamped to [-c, c] right after their projections (MPT, OLMo)
    output_gate: OutputGate | None = None  # sigmoid gate on the context before merge_heads (a dict converts)
    value_norm: QKNorm | None = None  # normalise v after projection, as qk_norm does q and k (Gemma 3n / 4)
    latent: Latent | None = None  # multi-head latent attention (a dict converts); see Latent
    # With alibi: None adds -slope_n * |pos_q - pos_k| (exact); a dtype name adds BLOOM's and Falcon's key form
    # rounded as Falcon-RW builds it, round(round(slope_n) * round(pos_k)) in that dtype (the same bias up to a
    # constant per query row, so under a causal mask the same softmax, but for the roundings)
    alibi_bias_dtype: str | None = None
    # A lightning indexer (DeepSeek V3.2, GLM-5, MiniMax M3; a dict converts): its tensors and its selection of
    # keys (impl_numpy.indexer), fed to the attention as topk_indices; see Indexer and docs/sparse-attention.md
    indexer: Indexer | None = None
    # Differential attention (diffllama; a dict converts): two softmaxes per output head subtracted with a learned
    # lambda, an RMS norm per head and the (1 - lambda_init) scale; see Differential and docs/differential-attention.md
    differential: Differential | None = None
    # Issue 42's cross-layer KV sharing and small knobs (docs/spec-frontier.md#cross-layer-kv-sharing-and-two-multipliers):
    key_multiplier: float = 1.0  # multiplies k after its projection and norm, before RoPE (Falcon-H1's key_multiplier)
    value_scale: float = 1.0  # multiplies v after its projection and norm (MiMo-V2's attention_value_scale)
    # The layer has no key or value projection: it attends to the cache it is given (past_key / past_value: another
    # layer's keys and values after their norm and RoPE) and appends nothing to it (Gemma 3n's num_kv_shared_layers)
    kv_shared: bool = False
    # Issue 41: a DeepSeek V4 layer (a dict converts; see Compressed and docs/spec-frontier.md#deepseek-v4). It runs
    # through impl_numpy.compressed.compressed_attention; multi_head_attention refuses it (weights.contract).
    compressed: Compressed | None = None

    def __post_init__(self) -> None:
        _check_positive_int("num_heads", self.num_heads)
        _check_positive_int("query_dim", self.query_dim)
        _check_positive_int("head_dim", self.head_dim)
        resolved = {
            "key_dim": self.query_dim if self.key_dim is None else self.key_dim,
            "value_head_dim": self.head_dim if self.value_head_dim is None else self.value_head_dim,
            "out_dim": self.query_dim if self.out_dim is None else self.out_dim,
            "num_kv_heads": self.num_heads if self.num_kv_heads is None else self.num_kv_heads,
        }
        resolved["value_dim"] = resolved["key_dim"] if self.value_dim is None else self.value_dim
        for name, value in resolved.items():
            _check_positive_int(name, value)
            object.__setattr__(self, name, value)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                "num_kv_heads must divide num_heads: "
                f"got num_kv_heads={self.num_kv_heads}, num_heads={self.num_heads}"
            )
        for name in ("use_query_bias", "use_key_bias", "use_value_bias", "use_output_bias"):
            _check_bool(name, getattr(self, name))
        if self.scale is not None:
            bad = isinstance(self.scale, bool) or not isinstance(self.scale, (int, float))
            try:
                bad = bad or not math.isfinite(float(self.scale))
            except OverflowError:  # an int beyond float range
                bad = True
            if bad:
                raise ValueError(f"scale must be a finite number or null: got {_shown(self.scale)}")
            object.__setattr__(self, "scale", float(self.scale))
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be a number in [0, 1): got {self.dropout!r}")
        object.__setattr__(self, "dropout", float(self.dropout))
        if self.masked_row not in MASKED_ROW_POLICIES:
            raise ValueError(
                f"masked_row must be one of {', '.join(MASKED_ROW_POLICIES)}: got {self.masked_row!r}"
            )
        self._resolve_modern()

    def _resolve_modern(self) -> None:
        rope = Rope.from_value(self.rope)
        latent = Latent.from_value(self.latent)
        object.__setattr__(self, "latent", latent)
        if latent is not None:
            self._check_latent(latent, rope)
            rope = dataclasses.replace(rope, rotary_dim=latent.rope_dim)
        if rope is not None:
            rotary_dim = self.head_dim if rope.rotary_dim is None else rope.rotary_dim
            if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim < 2:
                raise ValueError(f"rope.rotary_dim must be an even integer >= 2 or null: got {_shown(rotary_dim)}")
            if rotary_dim % 2:
                raise ValueError(f"rope.rotary_dim must be even (features rotate in pairs): got {rotary_dim}")
            if rotary_dim > self.head_dim:
                raise ValueError(f"rope.rotary_dim must be at most head_dim: got rotary_dim={rotary_dim}, "
                                 f"head_dim={self.head_dim}")
            if rope.scaling is not None:
                rope.scaling.factor_lists_fit(rotary_dim)
            rope.mrope_fits(rotary_dim)
            rope = dataclasses.replace(rope, rotary_dim=rotary_dim)
        object.__setattr__(self, "rope", rope)
        if self.logit_softcap is not None:
            object.__setattr__(self, "logit_softcap", _finite_number("logit_softcap", self.logit_softcap,
                                                                     positive=True))
        for name in ("window_left", "window_right"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < -1:
                raise ValueError(f"{name} must be an integer >= -1 (-1: unbounded): got {_shown(value)}")
        object.__setattr__(self, "qk_norm", QKNorm.from_value(self.qk_norm))
        _check_bool("use_sinks", self.use_sinks)
        _check_bool("alibi", self.alibi)
        if self.alibi_bias_dtype is not None:
            if self.alibi_bias_dtype not in ALIBI_BIAS_DTYPES:
                raise ValueError(f"alibi_bias_dtype must be one of {', '.join(ALIBI_BIAS_DTYPES)} or null: got "
                                 f"{_shown(self.alibi_bias_dtype)}")
            if not self.alibi:
                raise ValueError(f"alibi_bias_dtype needs alibi true (it says how ALiBi's bias is rounded): got "
                                 f"alibi_bias_dtype={self.alibi_bias_dtype!r} with alibi false")
        if self.local_chunk is not None:
            _check_positive_int("local_chunk", self.local_chunk)
        object.__setattr__(self, "query_temperature", QueryTemperature.from_value(self.query_temperature))
        if self.qkv_clip is not None:
            object.__setattr__(self, "qkv_clip", _finite_number("qkv_clip", self.qkv_clip, positive=True))
        object.__setattr__(self, "output_gate", OutputGate.from_value(self.output_gate))
        value_norm = QKNorm.from_value(self.value_norm, "value_norm")
        if value_norm is not None and value_norm.after_rope:
            raise ValueError("value_norm.after_rope must be false (RoPE never turns v)")
        object.__setattr__(self, "value_norm", value_norm)
        indexer = Indexer.from_value(self.indexer)
        if indexer is not None:
            self._check_indexer(indexer)
        object.__setattr__(self, "indexer", indexer)
        self._resolve_differential()
        self._resolve_sharing_and_knobs()
        self._check_mrope()
        self._resolve_compressed()

    def _resolve_compressed(self) -> None:
        """compressed (issue 41): a dict converts; what a V4 layer needs of the other fields (one line each)."""
        compressed = Compressed.from_value(self.compressed)
        object.__setattr__(self, "compressed", compressed)
        if compressed is None:
            return
        why = "(a DeepSeek V4 layer: impl_numpy.compressed)"
        if self.num_kv_heads != 1:
            raise ValueError(f"num_kv_heads must be 1 with compressed (one kv head read as key and as value) {why}: "
                             f"got {self.num_kv_heads}")
        if self.value_head_dim != self.head_dim:
            raise ValueError(f"value_head_dim must equal head_dim with compressed (the key is the value) {why}: got "
                             f"value_head_dim={self.value_head_dim}, head_dim={self.head_dim}")
        if len({self.query_dim, self.key_dim, self.value_dim}) != 1:
            raise ValueError(f"key_dim and value_dim must equal query_dim with compressed (one input, the hidden "
                             f"states) {why}: got query_dim={self.query_dim}, key_dim={self.key_dim}, "
                             f"value_dim={self.value_dim}")
        for name in ("use_query_bias", "use_key_bias", "use_value_bias", "use_output_bias"):
            if getattr(self, name):
                raise ValueError(f"{name} must be false with compressed (V4's projections have no bias) {why}: "
                                 f"got true")
        if self.rope is None or not self.rope.interleaved or self.rope.mrope_section is not None:
            raise ValueError(f"rope must be set, interleaved, without mrope_section with compressed (V4 turns pairs "
                             f"2i, 2i+1 of the last rotary_dim features) {why}: got "
                             f"{_shown(None if self.rope is None else self.rope.to_dict())}")
        if self.window_left < 0 or self.window_right != -1:
            raise ValueError(f"window_left must be >= 0 and window_right -1 with compressed (a causal window of "
                             f"window_left + 1 keys) {why}: got window_left={self.window_left}, "
                             f"window_right={self.window_right}")
        for name in ("logit_softcap", "qk_norm", "local_chunk", "query_temperature", "qkv_clip", "output_gate",
                     "value_norm", "latent", "indexer", "differential", "alibi_bias_dtype"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} must be null with compressed (V4's layer has its own norms and indexer) "
                                 f"{why}: got {_shown(getattr(self, name))}")
        for name, on in (("alibi", self.alibi), ("kv_shared", self.kv_shared), ("dropout", self.dropout != 0),
                         ("key_multiplier", self.key_multiplier != 1), ("value_scale", self.value_scale != 1)):
            if on:
                raise ValueError(f"{name} must keep its default with compressed {why}: got {getattr(self, name)}")
        if (self.num_heads * self.head_dim) % compressed.output_groups:
            raise ValueError(f"compressed.output_groups must divide num_heads * head_dim (each group projects its "
                             f"share of the heads) {why}: got output_groups={compressed.output_groups}, "
                             f"num_heads * head_dim={self.num_heads * self.head_dim}")
        if compressed.kind == "csa" and compressed.index_head_dim < self.rope.rotary_dim:
            raise ValueError(f"compressed.index_head_dim must be at least rope.rotary_dim (the indexer turns its last "
                             f"rotary_dim features) {why}: got index_head_dim={compressed.index_head_dim}, "
                             f"rotary_dim={self.rope.rotary_dim}")

    def _compressed_shapes(self) -> dict[str, tuple[int, ...]]:
        """A V4 layer's tensors (Compressed): the low-rank query, the one kv head's projection and norm, the sinks,
        the grouped output, the compressor's (csa, hca) and the indexer's (csa)."""
        N, H, D, O, c = self.num_heads, self.head_dim, self.query_dim, self.out_dim, self.compressed
        G, R, Qr = c.output_groups, c.output_rank, c.query_rank
        shapes: dict[str, tuple[int, ...]] = {
            "query.down.kernel": (D, Qr), "query.down.norm.scale": (Qr,), "query.kernel": (Qr, N, H),
            "key.kernel": (D, 1, H), "key.norm.scale": (H,),
            "output.group.kernel": (G, N * H // G, R), "output.kernel": (G * R, O)}
        if self.use_sinks:
            shapes["sinks"] = (N,)
        if c.kind == "sliding":
            return shapes
        widths = [("compressor", H)] + ([("indexer.compressor", c.index_head_dim)] if c.kind == "csa" else [])
        for prefix, width in widths:
            shapes.update({f"{prefix}.kernel": (D, c.slots * width), f"{prefix}.gate.kernel": (D, c.slots * width),
                           f"{prefix}.position_bias": (c.ratio, c.slots * width), f"{prefix}.norm.scale": (width,)})
        if c.kind == "csa":
            shapes["indexer.query.kernel"] = (Qr, c.index_heads, c.index_head_dim)
            shapes["indexer.weights.kernel"] = (D, c.index_heads)
        return shapes

    def _check_mrope(self) -> None:
        """Multimodal RoPE's positions (3, B, L) feed RoPE alone: the stages that read one position per token
        (ALiBi, local chunks, the query temperature, the indexer's own RoPE) are refused beside it."""
        if self.rope is None or self.rope.mrope_section is None:
            return
        for name, on in (("alibi", self.alibi), ("local_chunk", self.local_chunk is not None),
                         ("query_temperature", self.query_temperature is not None),
                         ("indexer", self.indexer is not None)):
            if on:
                raise ValueError(f"rope.mrope_section cannot be combined with {name} (it reads one position per "
                                 f"token; multimodal positions have three): got {name} {_shown(getattr(self, name))}")

    def _resolve_differential(self) -> None:
        """differential: a dict converts; what it needs of the other fields (one line each, naming the field)."""
        differential = Differential.from_value(self.differential)
        object.__setattr__(self, "differential", differential)
        if differential is None:
            return
        for name, heads in (("num_heads", self.num_heads), ("num_kv_heads", self.num_kv_heads)):
            if heads % 2:
                raise ValueError(f"{name} must be even with differential (its heads pair as n and n + {name} / 2): "
                                 f"got {name}={heads}")
        if self.dropout:
            raise ValueError(f"dropout must be 0 with differential (two softmaxes subtracted have no one dropout; "
                             f"diffllama refuses it too): got dropout={self.dropout}")
        for name in ("output_gate", "latent"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} must be null with differential (the differential head is 2V wide): got "
                                 f"{_shown(getattr(self, name).to_dict())}")

    def _resolve_sharing_and_knobs(self) -> None:
        """key_multiplier, value_scale and kv_shared (issue 42): one line each, naming the field."""
        for name in ("key_multiplier", "value_scale"):
            object.__setattr__(self, name, _finite_number(name, getattr(self, name)))
        _check_bool("kv_shared", self.kv_shared)
        if self.latent is not None:
            for name in ("key_multiplier", "value_scale"):
                if getattr(self, name) != 1.0:
                    raise ValueError(f"{name} must be 1 with latent (the latent's keys and values come from its "
                                     f"up-projections): got {getattr(self, name)}")
        if not self.kv_shared:
            return
        for name in ("key_multiplier", "value_scale"):
            if getattr(self, name) != 1.0:
                raise ValueError(f"{name} must be 1 with kv_shared (the layer makes no keys or values of its own; "
                                 f"the layer whose cache it reads applies it): got {getattr(self, name)}")
        for name in ("latent", "indexer", "value_norm", "qkv_clip", "differential"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} must be null with kv_shared (the layer has no key or value projection): "
                                 f"got {_shown(getattr(self, name))}")
        if self.qk_norm is not None and self.qk_norm.after_rope:
            raise ValueError("qk_norm.after_rope must be false with kv_shared (the shared keys were normed by the "
                             "layer that made them; the query's norm runs before RoPE, as Gemma 3n's q_norm)")

    def _check_indexer(self, indexer: Indexer) -> None:
        """What an indexer needs of the other fields (one line each, naming the field)."""
        if indexer.query_source == "latent" and (self.latent is None or self.latent.query_rank is None):
            raise ValueError("indexer.query_source latent needs latent.query_rank (the indexer's query is the "
                             "layer's normed query latent): got latent "
                             f"{'null' if self.latent is None else 'without query_rank'}")
        if indexer.per_kv_head and indexer.heads != self.num_kv_heads:
            raise ValueError(f"indexer.per_kv_head needs indexer.heads equal to num_kv_heads (index head i selects "
                             f"for kv head i): got heads={indexer.heads}, num_kv_heads={self.num_kv_heads}")
        if indexer.per_kv_head and indexer.head_weights:
            raise ValueError("indexer.per_kv_head needs head_weights false (each index head selects on its own "
                             "score; head weights sum the heads into one)")

    def _check_latent(self, latent: Latent, rope: Rope | None) -> None:
        """What a latent layer needs of the other fields (one line each, naming the field)."""
        if latent.rope_dim >= self.head_dim:
            raise ValueError(f"latent.rope_dim must be less than head_dim (the key's other features come from the "
                             f"latent): got rope_dim={latent.rope_dim}, head_dim={self.head_dim}")
        if rope is None:
            raise ValueError("latent needs rope (it turns the rope_dim features and the shared key): got rope null")
        if rope.rotary_dim is not None and rope.rotary_dim != latent.rope_dim:
            raise ValueError(f"rope.rotary_dim must equal latent.rope_dim or be null: got rotary_dim={rope.rotary_dim}, "
                             f"rope_dim={latent.rope_dim}")
        if self.use_value_bias:
            raise ValueError("use_value_bias must be false with latent (the values are the latent's up-projection, "
                             "which has no bias): got true")
        for name in ("qk_norm", "value_norm", "qkv_clip"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} must be null with latent (the latent has its own norms): got "
                                 f"{_shown(getattr(self, name))}")

    # -- derived quantities -------------------------------------------------
    @property
    def effective_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim) if self.scale is None else self.scale

    @property
    def reads_positions(self) -> bool:
        """The call's positions feed a stage: RoPE, ALiBi, local chunks or the query temperature."""
        return (self.rope is not None or self.alibi or self.local_chunk is not None
                or self.query_temperature is not None)

    @property
    def group_size(self) -> int:
        """G = N / K: how many query heads share one key/value head."""
        return self.num_heads // self.num_kv_heads

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """The canonical tensors this config has, name -> shape."""
        N, K, H, V = self.num_heads, self.num_kv_heads, self.head_dim, self.value_head_dim
        if self.compressed is not None:
            return self._compressed_shapes()
        if self.latent is not None:
            return {**self._latent_shapes(), **self._indexer_shapes()}
        shapes: dict[str, tuple[int, ...]] = {"query.kernel": (self.query_dim, N, H)}
        if self.use_query_bias:
            shapes["query.bias"] = (N, H)
        shapes.update(self._norm_shapes("query", N))
        if self.kv_shared:  # no key or value tensors: the keys and values are another layer's cache
            shapes.update(self._after_attention_shapes())
            return shapes
        shapes["key.kernel"] = (self.key_dim, K, H)
        if self.use_key_bias:
            shapes["key.bias"] = (K, H)
        shapes.update(self._norm_shapes("key", K))
        shapes["value.kernel"] = (self.value_dim, K, V)
        if self.use_value_bias:
            shapes["value.bias"] = (K, V)
        shapes.update(self._norm_shapes("value", K))
        shapes.update(self._after_attention_shapes())
        shapes.update(self._indexer_shapes())
        shapes.update(self._differential_shapes())
        return shapes

    def _differential_shapes(self) -> dict[str, tuple[int, ...]]:
        """differential.lambda_q1, _k1, _q2, _k2: (H,) each (diffllama's lambda vectors)."""
        return {} if self.differential is None else {name: (self.head_dim,) for name in DIFFERENTIAL_TENSORS}

    @property
    def indexer_query_width(self) -> int:
        """The width of what the indexer's query projection reads: the query rank (query_source "latent") or
        query_dim ("input")."""
        return self.latent.query_rank if self.indexer.query_source == "latent" else self.query_dim

    def _indexer_shapes(self) -> dict[str, tuple[int, ...]]:
        """indexer.*: the indexer's query projection (from the query latent or the query input), its norms, its
        key projection (one key of J features per token, shared by the index heads) and its head weights."""
        ix = self.indexer
        if ix is None:
            return {}
        I, J = ix.heads, ix.head_dim
        shapes: dict[str, tuple[int, ...]] = {"indexer.query.kernel": (self.indexer_query_width, I, J)}
        if ix.query_norm is not None and ix.query_norm.weight:
            shapes.update({f"indexer.query.norm.{n}": (J,) for n in
                           (("scale", "bias") if ix.query_norm.type == "layer" else ("scale",))})
        shapes["indexer.key.kernel"] = (self.key_dim, J)
        if ix.key_norm is not None and ix.key_norm.weight:
            shapes.update({f"indexer.key.norm.{n}": (J,) for n in
                           (("scale", "bias") if ix.key_norm.type == "layer" else ("scale",))})
        if ix.head_weights:
            shapes["indexer.weights.kernel"] = (self.query_dim, I)
        if ix.block_pool == "gated":
            shapes["indexer.pool.gate.kernel"] = (self.key_dim, J)
            shapes["indexer.pool.position"] = (ix.block_size, J)
        return shapes

    def _latent_shapes(self) -> dict[str, tuple[int, ...]]:
        """A latent layer's tensors: the query's down-projection, norm and up-projection (or one projection),
        the latent's down-projection and norm, its up-projections to keys and values, the output."""
        N, K, H, V, L = self.num_heads, self.num_kv_heads, self.head_dim, self.value_head_dim, self.latent
        C, R, Qr = L.kv_rank, L.rope_dim, L.query_rank
        shapes: dict[str, tuple[int, ...]] = {}
        if Qr is not None:
            shapes["query.down.kernel"] = (self.query_dim, Qr)
            if self.use_query_bias:
                shapes["query.down.bias"] = (Qr,)
            shapes["query.down.norm.scale"] = (Qr,)
            shapes["query.kernel"] = (Qr, N, H)
        else:
            shapes["query.kernel"] = (self.query_dim, N, H)
            if self.use_query_bias:
                shapes["query.bias"] = (N, H)
        shapes["latent.kernel"] = (self.key_dim, C + R)
        if self.use_key_bias:
            shapes["latent.bias"] = (C + R,)
        shapes["latent.norm.scale"] = (C,)
        shapes["key.kernel"] = (C, K, H - R)
        shapes["value.kernel"] = (C, K, V)
        shapes.update(self._after_attention_shapes())
        return shapes

    def _after_attention_shapes(self) -> dict[str, tuple[int, ...]]:
        """The tensors every layer, latent or not, takes after its keys and values: the output projection,
        sinks, ALiBi's slopes and the output gate."""
        N, V = self.num_heads, self.value_head_dim
        shapes: dict[str, tuple[int, ...]] = {"output.kernel": (N, V, self.out_dim)}
        if self.use_output_bias:
            shapes["output.bias"] = (self.out_dim,)
        if self.use_sinks:
            shapes["sinks"] = (N,)
        if self.alibi:
            shapes["alibi.slopes"] = (N,)
        if self.output_gate is not None:
            per_head = (N, V) if self.output_gate.scope == "element" else (N,)
            shapes["gate.kernel"] = (self.query_dim, *per_head)
            if self.output_gate.bias:
                shapes["gate.bias"] = per_head
        return shapes

    def _norm_shapes(self, prefix: str, heads: int) -> dict[str, tuple[int, ...]]:
        """query.norm.* / key.norm.* / value.norm.*: (W,) shared by every head, or (heads, W) per head or over
        the whole projection (W: H, or V for the value norm); none for a weightless norm."""
        norm = self.value_norm if prefix == "value" else self.qk_norm
        if norm is None or not norm.weight:
            return {}
        width = self.value_head_dim if prefix == "value" else self.head_dim
        shape = (width,) if norm.scope == "head" and not norm.per_head else (heads, width)
        names = ("scale", "bias") if norm.type == "layer" else ("scale",)
        return {f"{prefix}.norm.{name}": shape for name in names}

    @property
    def is_modern(self) -> bool:
        """Uses any field beyond the plain layer's."""
        return any(getattr(self, name) != default for name, default in MODERN_DEFAULTS.items())

    # -- serialisation -------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field, plain JSON values (rope, qk_norm, query_temperature, output_gate as objects or None)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in _OBJECT_FIELDS:
            if data[name] is not None:
                data[name] = data[name].to_dict()
        return data

    def to_json(self) -> str:
        """The file form: every plain field, and the modern ones that differ from their defaults."""
        data = self.to_dict()
        for name, default in MODERN_DEFAULTS.items():
            if data[name] == default:
                del data[name]
        return json.dumps(data, sort_keys=True)

    def replace(self, **changes: Any) -> AttentionConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: Any) -> AttentionConfig:
        if not isinstance(data, dict):
            raise ValueError(f"config must be a JSON object: got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"config has unknown fields: {', '.join(map(repr, unknown))}")
        missing = sorted(name for name in ("num_heads", "query_dim", "head_dim") if name not in data)
        if missing:
            raise ValueError(f"config is missing required fields: {', '.join(missing)}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> AttentionConfig:
        from .strict_json import _HeaderProblem, _parse_json_text

        if not isinstance(text, str):
            raise ValueError(f"config is not valid JSON: got {type(text).__name__}")
        try:
            data = _parse_json_text(text)
        except _HeaderProblem as err:
            raise ValueError(f"config is not valid JSON: {err}") from None
        return cls.from_dict(data)
