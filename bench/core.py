"""`mha bench`: what attention costs in each framework, as ratios measured in one run.

For every backend and shape it times our implementation (forward, eager and
compiled, and forward+backward), the framework's fastest native paths, and
one large float32 matmul in that framework; every time is then a ratio:

  % of matmul rate   FLOPs / time / (the framework's 2048^3 matmul rate),
                     FLOPs = 4*B*T*D^2 + 4*B*S*D^2 (projections, 8*B*T*D^2 when
                     T = S) + 4*B*N*T*S*H (attention, the full T*S even when
                     causal: a causal path that skips hidden key blocks can
                     pass 100%); forward+backward counts 3x the forward FLOPs.
  x native           time / the fastest native path of the same framework,
                     pass and mode (eager against eager, compiled against
                     compiled; NumPy has only eager).

Method
- Each backend runs in its own worker process (`python -m bench.core
  --worker`): frameworks do not share thread pools or allocators, a crash or
  an out-of-memory kill is reported as that backend's failure, and peak
  memory is the worker's own.
- A measurement: one first call (timed: for compiled paths it includes the
  compile; `compile_s` = first call - median), one more warm-up call when the
  first took under 2 s, then up to --repeats timed calls (at least 3, fewer
  once --max-seconds of a path's timing has passed). Median, min, max,
  quartiles.
- Pairs: each timed call of a path comes right after one timed run of the
  large matmul (measure_paired), and % of matmul is the median of the pairs'
  ratios. This machine is a shared VM whose speed drifts by tens of percent
  within minutes (CPU steal); a path and its matmul see the same drift. The
  paths themselves are timed one after another, each in its own steady state
  (measure_paired says why not round robin), a minute or so apart, so x
  native divides the two paths' paired ratios (add_native_ratios), in which
  a drift between them cancels.
- Peak memory, one more call after the timed ones: NumPy with tracemalloc
  (NumPy reports its array buffers to it); TensorFlow with its allocator's
  counters (tf.config.experimental.get_memory_info, CPU too: its oneDNN CPU
  allocator pools large blocks, so RSS would not move); torch and JAX as
  growth of the process's peak resident set: malloc_trim(0), "5" written to
  /proc/self/clear_refs (resets VmHWM), then VmHWM after the call minus VmRSS
  before it. GPU: the framework's own peak-allocation counter.
- Long sequences (T >= LONG_T): each implementation's chunked path if it has
  one (chunk_size= in NumPy, Keras and JAX; torch through SDPA); causal shapes
  (gpt2) time the chunked paths too; weights are never requested. A path
  whose (B, N, T, S) float32 arrays would not fit in --mem-limit is skipped
  with that reason instead of run.
- Sweep (T = S = 128 ... 16384, B 1, D 512, N 8): forward only, one path of
  ours and one native per backend; a path stops after the first point whose
  median exceeds --budget seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np

BACKENDS = ("numpy", "torch", "tf", "jax")
FRAMEWORKS = ("torch", "tf", "jax")
MATMUL_N = 2048
LONG_T = 2048  # from this query length on, the long-sequence (chunked) paths
CHUNK_SIZE = 512  # NumPy's chunk_size for causal and long shapes: key blocks of 512, query blocks of 128 (impl_numpy.chunked.QUERY_ROWS)
JAX_CHUNK_SIZE = 256  # impl_jax's chunk_size where B*N >= 32 (gpt2: 66.8% of matmul against 61.8% with 512)
JAX_CHUNK_SIZE_SMALL_BATCH = 512  # B*N < 32 (long: 92.4% against 63.1% with 256; XLA:CPU runs the 8 heads' (512 x 64)
# x (64 x 512) block matmuls on both cores, the (256 x 64) x (64 x 256) ones on one). Round robin, 2026-11-23.
TF_CHUNK_SIZE = 128  # impl_tf's, where B*N >= 32 (gpt2: 117% of matmul against 109% with 256, tf.function)
TF_CHUNK_SIZE_SMALL_BATCH = 512  # impl_tf's, B*N < 32. long, tf.function: 131% against 125% with 256 on run F's
# machine; 81-82% against 73-74% with 256 and 68-69% with 1024 on run G's (2026-11-24, paired, two rounds)
MIN_REPEATS = 3
SCHEMA = "mha-bench/1"


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    B: int
    T: int
    S: int
    D: int
    N: int
    causal: bool
    sweep: bool = False  # a point of the sweep (forward only, reduced path set)

    @property
    def H(self) -> int:
        return self.D // self.N

    @property
    def flops(self) -> int:
        """Forward FLOPs: q and output projections over T, k and v over S, and
        QK^T plus WV over the full T x S (even when causal)."""
        B, T, S, D, N, H = self.B, self.T, self.S, self.D, self.N, self.H
        return 4 * B * T * D * D + 4 * B * S * D * D + 4 * B * N * T * S * H

    @property
    def io_bytes(self) -> int:
        """float32 bytes of the inputs and the output: self-attention passes one
        (B, T, D) query as key and value, and gets one (B, T, D) back."""
        return 2 * self.B * self.T * self.D * 4

    @property
    def ts_bytes(self) -> int:
        """One float32 (B, N, T, S) array."""
        return self.B * self.N * self.T * self.S * 4

    @property
    def long(self) -> bool:
        return self.T >= LONG_T

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "H": self.H, "flops": self.flops, "io_bytes": self.io_bytes}


SHAPES = {
    "bert-base": Shape("bert-base", B=8, T=128, S=128, D=768, N=12, causal=False),
    "vit-b16": Shape("vit-b16", B=32, T=197, S=197, D=768, N=12, causal=False),
    "gpt2": Shape("gpt2", B=4, T=1024, S=1024, D=768, N=12, causal=True),
    "long": Shape("long", B=1, T=8192, S=8192, D=512, N=8, causal=True),
}
SWEEP_LENGTHS = tuple(2 ** i for i in range(7, 15))  # 128 ... 16384
# --quick: the same names, shrunk, so every part of the pipeline runs in seconds.
QUICK_SHAPES = {
    "bert-base": Shape("bert-base", B=2, T=16, S=16, D=64, N=4, causal=False),
    "vit-b16": Shape("vit-b16", B=2, T=13, S=13, D=64, N=4, causal=False),
    "gpt2": Shape("gpt2", B=1, T=64, S=64, D=64, N=4, causal=True),
    "long": Shape("long", B=1, T=LONG_T, S=LONG_T, D=32, N=2, causal=True),
}
QUICK_SWEEP_LENGTHS = (16, 32, 64)


def framework_chunk(shape: Shape, large_batch: int, small_batch: int) -> int:
    """The chunk_size `mha bench` gives a framework's chunked path (impl_tf, impl_jax) at `shape`:
    large_batch where B*N >= 32, else small_batch (the *_CHUNK_SIZE constants say why), at most T."""
    return min(shape.T, large_batch if shape.B * shape.N >= 32 else small_batch)


def sweep_shapes(lengths) -> list[Shape]:
    return [Shape(f"sweep-{T}", B=1, T=T, S=T, D=512 if T >= 128 else 64, N=8 if T >= 128 else 4, causal=False,
                  sweep=True) for T in lengths]


# -- one path of one backend ------------------------------------------------------

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


def _peak_rss_begin() -> int | None:
    """Reset the peak RSS counter; return the current RSS in bytes (None if the kernel refuses)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _status_kb("VmRSS") * 1024


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


