"""The shapes `mha bench` times and the chunk sizes it gives each framework's chunked path."""

from __future__ import annotations

import dataclasses

BACKENDS = ("numpy", "torch", "tf", "jax")  # the default run, and the backends the targets are set for
# Timed when named (`--backends mlx`), with no target set yet: impl_mlx, on MLX's Linux CPU wheel here.
OPTIONAL_BACKENDS = ("mlx",)
ALL_BACKENDS = BACKENDS + OPTIONAL_BACKENDS
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
    K: int | None = None  # key/value heads (GQA); None: N
    P: int = 0  # cached keys before the call (decode): past_key/past_value (B, K, P, H)
    window_left: int = -1  # the config's window_left (-1: none)
    family: str = ""  # "window" | "decode" for the points of those families, "" otherwise

    @property
    def H(self) -> int:
        return self.D // self.N

    @property
    def kv_heads(self) -> int:
        return self.N if self.K is None else self.K

    @property
    def pairs(self) -> int:
        """(query, key) pairs the attention computes: the full T x (P + S),
        even when causal, except under a window, where only the pairs it
        leaves count (query i sees min(i + 1, window_left + 1) keys, causal,
        top-left aligned as the window family runs)."""
        if self.window_left < 0:
            return self.T * (self.P + self.S)
        w = self.window_left + 1
        return sum(min(i + 1, w) for i in range(min(self.T, w))) + max(0, self.T - w) * w

    @property
    def flops(self) -> int:
        """Forward FLOPs: q and output projections over T, k and v over S (K
        heads each), and QK^T plus WV over `pairs` (the full T x S even when
        causal). K = N, N*H = D: 4*B*T*D^2 + 4*B*S*D^2 + 4*B*N*T*S*H."""
        B, T, S, D, N, H, K = self.B, self.T, self.S, self.D, self.N, self.H, self.kv_heads
        return 4 * B * T * D * N * H + 4 * B * S * D * K * H + 4 * B * N * self.pairs * H

    @property
    def cache_bytes(self) -> int:
        """float32 bytes of the cache the call reads (past_key and past_value)."""
        return 2 * self.B * self.kv_heads * self.P * self.H * 4

    @property
    def weight_bytes(self) -> int:
        """float32 bytes of the canonical weights the call reads (four kernels and their biases)."""
        D, N, K, H = self.D, self.N, self.kv_heads, self.H
        return 4 * (2 * D * N * H + 2 * D * K * H + N * H + 2 * K * H + D)

    @property
    def decode_floor(self) -> float:
        """The least a decode step can take over one read of its cache: every weight and cached byte read
        once (the step's own memory traffic), in units of the cache read."""
        return (self.weight_bytes + self.cache_bytes) / self.cache_bytes

    @property
    def io_bytes(self) -> int:
        """float32 bytes of the inputs and the output: self-attention passes one
        (B, T, D) query as key and value, and gets one (B, T, D) back; a decode
        step also reads the cache and returns it with its new keys (present_key,
        present_value)."""
        grown = 2 * self.B * self.kv_heads * (self.P + self.S) * self.H * 4 if self.family == "decode" else 0
        return 2 * self.B * self.T * self.D * 4 + self.cache_bytes + grown

    @property
    def ts_bytes(self) -> int:
        """One float32 (B, N, T, P + S) array."""
        return self.B * self.N * self.T * (self.P + self.S) * 4

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


# Families of shapes picked by name in --shapes, each a list of points (window and decode; sequence-sharded,
# one point measured by conformance/bench/sharded.py in processes of its own; latent, a latent layer's decode
# step in its two forms, measured by conformance/bench/latent.py; sparse, a DSA decode step's parts against
# their bounds, conformance/bench/sparse.py; v4, a DeepSeek V4 decode step against a dense MQA step,
# conformance/bench/v4.py), each with targets of its own (sparse, v4: ratios, no target).
FAMILIES = ("sweep", "window", "decode", "sequence-sharded", "latent", "sparse", "v4")

# latent: one new token after a cache of P tokens (conformance/bench/latent.py says the layer).
LATENT_LENGTHS = (4096, 8192, 16384, 32768, 65536)
QUICK_LATENT_LENGTHS = (16, 32, 64)

# window: causal, window_left 4095 (each query sees at most 4096 keys), T = S growing; B 1, D 512, N 8.
WINDOW_LEFT = 4095
WINDOW_LENGTHS = (8192, 16384, 32768, 65536)
QUICK_WINDOW_LEFT = 15
QUICK_WINDOW_LENGTHS = (32, 128)  # the second longer than 2 windows: the reference checks its last rows alone
QUICK_CHUNK = 16  # --quick: every chunked path's chunk_size on the window family, so hidden key blocks are skipped

# decode: one new token (T = S = 1) after a cache of P keys; GQA N 32, K 8, H 128 (D 4096), B 1.
DECODE_LENGTHS = (8192, 16384, 32768, 65536)
QUICK_DECODE_LENGTHS = (16, 32, 64)


def window_shapes(lengths, quick: bool = False) -> list[Shape]:
    left, D, N = (QUICK_WINDOW_LEFT, 32, 2) if quick else (WINDOW_LEFT, 512, 8)
    return [Shape(f"window-{T}", B=1, T=T, S=T, D=D, N=N, causal=True, window_left=left, family="window")
            for T in lengths]


def decode_shapes(lengths, quick: bool = False) -> list[Shape]:
    D, N, K = (32, 4, 2) if quick else (4096, 32, 8)
    return [Shape(f"decode-{P}", B=1, T=1, S=1, D=D, N=N, K=K, P=P, causal=True, family="decode") for P in lengths]
