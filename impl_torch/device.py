"""Device choice ("cpu" | "gpu") and float32 matmul precision ("highest" | "tf32")."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

DEVICES = ("cpu", "gpu")
PRECISIONS = ("highest", "tf32")


def devices() -> list[str]:
    """The device choices that work where this runs."""
    return ["cpu", "gpu"] if torch.cuda.is_available() else ["cpu"]


def resolve_device(device: str) -> torch.device:
    """"cpu" -> cpu; "gpu" -> cuda, or a ValueError when torch sees no CUDA GPU."""
    if device == "cpu":
        return torch.device("cpu")
    if device == "gpu":
        if not torch.cuda.is_available():
            raise ValueError("device gpu requested but torch sees no CUDA GPU (torch.cuda.is_available() is False)")
        return torch.device("cuda")
    raise ValueError(f"device must be one of {', '.join(DEVICES)}: got {device!r}")


def torch_device(device) -> torch.device:
    """A torch device from "cpu" | "gpu" (the project's choices) or anything torch.device takes."""
    if device is None:
        return torch.device("cpu")
    if isinstance(device, str) and device in DEVICES:
        return resolve_device(device)
    return torch.device(device)


@contextlib.contextmanager
def matmul_precision(precision: str = "highest") -> Iterator[None]:
    """Set float32 matmul precision for the duration of a call, then restore it.

    "highest": no TF32 anywhere (cuBLAS, cuDNN; `set_float32_matmul_precision
    ("highest")`), the setting every correctness comparison uses. "tf32": TF32
    matmuls and convolutions on GPUs that have them (u = 2**-11; the
    tolerance policy knows it as precision="tf32"). CPUs ignore both.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}: got {precision!r}")
    tf32 = precision == "tf32"
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )
    try:
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        yield
    finally:
        torch.set_float32_matmul_precision(saved[2])
        torch.backends.cuda.matmul.allow_tf32 = saved[0]
        torch.backends.cudnn.allow_tf32 = saved[1]