@dataclasses.dataclass
class Glue:
    """What a worker needs from a framework: kept to one function per framework."""

    info: dict
    matmul: Callable[[int], Callable[[], object]]  # n -> a callable doing one n x n float32 matmul
    paths: Callable[[Shape, object, dict, object], list[Path_]]  # (shape, config, tensors, x) -> paths
    to_numpy: Callable[[object], np.ndarray]
    memory: Callable[[Callable[[], object]], tuple[int | None, str, object]]  # call -> (peak bytes, method, out)


def _rss_memory(call):
    gc.collect()
    base = _peak_rss_begin()
    out = call()
    if base is None:
        return None, "unavailable (/proc/self/clear_refs not writable)", out
    return max(0, _status_kb("VmHWM") * 1024 - base), "peak RSS growth (VmHWM after - VmRSS before)", out


def _tracemalloc_memory(call):
    import tracemalloc

    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        out = call()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return peak, "tracemalloc peak", out


# -- the four frameworks' glue -----------------------------------------------------

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


def glue_numpy(device: str, quick: bool) -> Glue:
    from impl_numpy.backward import multi_head_attention_vjp
    from impl_numpy.functional import multi_head_attention

    if device != "cpu":
        raise RuntimeError("numpy runs on the CPU only")

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
        return _tracemalloc_memory(call)

    return Glue(info, matmul, paths, np.asarray, memory)


def glue_torch(device: str, quick: bool) -> Glue:
    import torch
    import torch.nn.functional as F

    from impl_torch.functional import multi_head_attention

    if device == "gpu" and not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA GPU (torch.cuda.is_available() is False)")
    dev = torch.device("cuda" if device == "gpu" else "cpu")
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
        torch._dynamo.reset()  # a fresh compile per shape (the cache limit counts recompiles)
        c, N = shape.causal, shape.N
        t = {k: torch.from_numpy(v).to(dev) for k, v in tensors_np.items()}
        x = torch.from_numpy(x_np).to(dev)
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

        mha = torch.nn.MultiheadAttention(D, N, batch_first=True, device=dev).eval()
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
        a = torch.randn(n, n, device=dev)
        c = torch.empty_like(a)
        return done(lambda: torch.mm(a, a, out=c))

    def memory(call):
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = call()
            return torch.cuda.max_memory_allocated() - base, "torch.cuda.max_memory_allocated growth", out
        return _rss_memory(call)

    info = {"version": torch.__version__, "threads": torch.get_num_threads(), "device": str(dev),
            "compiler": compiler, "tf32": False,
            "blas": torch.__config__.show().split("BLAS_INFO=")[-1].split(",")[0] if "BLAS_INFO=" in torch.__config__.show() else "?"}
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["sdp_enabled"] = {k: getattr(torch.backends.cuda, f"{k}_sdp_enabled")()
                               for k in ("flash", "mem_efficient", "math", "cudnn")
                               if hasattr(torch.backends.cuda, f"{k}_sdp_enabled")}
    return Glue(info, matmul, paths, lambda y: y.detach().cpu().numpy(), memory)


