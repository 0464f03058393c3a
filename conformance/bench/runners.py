"""What a `mha bench` worker needs from each framework, a Runner: the paths to
time (ours and native), its large matmul, its memory counter. One function per
framework (RUNNERS), each in its own module of conformance.bench.frameworks
(numpy, torch, tf, jax, mlx; what they share in frameworks.runner); each imports
its framework when called. The names the worker and the scripts read are
importable from here."""

from __future__ import annotations

from conformance.bench.frameworks.jax import jax_runner
from conformance.bench.frameworks.mlx import mlx_runner
from conformance.bench.frameworks.numpy import numpy_runner
from conformance.bench.frameworks.runner import (  # noqa: F401 - re-exported for the worker, the scripts and tests
    DECODE_OPTIONS,
    Path_,
    Runner,
    Unsupported,
    cache_read_path,
    decode_buffers,
    decode_cache,
    window_chunk,
)
from conformance.bench.frameworks.tf import tf_runner
from conformance.bench.frameworks.torch import torch_runner

RUNNERS = {"numpy": numpy_runner, "torch": torch_runner, "tf": tf_runner, "jax": jax_runner, "mlx": mlx_runner}
