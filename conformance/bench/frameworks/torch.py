"""The PyTorch runner of `mha bench`: impl_torch's paths (SDPA and the
stages, eager and torch.compile'd, an in-place cache) beside
F.scaled_dot_product_attention and nn.MultiheadAttention, the attention
kernels each runs (from the profiler), CUDA's or the process's peak memory.
"""

from __future__ import annotations

import contextlib
import os
import sys

from conformance.bench.frameworks.runner import (
    DECODE_OPTIONS,
    Path_,
    Runner,
    Unsupported,
    cache_read_path,
    decode_buffers,
    decode_cache,
)
from conformance.bench.measure import rss_memory


@contextlib.contextmanager
def _quiet_stderr():
    """Silence C++ libraries that write to file descriptor 2 (the torch profiler's USDT lines)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def torch_runner(device: str, quick: bool, dtype: str = "float32") -> Runner:
    import torch
    import torch.nn.functional as F

    from impl_torch.attention import multi_head_attention

    if device == "gpu" and not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA GPU (torch.cuda.is_available() is False)")
    dev = torch.device("cuda" if device == "gpu" else "cpu")
    dt = getattr(torch, dtype)  # the bench's inputs, weights and caches: float32, or bfloat16 on request
    torch.backends.cuda.matmul.allow_tf32 = False  # TF32 off: float32 means float32
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    compiler = "aot_eager" if quick else "inductor"  # --quick: dynamo capture only (inductor is ~45 s cold)

    def done(f):
        def call():
            y = f()
            sync()
            return y
        return call

    def kernels(f) -> str:
        """Names of the attention kernels one call runs, from the profiler."""
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        try:
            with _quiet_stderr(), profile(activities=acts) as prof:
                f()
        except Exception as err:  # noqa: BLE001 - the path itself will report the failure when timed
            return f"kernel unknown ({type(err).__name__})"
        names = {e.name for e in prof.events()}
        hits = sorted(n for n in names if ("scaled_dot_product" in n and n != "aten::scaled_dot_product_attention")
                      or "flash" in n.lower() or "efficient_attention" in n or "cudnn_attention" in n
                      or "native_multi_head" in n)
        return ", ".join(h.replace("aten::", "") for h in hits) or "math (no fused kernel)"

    def paths(shape, config, tensors_np, x_np):
        if shape.family == "window":
            raise Unsupported("impl_torch has no chunked path: its SDPA path takes a window as a (T, S) boolean "
                              "mask and skips no key block")
        torch._dynamo.reset()  # a fresh compile per shape (the cache limit counts recompiles)
        c, N = shape.causal, shape.N
        t = {k: torch.from_numpy(v).to(dev, dt) for k, v in tensors_np.items()}
        x = torch.from_numpy(x_np).to(dev, dt)
        if shape.family == "decode":
            pk, pv = (torch.from_numpy(a).to(dev, dt) for a in decode_cache(shape))
            bk, bv = (torch.from_numpy(a).to(dev, dt) for a in decode_buffers(shape))  # (CPU float32: the same memory)

            def step(sdpa, in_place=False):
                cache = dict(past_key=bk, past_value=bv, cache_length=shape.P) if in_place else dict(
                    past_key=pk, past_value=pv)

                def call():
                    with torch.no_grad():
                        return multi_head_attention(config, t, x, use_sdpa=sdpa, **cache, **DECODE_OPTIONS)
                return done(call)

            def read():
                with torch.no_grad():
                    return torch.sum(pk), torch.sum(pv)

            return [Path_("ours.sdpa.eager", "ours", "eager", "forward", step(True), note="SDPA, return_cache",
                          compare=True),
                    Path_("ours.eager", "ours", "eager", "forward", step(False), note="the stages, return_cache",
                          compare=True),
                    Path_("ours.sdpa.in_place", "ours", "eager", "forward", step(True, in_place=True),
                          note="SDPA, cache_length (buffers written in place)", compare=True),
                    Path_("ours.in_place", "ours", "eager", "forward", step(False, in_place=True),
                          note="the stages, cache_length (buffers written in place)", compare=True),
                    cache_read_path(shape, "eager", done(read), "torch.sum")]
        D = shape.D
        W = {n: t[f"{n}.kernel"].reshape(D, -1).T.contiguous() for n in ("query", "key", "value")}  # nn.Linear layout
        Wo = t["output.kernel"].reshape(-1, D).T.contiguous()
        b = {n: t[f"{n}.bias"].reshape(-1) for n in ("query", "key", "value")}

        def ours(sdpa):
            return lambda inp, tt: multi_head_attention(config, tt, inp, is_causal=c, use_sdpa=sdpa)

        def native_sdpa(inp, W=W, Wo=Wo, b=b):
            B, T, _ = inp.shape
            q, k, v = (F.linear(inp, W[n], b[n]).view(B, T, N, -1).transpose(1, 2) for n in ("query", "key", "value"))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=c)  # (B, N, T, H)
            return F.linear(o.transpose(1, 2).reshape(B, T, D), Wo, t["output.bias"])

        mha = torch.nn.MultiheadAttention(D, N, batch_first=True, device=dev, dtype=dt).eval()
        causal_mask = torch.ones(shape.T, shape.S, dtype=torch.bool, device=dev).triu(1) if c else None

        def native_mha(inp):
            return mha(inp, inp, inp, need_weights=False, attn_mask=causal_mask, is_causal=c)[0]

        def fwd(f):
            def call():
                with torch.no_grad():
                    return f()
            return done(call)

        def fwd_bwd(f):
            xg = x.clone().requires_grad_(True)
            tg = {k: v.clone().requires_grad_(True) for k, v in t.items()}
            g = torch.randn_like(x)

            def call():
                for v in (xg, *tg.values()):
                    v.grad = None
                y = f(xg, tg)
                y.backward(g)
                return y.detach()
            return done(call)

        sdpa_kernel = kernels(lambda: fwd(lambda: native_sdpa(x))())
        mha_kernel = kernels(lambda: fwd(lambda: native_mha(x))())
        ours_sdpa_kernel = kernels(lambda: fwd(lambda: ours(True)(x, t))())
        out = []
        if not shape.long:
            out.append(Path_("ours.eager", "ours", "eager", "forward", fwd(lambda: ours(False)(x, t)), ts_arrays=4,
                             compare=True))
        out.append(Path_("ours.sdpa.eager", "ours", "eager", "forward", fwd(lambda: ours(True)(x, t)),
                         note=ours_sdpa_kernel, compare=True))
        if not shape.sweep:
            compiled_sdpa = torch.compile(ours(True), backend=compiler, dynamic=False)
            out.append(Path_("ours.sdpa.compiled", "ours", "compiled", "forward", fwd(lambda: compiled_sdpa(x, t)),
                             note=f"torch.compile {compiler}", compare=True))
            if not shape.long:
                compiled_plain = torch.compile(ours(False), backend=compiler, dynamic=False)
                out.append(Path_("ours.compiled", "ours", "compiled", "forward", fwd(lambda: compiled_plain(x, t)),
                                 ts_arrays=3, note=f"torch.compile {compiler}", compare=True))
        out.append(Path_("native.sdpa.eager", "native", "eager", "forward", fwd(lambda: native_sdpa(x)), note=sdpa_kernel))
        if not shape.sweep:
            out.append(Path_("native.mha.eager", "native", "eager", "forward", fwd(lambda: native_mha(x)), ts_arrays=3,
                             note=mha_kernel))
            compiled_native = torch.compile(native_sdpa, backend=compiler, dynamic=False)
            out.append(Path_("native.sdpa.compiled", "native", "compiled", "forward", fwd(lambda: compiled_native(x)),
                             note=f"torch.compile {compiler}"))
            if not shape.long:
                out.append(Path_("ours.eager", "ours", "eager", "forward+backward", fwd_bwd(ours(False)), ts_arrays=6))
                out.append(Path_("ours.sdpa.eager", "ours", "eager", "forward+backward", fwd_bwd(ours(True))))
                out.append(Path_("native.sdpa.eager", "native", "eager", "forward+backward",
                                 fwd_bwd(lambda inp, tt: native_sdpa(inp, W={n: tt[f"{n}.kernel"].reshape(D, -1).T
                                                                              for n in ("query", "key", "value")},
                                                                     Wo=tt["output.kernel"].reshape(-1, D).T,
                                                                     b={n: tt[f"{n}.bias"].reshape(-1)
                                                                        for n in ("query", "key", "value")}))))
        return out

    def matmul(n):
        a = torch.randn(n, n, device=dev, dtype=dt)
        c = torch.empty_like(a)
        return done(lambda: torch.mm(a, a, out=c))

    def memory(call):
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = call()
            return torch.cuda.max_memory_allocated() - base, "torch.cuda.max_memory_allocated growth", out
        return rss_memory(call)

    info = {"version": torch.__version__, "threads": torch.get_num_threads(), "device": str(dev),
            "compiler": compiler, "tf32": False, "dtype": dtype,
            "blas": torch.__config__.show().split("BLAS_INFO=")[-1].split(",")[0] if "BLAS_INFO=" in torch.__config__.show() else "?"}
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["sdp_enabled"] = {k: getattr(torch.backends.cuda, f"{k}_sdp_enabled")()
                               for k in ("flash", "mem_efficient", "math", "cudnn")
                               if hasattr(torch.backends.cuda, f"{k}_sdp_enabled")}
    return Runner(info, matmul, paths, lambda y: y.detach().to("cpu", torch.float32).numpy(), memory)