def glue_tf(device: str, quick: bool) -> Glue:
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from impl_tf._keras import keras, tf
    from impl_tf.functional import multi_head_attention

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
                y = y.numpy()  # waits for the device
            return y
        return call

    def paths(shape, config, tensors_np, x_np):
        c = shape.causal
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
            return _rss_memory(call)
        out = call()
        peak = tf.config.experimental.get_memory_info(name)["peak"] - base
        return peak, f"tf.config.experimental.get_memory_info({name!r}) peak growth", out

    from impl_tf import chunked, functional

    info = {"version": tf.__version__, "keras": keras.__version__, "device": dev, "tf32": False,
            "keras_mha_kernel": "keras einsum path (Keras flash attention is not used on the TensorFlow backend)",
            "ours_kernels": f"fused attention core compiled by XLA from {functional.XLA_MIN_SCORES} score elements, "
                            f"chunked key-block step from {chunked.XLA_MIN_BLOCK} (eager paths too)"}
    return Glue(info, matmul, paths, lambda y: np.asarray(y), memory)


def glue_jax(device: str, quick: bool) -> Glue:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from impl_jax.functional import apply  # not impl_jax.adapter: it turns x64 on process-wide

    jax.config.update("jax_default_matmul_precision", "highest")  # no TF32 on GPUs (CPUs compute float32 anyway)
    platform_ = "gpu" if device == "gpu" else "cpu"
    try:
        dev = jax.devices(platform_)[0]
    except RuntimeError as err:
        raise RuntimeError(f"JAX has no {device} device ({err})") from None
    dpa_impl = "cudnn" if platform_ == "gpu" else "xla"

    def done(f):
        def call():
            return jax.block_until_ready(f())
        return call

    def paths(shape, config, tensors_np, x_np):
        c = shape.causal
        p = jax.device_put(tensors_np, dev)
        x = jax.device_put(x_np, dev)
        D, N = shape.D, shape.N

        def ours(pp, inp):
            return apply(config, pp, inp, is_causal=c)

        def dpa(pp, inp, implementation=None):
            q, k, v = (jnp.einsum("BTD,DNH->BTNH", inp, pp[f"{n}.kernel"]) + pp[f"{n}.bias"] for n in ("query", "key", "value"))
            o = jax.nn.dot_product_attention(q, k, v, is_causal=c, implementation=implementation)  # (B, T, N, H)
            return jnp.einsum("BTNH,NHO->BTO", o, pp["output.kernel"]) + pp["output.bias"]

        m = nnx.MultiHeadAttention(num_heads=N, in_features=D, qkv_features=D, out_features=D, decode=False,
                                   deterministic=True, rngs=nnx.Rngs(0))
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
            g = jax.device_put(np.random.default_rng(1).standard_normal(x_np.shape).astype(np.float32), dev)

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
        a = jax.device_put(np.random.default_rng(0).standard_normal((n, n)).astype(np.float32), dev)
        mm = jax.jit(jnp.matmul)
        return done(lambda: mm(a, a))

    def memory(call):
        if platform_ == "gpu":
            stats = dev.memory_stats() or {}
            base = stats.get("bytes_in_use", 0)
            out = call()
            peak = (dev.memory_stats() or {}).get("peak_bytes_in_use")
            return (None if peak is None else peak - base), "XLA peak_bytes_in_use growth (not reset per call)", out
        return _rss_memory(call)

    import flax

    info = {"version": jax.__version__, "flax": flax.__version__, "device": str(dev), "matmul_precision": "highest",
            "dpa_implementation": dpa_impl}
    return Glue(info, matmul, paths, lambda y: np.asarray(y[0] if isinstance(y, tuple) else y), memory)


GLUE = {"numpy": glue_numpy, "torch": glue_torch, "tf": glue_tf, "jax": glue_jax}


# -- measuring ---------------------------------------------------------------------

def time_call(call) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


MATMUL = "matmul"  # measure_paired's name for the large-matmul reference


def measure_paired(calls: dict, reference, *, repeats: int, max_seconds: float) -> dict:
    """Time every call of `calls` (name -> callable), one after another, each
    of its timed runs a moment after one run of the reference (the large
    matmul), so that a change in the machine's speed (this is a shared VM:
    CPU steal comes and goes) reaches a path and its matmul alike. Each call
    first runs once apart (timed: compile_s) plus one warm-up when that took
    under 2 s, then up to `repeats` timed runs, MIN_REPEATS once its timed
    runs passed max_seconds. A call that took under 2 s runs once more,
    untimed, between the matmul and each timed run.

    Why: a call's speed depends on what ran just before it in the process,
    beyond the machine. NumPy's plain forward at bert-base took 57 ms run
    after run, 72 ms right after the matmul, and 82 ms right after the
    hand-written backward (measured 2026-11-23). So each timed run follows a
    run of its own path, and the paths are not interleaved with each other.

    Returns name -> summarize()'s dict plus first_call_s and matmul_ratio
    (the median over pairs of the call's time / the matmul's time just
    before it: a drift that begins mid-path moves it by at most one pair,
    where it could move a ratio of two medians by the whole drift), or the
    exception the call raised; under MATMUL, every matmul run's summary
    (at least MIN_REPEATS)."""
    results: dict = {}
    first_ref = time_call(reference)
    time_call(reference)
    reference_times: list[float] = []
    for name, call in calls.items():
        try:
            first = time_call(call)
            if first < 2.0:
                time_call(call)
            times, ratios, spent = [], [], 0.0
            while len(times) < repeats and not (len(times) >= min(MIN_REPEATS, repeats) and spent > max_seconds):
                ref = time_call(reference)
                if first < 2.0:
                    call()  # untimed: the timed run follows a run of its own path, not the matmul
                t = time_call(call)
                reference_times.append(ref)
                times.append(t)
                ratios.append(t / ref)
                spent += t
        except Exception as err:  # noqa: BLE001 - reported in that path's row
            results[name] = err
            continue
        results[name] = summarize(times) | {"first_call_s": first, "matmul_ratio": statistics.median(ratios)}
    while len(reference_times) < MIN_REPEATS:
        reference_times.append(time_call(reference))
    results[MATMUL] = summarize(reference_times) | {"first_call_s": first_ref}
    return results


