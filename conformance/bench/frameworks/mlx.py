"""The MLX runner of `mha bench`: impl_mlx's paths (the fused kernel, chunked, forward+backward through
mx.vjp, an in-place cache) beside mx.fast.scaled_dot_product_attention around plain projections (the MLX
'native'), MLX's own peak-memory counter. Every timed call ends in mx.eval (MLX is lazy)."""

from __future__ import annotations

import math

import numpy as np

from conformance.bench.frameworks.runner import (
    DECODE_OPTIONS,
    Path_,
    Runner,
    cache_read_path,
    decode_buffers,
    decode_cache,
    float32_only,
    window_chunk,
)
from conformance.bench.shapes import CHUNK_SIZE


def mlx_runner(device: str, quick: bool, dtype: str = "float32") -> Runner:
    import mlx.core as mx

    from impl_mlx.attention import multi_head_attention
    from impl_mlx.convert import to_mx, to_numpy

    if device != "cpu":
        raise RuntimeError("mlx is benchmarked on the CPU here (Metal: macOS arm64)")
    float32_only("mlx", dtype)

    def run(f):
        def timed():
            out = f()
            mx.eval(out)
            return out
        return timed

    def naive(x, p, N, causal):
        """mx.fast.scaled_dot_product_attention around plain projections (the MLX 'native')."""
        B, T, D = x.shape
        H = D // N

        def heads(name):
            y = x @ p[f"{name}.kernel"].reshape(D, D) + p[f"{name}.bias"].reshape(D)
            return y.reshape(B, T, N, H).transpose(0, 2, 1, 3)

        o = mx.fast.scaled_dot_product_attention(heads("query"), heads("key"), heads("value"), scale=1 / math.sqrt(H),
                                                 mask="causal" if causal else None)
        return o.transpose(0, 2, 1, 3).reshape(B, T, D) @ p["output.kernel"].reshape(D, D) + p["output.bias"]

    def paths(shape, config, tensors, x_np):
        p = {name: to_mx(t) for name, t in tensors.items()}
        x = to_mx(x_np)
        c = shape.causal
        if shape.family == "window":
            chunk = window_chunk(shape, quick, CHUNK_SIZE, CHUNK_SIZE)
            return [Path_("ours.chunked", "ours", "eager", "forward",
                          run(lambda: multi_head_attention(config, p, x, is_causal=c, chunk_size=chunk)),
                          note=f"chunk_size={chunk}, window_left={shape.window_left}", compare=True)]
        if shape.family == "decode":
            pk, pv = (to_mx(a) for a in decode_cache(shape))
            bk, bv = (to_mx(a) for a in decode_buffers(shape))
            return [Path_("ours", "ours", "eager", "forward",
                          run(lambda: multi_head_attention(config, p, x, past_key=pk, past_value=pv,
                                                           **DECODE_OPTIONS)),
                          note="fused path (mx.fast.scaled_dot_product_attention), return_cache", compare=True),
                    Path_("ours.in_place", "ours", "eager", "forward",
                          run(lambda: multi_head_attention(config, p, x, past_key=bk, past_value=bv,
                                                           cache_length=shape.P, **DECODE_OPTIONS)),
                          note="fused path, cache_length (buffers written in place)", compare=True),
                    cache_read_path(shape, "eager", run(lambda: (mx.sum(pk), mx.sum(pv))), "mx.sum")]
        out = []
        if not shape.long:
            out.append(Path_("ours", "ours", "eager", "forward", run(lambda: multi_head_attention(config, p, x, is_causal=c)),
                             note="fused path (mx.fast.scaled_dot_product_attention)", compare=True))
        if c or shape.long:
            chunk = min(CHUNK_SIZE, shape.T)
            out.append(Path_("ours.chunked", "ours", "eager", "forward",
                             run(lambda: multi_head_attention(config, p, x, is_causal=c, chunk_size=chunk)),
                             note=f"chunk_size={chunk}", compare=True))
        out.append(Path_("native.sdpa", "native", "eager", "forward", run(lambda: naive(x, p, shape.N, c)),
                         note="mx.fast.scaled_dot_product_attention"))
        if not shape.sweep and not shape.long:
            g = to_mx(np.random.default_rng(1).standard_normal(x_np.shape).astype(np.float32))
            names = list(p)

            def forward_backward():
                def f(*params):
                    return [multi_head_attention(config, dict(zip(names, params)), x, is_causal=c)]
                return mx.vjp(f, [p[n] for n in names], [g])

            out.append(Path_("ours.vjp", "ours", "eager", "forward+backward", run(forward_backward),
                             note="mx.vjp"))
        return out

    def matmul(n):
        a = mx.array(np.random.default_rng(0).standard_normal((n, n)).astype(np.float32))
        return run(lambda: a @ a)

    def memory(call):
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        out = call()
        return mx.get_peak_memory() - base, "mx.get_peak_memory", out

    def numpy_of(out):
        while isinstance(out, (tuple, list)):
            out = out[0]
        return to_numpy(out)

    info = {"version": mx.__version__, "device": str(mx.default_device())}
    return Runner(info, matmul, paths, numpy_of, memory)
