"""The named case grid: every feature of the contract, small enough to ship.

A Case is data only (config, sizes, which inputs it has, call options).
`make_tensors` and `make_inputs` turn it into float64 arrays from fixed seeds,
so every backend, test and vector file sees the same numbers.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import numpy as np

import weights
from weights import AttentionConfig
from weights.dtypes import is_float

DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    config: AttentionConfig
    B: int = 2
    T: int = 5
    S: int = 5
    self_attention: bool = True  # key and value are the query (else separate inputs)
    mask: str | None = None  # None | "padding" | "random" | "random_bts" | "random_ts" | "empty_rows"
    bias: str | None = None  # None | "random" | "neg_inf"
    is_causal: bool = False
    causal_alignment: str = "top_left"
    training: bool = False  # with an explicit dropout mask
    return_weights: bool = True
    input_scale: float = 1.0  # > 1 makes large logits

    @property
    def seed(self) -> int:
        return zlib.crc32(self.name.encode())

    def options(self, dtype: str) -> dict[str, Any]:
        return {
            "is_causal": self.is_causal, "causal_alignment": self.causal_alignment,
            "return_weights": self.return_weights, "dtype": dtype, "training": self.training,
        }


def _cfg(**kw) -> AttentionConfig:
    base = dict(num_heads=2, query_dim=8, head_dim=4)
    base.update(kw)
    return AttentionConfig(**base)


def _grid() -> list[Case]:
    cross = dict(self_attention=False, T=4, S=6)
    return [
        Case("self_basic", _cfg()),
        Case("cross_basic", _cfg(), **cross),
        Case("cross_dims", _cfg(query_dim=6, key_dim=5, value_dim=7, head_dim=3), **cross),
        Case("value_head_dim", _cfg(head_dim=3, value_head_dim=5), **cross),
        Case("out_dim", _cfg(out_dim=3)),
        Case("no_query_bias", _cfg(use_query_bias=False)),
        Case("no_key_bias", _cfg(use_key_bias=False), **cross),
        Case("no_value_bias", _cfg(use_value_bias=False), **cross),
        Case("no_output_bias", _cfg(use_output_bias=False)),
        Case("no_biases", _cfg(use_query_bias=False, use_key_bias=False, use_value_bias=False, use_output_bias=False)),
        Case("custom_scale", _cfg(scale=0.3)),
        Case("gqa", _cfg(num_heads=4, num_kv_heads=2, head_dim=3), **cross),
        Case("mqa", _cfg(num_heads=4, num_kv_heads=1, head_dim=3), **cross),
        Case("query_len_1", _cfg(), self_attention=False, T=1, S=5),
        Case("key_len_1", _cfg(), self_attention=False, T=4, S=1),
        Case("causal_square", _cfg(), is_causal=True),
        Case("causal_top_left", _cfg(), is_causal=True, **cross),
        Case("causal_bottom_right", _cfg(), is_causal=True, causal_alignment="bottom_right", **cross),
        Case("causal_bottom_right_long_query", _cfg(), is_causal=True, causal_alignment="bottom_right",
             self_attention=False, T=6, S=4, mask=None),
        Case("padding_mask", _cfg(), mask="padding", **cross),
        Case("mask_bnts", _cfg(), mask="random", **cross),
        Case("mask_bts", _cfg(), mask="random_bts", **cross),
        Case("mask_ts", _cfg(), mask="random_ts", **cross),
        Case("bias", _cfg(), bias="random", **cross),
        Case("bias_neg_inf", _cfg(), bias="neg_inf", **cross),
        Case("mask_and_bias_causal", _cfg(num_heads=4, num_kv_heads=2), mask="padding", bias="random", is_causal=True),
        Case("masked_rows_zero", _cfg(masked_row="zero"), mask="empty_rows", **cross),
        Case("masked_rows_uniform", _cfg(masked_row="uniform"), mask="empty_rows", **cross),
        Case("masked_rows_nan", _cfg(masked_row="nan"), mask="empty_rows", **cross),
        Case("large_logits", _cfg(scale=1.0), input_scale=6.0),
        Case("dropout_train", _cfg(dropout=0.25), training=True, **cross),
        Case("no_weights", _cfg(), return_weights=False, mask="padding", **cross),
    ]


CASES: dict[str, Case] = {case.name: case for case in _grid()}
assert len(CASES) == len(_grid()), "case names must be unique"


def make_tensors(case: Case) -> dict[str, np.ndarray]:
    """The case's canonical tensors in float64 (cast per dtype by the caller)."""
    return weights.init(case.config, seed=case.seed, dtype="float64")