def paired_ratios(calls: dict, reference, *, repeats: int) -> tuple[dict, float]:
    """measure_paired for the timing scripts (docs/bench): each call's
    matmul_ratio (its time in matmul-times) and the reference's median time
    in seconds; a call that failed raises its exception here."""
    measured = measure_paired(calls, reference, repeats=repeats, max_seconds=float("inf"))
    for name in calls:
        if isinstance(measured[name], Exception):
            raise measured[name]
    return {name: measured[name]["matmul_ratio"] for name in calls}, measured[MATMUL]["median_s"]


def summarize(times: list[float]) -> dict:
    s = sorted(times)
    q = statistics.quantiles(s, n=4, method="inclusive") if len(s) > 1 else [s[0]] * 3
    return {"times_s": times, "repeats": len(times), "median_s": statistics.median(s), "min_s": s[0], "max_s": s[-1],
            "q1_s": q[0], "q3_s": q[2]}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_worker(spec: dict) -> dict:
    """One backend: every requested shape, every path. Runs in its own process."""
    import weights

    backend = spec["backend"]
    started = time.perf_counter()
    try:
        glue = GLUE[backend](spec["device"], spec["quick"])
    except Exception as err:  # noqa: BLE001 - any failure to import or set up means 'unavailable'
        return {"backend": backend, "status": f"unavailable: {type(err).__name__}: {err}".splitlines()[0]}
    results, matmuls, sweep_stops = [], [], {}
    stopped: dict[str, str] = {}
    for sd in spec["shapes"]:
        shape = Shape(**sd)
        config = weights.AttentionConfig(num_heads=shape.N, query_dim=shape.D, head_dim=shape.H)
        tensors = weights.init(config, seed=0, dtype="float32")
        x = np.random.default_rng(0).standard_normal((shape.B, shape.T, shape.D)).astype(np.float32)
        reference = None
        try:
            paths = glue.paths(shape, config, tensors, x)
        except Exception as err:  # noqa: BLE001
            results.append(_row(backend, shape, None, f"failed: setting up paths: {type(err).__name__}: {err}", None))
            _log(f"  {backend} {shape.name}: could not set up paths: {err}")
            continue
        rows, timed = [], {}
        for path in paths:
            key = f"{path.name}/{path.pass_}"
            row = _row(backend, shape, path, "ok", None)
            estimate = path.ts_arrays * shape.ts_bytes
            if shape.sweep and key in stopped:
                row["status"] = f"skipped: {stopped[key]}"
            elif estimate > spec["mem_limit"]:
                row["status"] = (f"skipped: would hold ~{estimate / 2**30:.1f} GiB of (B, N, T, S) arrays "
                                 f"(no chunked path), over --mem-limit {spec['mem_limit'] / 2**30:.1f} GiB")
            else:
                timed[key] = path.call
            rows.append((key, path, row))
        measured = measure_paired(timed, glue.matmul(spec["matmul_n"]), repeats=spec["repeats"],
                                  max_seconds=spec["max_seconds"])
        mm = measured.pop(MATMUL)
        rate = 2 * spec["matmul_n"] ** 3 / mm["median_s"]
        matmuls.append({"backend": backend, "shape": shape.name, "n": spec["matmul_n"], **mm, "flops_per_s": rate})
        for key, path, row in rows:
            row["matmul_flops_per_s"], row["matmul_flops"] = rate, 2 * spec["matmul_n"] ** 3
            if key in measured:
                try:
                    if isinstance(measured[key], Exception):
                        raise measured[key]
                    row.update(measured[key])
                    row["compile_s"] = max(0.0, row["first_call_s"] - row["median_s"])
                    if not shape.sweep:
                        peak, method, y = glue.memory(path.call)
                        row.update(peak_bytes=peak, memory_method=method)
                        if peak is not None:
                            row["peak_over_io"] = peak / shape.io_bytes
                        if path.compare:
                            if reference is None:
                                reference = _numpy_reference(config, tensors, x, shape)
                            diff = np.abs(glue.to_numpy(y).astype(np.float64) - reference)
                            row["max_abs_diff_vs_numpy"] = float(diff.max())
                            row["reference_max_abs"] = float(np.abs(reference).max())
                except Exception as err:  # noqa: BLE001
                    row["status"] = f"failed: {type(err).__name__}: {err}".splitlines()[0][:300]
                    if os.environ.get("MHA_DEBUG"):
                        traceback.print_exception(err)
            if shape.sweep and row["status"] == "ok" and row["median_s"] > spec["budget"]:
                stopped[key] = f"stopped after T={shape.T}: {row['median_s']:.1f} s > budget {spec['budget']:g} s"
                sweep_stops[key] = stopped[key]
            _finish(row)
            results.append(row)
            _log(f"  {backend:5} {shape.name:12} {path.name:24} {path.pass_:16} " + (
                f"{row['median_s'] * 1e3:10.2f} ms  {row['pct_matmul']:6.1f}% of matmul"
                if row["status"] == "ok" else row["status"]))
        del paths, timed, rows
        gc.collect()
    return {"backend": backend, "status": "ok", "info": glue.info, "results": results, "matmul": matmuls,
            "sweep_stops": sweep_stops, "worker_s": time.perf_counter() - started}


