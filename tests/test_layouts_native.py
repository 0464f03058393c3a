"""Live framework layers, and the seeds' own layers rebuilt here, converted to
canonical weights and run through the NumPy reference: the outputs match
under the tolerance policy (conformance.suite.tolerance), never a hand-picked number.

Each framework is skipped with a reason when it is not installed. The seeds
(the project's seed documents 000-004) are rebuilt from their descriptions: 000 fused qkv_proj/out_proj,
001 a ModuleList of single heads + fc_out, 002 fused qkv/proj with a
`mask == 0 -> -inf` mask, 003 the Keras split_heads layer (`mask * -1e9`,
1 = masked), 004 LLMs-from-scratch W_query/W_key/W_value/out_proj with its
causal `mask` buffer.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import math

import numpy as np
import pytest
from assertions import assert_bit_exact

from conformance.suite.tolerance import assert_close
from impl_numpy import multi_head_attention
from weights import AttentionConfig, init


def reference(config, tensors, query, key=None, value=None, **options):
    """The float64 reference output (and weights when asked) plus its logits, for the policy's logit scale."""
    as64 = lambda x: None if x is None else np.asarray(x, dtype=np.float64)  # noqa: E731
    trace: list = []
    result = multi_head_attention(config, {n: as64(a) for n, a in tensors.items()}, as64(query), as64(key),
                                  as64(value), trace=trace, **options)
    logits = next(entry.value for entry in trace if entry.stage == "logits")
    return result, logits


def check(name, actual, config, tensors, query, key=None, value=None, *, dtype, quantity="output", **options):
    """assert_close against the float64 reference; returns the Comparison (printed with -s)."""
    expected, logits = reference(config, tensors, query, key, value, **options)
    if isinstance(expected, tuple):
        expected = expected[1] if quantity == "weights" else expected[0]
    S = (query if key is None else key).shape[1]
    result = assert_close(name, np.asarray(actual, dtype=np.float64), expected, config=config, dtype=dtype,
                          quantity=quantity, B=query.shape[0], T=query.shape[1], S=S, logits=logits)
    print(result.describe())
    return result


def allowed_mask(rng, B, T, S):
    """(B, 1, T, S) bool, True = may attend, at least one allowed key per row."""
    mask = rng.random((B, 1, T, S)) < 0.7
    mask[..., 0] = True
    return mask


# -- torch ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch", reason="PyTorch not installed: pip install 'mha-conformance[torch]'")


@pytest.fixture(scope="module")
def tnative(torch):
    from impl_torch import native

    return native


@pytest.mark.torch
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("dims", [dict(E=8, N=2), dict(E=12, N=3, kdim=5, vdim=7)], ids=["packed", "kdim-vdim"])
def test_torch_multihead_attention(torch, tnative, dtype, dims):
    torch.manual_seed(0)
    tdtype = getattr(torch, dtype)
    E, N = dims["E"], dims["N"]
    module = torch.nn.MultiheadAttention(E, N, kdim=dims.get("kdim"), vdim=dims.get("vdim"), batch_first=True,
                                         dtype=tdtype)
    with torch.no_grad():  # nonzero biases, so a dropped bias shows
        module.in_proj_bias.uniform_(-0.5, 0.5)
        module.out_proj.bias.uniform_(-0.5, 0.5)
    module.eval()
    config, tensors = tnative.from_native(module)
    assert (config.num_heads, config.query_dim, config.key_dim, config.value_dim, config.out_dim) == (
        N, E, dims.get("kdim", E), dims.get("vdim", E), E)
    rng = np.random.default_rng(1)
    B, T, S = 2, 5, 6
    q = rng.standard_normal((B, T, E))
    k = rng.standard_normal((B, S, config.key_dim))
    v = rng.standard_normal((B, S, config.value_dim))
    allowed = allowed_mask(rng, B, T, S)
    # torch's attn_mask: True = NOT allowed, (B*N, T, S)
    attn_mask = torch.from_numpy(np.repeat(~allowed, N, axis=1).reshape(B * N, T, S))
    as_t = lambda x: torch.from_numpy(x).to(tdtype)  # noqa: E731
    with torch.no_grad():
        out, _ = module(as_t(q), as_t(k), as_t(v), attn_mask=attn_mask, need_weights=False)
    check(f"nn.MultiheadAttention {dtype}", out.numpy(), config, tensors, q, k, v, dtype=dtype, mask=allowed)