def make_inputs(case: Case) -> dict[str, np.ndarray]:
    """query, key, value (always explicit) and the case's mask, bias, dropout_mask.

    Masks other than "empty_rows" leave every query row at least one key, so a
    case only meets fully masked rows where it says so.
    """
    c = case.config
    rng = np.random.default_rng(case.seed + 1)
    B, T, S, N = case.B, case.T, case.S, c.num_heads
    query = rng.standard_normal((B, T, c.query_dim)) * case.input_scale
    if case.self_attention:
        if not (T == S and c.query_dim == c.key_dim == c.value_dim):
            raise ValueError(f"case {case.name}: self attention needs T == S and equal input dims")
        key = value = query
    else:
        key = rng.standard_normal((B, S, c.key_dim)) * case.input_scale
        value = rng.standard_normal((B, S, c.value_dim)) * case.input_scale
    inputs: dict[str, np.ndarray] = {"query": query, "key": key.copy(), "value": value.copy()}

    def with_one_allowed(m: np.ndarray) -> np.ndarray:
        m = m.copy()
        m[..., 0] = True  # key 0 always visible (before any causal mask, which keeps j=0 for top_left)
        return m

    if case.mask == "padding":
        lengths = rng.integers(1, S + 1, size=B)
        lengths[0] = S
        inputs["mask"] = (np.arange(S)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)
    elif case.mask == "random":
        inputs["mask"] = with_one_allowed(rng.random((B, N, T, S)) < 0.6)
    elif case.mask == "random_bts":
        inputs["mask"] = with_one_allowed(rng.random((B, T, S)) < 0.6)
    elif case.mask == "random_ts":
        inputs["mask"] = with_one_allowed(rng.random((T, S)) < 0.6)
    elif case.mask == "empty_rows":
        m = with_one_allowed(rng.random((B, 1, T, S)) < 0.6)
        m[0, 0, min(1, T - 1), :] = False  # query 1 of batch 0: no key at all
        m[-1, 0, -1, :] = False
        inputs["mask"] = m
    elif case.mask is not None:
        raise ValueError(f"case {case.name}: unknown mask kind {case.mask!r}")
    if case.bias == "random":
        inputs["bias"] = rng.standard_normal((B, 1, T, S))
    elif case.bias == "neg_inf":
        b = rng.standard_normal((B, N, T, S))
        b[rng.random((B, N, T, S)) < 0.3] = -np.inf
        b[..., 0] = np.where(np.isinf(b[..., 0]), 0.0, b[..., 0])
        inputs["bias"] = b
    if case.training:
        inputs["dropout_mask"] = rng.random((B, N, T, S)) >= c.dropout
    return inputs


def cast_inputs(inputs: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """Float inputs to the case dtype (bias too); bool masks unchanged."""
    dt = weights.dtype_from_name(dtype)
    return {k: (v.astype(dt) if is_float(v.dtype) else v) for k, v in inputs.items()}


def cast_tensors(tensors: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    dt = weights.dtype_from_name(dtype)
    return {k: v.astype(dt) for k, v in tensors.items()}


def output_cotangent(case: Case) -> np.ndarray:
    """The fixed d_output for gradient checks, (B, T, O), float64."""
    rng = np.random.default_rng(case.seed + 2)
    return rng.standard_normal((case.B, case.T, case.config.out_dim))


def random_case(seed: int) -> Case:
    """A random point of the same feature space, for sweeps (name random_<seed>)."""
    rng = np.random.default_rng(seed)
    pick = lambda options: options[int(rng.integers(len(options)))]  # noqa: E731
    K = int(rng.integers(1, 4))
    N = K * int(rng.integers(1, 4))
    self_attention = bool(rng.random() < 0.4)
    query_dim = int(rng.integers(1, 17))
    dims = (query_dim, query_dim) if self_attention else (int(rng.integers(1, 17)), int(rng.integers(1, 17)))
    config = AttentionConfig(
        num_heads=N, num_kv_heads=K, query_dim=query_dim, key_dim=dims[0], value_dim=dims[1],
        head_dim=int(rng.integers(1, 9)), value_head_dim=int(rng.integers(1, 9)), out_dim=int(rng.integers(1, 17)),
        use_query_bias=bool(rng.random() < 0.8), use_key_bias=bool(rng.random() < 0.8),
        use_value_bias=bool(rng.random() < 0.8), use_output_bias=bool(rng.random() < 0.8),
        scale=None if rng.random() < 0.7 else float(rng.uniform(0.05, 1.5)),
        dropout=pick([0.0, 0.0, 0.1, 0.4]), masked_row=pick(["zero", "uniform", "nan"]),
    )
    T = int(rng.integers(1, 9))
    S = T if self_attention else int(rng.integers(1, 9))
    mask = pick([None, None, "padding", "random", "random_bts", "random_ts", "empty_rows"])
    causal = bool(rng.random() < 0.35)
    return Case(
        name=f"random_{seed}", config=config, B=int(rng.integers(1, 4)), T=T, S=S, self_attention=self_attention,
        mask=mask, bias=pick([None, None, "random", "neg_inf"]), is_causal=causal,
        causal_alignment=pick(["top_left", "bottom_right"]),
        training=config.dropout > 0 and bool(rng.random() < 0.7), return_weights=bool(rng.random() < 0.8),
        input_scale=pick([1.0, 1.0, 0.1, 3.0]),
    )