def _numpy_reference(config, tensors, x, shape):
    from impl_numpy.functional import multi_head_attention

    chunk = min(CHUNK_SIZE, shape.T) if shape.long else None
    return np.asarray(multi_head_attention(config, tensors, x, is_causal=shape.causal, chunk_size=chunk), np.float64)


def _row(backend, shape, path, status, rate) -> dict:
    return {
        "backend": backend, "shape": shape.name, "B": shape.B, "T": shape.T, "S": shape.S, "D": shape.D, "N": shape.N,
        "H": shape.H, "causal": shape.causal, "sweep": shape.sweep,
        "path": None if path is None else path.name, "kind": None if path is None else path.kind,
        "mode": None if path is None else path.mode, "pass": None if path is None else path.pass_,
        "note": "" if path is None else path.note, "status": status,
        "flops": shape.flops * (3 if path is not None and path.pass_ == "forward+backward" else 1),
        "io_bytes": shape.io_bytes, "matmul_flops_per_s": rate, "matmul_flops": None, "matmul_ratio": None,
        "median_s": None, "min_s": None, "max_s": None, "q1_s": None, "q3_s": None, "times_s": [], "repeats": 0,
        "first_call_s": None, "compile_s": None, "peak_bytes": None, "memory_method": None, "peak_over_io": None,
        "max_abs_diff_vs_numpy": None, "reference_max_abs": None,
        "pct_matmul": None, "native_path": None, "ratio_to_native": None,
    }


def _finish(row: dict) -> None:
    if row["status"] == "ok":
        # measure_paired's ratio: the path's time over the matmul run just before it, median over pairs
        row["pct_matmul"] = 100.0 * row["flops"] / row["matmul_flops"] / row["matmul_ratio"]


def add_native_ratios(results: list[dict]) -> None:
    """ratio_to_native: time / the fastest native path of the same backend, shape,
    pass and mode (eager against eager, compiled against compiled); where the
    backend has no native path in that mode (NumPy), against any mode. Both
    times are taken as measure_paired's matmul_ratio (each path's time over its
    own adjacent matmul runs): the two paths ran a minute or so apart, and a
    change of machine speed between them cancels out of this ratio, where it
    would stay in a ratio of their medians."""
    ok = [r for r in results if r["status"] == "ok" and r["kind"] == "native" and r.get("matmul_ratio")]
    for r in results:
        if r["status"] != "ok" or not r.get("matmul_ratio"):
            continue
        same = [n for n in ok if (n["backend"], n["shape"], n["pass"]) == (r["backend"], r["shape"], r["pass"])]
        pool = [n for n in same if n["mode"] == r["mode"]] or same
        if pool:
            best = min(pool, key=lambda n: n["matmul_ratio"])
            r["native_path"] = f"{best['path']}"
            r["ratio_to_native"] = r["matmul_ratio"] / best["matmul_ratio"]


# -- targets -----------------------------------------------------------------------

def _best(results, backend, shape, *, kind="ours", mode=None, pass_="forward", key="median_s"):
    rows = [r for r in results if r["status"] == "ok" and r["backend"] == backend and r["shape"] == shape
            and r["kind"] == kind and r["pass"] == pass_ and (mode is None or r["mode"] == mode)
            and r.get(key) is not None]
    return min(rows, key=lambda r: r[key]) if rows else None


def _entry(target, backend, shape, measured, threshold, op, *, unit, path=None, why=None) -> dict:
    if measured is None:
        return {"target": target, "backend": backend, "shape": shape, "measured": None, "threshold": threshold,
                "unit": unit, "path": path, "pass": None, "status": f"not measured{': ' + why if why else ''}"}
    passed = {">=": measured >= threshold, "<=": measured <= threshold, ">": measured > threshold,
              "<": measured < threshold}[op]
    return {"target": target, "backend": backend, "shape": shape, "measured": measured, "threshold": threshold,
            "unit": unit, "path": path, "pass": bool(passed), "status": "pass" if passed else "miss"}


