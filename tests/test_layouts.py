"""weights.layouts, NumPy only: every layout round-trips bit-exactly in every
dtype, refuses what it cannot express by name, lists every problem of a bad
state at once, and the hf-bert / hf-gpt2 tables agree with independent NumPy
formulations of those models' attention (written here from the models'
definitions, not from the reference)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from assertions import assert_bit_exact
from hypothesis import given
from hypothesis import strategies as st

from conformance.suite.tolerance import assert_close
from impl_numpy import multi_head_attention
from weights import DTYPES, AttentionConfig, WeightsFormatError, init, layouts
from weights.dtypes import resolve_dtype
from weights.layouts import registry

pytestmark = pytest.mark.reference  # NumPy only, no framework looked for: the numpy env runs it, not `all`

STRUCTURAL = ("num_heads", "num_kv_heads", "head_dim", "value_head_dim", "query_dim", "key_dim", "value_dim",
              "out_dim", "use_query_bias", "use_key_bias", "use_value_bias", "use_output_bias")
BIASES = ("use_query_bias", "use_key_bias", "use_value_bias", "use_output_bias")
# Layouts whose state alone converts (hf-llama and meta-llama also need their config file:
# tests/test_layouts.py's hf-llama section and tests/test_layouts_modern.py)
PLAIN = [layout for layout in layouts.LAYOUTS if not layouts.spec(layout).needs_hf_config]
# Layouts that hold a plain (non-latent) layer: the latent-only ones refuse every plain config
# (tests/test_layouts_deepseek.py)
NOT_LATENT = [layout for layout in layouts.LAYOUTS if layout not in registry.OWN_CONVERTERS]


@st.composite
def configs(draw):
    """Any small config: GQA, odd widths, any bias flags."""
    K = draw(st.integers(1, 3))
    N = K * draw(st.integers(1, 3))
    return AttentionConfig(
        num_heads=N, num_kv_heads=K, head_dim=draw(st.integers(1, 4)), value_head_dim=draw(st.integers(1, 4)),
        query_dim=draw(st.integers(1, 7)), key_dim=draw(st.integers(1, 7)), value_dim=draw(st.integers(1, 7)),
        out_dim=draw(st.integers(1, 7)), **{flag: draw(st.booleans()) for flag in BIASES},
        scale=draw(st.sampled_from([None, 0.3])), dropout=draw(st.sampled_from([0.0, 0.25])),
        masked_row=draw(st.sampled_from(["zero", "uniform", "nan"])),
    )


def conform(layout: str, config: AttentionConfig) -> AttentionConfig:
    """The nearest config the layout can express: its ties applied, its bias rule obeyed
    (written from the Layout spec, so a tie missing from a table shows up as a failed round trip)."""
    spec = layouts.spec(layout)
    table = spec.tables[-1]  # the least restrictive table (torch-mha: separate kdim/vdim)
    values = config.to_dict()
    for _ in range(3):  # ties are written in free fields; a second pass settles chains
        for tie in table.ties:
            values[tie.field] = math.prod(values[f] for f in tie.equals.split("*"))
    if spec.bias == "required":
        values.update({flag: True for flag in BIASES})
    elif spec.bias == "all":
        values.update({flag: values["use_query_bias"] for flag in BIASES})
    for row in table.rows:  # a concatenated bias row holds its parts together
        if row.is_bias and len(row.parts) > 1:
            flags = [layouts.BIAS_FLAG[p] for p in row.parts]
            values.update({flag: values[flags[0]] for flag in flags})
    return AttentionConfig.from_dict(values)


def hints_for(layout: str, config: AttentionConfig) -> dict:
    """The hints a reader passes: heads (flattened in most layouts) and the behaviour fields no state holds."""
    return {"num_heads": config.num_heads, "scale": config.scale, "dropout": config.dropout,
            "masked_row": config.masked_row}


# -- round trips ----------------------------------------------------------------------

@pytest.mark.parametrize("layout", PLAIN)
@given(config=configs(), seed=st.integers(0, 2**16))
def test_round_trip_bit_exact_every_dtype(layout, config, seed):
    config = conform(layout, config)
    assert layouts.cannot_express(layout, config) == [], f"{layout} refuses its own conformed config {config}"
    for dtype in DTYPES:
        tensors = init(config, seed=seed, dtype=dtype)
        hints = {"layer": 2} if layout.startswith("hf-") else {}
        state = layouts.from_canonical(layout, config, tensors, **hints)
        assert all(a.flags.c_contiguous for a in state.values()), f"{layout}: non-contiguous arrays"
        back_config, back = layouts.to_canonical(layout, state, **hints_for(layout, config), **hints)
        differ = {f: (getattr(config, f), getattr(back_config, f)) for f in config.to_dict()
                  if getattr(config, f) != getattr(back_config, f)}
        assert not differ, f"{layout} {dtype}: config fields changed (given, read back): {differ}"
        assert_bit_exact(tensors, back, f"{layout} {dtype} canonical -> state -> canonical")
        again = layouts.from_canonical(layout, back_config, back, **hints)
        assert_bit_exact(state, again, f"{layout} {dtype} state -> canonical -> state")


@pytest.mark.parametrize("layout", NOT_LATENT)
@given(config=configs())
def test_refusals_name_every_field(layout, config):
    """from_canonical either succeeds or names each field cannot_express names; and a
    config the layout's ties leave unchanged is always expressible."""
    problems = layouts.cannot_express(layout, config)
    tensors = init(config, seed=0, dtype="float32")
    if not problems:
        layouts.from_canonical(layout, config, tensors)
        return
    assert conform(layout, config) != config, f"{layout}: refuses {config} although it conforms: {problems}"
    with pytest.raises(ValueError) as info:
        layouts.from_canonical(layout, config, tensors)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{layout} cannot express")
    for problem in problems:
        field_value = problem.split(" ", 1)[0]
        assert field_value in message, f"{field_value!r} missing from: {message}"


