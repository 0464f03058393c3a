"""What a `mha bench` worker needs from each framework, a Runner: the paths to
time (ours and native), its large matmul, its memory counter. One function per
framework (RUNNERS); each imports its framework when called."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import sys
from collections.abc import Callable

import numpy as np

from conformance.bench.measure import rss_memory, tracemalloc_memory
from conformance.bench.shapes import (
    CHUNK_SIZE,
    JAX_CHUNK_SIZE,
    JAX_CHUNK_SIZE_SMALL_BATCH,
    QUICK_CHUNK,
    TF_CHUNK_SIZE,
    TF_CHUNK_SIZE_SMALL_BATCH,
    Shape,
    framework_chunk,
)


@dataclasses.dataclass
class Path_:
    """A thing to time: `call()` runs it once, synchronised, and returns the output."""

    name: str  # e.g. "ours.sdpa.eager", "native.keras_mha.xla"
    kind: str  # "ours" | "native"
    mode: str  # "eager" | "compiled"
    pass_: str  # "forward" | "forward+backward"
    call: Callable[[], object]
    ts_arrays: float = 0.0  # (B, N, T, S) float32 arrays alive at the peak (memory guard); 0 if chunked/flash
    note: str = ""  # kernel, compiler or chunk size, shown in the table
    compare: bool = False  # compare the output with the NumPy reference
    flops: int | None = None  # work to count instead of the shape's attention FLOPs (the cache read: its elements)


class Unsupported(Exception):
    """A backend cannot run a shape the way the bench needs: its rows say why, as skipped."""


@functools.lru_cache(maxsize=1)
def decode_cache(shape: Shape) -> tuple[np.ndarray, np.ndarray]:
    """The decode family's cache, past_key (B, K, P, H) and past_value (B, K, P, H), float32,
    the same for every backend (and the NumPy reference); the last shape's is kept."""
    rng = np.random.default_rng(2)
    size = (shape.B, shape.kv_heads, shape.P, shape.H)
    return rng.standard_normal(size, dtype=np.float32), rng.standard_normal(size, dtype=np.float32)


def window_chunk(shape: Shape, quick: bool, large_batch: int, small_batch: int) -> int:
    """chunk_size of a chunked path on the window family: the shape's own in a real run, QUICK_CHUNK
    under --quick (smaller than the quick window, so hidden key blocks are skipped there too)."""
    return min(shape.T, QUICK_CHUNK) if quick else framework_chunk(shape, large_batch, small_batch)


def cache_read_path(shape: Shape, mode: str, call: Callable[[], object], how: str) -> Path_:
    """The decode family's yardstick: one pass over the cache (past_key and past_value), a sum in
    the backend's own framework, timed like every path and beside them."""
    return Path_("cache.read", "reference", mode, "forward", call, flops=shape.cache_bytes // 4,
                 note=f"{how} over past_key and past_value ({shape.cache_bytes / 2**20:.0f} MiB)")


DECODE_OPTIONS = dict(is_causal=True, causal_alignment="bottom_right", return_cache=True)  # the new token sees the cache


def decode_buffers(shape: Shape) -> tuple[np.ndarray, np.ndarray]:
    """The decode family's cache as in-place buffers (cache_length=P): capacity P + 1, the first P
    positions decode_cache's, the last one the step's own (each timed call writes it again, with the
    same values: every call computes the same step)."""
    buffers = []
    for past in decode_cache(shape):
        B, K, P, H = past.shape
        buffer = np.zeros((B, K, P + 1, H), np.float32)
        buffer[:, :, :P] = past
        buffers.append(buffer)
    return buffers[0], buffers[1]


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


@dataclasses.dataclass
class Runner:
    """What a worker needs from a framework: kept to one function per framework."""

    info: dict
    matmul: Callable[[int], Callable[[], object]]  # n -> a callable doing one n x n float32 matmul
    paths: Callable[[Shape, object, dict, object], list[Path_]]  # (shape, config, tensors, x) -> paths
    to_numpy: Callable[[object], np.ndarray]
    memory: Callable[[Callable[[], object]], tuple[int | None, str, object]]  # call -> (peak bytes, method, out)