def targets(results) -> list[dict]:
    """The issue's targets evaluated on a result set (a bench JSON dict, or its
    "results" list). One entry per target and backend/shape; `pass` is None
    where the measurement is missing."""
    rows = results["results"] if isinstance(results, dict) else results
    out = []
    for backend in FRAMEWORKS:
        for shape in ("bert-base", "vit-b16"):
            best = max((r for r in rows if r["status"] == "ok" and r["backend"] == backend and r["shape"] == shape
                        and r["kind"] == "ours" and r["pass"] == "forward"), key=lambda r: r["pct_matmul"], default=None)
            out.append(_entry(f"{backend} forward at {shape} >= 85% of matmul rate", backend, shape,
                              None if best is None else best["pct_matmul"], 85.0, ">=", unit="%",
                              path=None if best is None else best["path"]))
            for mode in ("eager", "compiled"):  # by paired time (add_native_ratios says why)
                ours = _best(rows, backend, shape, mode=mode, key="matmul_ratio")
                native = _best(rows, backend, shape, kind="native", mode=mode, key="matmul_ratio")
                ratio = None if ours is None or native is None else ours["matmul_ratio"] / native["matmul_ratio"]
                out.append(_entry(f"{backend} {mode} forward at {shape} <= 1.10x native fastest {mode}", backend, shape,
                                  ratio, 1.10, "<=", unit="x",
                                  path=None if ratio is None else f"{ours['path']} vs {native['path']}"))
    for shape in ("gpt2", "long"):
        for backend in BACKENDS:
            best = max((r for r in rows if r["status"] == "ok" and r["backend"] == backend and r["shape"] == shape
                        and r["kind"] == "ours" and r["pass"] == "forward"), key=lambda r: r["pct_matmul"], default=None)
            out.append(_entry(f"{backend} causal {shape} forward > 100% of matmul rate (full T*S FLOPs)", backend, shape,
                              None if best is None else best["pct_matmul"], 100.0, ">", unit="%",
                              path=None if best is None else best["path"]))
        numpy_ok = out[-4]["pass"]
        fw = [e for e in out[-3:] if e["measured"] is not None]
        top = max(fw, key=lambda e: e["measured"], default=None)
        both = None if numpy_ok is None or top is None else bool(numpy_ok and top["pass"])
        out.append({"target": f"causal {shape}: > 100% in numpy and at least one framework", "backend": "numpy+any",
                    "shape": shape, "measured": None if top is None else min(out[-4]["measured"] or 0, top["measured"]),
                    "threshold": 100.0, "unit": "%", "path": None if top is None else f"numpy, {top['backend']}",
                    "pass": both, "status": "not measured" if both is None else ("pass" if both else "miss")})
    best = max((r for r in rows if r["status"] == "ok" and r["backend"] == "numpy" and r["shape"] == "bert-base"
                and r["kind"] == "ours" and r["pass"] == "forward"), key=lambda r: r["pct_matmul"], default=None)
    out.append(_entry("numpy float32 forward at bert-base >= 75% of matmul rate", "numpy", "bert-base",
                      None if best is None else best["pct_matmul"], 75.0, ">=", unit="%",
                      path=None if best is None else best["path"]))
    for backend in BACKENDS:
        best = _best(rows, backend, "long", key="peak_over_io")
        out.append(_entry(f"{backend} long forward peak memory < 4x inputs+outputs", backend, "long",
                          None if best is None else best["peak_over_io"], 4.0, "<", unit="x",
                          path=None if best is None else best["path"]))
    return out


# -- output: table, JSON, plots ---------------------------------------------------

def _fmt_ms(s):
    return "-" if s is None else (f"{s * 1e3:.3g}" if s < 1 else f"{s * 1e3:,.0f}")


def _fmt_bytes(b):
    if b is None:
        return "-"
    return f"{b / 2**20:.0f} MiB" if b >= 2**20 else f"{b / 2**10:.0f} KiB"


def print_report(console, data: dict) -> None:
    from rich.table import Table

    rows = data["results"]
    title = "mha bench" + (" --quick (shapes shrunk: not the issue's figures)" if data["settings"]["quick"] else "")
    table = Table(title=title, show_lines=False)
    for col in ("shape", "backend", "path", "pass", "median ms", "spread ms (min-max)", "% matmul", "x native",
                "first call s", "peak mem", "note"):
        table.add_column(col, no_wrap=col not in ("note",), justify="right" if col in (
            "median ms", "% matmul", "x native", "first call s", "peak mem") else "left")
    last = None
    for r in (r for r in rows if not r["sweep"]):
        if last is not None and (r["shape"], r["backend"]) != last:
            table.add_section()
        last = (r["shape"], r["backend"])
        if r["status"] != "ok":
            table.add_row(r["shape"], r["backend"], r["path"] or "-", r["pass"] or "-", "-", "", "", "", "", "",
                          f"[yellow]{r['status']}[/]")
            continue
        pct = f"{r['pct_matmul']:.0f}%"
        ratio = "-" if r["ratio_to_native"] is None else f"{r['ratio_to_native']:.2f}"
        style = "bold" if r["kind"] == "ours" else "dim"
        table.add_row(r["shape"], r["backend"], f"[{style}]{r['path']}[/]", r["pass"], _fmt_ms(r["median_s"]),
                      f"{_fmt_ms(r['min_s'])}-{_fmt_ms(r['max_s'])}", pct, ratio, f"{r['first_call_s']:.2f}",
                      _fmt_bytes(r["peak_bytes"]), r["note"])
    console.print(table)
    for name, b in data["backends"].items():
        if b["status"] != "ok":
            console.print(f"[yellow]{name}: {b['status']}[/]")
    rates = {}
    for m in data["matmul"]:
        rates.setdefault(m["backend"], []).append(m["flops_per_s"] / 1e9)
    if rates:
        console.print("large-matmul rate (float32 2048^3, GFLOP/s, per shape): " + "; ".join(
            f"{b} {min(v):.0f}-{max(v):.0f}" for b, v in rates.items()))
    sweep = [r for r in rows if r["sweep"] and r["path"] is not None]
    if sweep:
        st = Table(title=f"sweep: forward median ms (B {sweep[0]['B']}, D {sweep[0]['D']}, N {sweep[0]['N']}, not causal)")
        st.add_column("T", justify="right")
        cols = sorted({(r["backend"], r["path"]) for r in sweep}, key=lambda k: (BACKENDS.index(k[0]), k[1]))
        for b, p in cols:
            st.add_column(f"{b} {p}", justify="right")
        for T in sorted({r["T"] for r in sweep}):
            cells = []
            for b, p in cols:
                r = next((r for r in sweep if (r["backend"], r["path"], r["T"]) == (b, p, T)), None)
                cells.append("" if r is None else (_fmt_ms(r["median_s"]) if r["status"] == "ok"
                                                   else r["status"].split(":")[0]))
            st.add_row(str(T), *cells)
        console.print(st)
        for key, why in data.get("sweep_stops", {}).items():
            console.print(f"sweep {key}: {why}")
    tt = Table(title="targets (issue 7)")
    for col in ("target", "measured", "threshold", "path", "result"):
        tt.add_column(col)
    for e in data["targets"]:
        m = "-" if e["measured"] is None else (f"{e['measured']:.1f}%" if e["unit"] == "%" else f"{e['measured']:.2f}x")
        res = {"pass": "[green]pass[/]", "miss": "[red]miss[/]"}.get(e["status"], f"[yellow]{e['status']}[/]")
        thr = f"{e['threshold']:g}{'%' if e['unit'] == '%' else 'x'}"
        tt.add_row(e["target"], m, thr, e["path"] or "-", res)
    console.print(tt)