def test_cannot_express_names_field_and_value():
    config = AttentionConfig(num_heads=4, query_dim=8, head_dim=2, out_dim=5, num_kv_heads=2)
    with pytest.raises(ValueError) as info:
        layouts.from_canonical("torch-mha", config, init(config, seed=0))
    message = str(info.value)
    assert "out_dim=5" in message and "num_kv_heads=2" in message, message
    config = AttentionConfig(num_heads=2, query_dim=4, head_dim=2, value_head_dim=3)
    with pytest.raises(ValueError, match=r"value_head_dim=3"):
        layouts.from_canonical("flax-linen-mha", config, init(config, seed=0))
    config = AttentionConfig(num_heads=2, query_dim=4, head_dim=2, use_key_bias=False)
    with pytest.raises(ValueError, match=r"use_key_bias=False"):
        layouts.from_canonical("torch-fused-qkv", config, init(config, seed=0))
    with pytest.raises(ValueError, match=r"use_key_bias=False"):
        layouts.from_canonical("hf-gpt2", config, init(config, seed=0))


def test_torch_mha_picks_packed_or_separate():
    packed = AttentionConfig(num_heads=2, query_dim=8, head_dim=4)
    separate = packed.replace(key_dim=3, value_dim=5)
    assert set(layouts.from_canonical("torch-mha", packed, init(packed, seed=0))) == {
        "in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"}
    state = layouts.from_canonical("torch-mha", separate, init(separate, seed=0))
    assert {k: v.shape for k, v in state.items()} == {
        "q_proj_weight": (8, 8), "k_proj_weight": (8, 3), "v_proj_weight": (8, 5), "in_proj_bias": (24,),
        "out_proj.weight": (8, 8), "out_proj.bias": (8,)}


def test_known_shapes_and_transposes():
    """The table's forms, checked element by element on one config."""
    config = AttentionConfig(num_heads=2, query_dim=3, head_dim=4, out_dim=5)
    t = init(config, seed=1, dtype="float64")
    Wq = t["query.kernel"].reshape(3, 8)  # flat view (D, N*H)
    linear = layouts.from_canonical("torch-linears", config, t)
    np.testing.assert_array_equal(linear["W_query.weight"], Wq.T)
    np.testing.assert_array_equal(linear["out_proj.weight"], t["output.kernel"].reshape(8, 5).T)
    square = config.replace(out_dim=3)
    fused = layouts.from_canonical("torch-fused-qkv", square, init(square, seed=1))
    assert fused["qkv.weight"].shape == (24, 3)
    dense = layouts.from_canonical("keras-split-heads", config, t)
    np.testing.assert_array_equal(dense["WQ/kernel"], Wq)
    per_head = layouts.from_canonical("torch-per-head", config, t)
    np.testing.assert_array_equal(per_head["heads.1.W_q.weight"], t["query.kernel"][:, 1, :].T)
    np.testing.assert_array_equal(per_head["heads.1.W_q.bias"], t["query.bias"][1])
    hidden = AttentionConfig(num_heads=2, query_dim=8, head_dim=4)
    th = init(hidden, seed=2, dtype="float64")
    gpt2 = layouts.from_canonical("hf-gpt2", hidden, th)
    np.testing.assert_array_equal(gpt2["h.0.attn.c_attn.weight"][:, 8:16], th["key.kernel"].reshape(8, 8))
    mapping = layouts.mapping("torch-mha", hidden)
    assert mapping["in_proj_weight"] == ("query.kernel", "key.kernel", "value.kernel")


# -- errors: every problem at once ---------------------------------------------------------

@pytest.mark.parametrize("layout", PLAIN)
def test_error_lists_every_problem(layout):
    config = conform(layout, AttentionConfig(num_heads=2, query_dim=8, head_dim=4, key_dim=6, value_dim=5,
                                             out_dim=7))
    hints = {"layer": 1} if layout.startswith("hf-") else {}
    state = layouts.from_canonical(layout, config, init(config, seed=3, dtype="float32"), **hints)
    holds = layouts.mapping(layout, config, **hints)
    first = lambda part: next(key for key, parts in holds.items() if part in parts)  # noqa: E731
    removed, reshaped, retyped = first("output.kernel"), first("value.bias"), first("query.kernel")
    del state[removed]
    state[reshaped] = np.concatenate([state[reshaped], state[reshaped][:1]], axis=0)  # one row too many
    state[retyped] = state[retyped].astype(np.float64)
    spec = layouts.spec(layout)
    stray = reshaped.rsplit(spec.sep, 2)[0] + spec.sep + "stray" + spec.sep + "weight"
    state[stray] = np.zeros(3, np.float32)
    with pytest.raises(WeightsFormatError) as info:
        layouts.to_canonical(layout, state, num_heads=2, **hints)
    message = str(info.value)
    assert "\n" not in message, message
    expected = [f"missing {removed}", f"{reshaped} has shape", "mixed dtypes", retyped]
    if not spec.select:  # hf-* read their rows out of a whole checkpoint; other keys are not theirs
        expected.append(f"unexpected {stray}")
    for piece in expected:
        assert piece in message, f"{piece!r} not in: {message}"