@pytest.mark.torch
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_torch_round_trip_bit_exact(torch, tnative, dtype):
    module = torch.nn.MultiheadAttention(8, 2, bias=False, batch_first=True, dtype=getattr(torch, dtype))
    config, tensors = tnative.from_native(module)
    assert not config.use_query_bias and not config.use_output_bias
    rebuilt = tnative.to_native(config, tensors)
    assert_bit_exact(tnative.state_dict(module), tnative.state_dict(rebuilt), "to_native(from_native(m))")


@pytest.mark.torch
def test_torch_to_native_refuses(torch, tnative):
    config = AttentionConfig(num_heads=2, query_dim=8, head_dim=4, out_dim=6, scale=0.5)
    with pytest.raises(ValueError, match=r"out_dim=6"):
        tnative.to_native(config, init(config, seed=0))
    config = AttentionConfig(num_heads=2, query_dim=8, head_dim=4, scale=0.25)  # 1/sqrt(4) would be 0.5
    with pytest.raises(ValueError, match=r"scale=0.25"):
        tnative.to_native(config, init(config, seed=0))
    with pytest.raises(ValueError, match="add_bias_kv"):
        tnative.from_native(torch.nn.MultiheadAttention(8, 2, add_bias_kv=True))


def _seed_modules(torch):
    nn, F = torch.nn, torch.nn.functional

    class Seed000(nn.Module):  # seed 000: fused qkv_proj, reshape (B, T, 3, N, H)
        def __init__(self, embed_dim, num_heads):
            super().__init__()
            self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
            self.qkv_proj = nn.Linear(embed_dim, embed_dim * 3)
            self.out_proj = nn.Linear(embed_dim, embed_dim)

        def forward(self, x):
            B, T, E = x.shape
            qkv = self.qkv_proj(x)
            qkv = qkv.reshape(B, T, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
            Q, K, V = qkv[0], qkv[1], qkv[2]
            scores = torch.matmul(Q, K.transpose(-2, -1)) / (self.head_dim ** 0.5)
            weights = F.softmax(scores, dim=-1)
            attention = torch.matmul(weights, V)
            attention = attention.transpose(1, 2).reshape(B, T, E)
            return self.out_proj(attention)

    class SelfAttentionHead(nn.Module):  # seed 001
        def __init__(self, embed_dim, d_k, d_v):
            super().__init__()
            self.d_k = d_k
            self.W_q = nn.Linear(embed_dim, d_k)
            self.W_k = nn.Linear(embed_dim, d_k)
            self.W_v = nn.Linear(embed_dim, d_v)

        def forward(self, x):
            Q, K, V = self.W_q(x), self.W_k(x), self.W_v(x)
            scores = torch.matmul(Q, K.transpose(-2, -1)) / math.sqrt(self.d_k)
            return torch.matmul(F.softmax(scores, dim=-1), V)

    class Seed001(nn.Module):
        def __init__(self, num_heads, embed_dim):
            super().__init__()
            self.d_k = self.d_v = embed_dim // num_heads
            self.heads = nn.ModuleList([SelfAttentionHead(embed_dim, self.d_k, self.d_v) for _ in range(num_heads)])
            self.fc_out = nn.Linear(num_heads * self.d_v, embed_dim)

        def forward(self, x):
            return self.fc_out(torch.cat([head(x) for head in self.heads], dim=-1))

    class Seed002(nn.Module):  # seed 002: fused qkv/proj, mask == 0 -> -inf (1 = may attend)
        def __init__(self, embed_dim, num_heads, dropout=0.0):
            super().__init__()
            self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
            self.qkv = nn.Linear(embed_dim, embed_dim * 3)
            self.proj = nn.Linear(embed_dim, embed_dim)
            self.attn_drop = nn.Dropout(dropout)
            self.scale = math.sqrt(self.head_dim)

        def forward(self, x, mask=None):
            B, N, C = x.shape
            qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim)
            qkv = qkv.permute(2, 0, 3, 1, 4)
            q, k, v = qkv.unbind(0)
            attn = (q @ k.transpose(-2, -1)) / self.scale
            if mask is not None:
                attn = attn.masked_fill(mask == 0, float("-inf"))
            attn = self.attn_drop(F.softmax(attn, dim=-1))
            out = (attn @ v).transpose(1, 2).reshape(B, N, C)
            return self.proj(out)

    class Seed004(nn.Module):  # seed 004: LLMs-from-scratch, causal via a triu buffer
        def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
            super().__init__()
            self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
            self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
            self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
            self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
            self.out_proj = nn.Linear(d_out, d_out)
            self.dropout = nn.Dropout(dropout)
            self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

        def forward(self, x):
            b, num_tokens, d_in = x.shape
            keys, queries, values = self.W_key(x), self.W_query(x), self.W_value(x)
            keys = keys.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
            values = values.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
            queries = queries.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
            attn_scores = queries @ keys.transpose(2, 3)
            mask_bool = self.mask.bool()[:num_tokens, :num_tokens]
            attn_scores.masked_fill_(mask_bool, -torch.inf)
            attn_weights = self.dropout(torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1))
            context_vec = (attn_weights @ values).transpose(1, 2)
            context_vec = context_vec.contiguous().view(b, num_tokens, self.d_out)
            return self.out_proj(context_vec)

    return Seed000, Seed001, Seed002, Seed004