def write_plots(data: dict, directory: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    colors = {"numpy": "tab:blue", "torch": "tab:red", "tf": "tab:orange", "jax": "tab:green"}
    rows = [r for r in data["results"] if r["status"] == "ok"]
    sweep = [r for r in rows if r["sweep"]]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for backend in BACKENDS:
        for kind, style in (("ours", "-"), ("native", "--")):
            pts = {}
            for r in (r for r in sweep if r["backend"] == backend and r["kind"] == kind):
                if r["T"] not in pts or r["median_s"] < pts[r["T"]]["median_s"]:
                    pts[r["T"]] = r
            if pts:
                Ts = sorted(pts)
                label = f"{backend} {'ours' if kind == 'ours' else 'native'} ({', '.join(sorted({pts[T]['path'] for T in Ts}))})"
                ax.errorbar(Ts, [pts[T]["median_s"] for T in Ts],
                            yerr=[[pts[T]["median_s"] - pts[T]["min_s"] for T in Ts],
                                  [pts[T]["max_s"] - pts[T]["median_s"] for T in Ts]],
                            fmt=style + "o", color=colors[backend], label=label, markersize=4, capsize=2)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T = S")
    ax.set_ylabel("forward time, median (s)")
    dims = f"B {sweep[0]['B']}, D {sweep[0]['D']}, N {sweep[0]['N']}" if sweep else ""
    ax.set_title(f"mha bench sweep: {dims}, float32, not causal" + (" (--quick)" if data["settings"]["quick"] else ""))
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no sweep points measured", transform=ax.transAxes, ha="center")
    fig.tight_layout()
    path = directory / "sweep.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    for shape in dict.fromkeys(r["shape"] for r in rows if not r["sweep"]):
        bars = [r for r in rows if r["shape"] == shape and r["ratio_to_native"] is not None]
        if not bars:
            continue
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 0.32 * len(bars) + 1.8), sharey=True)
        labels = [f"{r['backend']} {r['path']} [{r['pass'].replace('forward+backward', 'fwd+bwd')}]" for r in bars]
        ys = range(len(bars))
        cs = [colors[r["backend"]] for r in bars]
        alphas = [1.0 if r["kind"] == "ours" else 0.45 for r in bars]
        for y, r, c, a in zip(ys, bars, cs, alphas):
            ax1.barh(y, r["ratio_to_native"], color=c, alpha=a)
            ax2.barh(y, r["pct_matmul"], color=c, alpha=a)
        ax1.set_yticks(list(ys), labels, fontsize=7)
        ax1.invert_yaxis()
        ax1.axvline(1.0, color="k", lw=0.8)
        ax1.axvline(1.10, color="k", lw=0.8, ls=":")
        ax1.set_xscale("log", base=2)
        ax1.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=2, subs=(1.0, 1.5)))  # ... 0.75, 1, 1.5, 2 ...
        ax1.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%gx"))
        ax1.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # log minor labels collide
        ax1.set_xlabel("time / native fastest (same framework, pass, mode); < 1 is faster")
        ax2.axvline(100, color="k", lw=0.8)
        ax2.axvline(85, color="k", lw=0.8, ls=":")
        ax2.set_xlabel("% of the framework's large-matmul FLOP rate")
        fig.suptitle(f"{shape}: ours (solid) and native (pale)" + (" --quick" if data["settings"]["quick"] else ""))
        fig.tight_layout()
        path = directory / f"ratio-{shape}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


# -- the command -------------------------------------------------------------------

def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="time every backend against its framework's native paths and matmul rate")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    p.add_argument("--shapes", nargs="+", default=[*SHAPES, "sweep"], choices=[*SHAPES, "sweep"])
    p.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--dtype", default="float32", choices=["float32"], help="only float32 is benchmarked")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per measurement (default 7; --quick 2)")
    p.add_argument("--max-seconds", type=float, default=10.0,
                   help="stop repeating a measurement after this much timing, once 3 calls are done (default 10)")
    p.add_argument("--budget", type=float, default=5.0,
                   help="sweep: stop a path after a point whose median exceeds this many seconds (default 5)")
    p.add_argument("--sweep-max", type=int, default=SWEEP_LENGTHS[-1], help="largest sweep length (default 16384)")
    p.add_argument("--mem-limit", type=float, default=None,
                   help="GiB a path's (B, N, T, S) arrays may take (default: 40%% of MemAvailable)")
    p.add_argument("--json", metavar="FILE", help="write every raw number as JSON")
    p.add_argument("--plot", metavar="DIR", help="write sweep.png and ratio-<shape>.png here")
    p.add_argument("--quick", action="store_true", help="tiny shapes, 2 repeats: checks that everything runs")
    p.set_defaults(func=run)


