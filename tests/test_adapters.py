"""conformance.suite.adapters: a user's own live module verified against the
vectors, gradients included, in about ten lines of user code each (the
blocks marked "user code"). Each worked example passes every vector it can
express with its gradients checked, refuses the others with a reason, and
the same module with a porting bug fails."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from conformance.suite import adapters
from conformance.suite.vectors import load_all
from conformance.suite.verify import GRADIENTS_CHECKED, STATUS_FAIL, STATUS_PASS, STATUS_UNSUPPORTED, summary, verify

VECTORS = {v.name: v for v in load_all()}


def statuses(results) -> dict[str, set[str]]:
    out = collections.defaultdict(set)
    for r in results:
        out[r.status].add(r.name)
    return out


def assert_worked_example(results, must_pass, *, weights_checked=True):
    """No failure and no error; the named cases pass in every dtype, gradients checked."""
    by = statuses(results)
    bad = [r.message() for r in results if r.status not in (STATUS_PASS, STATUS_UNSUPPORTED)]
    assert not bad, "\n".join(bad)
    wanted = {f"{case}.{dtype}" for case in must_pass for dtype in ("float64", "float32", "float16", "bfloat16")}
    assert wanted <= by[STATUS_PASS], sorted(wanted - by[STATUS_PASS])
    for r in results:
        if r.status == STATUS_PASS:
            assert r.gradients == GRADIENTS_CHECKED
            checked = {c.name for c in r.comparisons}
            params = {f"grad {n}" for n in VECTORS[r.name].tensors}
            assert params <= checked, r.message()
            if weights_checked and VECTORS[r.name].options["return_weights"]:
                assert "weights" in checked
        if r.status == STATUS_UNSUPPORTED:  # refused by the adapter, with its reason
            assert r.detail.startswith(("torch_module: ", "keras_layer: ", "flax_module: ")), r.detail
    print(summary(results))
    return by


# -- PyTorch nn.MultiheadAttention -----------------------------------------------------------

@pytest.mark.torch
def test_torch_multihead_attention():
    nn = pytest.importorskip("torch.nn", reason="PyTorch not installed: pip install -c constraints/cpu.txt '.[torch]'")

    # user code
    def build(c):
        return nn.MultiheadAttention(c.query_dim, c.num_heads, bias=c.use_query_bias, kdim=c.key_dim, vdim=c.value_dim,
                                     batch_first=True)

    def call(mha, x, options):
        out, w = mha(x["query"], x["key"], x["value"], need_weights=options["return_weights"],
                     average_attn_weights=False)
        return {"output": out, "weights": w}

    results = verify(adapters.torch_module(build, "torch-mha", call), require_gradients=True)
    # end of user code
    by = assert_worked_example(results, ["self_basic", "cross_basic", "query_len_1", "key_len_1", "no_biases"])
    assert {f"gqa.{d}" for d in ("float32", "float64")} <= by[STATUS_UNSUPPORTED]
    # the classic port bug: batch_first left at its default, (B, T, D) read as (T, B, D)
    def build_seq_first(c):
        return nn.MultiheadAttention(c.query_dim, c.num_heads, bias=c.use_query_bias, kdim=c.key_dim, vdim=c.value_dim)

    failed = statuses(verify(adapters.torch_module(build_seq_first, "torch-mha", call), only=["self_basic"]))
    assert failed[STATUS_FAIL] == {f"self_basic.{d}" for d in ("float64", "float32", "float16", "bfloat16")}


# -- seed 001's per-head layer (a ModuleList of heads, fc_out) ---------------------------------

@pytest.mark.torch
def test_seed_001_per_head_layer():
    torch = pytest.importorskip("torch", reason="PyTorch not installed: pip install -c constraints/cpu.txt '.[torch]'")
    nn = torch.nn

    class SelfAttentionHead(nn.Module):  # seed 001's single head, as its lecture builds it
        def __init__(self, embed_dim, d_k, d_v):
            super().__init__()
            self.d_k = d_k
            self.W_q, self.W_k, self.W_v = nn.Linear(embed_dim, d_k), nn.Linear(embed_dim, d_k), nn.Linear(embed_dim, d_v)

        def forward(self, x):
            scores = self.W_q(x) @ self.W_k(x).transpose(-2, -1) / self.d_k ** 0.5
            return torch.softmax(scores, dim=-1) @ self.W_v(x)

    class MultiHeadAttention(nn.Module):
        def __init__(self, num_heads, embed_dim):
            super().__init__()
            d = embed_dim // num_heads
            self.heads = nn.ModuleList([SelfAttentionHead(embed_dim, d, d) for _ in range(num_heads)])
            self.fc_out = nn.Linear(num_heads * d, embed_dim)

        def forward(self, x):
            return self.fc_out(torch.cat([head(x) for head in self.heads], dim=-1))

    # user code
    fn = adapters.torch_module(lambda c: MultiHeadAttention(c.num_heads, c.query_dim), "torch-per-head",
                               call=lambda m, x, options: m(x["query"]), self_attention=True)
    results = verify(fn, require_gradients=True)
    # end of user code
    by = assert_worked_example(results, ["self_basic"], weights_checked=False)
    for r in results:
        if r.status == STATUS_PASS:
            assert set(r.unchecked) == {"grad query", "grad key", "grad value"} | (
                {"weights"} if VECTORS[r.name].options["return_weights"] else set())
    assert "cross_basic.float32" in by[STATUS_UNSUPPORTED]

    class OffByRoot(SelfAttentionHead):  # dividing by d_k instead of sqrt(d_k)
        def forward(self, x):
            return torch.softmax(self.W_q(x) @ self.W_k(x).transpose(-2, -1) / self.d_k, dim=-1) @ self.W_v(x)

    def buggy(c):
        m = MultiHeadAttention(c.num_heads, c.query_dim)
        d = c.query_dim // c.num_heads
        m.heads = nn.ModuleList([OffByRoot(c.query_dim, d, d) for _ in range(c.num_heads)])
        return m

    bad = verify(adapters.torch_module(buggy, "torch-per-head", call=lambda m, x, o: m(x["query"]),
                                       self_attention=True), only=["self_basic"])
    assert statuses(bad)[STATUS_FAIL] == {f"self_basic.{d}" for d in ("float64", "float32", "float16", "bfloat16")}


# -- Keras MultiHeadAttention ---------------------------------------------------------------------

@pytest.mark.tf
def test_keras_multi_head_attention():
    pytest.importorskip("tensorflow", reason="TensorFlow not installed: pip install -c constraints/cpu.txt '.[tf]'")
    keras = pytest.importorskip("keras")

    # user code
    def build(c):
        return keras.layers.MultiHeadAttention(c.num_heads, c.head_dim, value_dim=c.value_head_dim,
                                               output_shape=c.out_dim, use_bias=c.use_query_bias)

    def call(layer, x, options):
        out, scores = layer(x["query"], x["value"], key=x["key"], return_attention_scores=True)
        return {"output": out, "weights": scores}

    results = verify(adapters.keras_layer(build, "keras-mha", call), require_gradients=True)
    # end of user code
    # Keras's own difference (conformance/native/keras_native_mha.py): in float64 it scales by 1/sqrt(key_dim)
    # rounded through float32, which only a head_dim with an exact float32 1/sqrt survives
    inexact = {n for n, v in VECTORS.items()
               if v.dtype == "float64" and float(np.float32(v.config.head_dim ** -0.5)) != v.config.head_dim ** -0.5}
    failed = {r.name for r in results if r.status == STATUS_FAIL}
    assert failed and failed <= inexact and "cross_dims.float64" in failed
    by = assert_worked_example([r for r in results if r.name not in failed],
                               ["self_basic", "cross_basic", "out_dim", "no_biases"])
    assert {"cross_dims.float32", "value_head_dim.bfloat16"} <= by[STATUS_PASS]
    assert "gqa.float32" in by[STATUS_UNSUPPORTED]
    # key and value swapped in the call (Keras's order is query, value, key)
    swapped = adapters.keras_layer(build, "keras-mha", lambda layer, x, o: layer(x["query"], x["key"], key=x["value"]))
    assert statuses(verify(swapped, only=["cross_basic"], dtypes=["float32"]))[STATUS_FAIL] == {"cross_basic.float32"}


# -- Flax NNX MultiHeadAttention --------------------------------------------------------------------

@pytest.mark.jax
def test_flax_nnx_multi_head_attention():
    nnx = pytest.importorskip("flax.nnx", reason="JAX/Flax not installed: pip install -c constraints/cpu.txt '.[jax]'")

    # user code
    def build(c):
        return nnx.MultiHeadAttention(c.num_heads, c.query_dim, c.num_heads * c.head_dim, c.out_dim,
                                      num_kv_heads=c.num_kv_heads, in_kv_features=c.key_dim,
                                      use_bias=c.use_query_bias, decode=False, rngs=nnx.Rngs(0))

    fn = adapters.flax_module(build, "flax-nnx-mha")  # the default call, module(query, key, value): no weights
    # end of user code
    # JAX compiles a program per vector (about 2 s on a 2-core VM): a few cases here, every vector in CI
    cases = ["self_basic", "cross_basic", "gqa", "mqa", "key_len_1", "no_biases", "mask_bts", "custom_scale"]
    results = verify(fn, only=cases, dtypes=["float32", "float64", "bfloat16"], require_gradients=True)
    # Flax's own difference (conformance/native/flax_nnx_mha.py): in float64 its default path's softmax is
    # float32-accurate, which only a single key (S = 1) survives
    failed = {r.name for r in results if r.status == STATUS_FAIL}
    assert failed == {f"{c}.float64" for c in ("self_basic", "cross_basic", "gqa", "mqa", "no_biases")}
    by = assert_worked_example([r for r in results if r.name not in failed], [], weights_checked=False)
    assert by[STATUS_PASS] == {f"{c}.{d}" for c in ("self_basic", "cross_basic", "gqa", "mqa", "no_biases")
                               for d in ("float32", "bfloat16")} | {"key_len_1.float32", "key_len_1.bfloat16",
                                                                    "key_len_1.float64"}
    assert all(r.unchecked.get("weights") == "the call returns no attention weights" for r in results
               if r.status == STATUS_PASS and VECTORS[r.name].options["return_weights"])
    assert by[STATUS_UNSUPPORTED] == {f"{c}.{d}" for c in ("mask_bts", "custom_scale")
                                      for d in ("float32", "float64", "bfloat16")}

    # the kv heads of GQA left out: each query head gets its own key head, and the weights no longer fit
    def build_no_gqa(c):
        return nnx.MultiHeadAttention(c.num_heads, c.query_dim, c.num_heads * c.head_dim, c.out_dim,
                                      in_kv_features=c.key_dim, use_bias=c.use_query_bias, decode=False,
                                      rngs=nnx.Rngs(0))

    (no_gqa,) = verify(adapters.flax_module(build_no_gqa, "flax-nnx-mha"), only=["gqa"], dtypes=["float32"])
    assert no_gqa.status == STATUS_UNSUPPORTED and "has other shapes: key/kernel (8, 4, 3) (the config gives (8, 2, 3))" in no_gqa.detail


# -- the adapter's own rules, framework-free through a canonical-layout fake -------------------------------

def test_undeclared_features_are_unsupported_with_the_reason():
    plan_args = dict(layout="canonical", accepts=(), self_attention=False)
    v = VECTORS["mask_and_bias_causal.float32"]
    with pytest.raises(NotImplementedError, match="not declared to take input bias, input mask, option is_causal"):
        adapters._Plan("t", config=v.config.to_dict(), inputs=v.inputs, options=v.options, **plan_args)
    v = VECTORS["custom_scale.float32"]
    with pytest.raises(NotImplementedError, match=r"scale=0.3 \(not 1/sqrt\(head_dim\) = 0.5\)"):
        adapters._Plan("t", config=v.config.to_dict(), inputs=v.inputs, options=v.options, **plan_args)
    adapters._Plan("t", config=v.config.to_dict(), inputs=v.inputs, options=v.options,
                   **(plan_args | {"accepts": ("scale",)}))
    v = VECTORS["cross_basic.float32"]
    with pytest.raises(NotImplementedError, match="self-attention module"):
        adapters._Plan("t", config=v.config.to_dict(), inputs=v.inputs, options=v.options,
                       **(plan_args | {"self_attention": True}))
    with pytest.raises(ValueError, match="hints must be among names, prefix: got num_heads"):
        adapters.torch_module(lambda c: None, "torch-linears", num_heads=2)


def test_gradients_map_back_through_the_layout():
    """A gradient in a layout's names maps to the canonical ones exactly as the weights do."""
    from weights import layouts

    v = VECTORS["cross_dims.float64"]
    grads = {name: np.asarray(v.expected[f"grad.{name}"]) for name in v.tensors}
    state = layouts.from_canonical("torch-linears", v.config, grads)
    back = adapters.canonical_gradients("torch-linears", v.config, state, {})
    assert set(back) == set(grads) and all(np.array_equal(back[n], grads[n]) for n in grads)
