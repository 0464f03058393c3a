"""The JAX runner of `mha bench`: impl_jax's paths (eager, jax.jit, chunked,
an in-place cache with donated buffers) beside Flax NNX's
MultiHeadAttention and jax.nn.dot_product_attention, XLA's or the
process's peak memory.
"""

from __future__ import annotations

import numpy as np

from conformance.bench.frameworks.runner import (
    DECODE_OPTIONS,
    Path_,
    Runner,
    cache_read_path,
    decode_buffers,
    decode_cache,
    window_chunk,
)
from conformance.bench.measure import rss_memory
from conformance.bench.shapes import JAX_CHUNK_SIZE, JAX_CHUNK_SIZE_SMALL_BATCH, framework_chunk


def jax_runner(device: str, quick: bool, dtype: str = "float32") -> Runner:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from impl_jax.attention import apply  # not impl_jax.adapter: it turns x64 on process-wide

    jax.config.update("jax_default_matmul_precision", "highest")  # no TF32 on GPUs (CPUs compute float32 anyway)
    platform_ = "gpu" if device == "gpu" else "cpu"
    try:
        dev = jax.devices(platform_)[0]
    except RuntimeError as err:
        raise RuntimeError(f"JAX has no {device} device ({err})") from None
    dpa_impl = "cudnn" if platform_ == "gpu" else "xla"
    dt = jnp.dtype(dtype)  # the bench's inputs, weights and caches: float32, or bfloat16 on request

    def put(a):
        return jax.device_put(jax.tree.map(lambda y: jnp.asarray(y, dt), a), dev)

    def done(f):
        def call():
            return jax.block_until_ready(f())
        return call

    def paths(shape, config, tensors_np, x_np):
        c = shape.causal
        p, x = put(tensors_np), put(x_np)
        D, N = shape.D, shape.N
        if shape.family == "window":
            chunk = window_chunk(shape, quick, JAX_CHUNK_SIZE, JAX_CHUNK_SIZE_SMALL_BATCH)
            windowed = jax.jit(lambda pp, inp: apply(config, pp, inp, is_causal=True, chunk_size=chunk))
            return [Path_("ours.chunked", "ours", "compiled", "forward", done(lambda: windowed(p, x)),
                          note=f"jax.jit, chunk_size={chunk}, window_left={shape.window_left}", compare=True)]
        if shape.family == "decode":
            pk, pv = put(decode_cache(shape))
            step = jax.jit(lambda pp, inp, k, v: apply(config, pp, inp, past_key=k, past_value=v, **DECODE_OPTIONS))
            read = jax.jit(lambda k, v: (jnp.sum(k), jnp.sum(v)))
            # In place: the buffers donated to each call and the written ones kept for the next (XLA writes
            # the new key where the buffer lies); P traced, as a decode loop passes it (one program).
            in_place = jax.jit(lambda pp, inp, k, v, P: apply(config, pp, inp, past_key=k, past_value=v,
                                                               cache_length=P, **DECODE_OPTIONS),
                               donate_argnums=(2, 3))
            held = list(put(decode_buffers(shape)))
            length = jnp.int32(shape.P)

            def in_place_step():
                out, held[0], held[1] = in_place(p, x, held[0], held[1], length)
                return out

            return [Path_("ours.jit", "ours", "compiled", "forward", done(lambda: step(p, x, pk, pv)),
                          note="jax.jit, return_cache", compare=True),
                    Path_("ours.in_place.jit", "ours", "compiled", "forward", done(in_place_step),
                          note="jax.jit, cache_length traced, buffers donated (written in place)", compare=True),
                    cache_read_path(shape, "compiled", done(lambda: read(pk, pv)), "jnp.sum under jax.jit")]

        def ours(pp, inp):
            return apply(config, pp, inp, is_causal=c)

        def dpa(pp, inp, implementation=None):
            q, k, v = (jnp.einsum("BTD,DNH->BTNH", inp, pp[f"{n}.kernel"]) + pp[f"{n}.bias"] for n in ("query", "key", "value"))
            o = jax.nn.dot_product_attention(q, k, v, is_causal=c, implementation=implementation)  # (B, T, N, H)
            return jnp.einsum("BTNH,NHO->BTO", o, pp["output.kernel"]) + pp["output.bias"]

        m = nnx.MultiHeadAttention(num_heads=N, in_features=D, qkv_features=D, out_features=D, decode=False,
                                   deterministic=True, dtype=dt, param_dtype=dt, rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(m)
        state = jax.device_put(state, dev)

        def nnx_mha(st, inp):
            mask = nnx.make_causal_mask(inp[..., 0]) if c else None  # (B, 1, T, T)
            return nnx.merge(graphdef, st)(inp, mask=mask)

        chunk = framework_chunk(shape, JAX_CHUNK_SIZE, JAX_CHUNK_SIZE_SMALL_BATCH)

        def ours_chunked(pp, inp):
            return apply(config, pp, inp, is_causal=c, chunk_size=chunk)

        ours_jit = jax.jit(ours)
        chunked_jit = jax.jit(ours_chunked)
        dpa_jit = jax.jit(dpa, static_argnames="implementation")
        nnx_jit = jax.jit(nnx_mha)
        out = []
        if not shape.sweep and not shape.long:
            out.append(Path_("ours.eager", "ours", "eager", "forward", done(lambda: ours(p, x)), ts_arrays=5, compare=True))
        if not shape.long:
            out.append(Path_("ours.jit", "ours", "compiled", "forward", done(lambda: ours_jit(p, x)), ts_arrays=2,
                             note="jax.jit", compare=True))
        if c or shape.long:
            out.append(Path_("ours.chunked", "ours", "compiled", "forward", done(lambda: chunked_jit(p, x)),
                             note=f"jax.jit, chunk_size={chunk}", compare=True))
        if not shape.sweep:
            out.append(Path_("native.nnx_mha.eager", "native", "eager", "forward", done(lambda: nnx_mha(state, x)),
                             ts_arrays=5))
            out.append(Path_("native.nnx_mha.jit", "native", "compiled", "forward", done(lambda: nnx_jit(state, x)),
                             ts_arrays=2, note="jax.jit"))
            out.append(Path_("native.dpa.eager", "native", "eager", "forward", done(lambda: dpa(p, x)), ts_arrays=4,
                             note="jax.nn.dot_product_attention"))
        chosen = dpa_impl
        if dpa_impl == "cudnn":
            try:
                dpa_jit(p, x, implementation="cudnn")
            except Exception:  # noqa: BLE001 - cuDNN refuses some shapes/dtypes
                chosen = None
        out.append(Path_("native.dpa.jit", "native", "compiled", "forward",
                         done(lambda: dpa_jit(p, x, implementation=chosen)), ts_arrays=2,
                         note=f"jax.nn.dot_product_attention implementation={chosen or 'xla'}", compare=True))
        if not shape.sweep and not shape.long:
            g = put(np.random.default_rng(1).standard_normal(x_np.shape).astype(np.float32))

            def grad_of(f):
                @jax.jit
                def step(pp, inp):
                    y, pull = jax.vjp(f, pp, inp)
                    return y, pull(g)
                return lambda: step(p, x)

            out.append(Path_("ours.jit", "ours", "compiled", "forward+backward", done(grad_of(ours)), ts_arrays=5,
                             note="jax.jit(jax.vjp)"))
            out.append(Path_("native.dpa.jit", "native", "compiled", "forward+backward", done(grad_of(dpa)),
                             ts_arrays=5, note="jax.jit(jax.vjp)"))
        return out

    def matmul(n):
        a = put(np.random.default_rng(0).standard_normal((n, n)).astype(np.float32))
        mm = jax.jit(jnp.matmul)
        return done(lambda: mm(a, a))

    def memory(call):
        if platform_ == "gpu":
            stats = dev.memory_stats() or {}
            base = stats.get("bytes_in_use", 0)
            out = call()
            peak = (dev.memory_stats() or {}).get("peak_bytes_in_use")
            return (None if peak is None else peak - base), "XLA peak_bytes_in_use growth (not reset per call)", out
        return rss_memory(call)

    import flax

    info = {"version": jax.__version__, "flax": flax.__version__, "device": str(dev), "matmul_precision": "highest",
            "dpa_implementation": dpa_impl, "dtype": dtype}
    return Runner(info, matmul, paths, lambda y: np.asarray(y[0] if isinstance(y, tuple) else y, np.float32), memory)