def _mem_available() -> int:
    try:
        return _status_like("/proc/meminfo", "MemAvailable") * 1024
    except OSError:
        return 8 * 2**30


def _status_like(path, field):
    with open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{path} has no {field}")


def _machine() -> dict:
    cpu = platform.processor()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(), "python": sys.version.split()[0],
            "loadavg_start": os.getloadavg(),
            "env": {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OMP_NUM_THREADS",
                                                    "KERAS_BACKEND")}}


def run_backend(backend: str, spec: dict) -> dict:
    """Run one backend's worker in a child process; its stderr (progress) passes through."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.setdefault("KERAS_BACKEND", "tensorflow")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with tempfile.TemporaryDirectory(prefix="mha-bench-") as tmp:
        spec_file, out_file = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec_file.write_text(json.dumps({**spec, "backend": backend}))
        proc = subprocess.run([sys.executable, "-m", "bench.core", "--worker", str(spec_file), str(out_file)],
                              env=env, stdout=subprocess.PIPE, stderr=None, text=True)
        if proc.returncode != 0 or not out_file.exists():
            why = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
            tail = (proc.stdout or "").strip().splitlines()[-1:] or [""]
            return {"backend": backend, "status": f"unavailable: worker died ({why}) {tail[0]}".strip()}
        return json.loads(out_file.read_text())


def run(args) -> int:
    from rich.console import Console

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    quick = args.quick
    repeats = args.repeats if args.repeats is not None else (2 if quick else 7)
    if repeats < 1:
        raise ValueError(f"--repeats must be at least 1: got {repeats}")
    shape_table = QUICK_SHAPES if quick else SHAPES
    shapes = [shape_table[s] for s in args.shapes if s != "sweep"]
    if "sweep" in args.shapes:
        lengths = QUICK_SWEEP_LENGTHS if quick else tuple(T for T in SWEEP_LENGTHS if T <= args.sweep_max)
        shapes += sweep_shapes(lengths)
    mem_limit = int(args.mem_limit * 2**30) if args.mem_limit is not None else int(0.4 * _mem_available())
    spec = {"shapes": [dataclasses.asdict(s) for s in shapes], "device": args.device, "dtype": args.dtype,
            "repeats": repeats, "max_seconds": args.max_seconds, "budget": args.budget, "mem_limit": mem_limit,
            "quick": quick, "matmul_n": 256 if quick else MATMUL_N}
    started = time.perf_counter()
    data = {"schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": ["mha", *sys.argv[1:]],
            "machine": _machine(),
            "settings": {k: v for k, v in spec.items() if k != "shapes"} | {
                "shapes": {s.name: s.to_dict() for s in shapes}, "min_repeats": MIN_REPEATS, "long_T": LONG_T,
                "chunk_size": CHUNK_SIZE,
                "flops": "forward 4*B*T*D^2 + 4*B*S*D^2 + 4*B*N*T*S*H (full T*S when causal); forward+backward 3x",
                "matmul": "median time of one float32 matmul_n^3 matmul in the framework, one run before each timed path call",
                "memory": "numpy: tracemalloc peak; tf: get_memory_info peak growth; torch, jax: peak RSS growth via "
                          "/proc/self/clear_refs + VmHWM (GPU: the framework's peak-allocation counter); "
                          "one extra call after timing",
                "ratio_to_native": "time / fastest native path, same backend, shape, pass and mode"},
            "backends": {}, "results": [], "matmul": [], "sweep_stops": {}}
    for backend in args.backends:
        console.print(f"[bold]{backend}[/]: running ({len(shapes)} shapes) ...")
        out = run_backend(backend, spec)
        data["backends"][backend] = {"status": out["status"], "info": out.get("info", {}),
                                     "worker_s": out.get("worker_s")}
        data["results"] += out.get("results", [])
        data["matmul"] += out.get("matmul", [])
        data["sweep_stops"].update({f"{backend} {k}": v for k, v in out.get("sweep_stops", {}).items()})
        if out["status"] != "ok":
            console.print(f"[yellow]{backend}: {out['status']}[/]")
    add_native_ratios(data["results"])
    data["targets"] = targets(data)
    data["machine"]["loadavg_end"] = os.getloadavg()
    data["total_s"] = time.perf_counter() - started
    if args.json:  # first: a problem in printing must not lose the numbers
        from weights.atomic import write_bytes_atomic

        write_bytes_atomic(args.json, (json.dumps(data, indent=1) + "\n").encode(), overwrite=True)
    print_report(console, data)
    if args.json:
        console.print(f"wrote {args.json}")
    if args.plot:
        for path in write_plots(data, Path(args.plot)):
            console.print(f"wrote {path}")
    return 0


def _worker_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.core")
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), required=True)
    args = parser.parse_args(argv)
    spec = json.loads(Path(args.worker[0]).read_text())
    result = run_worker(spec)
    Path(args.worker[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(_worker_main(sys.argv[1:]))