@pytest.mark.torch
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("seed", ["000", "001", "002", "002-masked", "004", "004-walkthrough"])
def test_torch_seed_layers(torch, tnative, seed, dtype):
    Seed000, Seed001, Seed002, Seed004 = _seed_modules(torch)
    torch.manual_seed(123)
    rng = np.random.default_rng(2)
    B, T, E, N = 2, 5, 8, 2
    options: dict = {}
    call_args: tuple = ()
    if seed == "000":
        module, layout, hints = Seed000(E, N), "torch-fused-qkv", {"num_heads": N}
    elif seed == "001":
        module, layout, hints = Seed001(N, E), "torch-per-head", {}
    elif seed.startswith("002"):
        module, layout, hints = Seed002(E, N), "torch-fused-qkv", {"num_heads": N}
        if seed == "002-masked":
            allowed = rng.random((B, 1, 1, T)) < 0.6  # seed 002's (B, 1, 1, N) padding mask, 1 = may attend
            allowed[..., 0] = True
            options["mask"] = allowed
            call_args = (torch.from_numpy(allowed.astype(np.int64)),)
    elif seed == "004":
        E_in, N, D_out = 6, 4, 8
        module, layout, hints = Seed004(E_in, D_out, 16, 0.0, N, qkv_bias=True), "torch-linears", {"num_heads": N}
        E = E_in
        options["is_causal"] = True
    else:  # the walk-through's sizes: d_in 3, d_out 2, 2 heads of width 1, default qkv_bias=False
        N = 2
        module, layout, hints = Seed004(3, 2, 4, 0.0, N), "torch-linears", {"num_heads": N}
        E, T = 3, 4
        options["is_causal"] = True
    module = module.to(getattr(torch, dtype)).eval()
    config, tensors = tnative.from_native(module, layout=layout, **hints)
    x = rng.standard_normal((B, T, E))
    with torch.no_grad():
        out = module(torch.from_numpy(x).to(getattr(torch, dtype)), *call_args).numpy()
    check(f"seed {seed} ({layout}) {dtype}", out, config, tensors, x, dtype=dtype, **options)
    # and back: the canonical weights load into the seed's own module, bit-exact
    fresh = type(module)(*_ctor_args(seed)).to(getattr(torch, dtype))
    tnative.to_native(config, tensors, into=fresh, layout=layout)
    assert_bit_exact(tnative.state_dict(module), tnative.state_dict(fresh), f"seed {seed} to_native(into=)")


def _ctor_args(seed):
    return {"000": (8, 2), "001": (2, 8), "002": (8, 2), "002-masked": (8, 2), "004": (6, 8, 16, 0.0, 4, True),
            "004-walkthrough": (3, 2, 4, 0.0, 2)}[seed]


# -- Keras ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def keras():
    pytest.importorskip("tensorflow", reason="TensorFlow not installed: pip install 'mha-conformance[tf]'")
    return pytest.importorskip("keras", reason="Keras not installed: pip install 'mha-conformance[tf]'")


@pytest.fixture(scope="module")
def knative(keras):
    from impl_tf import native

    return native