def test_error_bad_values_and_types():
    config = AttentionConfig(num_heads=2, query_dim=4, head_dim=2)
    state = layouts.from_canonical("keras-mha", config, init(config, seed=0))
    state["query/kernel"] = state["query/kernel"].copy()
    state["query/kernel"][0, 0, 0] = np.nan
    state["key/kernel"] = state["key/kernel"].astype(np.int32)
    state["value/kernel"] = state["value/kernel"].tolist()
    with pytest.raises(WeightsFormatError) as info:
        layouts.to_canonical("keras-mha", state)
    message = str(info.value)
    for piece in ("query/kernel contains NaN", "key/kernel has dtype int32", "value/kernel is a list"):
        assert piece in message, message


def test_hint_errors():
    config = AttentionConfig(num_heads=2, query_dim=4, head_dim=2)
    state = layouts.from_canonical("torch-linears", config, init(config, seed=0))
    with pytest.raises(WeightsFormatError, match=r"num_heads is not stored .* pass num_heads"):
        layouts.to_canonical("torch-linears", state)
    with pytest.raises(ValueError, match=r"unknown hints colour"):
        layouts.to_canonical("torch-linears", state, colour=1)
    with pytest.raises(ValueError, match=r"hints layer do not apply"):
        layouts.to_canonical("torch-linears", state, layer=1, num_heads=2)
    with pytest.raises(ValueError, match=r"needs 4 names .* got 2"):
        layouts.to_canonical("torch-linears", state, names="a,b", num_heads=2)
    with pytest.raises(ValueError, match=r"fixed names"):
        layouts.to_canonical("keras-mha", {}, names="a,b")
    with pytest.raises(ValueError, match=r"layout must be one of .* got 'torch'"):
        layouts.to_canonical("torch", state)
    with pytest.raises(WeightsFormatError, match=r"cannot determine .* num_heads=3"):
        layouts.to_canonical("torch-linears", state, num_heads=3)
    with pytest.raises(WeightsFormatError, match=r"pass names="):
        layouts.to_canonical("torch-linears", {"q." + k.split(".", 1)[1]: v for k, v in state.items()}, num_heads=2)


def test_names_prefix_and_ignore():
    config = AttentionConfig(num_heads=2, query_dim=4, head_dim=2)
    t = init(config, seed=5)
    renamed = layouts.from_canonical("torch-linears", config, t, names="q,k,v,o")
    assert set(renamed) == {f"{m}.{p}" for m in "qkvo" for p in ("weight", "bias")}
    _, back = layouts.to_canonical("torch-linears", renamed, names={"query": "q", "key": "k", "value": "v",
                                                                     "output": "o"}, num_heads=2)
    assert_bit_exact(t, back, "names as a mapping")
    # two modules in one model: the prefix must be chosen
    model = {}
    for prefix in ("blocks.0.attn.", "blocks.1.attn."):
        model.update({prefix + k: v for k, v in layouts.from_canonical("torch-fused-qkv", config, t).items()})
    model["blocks.0.ln.weight"] = np.ones(4, np.float32)
    with pytest.raises(WeightsFormatError, match=r"several candidates.*'blocks.0.attn.', 'blocks.1.attn.'"):
        layouts.to_canonical("torch-fused-qkv", model, num_heads=2)
    _, back = layouts.to_canonical("torch-fused-qkv", model, num_heads=2, prefix="blocks.1.attn.")
    assert_bit_exact(t, back, "prefix")
    # seed 004's causal-mask buffer is skipped by the table; other buffers by ignore=
    seed004 = layouts.from_canonical("torch-linears", config, t)
    seed004["mask"] = np.triu(np.ones((4, 4), np.float32), 1)
    seed004["counter"] = np.zeros((), np.int64)
    with pytest.raises(WeightsFormatError, match=r"unexpected counter$"):
        layouts.to_canonical("torch-linears", seed004, num_heads=2)
    layouts.to_canonical("torch-linears", seed004, num_heads=2, ignore=["count*"])
    # seed 000's names are accepted by torch-fused-qkv without a hint
    seed000 = layouts.from_canonical("torch-fused-qkv", config, t, names="qkv_proj,out_proj")
    assert set(seed000) == {"qkv_proj.weight", "qkv_proj.bias", "out_proj.weight", "out_proj.bias"}
    _, back = layouts.to_canonical("torch-fused-qkv", seed000, num_heads=2)
    assert_bit_exact(t, back, "seed 000 names")
    # flax linen variables with their "params" collection
    linen = {"params/" + k: v for k, v in layouts.from_canonical("flax-linen-mha", config, t).items()}
    assert_bit_exact(t, layouts.to_canonical("flax-linen-mha", linen)[1], "params/ prefix")


def test_per_head_counts_heads_and_checks_them():
    config = AttentionConfig(num_heads=3, query_dim=4, head_dim=2, value_head_dim=3)
    state = layouts.from_canonical("torch-per-head", config, init(config, seed=6))
    read, _ = layouts.to_canonical("torch-per-head", state)
    assert read.num_heads == 3
    del state["heads.1.W_k.weight"]
    state["heads.2.W_q.bias"] = state["heads.2.W_q.bias"][:1]
    with pytest.raises(WeightsFormatError) as info:
        layouts.to_canonical("torch-per-head", state, num_heads=2)
    message = str(info.value)
    for piece in ("num_heads=2 was given but the state holds 3 heads", "missing heads.1.W_k.weight",
                  "heads.2.W_q.bias has shape (1,), expected (2,)"):
        assert piece in message, message


def test_detect_layout():
    config = AttentionConfig(num_heads=2, query_dim=4, head_dim=2)
    t = init(config, seed=7)
    for layout in NOT_LATENT:
        state = layouts.from_canonical(layout, config, t)
        expected = {"flax-nnx-mha": "flax-linen-mha", "hf-falcon": "hf-bloom"}.get(layout, layout)  # the same keys
        assert layouts.detect_layout(state) == expected, layout
    assert layouts.detect_layout({"x": np.zeros(1)}) is None


