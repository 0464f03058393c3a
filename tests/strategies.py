"""Hypothesis strategies for configs and calls (small sizes, every option)."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from weights import AttentionConfig


@st.composite
def configs(draw, *, equal_dims: bool = False, masked_rows=("zero", "uniform", "nan"), dropout: bool = False):
    K = draw(st.integers(1, 3))
    G = draw(st.integers(1, 3))
    query_dim = draw(st.integers(1, 7))
    return AttentionConfig(
        num_heads=K * G,
        num_kv_heads=K,
        query_dim=query_dim,
        key_dim=query_dim if equal_dims else draw(st.integers(1, 7)),
        value_dim=query_dim if equal_dims else draw(st.integers(1, 7)),
        head_dim=draw(st.integers(1, 5)),
        value_head_dim=draw(st.integers(1, 5)),
        out_dim=draw(st.integers(1, 6)),
        use_query_bias=draw(st.booleans()),
        use_key_bias=draw(st.booleans()),
        use_value_bias=draw(st.booleans()),
        use_output_bias=draw(st.booleans()),
        scale=draw(st.one_of(st.none(), st.floats(0.05, 2.0))),
        dropout=draw(st.sampled_from([0.0, 0.2])) if dropout else 0.0,
        masked_row=draw(st.sampled_from(masked_rows)),
    )


@st.composite
def calls(draw, config: AttentionConfig, *, allow_empty_rows: bool = True, self_attention: bool | None = None):
    """(query, key, value, options) in float64 with a random mask/bias/causal."""
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    B = draw(st.integers(1, 3))
    T = draw(st.integers(1, 6))
    same = self_attention if self_attention is not None else draw(st.booleans())
    same = same and config.query_dim == config.key_dim == config.value_dim
    S = T if same else draw(st.integers(1, 6))
    query = rng.standard_normal((B, T, config.query_dim))
    key = query if same else rng.standard_normal((B, S, config.key_dim))
    value = query if same else rng.standard_normal((B, S, config.value_dim))
    options: dict = {}
    mask_kind = draw(st.sampled_from(["none", "ts", "bts", "b1ts", "bnts", "padding"]))
    N = config.num_heads
    shape = {"ts": (T, S), "bts": (B, T, S), "b1ts": (B, 1, T, S), "bnts": (B, N, T, S), "padding": (B, 1, 1, S)}.get(mask_kind)
    if shape is not None:
        m = rng.random(shape) < 0.7
        if not allow_empty_rows:
            m[..., 0] = True
        options["mask"] = m
    if draw(st.booleans()):
        b = rng.standard_normal((B, 1, T, S))
        if allow_empty_rows and draw(st.booleans()):
            b[rng.random(b.shape) < 0.2] = -np.inf
        options["bias"] = b
    if draw(st.booleans()):
        options["is_causal"] = True
        options["causal_alignment"] = draw(st.sampled_from(["top_left", "bottom_right"]))
        if not allow_empty_rows and options["causal_alignment"] == "bottom_right" and T > S:
            options["causal_alignment"] = "top_left"
    if config.dropout > 0 and draw(st.booleans()):
        options["training"] = True
        options["dropout_mask"] = rng.random((B, N, T, S)) >= config.dropout
    return query, key, value, options