def _numpy_blas() -> str:
    """The OpenBLAS kernel NumPy runs (OPENBLAS_CORETYPE changes it)."""
    import ctypes
    import glob

    libs = glob.glob(os.path.join(os.path.dirname(np.__file__), "..", "numpy.libs", "*openblas*"))
    for lib in libs:
        for name in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename"):
            with contextlib.suppress(OSError, AttributeError):
                f = getattr(ctypes.CDLL(lib), name)
                f.restype = ctypes.c_char_p
                return f"OpenBLAS {f().decode()}"
    return "unknown"


def _float32_only(backend: str, dtype: str) -> None:
    if dtype != "float32":
        raise RuntimeError(f"{backend} is benchmarked in float32 only (bfloat16: torch and jax)")


def numpy_runner(device: str, quick: bool, dtype: str = "float32") -> Runner:
    from impl_numpy.attention import multi_head_attention
    from impl_numpy.backward import multi_head_attention_vjp

    if device != "cpu":
        raise RuntimeError("numpy runs on the CPU only")
    _float32_only("numpy", dtype)

    def naive(x, p, N, causal):
        """Plain float32 attention, written the obvious way (the NumPy 'native')."""
        B, T, D = x.shape
        H = D // N
        q = (x @ p["query.kernel"].reshape(D, D) + p["query.bias"].reshape(D)).reshape(B, T, N, H).transpose(0, 2, 1, 3)
        k = (x @ p["key.kernel"].reshape(D, D) + p["key.bias"].reshape(D)).reshape(B, T, N, H).transpose(0, 2, 1, 3)
        v = (x @ p["value.kernel"].reshape(D, D) + p["value.bias"].reshape(D)).reshape(B, T, N, H).transpose(0, 2, 1, 3)
        s = (q @ k.transpose(0, 1, 3, 2)) * np.float32(1 / math.sqrt(H))  # (B, N, T, S)
        if causal:
            s = np.where(np.tril(np.ones((T, T), bool)), s, np.float32(-np.inf))
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        s /= s.sum(axis=-1, keepdims=True)
        o = (s @ v).transpose(0, 2, 1, 3).reshape(B, T, D)
        return o @ p["output.kernel"].reshape(D, D) + p["output.bias"]

    def paths(shape, config, tensors, x):
        c = shape.causal
        if shape.family == "window":
            chunk = window_chunk(shape, quick, CHUNK_SIZE, CHUNK_SIZE)
            return [Path_("ours.chunked", "ours", "eager", "forward",
                          lambda: multi_head_attention(config, tensors, x, is_causal=c, chunk_size=chunk),
                          note=f"chunk_size={chunk}, window_left={shape.window_left}", compare=True)]
        if shape.family == "decode":
            pk, pv = decode_cache(shape)
            bk, bv = decode_buffers(shape)
            return [Path_("ours", "ours", "eager", "forward",
                          lambda: multi_head_attention(config, tensors, x, past_key=pk, past_value=pv, **DECODE_OPTIONS),
                          note="fused path, return_cache", compare=True),
                    Path_("ours.in_place", "ours", "eager", "forward",
                          lambda: multi_head_attention(config, tensors, x, past_key=bk, past_value=bv,
                                                       cache_length=shape.P, **DECODE_OPTIONS),
                          note="fused path, cache_length (buffers written in place)", compare=True),
                    cache_read_path(shape, "eager", lambda: (np.sum(pk), np.sum(pv)), "np.sum")]
        g = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)
        out = []
        if not shape.long:
            out.append(Path_("ours", "ours", "eager", "forward", lambda: multi_head_attention(config, tensors, x, is_causal=c),
                             ts_arrays=4, compare=True))
        if c or shape.long:
            chunk = min(CHUNK_SIZE, shape.T)
            out.append(Path_("ours.chunked", "ours", "eager", "forward",
                             lambda: multi_head_attention(config, tensors, x, is_causal=c, chunk_size=chunk),
                             note=f"chunk_size={chunk}", compare=True))
        out.append(Path_("native.naive", "native", "eager", "forward", lambda: naive(x, tensors, shape.N, c), ts_arrays=3))
        if not shape.sweep and not shape.long:
            out.append(Path_("ours.vjp", "ours", "eager", "forward+backward",
                             lambda: multi_head_attention_vjp(config, tensors, x, d_output=g, is_causal=c)[0],
                             ts_arrays=7, note="hand-written backward"))
        return out

    def matmul(n):
        a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
        c = np.empty_like(a)
        return lambda: np.matmul(a, a, out=c)

    info = {"version": np.__version__, "blas": _numpy_blas(),
            "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"), "threads": "BLAS default"}

    def memory(call):
        from impl_numpy.chunked import release_workspace

        release_workspace()  # the buffers the fast path keeps between calls are allocated, and counted, in this one
        return tracemalloc_memory(call)

    return Runner(info, matmul, paths, np.asarray, memory)


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