def test_canonical_layout_checks_a_given_config():
    config = AttentionConfig(num_heads=2, query_dim=4, head_dim=2, scale=0.5, masked_row="nan")
    t = init(config, seed=8)
    assert layouts.to_canonical("canonical", t, config=config)[0] is config
    inferred, _ = layouts.to_canonical("canonical", t)
    assert inferred == config.replace(scale=None, masked_row="zero")  # behaviour fields are not in tensors
    with pytest.raises(WeightsFormatError, match=r"do not match config: out_dim=3 \(tensors say 4\)"):
        layouts.to_canonical("canonical", t, config=config.replace(out_dim=3))


def test_describe_lists_each_row():
    for layout in layouts.LAYOUTS:
        text = layouts.describe(layout)
        assert text.startswith(layout) and ("linear" in text or "dense" in text or "heads" in text), text


# -- Hugging Face BERT and GPT-2 --------------------------------------------------------------

def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def bert_checkpoint(rng, *, E, N, L, prefix="bert.", intermediate=16):
    """A BertForMaskedLM-style state dict with the real key names and shapes (float64)."""
    w = lambda *shape: rng.standard_normal(shape) / math.sqrt(shape[-1])  # noqa: E731
    b = lambda n: rng.standard_normal(n) * 0.5  # noqa: E731
    s = {f"{prefix}embeddings.word_embeddings.weight": w(30, E),
         f"{prefix}embeddings.position_embeddings.weight": w(16, E),
         f"{prefix}embeddings.token_type_embeddings.weight": w(2, E),
         f"{prefix}embeddings.LayerNorm.weight": np.ones(E), f"{prefix}embeddings.LayerNorm.bias": np.zeros(E)}
    for i in range(L):
        p = f"{prefix}encoder.layer.{i}."
        for name in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            s[p + name + ".weight"], s[p + name + ".bias"] = w(E, E), b(E)  # nn.Linear(E, E): (out, in)
        s[p + "attention.output.LayerNorm.weight"], s[p + "attention.output.LayerNorm.bias"] = np.ones(E), b(E)
        s[p + "intermediate.dense.weight"], s[p + "intermediate.dense.bias"] = w(intermediate, E), b(intermediate)
        s[p + "output.dense.weight"], s[p + "output.dense.bias"] = w(E, intermediate), b(E)
        s[p + "output.LayerNorm.weight"], s[p + "output.LayerNorm.bias"] = np.ones(E), b(E)
    s["cls.predictions.bias"] = b(30)
    return s


def bert_self_attention(state, prefix, layer, x, attention_mask, N):
    """BertSelfAttention (eager) + BertSelfOutput.dense, from modeling_bert: Linear is
    x W^T + b; scores / sqrt(head size); the extended mask (1 - m) * finfo.min is added."""
    p = f"{prefix}encoder.layer.{layer}.attention."
    lin = lambda name, h: h @ state[p + name + ".weight"].T + state[p + name + ".bias"]  # noqa: E731
    B, T, E = x.shape
    H = E // N
    heads = lambda h: h.reshape(B, T, N, H).transpose(0, 2, 1, 3)  # noqa: E731  (B, N, T, H)
    q, k, v = heads(lin("self.query", x)), heads(lin("self.key", x)), heads(lin("self.value", x))
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(H)  # (B, N, T, S)
    scores = scores + (1.0 - attention_mask[:, None, None, :]) * np.finfo(np.float64).min
    context = (_softmax(scores) @ v).transpose(0, 2, 1, 3).reshape(B, T, E)  # (B, T, N*H)
    return lin("output.dense", context)


def gpt2_checkpoint(rng, *, E, L, prefix=""):
    """A GPT2Model state dict with the real key names and shapes, old-style attn.bias buffers included."""
    w = lambda *shape: rng.standard_normal(shape) / math.sqrt(shape[0])  # noqa: E731
    b = lambda n: rng.standard_normal(n) * 0.5  # noqa: E731
    s = {f"{prefix}wte.weight": w(40, E), f"{prefix}wpe.weight": w(16, E)}
    for i in range(L):
        p = f"{prefix}h.{i}."
        s[p + "ln_1.weight"], s[p + "ln_1.bias"] = np.ones(E), np.zeros(E)
        s[p + "attn.c_attn.weight"], s[p + "attn.c_attn.bias"] = w(E, 3 * E), b(3 * E)  # Conv1D (nx, nf)
        s[p + "attn.c_proj.weight"], s[p + "attn.c_proj.bias"] = w(E, E), b(E)
        s[p + "attn.bias"] = np.tril(np.ones((16, 16)))[None, None]  # the causal buffer
        s[p + "attn.masked_bias"] = np.array(-1e4)
        s[p + "ln_2.weight"], s[p + "ln_2.bias"] = np.ones(E), np.zeros(E)
        s[p + "mlp.c_fc.weight"], s[p + "mlp.c_fc.bias"] = w(E, 4 * E), b(4 * E)
        s[p + "mlp.c_proj.weight"], s[p + "mlp.c_proj.bias"] = w(4 * E, E), b(E)
    s[f"{prefix}ln_f.weight"], s[f"{prefix}ln_f.bias"] = np.ones(E), np.zeros(E)
    return s