@pytest.mark.tf
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_keras_multi_head_attention(keras, knative, dtype):
    keras.utils.set_random_seed(0)
    layer = keras.layers.MultiHeadAttention(num_heads=3, key_dim=4, value_dim=5, output_shape=7, dtype=dtype,
                                            bias_initializer="random_normal")
    rng = np.random.default_rng(3)
    B, T, S, Dq, Dk, Dv = 2, 4, 6, 6, 9, 8
    q, k, v = rng.standard_normal((B, T, Dq)), rng.standard_normal((B, S, Dk)), rng.standard_normal((B, S, Dv))
    allowed = allowed_mask(rng, B, T, S)[:, 0]  # (B, T, S), Keras: True = may attend
    out = layer(q.astype(dtype), v.astype(dtype), k.astype(dtype), attention_mask=allowed)  # call(query, value, key)
    config, tensors = knative.from_native(layer)
    assert (config.num_heads, config.head_dim, config.value_head_dim, config.out_dim) == (3, 4, 5, 7)
    assert (config.query_dim, config.key_dim, config.value_dim) == (Dq, Dk, Dv)
    check(f"keras MultiHeadAttention {dtype}", keras.ops.convert_to_numpy(out), config, tensors, q, k, v,
          dtype=dtype, mask=allowed)


@pytest.mark.tf
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_keras_round_trip_bit_exact(keras, knative, dtype):
    config = AttentionConfig(num_heads=2, query_dim=6, head_dim=3, key_dim=5, value_dim=4, value_head_dim=2,
                             out_dim=7)
    tensors = init(config, seed=4, dtype=dtype)
    layer = knative.to_native(config, tensors)
    back_config, back = knative.from_native(layer)
    assert back_config == config
    assert_bit_exact(tensors, back, "from_native(to_native(config, tensors))")


def _seed003(keras):
    import tensorflow as tf

    class Seed003(keras.layers.Layer):  # seed 003: split_heads with Dense WQ/WK/WV/WO; mask * -1e9, 1 = masked
        def __init__(self, num_heads, d_model, **kwargs):
            super().__init__(**kwargs)
            self.num_heads, self.d_model = num_heads, d_model
            self.depth = self.d_model // self.num_heads
            self.WQ = keras.layers.Dense(self.d_model, bias_initializer="random_normal")
            self.WK = keras.layers.Dense(self.d_model, bias_initializer="random_normal")
            self.WV = keras.layers.Dense(self.d_model, bias_initializer="random_normal")
            self.WO = keras.layers.Dense(self.d_model, bias_initializer="random_normal")

        def split_heads(self, x, batch_size):
            x = tf.reshape(x, (batch_size, -1, self.num_heads, self.depth))
            return tf.transpose(x, perm=[0, 2, 1, 3])

        def call(self, Q, K, V, mask=None):
            batch_size = tf.shape(Q)[0]
            Q, K, V = self.WQ(Q), self.WK(K), self.WV(V)
            Q, K, V = (self.split_heads(x, batch_size) for x in (Q, K, V))
            scaled_attention_logits = tf.matmul(Q, K, transpose_b=True)
            scaled_attention_logits /= tf.math.sqrt(tf.cast(self.depth, tf.float32))
            if mask is not None:
                scaled_attention_logits += mask * -1e9
            attention_weights = tf.nn.softmax(scaled_attention_logits, axis=-1)
            output = tf.matmul(attention_weights, V)
            output = tf.transpose(output, perm=[0, 2, 1, 3])
            output = tf.reshape(output, (batch_size, -1, self.d_model))
            return self.WO(output), attention_weights

    return Seed003


@pytest.mark.tf
@pytest.mark.filterwarnings("ignore:Layer 'seed003'.*mask:UserWarning")  # the seed names its argument `mask`
def test_keras_seed003_split_heads(keras, knative):
    keras.utils.set_random_seed(1)
    layer = _seed003(keras)(num_heads=2, d_model=8)
    rng = np.random.default_rng(5)
    B, T, S = 2, 4, 5
    q, k, v = rng.standard_normal((B, T, 6)), rng.standard_normal((B, S, 5)), rng.standard_normal((B, S, 7))
    allowed = allowed_mask(rng, B, T, S)
    masked = (~allowed).astype(np.float32)  # the seed's polarity: 1 = masked
    out, weights = layer(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), mask=masked)
    config, tensors = knative.from_native(layer, layout="keras-split-heads", num_heads=2)
    assert (config.query_dim, config.key_dim, config.value_dim, config.out_dim) == (6, 5, 7, 8)
    check("seed 003 (keras-split-heads) float32 output", keras.ops.convert_to_numpy(out), config, tensors, q, k, v,
          dtype="float32", mask=allowed)
    check("seed 003 (keras-split-heads) float32 weights", keras.ops.convert_to_numpy(weights), config, tensors,
          q, k, v, dtype="float32", quantity="weights", mask=allowed, return_weights=True)
    fresh = _seed003(keras)(num_heads=2, d_model=8)
    fresh(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))
    knative.to_native(config, tensors, into=fresh, layout="keras-split-heads")
    assert_bit_exact(knative.from_native(layer, layout="keras-split-heads", num_heads=2)[1],
                     knative.from_native(fresh, layout="keras-split-heads", num_heads=2)[1], "seed 003 into=")