def tf_runner(device: str, quick: bool, dtype: str = "float32") -> Runner:
    _float32_only("tf", dtype)
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from impl_tf._keras import keras, tf
    from impl_tf.attention import multi_head_attention

    gpus = tf.config.list_physical_devices("GPU")
    if device == "gpu" and not gpus:
        raise RuntimeError("TensorFlow sees no GPU (tf.config.list_physical_devices('GPU') is empty)")
    tf.config.experimental.enable_tensor_float_32_execution(False)
    dev = "/GPU:0" if device == "gpu" else "/CPU:0"

    def done(f):
        def call():
            with tf.device(dev):
                y = f()
            if device == "gpu":
                y = tf.nest.map_structure(lambda a: a.numpy(), y)  # waits for the device
            return y
        return call

    def paths(shape, config, tensors_np, x_np):
        c = shape.causal
        if shape.family:
            return family_paths(shape, config, tensors_np, x_np)
        with tf.device(dev):
            t = {k: tf.constant(v) for k, v in tensors_np.items()}
            x = tf.constant(x_np)
            layer = keras.layers.MultiHeadAttention(num_heads=shape.N, key_dim=shape.H)
            layer(x[:1, :2], x[:1, :2])  # build

        def ours(inp, tt):
            return multi_head_attention(config, tt, inp, is_causal=c)

        def native(inp):
            return layer(inp, inp, use_causal_mask=c)

        out = []
        ours_xla = tf.function(ours, jit_compile=True, reduce_retracing=False)
        native_xla = tf.function(native, jit_compile=True)
        if not shape.sweep and not shape.long:
            out.append(Path_("ours.eager", "ours", "eager", "forward", done(lambda: ours(x, t)), ts_arrays=5, compare=True))
            ours_graph = tf.function(ours)
            out.append(Path_("ours.graph", "ours", "compiled", "forward", done(lambda: ours_graph(x, t)), ts_arrays=4,
                             note="tf.function", compare=True))
        if not shape.long:
            out.append(Path_("ours.xla", "ours", "compiled", "forward", done(lambda: ours_xla(x, t)), ts_arrays=2,
                             note="tf.function(jit_compile=True)", compare=True))
        if c or shape.long:
            # The chunked path (never a (T, S) array; causal key blocks skipped); its key-block step is
            # compiled by XLA in both modes. Chunk sizes: see TF_CHUNK_SIZE.
            chunk = framework_chunk(shape, TF_CHUNK_SIZE, TF_CHUNK_SIZE_SMALL_BATCH)

            def ours_chunked(inp, tt):
                return multi_head_attention(config, tt, inp, is_causal=c, chunk_size=chunk)

            ours_chunked_graph = tf.function(ours_chunked)
            if not shape.sweep:
                out.append(Path_("ours.chunked.eager", "ours", "eager", "forward", done(lambda: ours_chunked(x, t)),
                                 note=f"chunk_size={chunk}", compare=True))
            out.append(Path_("ours.chunked.graph", "ours", "compiled", "forward", done(lambda: ours_chunked_graph(x, t)),
                             note=f"chunk_size={chunk}, tf.function", compare=True))
        if not shape.sweep:
            out.append(Path_("native.keras_mha.eager", "native", "eager", "forward", done(lambda: native(x)), ts_arrays=5))
            native_graph = tf.function(native)
            out.append(Path_("native.keras_mha.graph", "native", "compiled", "forward", done(lambda: native_graph(x)),
                             ts_arrays=4, note="tf.function"))
        out.append(Path_("native.keras_mha.xla", "native", "compiled", "forward", done(lambda: native_xla(x)),
                         ts_arrays=2, note="tf.function(jit_compile=True)"))
        if not shape.sweep and not shape.long:
            g = tf.constant(np.random.default_rng(1).standard_normal(x_np.shape).astype(np.float32))

            @tf.function(jit_compile=True)
            def ours_grad(inp, tt):
                with tf.GradientTape() as tape:
                    tape.watch([inp, tt])
                    y = ours(inp, tt)
                grads = tape.gradient(y, [inp, tt], output_gradients=g)
                return y, grads  # returned, or tf.function prunes the backward pass away

            @tf.function(jit_compile=True)
            def native_grad(inp):
                with tf.GradientTape() as tape:
                    tape.watch(inp)
                    y = native(inp)
                grads = tape.gradient(y, [inp, *layer.trainable_variables], output_gradients=g)
                return y, grads

            out.append(Path_("ours.xla", "ours", "compiled", "forward+backward", done(lambda: ours_grad(x, t)),
                             ts_arrays=5, note="GradientTape in tf.function(jit_compile=True)"))
            out.append(Path_("native.keras_mha.xla", "native", "compiled", "forward+backward",
                             done(lambda: native_grad(x)), ts_arrays=5, note="GradientTape in tf.function(jit_compile=True)"))
        return out

    def family_paths(shape, config, tensors_np, x_np):
        """window: the chunked path under tf.function (its key-block step XLA-compiled); decode: the
        default path, eager and under tf.function, and the cache read."""
        with tf.device(dev):
            t = {k: tf.constant(v) for k, v in tensors_np.items()}
            x = tf.constant(x_np)
        if shape.family == "window":
            chunk = window_chunk(shape, quick, TF_CHUNK_SIZE, TF_CHUNK_SIZE_SMALL_BATCH)
            graph = tf.function(lambda inp, tt: multi_head_attention(config, tt, inp, is_causal=True, chunk_size=chunk))
            return [Path_("ours.chunked.graph", "ours", "compiled", "forward", done(lambda: graph(x, t)),
                          note=f"chunk_size={chunk}, window_left={shape.window_left}, tf.function", compare=True)]
        with tf.device(dev):
            pk, pv = (tf.constant(a) for a in decode_cache(shape))

        def step(inp, tt, k, v):
            return multi_head_attention(config, tt, inp, past_key=k, past_value=v, **DECODE_OPTIONS)

        graph = tf.function(step)
        with tf.device(dev):
            bk, bv = (tf.Variable(a) for a in decode_buffers(shape))
        # The in-place step returns its output alone: the variables are written where they lie, and a read
        # of them handed out of the graph would make the next write copy the buffer whole.
        in_place = tf.function(lambda inp, tt: multi_head_attention(
            config, tt, inp, past_key=bk, past_value=bv, cache_length=shape.P,
            **{**DECODE_OPTIONS, "return_cache": False}))
        return [Path_("ours.eager", "ours", "eager", "forward", done(lambda: step(x, t, pk, pv)), note="return_cache",
                      compare=True),
                Path_("ours.in_place.graph", "ours", "compiled", "forward", done(lambda: in_place(x, t)),
                      note="cache_length (variables written in place), tf.function", compare=True),
                Path_("ours.graph", "ours", "compiled", "forward", done(lambda: graph(x, t, pk, pv)),
                      note="return_cache, tf.function", compare=True),
                cache_read_path(shape, "eager", done(lambda: (tf.reduce_sum(pk), tf.reduce_sum(pv))), "tf.reduce_sum")]

    def matmul(n):
        with tf.device(dev):
            a = tf.random.normal((n, n))
        return done(lambda: tf.linalg.matmul(a, a))

    def memory(call):
        # TF's allocator's own counters, CPU included: with oneDNN on, the CPU allocator pools
        # large blocks (a BFC allocator), so the process RSS does not grow after the first call.
        name = "GPU:0" if device == "gpu" else "CPU:0"
        try:
            tf.config.experimental.reset_memory_stats(name)
            base = tf.config.experimental.get_memory_info(name)["current"]
        except (ValueError, RuntimeError):
            return rss_memory(call)
        out = call()
        peak = tf.config.experimental.get_memory_info(name)["peak"] - base
        return peak, f"tf.config.experimental.get_memory_info({name!r}) peak growth", out

    from impl_tf import attention, chunked

    info = {"version": tf.__version__, "keras": keras.__version__, "device": dev, "tf32": False,
            "keras_mha_kernel": "keras einsum path (Keras flash attention is not used on the TensorFlow backend)",
            "ours_kernels": f"fused attention core compiled by XLA from {attention.XLA_MIN_SCORES} score elements, "
                            f"chunked key-block step from {chunked.XLA_MIN_BLOCK} (eager paths too)"}
    return Runner(info, matmul, paths, lambda y: np.asarray(y), memory)


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


RUNNERS = {"numpy": numpy_runner, "torch": torch_runner, "tf": tf_runner, "jax": jax_runner}