def gpt2_attention(state, prefix, layer, x, N, *, scale_attn_weights=True, scale_by_layer=False):
    """GPT2Attention (eager), from modeling_gpt2: Conv1D is x W + b; split q, k, v; divide by
    sqrt(head dim) and, with scale_attn_by_inverse_layer_idx, by layer + 1; causal fill finfo.min."""
    p = f"{prefix}h.{layer}.attn."
    B, T, E = x.shape
    H = E // N
    qkv = x @ state[p + "c_attn.weight"] + state[p + "c_attn.bias"]  # (B, T, 3E)
    heads = lambda h: h.reshape(B, T, N, H).transpose(0, 2, 1, 3)  # noqa: E731
    q, k, v = (heads(h) for h in np.split(qkv, 3, axis=2))
    w = q @ k.transpose(0, 1, 3, 2)
    if scale_attn_weights:
        w = w / H ** 0.5
    if scale_by_layer:
        w = w / float(layer + 1)
    causal = np.tril(np.ones((T, T), dtype=bool))
    w = np.where(causal, w, np.finfo(np.float64).min)
    a = (_softmax(w) @ v).transpose(0, 2, 1, 3).reshape(B, T, E)
    return a @ state[p + "c_proj.weight"] + state[p + "c_proj.bias"]


def _check(name, actual, config, tensors, x, **options):
    trace: list = []
    expected = multi_head_attention(config, tensors, x, trace=trace, **options)
    logits = next(e.value for e in trace if e.stage == "logits")
    B, T = x.shape[:2]
    return assert_close(name, actual, expected, config=config, dtype="float64", quantity="output", B=B, T=T, S=T,
                        logits=logits)