# -- Flax ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def jax():
    pytest.importorskip("flax", reason="Flax not installed: pip install 'mha-conformance[jax]'")
    return pytest.importorskip("jax", reason="JAX not installed: pip install 'mha-conformance[jax]'")


@pytest.fixture(scope="module")
def jnative(jax):
    from impl_jax import native

    return native


@pytest.mark.jax
def test_flax_linen(jax, jnative):
    from flax import linen

    module = linen.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, out_features=5,
                                                bias_init=linen.initializers.normal(0.5))
    rng = np.random.default_rng(6)
    B, T, S = 2, 4, 6
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((B, T, 6), (B, S, 3), (B, S, 7)))
    variables = module.init(jax.random.key(0), q, k, v)
    allowed = allowed_mask(rng, B, T, S)  # (B, 1, T, S), True = may attend
    out = module.apply(variables, q, k, v, mask=allowed)
    config, tensors = jnative.from_native((module, variables))
    assert (config.query_dim, config.key_dim, config.value_dim, config.out_dim) == (6, 3, 7, 5)
    check("flax linen MultiHeadDotProductAttention float32", np.asarray(out), config, tensors, q, k, v,
          dtype="float32", mask=allowed)
    rebuilt, rebuilt_vars = jnative.to_native(config, tensors, kind="linen")
    assert_bit_exact(tensors, jnative.from_native((rebuilt, rebuilt_vars))[1], "linen round trip")
    np.testing.assert_array_equal(np.asarray(rebuilt.apply(rebuilt_vars, q, k, v, mask=allowed)), np.asarray(out),
                                  err_msg="the rebuilt linen module computes differently")


@pytest.mark.jax
@pytest.mark.parametrize("num_kv_heads", [4, 2], ids=["mha", "gqa"])
def test_flax_nnx(jax, jnative, num_kv_heads):
    from flax import nnx

    module = nnx.MultiHeadAttention(num_heads=4, in_features=6, qkv_features=8, out_features=5,
                                    num_kv_heads=num_kv_heads, in_kv_features=7, decode=False,
                                    bias_init=nnx.initializers.normal(0.5), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(7)
    B, T, S = 2, 3, 5
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((B, T, 6), (B, S, 7), (B, S, 7)))
    allowed = allowed_mask(rng, B, T, S)
    out = module(q, k, v, mask=allowed)
    config, tensors = jnative.from_native(module)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, num_kv_heads, 2)
    check(f"flax nnx MultiHeadAttention K={num_kv_heads} float32", np.asarray(out), config, tensors, q, k, v,
          dtype="float32", mask=allowed)
    rebuilt = jnative.to_native(config, tensors)
    assert_bit_exact(tensors, jnative.from_native(rebuilt)[1], "nnx round trip")


@pytest.mark.jax
@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_flax_float64(jax, jnative, kind):
    config = AttentionConfig(num_heads=2, query_dim=6, head_dim=3, out_dim=4)
    tensors = init(config, seed=8, dtype="float64")
    # x64 is process-wide and impl_jax.adapter switches it on when imported:
    # state it here rather than depend on which tests ran before.
    with jax.enable_x64(False), pytest.raises(ValueError, match="x64"):
        jnative.to_native(config, tensors, kind=kind)
    x = np.random.default_rng(9).standard_normal((2, 3, 6))
    with jax.enable_x64(True):
        if kind == "linen":
            module, variables = jnative.to_native(config, tensors, kind=kind)
            out = np.asarray(module.apply(variables, x))
        else:
            out = np.asarray(jnative.to_native(config, tensors, kind=kind)(x))
    assert out.dtype == np.float64
    # nnx without dropout calls jax.nn.dot_product_attention, whose softmax runs in
    # float32 even for float64 inputs (measured: errors ~3e-8): float64 storage,
    # float32 accuracy. It is held to the float32 policy; linen to float64's.
    policy = "float64" if kind == "linen" else "float32"
    check(f"flax {kind} float64 (judged as {policy})", out, config, tensors, x, dtype=policy)