def test_hf_bert_matches_bert_self_attention():
    rng = np.random.default_rng(10)
    E, N, L = 12, 3, 3
    state = bert_checkpoint(rng, E=E, N=N, L=L)
    hf_config = {"model_type": "bert", "hidden_size": E, "num_attention_heads": N, "num_hidden_layers": L,
                 "attention_probs_dropout_prob": 0.1, "position_embedding_type": "absolute"}
    assert layouts.layers("hf-bert", state) == [0, 1, 2]
    assert layouts.detect_layout(state) == "hf-bert"
    x = rng.standard_normal((2, 5, E))
    padding = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=np.float64)  # HF attention_mask: 1 = attend
    for layer in range(L):
        config, tensors = layouts.to_canonical("hf-bert", state, layer=layer, hf_config=hf_config)
        assert (config.num_heads, config.head_dim, config.dropout) == (N, E // N, 0.1)
        expected = bert_self_attention(state, "bert.", layer, x, padding, N)
        _check(f"hf-bert layer {layer}", expected, config, tensors, x, mask=padding.astype(bool)[:, None, None, :])
        # and back into a checkpoint: the same eight tensors
        back = layouts.from_canonical("hf-bert", config, tensors, layer=layer, prefix="bert.")
        assert_bit_exact(back, {k: state[k] for k in back}, f"hf-bert layer {layer} back")


def test_hf_bert_hints_and_refusals():
    rng = np.random.default_rng(11)
    state = bert_checkpoint(rng, E=8, N=2, L=2, prefix="")
    with pytest.raises(ValueError, match=r"layers 0, 1: pass layer=I"):
        layouts.to_canonical("hf-bert", state, num_heads=2)
    with pytest.raises(ValueError, match=r"position_embedding_type='relative_key'"):
        layouts.to_canonical("hf-bert", state, layer=0, hf_config={"num_attention_heads": 2,
                                                                   "position_embedding_type": "relative_key"})
    with pytest.raises(ValueError, match=r"num_heads=4 disagrees with the checkpoint's config.json \(2\)"):
        layouts.to_canonical("hf-bert", state, layer=0, num_heads=4, hf_config={"num_attention_heads": 2})
    with pytest.raises(WeightsFormatError, match=r"expected \(6, 6\)"):  # hidden_size from config.json
        layouts.to_canonical("hf-bert", state, layer=0, hf_config={"num_attention_heads": 2, "hidden_size": 6})
    del state["encoder.layer.1.attention.self.key.bias"]
    with pytest.raises(WeightsFormatError, match=r"missing encoder.layer.1.attention.self.key.bias"):
        layouts.to_canonical("hf-bert", state, layer=1, num_heads=2)


@pytest.mark.parametrize("scale_by_layer", [False, True], ids=["plain", "scale_attn_by_inverse_layer_idx"])
def test_hf_gpt2_matches_gpt2_attention(scale_by_layer):
    rng = np.random.default_rng(12)
    E, N, L = 12, 4, 2
    state = gpt2_checkpoint(rng, E=E, L=L, prefix="transformer.")
    hf_config = {"model_type": "gpt2", "n_embd": E, "n_head": N, "attn_pdrop": 0.1,
                 "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": scale_by_layer}
    x = rng.standard_normal((2, 6, E))
    for layer in range(L):
        config, tensors = layouts.to_canonical("hf-gpt2", state, layer=layer, hf_config=hf_config)
        expected = gpt2_attention(state, "transformer.", layer, x, N, scale_by_layer=scale_by_layer)
        _check(f"hf-gpt2 layer {layer}", expected, config, tensors, x, is_causal=True)
        back = layouts.from_canonical("hf-gpt2", config, tensors, layer=layer, prefix="transformer.")
        assert_bit_exact(back, {k: state[k] for k in back}, f"hf-gpt2 layer {layer} back")


def test_hf_gpt2_unscaled():
    rng = np.random.default_rng(13)
    state = gpt2_checkpoint(rng, E=8, L=1)
    config, tensors = layouts.to_canonical("hf-gpt2", state, hf_config={"n_head": 2, "scale_attn_weights": False})
    assert config.scale == 1.0
    x = rng.standard_normal((1, 4, 8))
    _check("hf-gpt2 unscaled", gpt2_attention(state, "", 0, x, 2, scale_attn_weights=False), config, tensors, x,
           is_causal=True)


# -- hf-llama and meta-llama: config.json forms, round trips (real models: test_layouts_modern.py) ----

MANTISSA = {"float16": 10, "bfloat16": 7, "float32": 23, "float64": 52}  # explicit fraction bits
LLAMA_SIZES = {"hidden_size": 12, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
               "num_hidden_layers": 6, "rms_norm_eps": 1e-5}


def llama_state(rng, *, N=4, K=2, H=4, D=12, layers=6, prefix="model.", bias=(), norms=None, sinks=False,
                fused=False, dtype=np.float32):
    """A decoder checkpoint's attention keys (real names and shapes) plus another module's weight."""
    r = lambda *shape: rng.standard_normal(shape).astype(dtype)  # noqa: E731
    state = {}
    for layer in range(layers):
        p = f"{prefix}layers.{layer}.self_attn."
        widths = {"q": N * H, "k": K * H, "v": K * H}
        if fused:
            state[p + "qkv_proj.weight"] = r(sum(widths.values()), D)
        else:
            for name, width in widths.items():
                state[p + f"{name}_proj.weight"] = r(width, D)
                if name in bias:
                    state[p + f"{name}_proj.bias"] = r(width)
        state[p + "o_proj.weight"] = r(D, N * H)
        if "o" in bias:
            state[p + "o_proj.bias"] = r(D)
        if norms == "head":
            state[p + "q_norm.weight"], state[p + "k_norm.weight"] = r(H), r(H)
        elif norms == "all":
            state[p + "q_norm.weight"], state[p + "k_norm.weight"] = r(N * H), r(K * H)
        if sinks:
            state[p + "sinks"] = r(N)
        state[f"{prefix}layers.{layer}.mlp.up_proj.weight"] = r(8, D)
    return state


# model_type, extra config.json entries, state options, what each block reads: {layer: expected fields}
LLAMA_CASES = {
    "llama 4.x llama3 scaling": ("llama", {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}, "attention_bias": True}, {"bias": "qkvo"},
        {0: {"rope": {"theta": 500000.0, "rotary_dim": 4, "interleaved": False, "scaling": {
            "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}}}}),
    "mistral 4.x: every layer slides": ("mistral", {"rope_theta": 1e6, "sliding_window": 4096}, {},
                                        {0: {"window_left": 4095}, 5: {"window_left": 4095}}),
    "qwen2 4.x: window off although sliding_window is set": (
        "qwen2", {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 2},
        {"bias": "qkv"}, {3: {"window_left": -1, "use_output_bias": False, "use_query_bias": True}}),
    "qwen2 4.x: layers from max_window_layers slide": (
        "qwen2", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2}, {"bias": "qkv"},
        {1: {"window_left": -1}, 2: {"window_left": 63}}),
    "qwen3 5.x: per-head norms": ("qwen3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
                                  {"norms": "head"},
                                  {0: {"qk_norm": {"type": "rms", "eps": 1e-5, "scope": "head"}}}),
    "olmo2: norms over the whole projection": ("olmo2", {}, {"norms": "all"},
                                               {0: {"qk_norm": {"type": "rms", "eps": 1e-5, "scope": "all"}}}),
    "gemma2 4.x: even layers slide, softcap, query_pre_attn_scalar": (
        "gemma2", {"sliding_window": 8, "attn_logit_softcapping": 50.0, "query_pre_attn_scalar": 9},
        {}, {0: {"window_left": 7, "logit_softcap": 50.0, "scale": 1 / 3}, 1: {"window_left": -1}}),
    "gemma3 4.x: local base on sliding layers, scaling on global ones": (
        "gemma3_text", {"rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window": 512,
                        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window_pattern": 6},
        {"norms": "head"},
        {0: {"window_left": 511, "rope": {"theta": 1e4, "rotary_dim": 4, "interleaved": False, "scaling": None}},
         5: {"window_left": -1, "rope": {"theta": 1e6, "rotary_dim": 4, "interleaved": False,
                                         "scaling": {"type": "linear", "factor": 8.0}}}}),
    "gemma3 5.x: rope_parameters per layer type": (
        "gemma3_text", {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                            "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
                        "sliding_window": 512, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
        {"norms": "head"}, {4: {"window_left": 511, "rope": {"theta": 1e4, "rotary_dim": 4, "interleaved": False,
                                                             "scaling": None}},
                            5: {"window_left": -1, "rope": {"theta": 1e6, "rotary_dim": 4, "interleaved": False,
                                                            "scaling": None}}}),
    "gpt_oss: yarn, sinks, biases": (
        "gpt_oss", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                        "original_max_position_embeddings": 4096},
                    "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 3},
        {"bias": "qkvo", "sinks": True}, {0: {"window_left": 127, "use_sinks": True}, 1: {"window_left": -1}}),
    "phi3 4.x: fused qkv_proj, partial rotary": (
        "phi3", {"partial_rotary_factor": 0.5, "rope_theta": 10000.0}, {"fused": True},
        {0: {"rope": {"theta": 10000.0, "rotary_dim": 2, "interleaved": False, "scaling": None}}}),
}


@pytest.mark.parametrize("case", list(LLAMA_CASES))
def test_hf_llama_reads_every_config_form(case):
    """What each block reads from config.json (transformers 4.x and 5.x forms), written out from
    the models' definitions; then canonical -> hf-llama -> canonical and the state back, bit-exact in
    every dtype (Gemma's 1 + w is an addition: checked to one rounding instead)."""
    model_type, extra, options, expect = LLAMA_CASES[case]
    hf_config = {"model_type": model_type, **LLAMA_SIZES, **extra}
    for dtype in DTYPES:
        state = llama_state(np.random.default_rng(0), dtype=resolve_dtype(dtype), **options)
        for layer, fields in expect.items():
            config, tensors = layouts.to_canonical("hf-llama", state, hf_config=hf_config, layer=layer)
            got = config.to_dict()
            for field, value in fields.items():
                if field == "scale":
                    assert math.isclose(config.effective_scale, value, rel_tol=1e-12), (case, layer, got)
                else:
                    assert got[field] == value, f"{case} block {layer}: {field}={got[field]!r}, expected {value!r}"
            back = layouts.from_canonical("hf-llama", config, tensors, hf_config=hf_config, layer=layer,
                                          prefix="model.")
            for key, value in back.items():
                if model_type.startswith("gemma") and "_norm." in key:  # w -> 1 + w -> (1 + w) - 1
                    w = state[key].astype(np.float64)
                    ulp = np.abs(1 + w).max() * 2.0 ** -MANTISSA[dtype]  # one rounding of 1 + w
                    err = np.abs(value.astype(np.float64) - w).max()
                    assert err <= ulp, f"{case} {dtype} {key}: |(1 + w) - 1 - w| = {err} > {ulp}"
                    continue
                assert value.dtype == state[key].dtype and value.tobytes() == state[key].tobytes(), (case, key)
            again_config, again = layouts.to_canonical("hf-llama", back, hf_config=hf_config, layer=layer)
            assert again_config == config, (case, again_config, config)
            if not model_type.startswith("gemma"):
                assert_bit_exact(tensors, again, f"{case} {dtype} block {layer}")


def test_hf_llama_gemma_norm_is_one_plus_w():
    hf_config = {"model_type": "gemma3_text", **LLAMA_SIZES, "query_pre_attn_scalar": 4}
    state = llama_state(np.random.default_rng(1), norms="head")
    _, tensors = layouts.to_canonical("hf-llama", state, hf_config=hf_config, layer=2)
    np.testing.assert_array_equal(tensors["query.norm.scale"], 1 + state["model.layers.2.self_attn.q_norm.weight"])
    hf_config["model_type"] = "qwen3"
    _, tensors = layouts.to_canonical("hf-llama", state, hf_config=hf_config, layer=2)
    np.testing.assert_array_equal(tensors["key.norm.scale"], state["model.layers.2.self_attn.k_norm.weight"])
    hf_config["model_type"] = "olmo2"  # one scale per feature of the whole projection: (K*H,) -> (K, H)
    state = llama_state(np.random.default_rng(1), norms="all")
    _, tensors = layouts.to_canonical("hf-llama", state, hf_config=hf_config, layer=2)
    np.testing.assert_array_equal(tensors["key.norm.scale"],
                                  state["model.layers.2.self_attn.k_norm.weight"].reshape(2, 4))


def test_hf_llama_refusals():
    state = llama_state(np.random.default_rng(2))
    with pytest.raises(ValueError, match=r"^hf_config: hf-llama reads RoPE"):
        layouts.to_canonical("hf-llama", state, layer=0)
    with pytest.raises(ValueError, match=r"model_type must be one of .*: got 'bert'"):
        layouts.to_canonical("hf-llama", state, layer=0, hf_config={**LLAMA_SIZES, "model_type": "bert"})
    with pytest.raises(ValueError, match=r"^hf_config: rope_type=.dynamic. is not expressible"):
        layouts.to_canonical("hf-llama", state, layer=0, hf_config={
            **LLAMA_SIZES, "model_type": "llama", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    normed = llama_state(np.random.default_rng(2), norms="head")
    with pytest.raises(WeightsFormatError, match=r"unexpected model.layers.0.self_attn.q_norm.weight"):
        layouts.to_canonical("hf-llama", normed, layer=0, hf_config={**LLAMA_SIZES, "model_type": "llama"})
    with pytest.raises(WeightsFormatError, match=r"missing model.layers.0.self_attn.sinks"):
        layouts.to_canonical("hf-llama", state, layer=0, hf_config={**LLAMA_SIZES, "model_type": "gpt_oss"})
    with pytest.raises(WeightsFormatError, match=r"k_proj.weight has shape \(8, 12\), expected \(12, 12\)"):
        layouts.to_canonical("hf-llama", state, layer=0,
                             hf_config={**LLAMA_SIZES, "model_type": "llama", "num_key_value_heads": 3})
    config, tensors = layouts.to_canonical("hf-llama", state, layer=0, hf_config={**LLAMA_SIZES, "model_type": "llama"})
    with pytest.raises(ValueError, match=r"hf_config disagrees with config .*window_left=-1 \(config file gives 15\)"):
        layouts.from_canonical("hf-llama", config, tensors, hf_config={**LLAMA_SIZES, "model_type": "mistral",
                                                                       "sliding_window": 16})
    layer_norm = config.replace(qk_norm={"type": "layer", "scope": "head"})
    with pytest.raises(ValueError, match=r"qk_norm.type='layer'"):
        layouts.from_canonical("hf-llama", layer_norm, init(layer_norm, seed=0))
    sinks = config.replace(use_sinks=True)
    with pytest.raises(ValueError, match=r"use_sinks=True \(meta-llama holds no sinks tensor\)"):
        layouts.from_canonical("meta-llama", sinks, init(sinks, seed=0))


def test_rope_pairing_permutation_keeps_the_numbers():
    """canonical with interleaved RoPE -> meta-llama is direct; -> hf-llama permutes q and k
    features inside each head (biases and norm scales alike, the pass-through features of a
    partial rotary untouched) and the float64 reference gives the same output to round-off."""
    config = AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=6, query_dim=12,
                             rope={"theta": 100.0, "rotary_dim": 4, "interleaved": True},
                             qk_norm={"type": "rms", "scope": "head"}, use_query_bias=True, use_key_bias=True)
    tensors = init(config, seed=4, dtype="float64")
    rng = np.random.default_rng(4)
    tensors["query.norm.scale"], tensors["key.norm.scale"] = rng.standard_normal(6), rng.standard_normal(6)
    state = layouts.from_canonical("hf-llama", config, tensors)
    half_config, half = layouts.to_canonical("hf-llama", state, hf_config={
        "model_type": "qwen3", "hidden_size": 12, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 6,
        "rope_theta": 100.0, "partial_rotary_factor": 4 / 6, "attention_bias": True, "rms_norm_eps": 1e-6}, layer=0)
    assert half_config.rope.interleaved is False and half_config.rope.rotary_dim == 4
    order = [0, 2, 1, 3, 4, 5]  # rotary pairs (0,1), (2,3) -> (0,2), (1,3); features 4, 5 pass through
    np.testing.assert_array_equal(half["query.kernel"], tensors["query.kernel"][..., order])
    np.testing.assert_array_equal(half["key.norm.scale"], tensors["key.norm.scale"][order])
    x = rng.standard_normal((2, 7, 12))
    a = multi_head_attention(config, tensors, x, x, x, is_causal=True)
    b = multi_head_attention(half_config.replace(qk_norm=config.qk_norm), half, x, x, x, is_causal=True)
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-12)


def test_gpt_neox_rows_are_per_head():
    """GPT-NeoX's query_key_value rows are (N, 3, H): head n's q, k and v rows sit together (its
    forward views the projection as (..., N, 3H) and chunks the last axis in three). 4.x's
    rotary_pct and rotary_emb_base give the rope."""
    rng = np.random.default_rng(6)
    N, H, D = 2, 8, 16
    p = "gpt_neox.layers.1.attention."
    state = {p + "query_key_value.weight": rng.standard_normal((3 * N * H, D)).astype(np.float32),
             p + "query_key_value.bias": rng.standard_normal(3 * N * H).astype(np.float32),
             p + "dense.weight": rng.standard_normal((D, D)).astype(np.float32),
             p + "dense.bias": rng.standard_normal(D).astype(np.float32)}
    hf_config = {"model_type": "gpt_neox", "hidden_size": D, "num_attention_heads": N, "rotary_pct": 0.25,
                 "rotary_emb_base": 5000.0}
    config, tensors = layouts.to_canonical("hf-gpt-neox", state, hf_config=hf_config, layer=1)
    assert config.rope.to_dict() == {"theta": 5000.0, "rotary_dim": 2, "interleaved": False, "scaling": None}
    rows = state[p + "query_key_value.weight"].reshape(N, 3, H, D)
    bias = state[p + "query_key_value.bias"].reshape(N, 3, H)
    for n in range(N):
        for j, role in enumerate(("query", "key", "value")):
            np.testing.assert_array_equal(tensors[f"{role}.kernel"][:, n, :], rows[n, j].T)
            np.testing.assert_array_equal(tensors[f"{role}.bias"][n], bias[n, j])
    back = layouts.from_canonical("hf-gpt-neox", config, tensors, hf_config=hf_config, layer=1, prefix="gpt_neox.")
    assert_bit_exact(back, state, "hf-gpt-neox back")


def test_gptj_and_its_refusal():
    rng = np.random.default_rng(7)
    N, H, D = 2, 4, 8
    state = {f"transformer.h.0.attn.{n}_proj.weight": rng.standard_normal((D, D)).astype(np.float32)
             for n in ("q", "k", "v", "out")}
    config, tensors = layouts.to_canonical("hf-gptj", state, hf_config={"n_head": N, "n_embd": D, "rotary_dim": 2})
    assert config.rope.to_dict() == {"theta": 10000.0, "rotary_dim": 2, "interleaved": True, "scaling": None}
    assert (config.num_heads, config.head_dim) == (N, H)
    # to hf-llama: q and k rows permuted inside each head (interleaved -> half-split); with rotary_dim 2
    # the one pair (0, 1) is already both conventions' pair, so nothing moves
    hf = layouts.from_canonical("hf-llama", config, tensors)
    np.testing.assert_array_equal(hf["layers.0.self_attn.q_proj.weight"], state["transformer.h.0.attn.q_proj.weight"])
    with pytest.raises(ValueError, match=r"^hf_config: rotary_dim=None"):
        layouts.to_canonical("hf-gptj", state, hf_config={"n_head": N, "n_embd": D, "rotary_dim": None})


def test_hf_llama_multimodal_gemma3_reads_its_text_config():
    """model_type gemma3 (the multimodal wrapper): the language model's fields are in text_config, and
    the vision tower's layers.{L}.self_attn share the key names, so the prefix must be named."""
    rng = np.random.default_rng(8)
    text = llama_state(rng, layers=1, prefix="model.language_model.", norms="head")
    vision = llama_state(rng, layers=1, prefix="model.vision_tower.vision_model.encoder.")
    hf_config = {"model_type": "gemma3", "text_config": {**LLAMA_SIZES, "query_pre_attn_scalar": 16,
                                                         "sliding_window": 4, "layer_types": ["sliding_attention"]}}
    with pytest.raises(WeightsFormatError, match=r"several candidates, under prefixes 'model.language_model.', "
                                                 r"'model.vision_tower.vision_model.encoder.'"):
        layouts.to_canonical("hf-llama", {**text, **vision}, hf_config=hf_config, layer=0)
    config, tensors = layouts.to_canonical("hf-llama", {**text, **vision}, hf_config=hf_config, layer=0,
                                           prefix="model.language_model.")
    assert (config.window_left, config.scale, config.qk_norm.scope) == (3, 0.25, "head"), config
    np.testing.assert_array_equal(tensors["query.norm.scale"],
                                  1 + text["model.language_model.layers.0.self_attn.q_norm.weight"])
