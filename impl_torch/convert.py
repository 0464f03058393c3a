"""NumPy <-> torch at the package's edges, bit-exact for all four dtypes.

torch cannot wrap an ml_dtypes bfloat16 array, so bfloat16 crosses as its
raw 16 bits (int16 views on both sides): no rounding, no copy beyond the one
a device transfer needs.
"""

from __future__ import annotations

import numpy as np
import torch

from weights import DTYPES, dtype_from_name

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.float32 -> "float32", the NumPy spelling the contract's messages use."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(dtype, *, argument: str = "dtype") -> torch.dtype:
    """One of the format's four dtypes, given by name, NumPy dtype or torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype_name(dtype) not in TORCH_DTYPES:
            raise ValueError(f"{argument} must be one of {', '.join(DTYPES)}: got {dtype_name(dtype)}")
        return dtype
    return TORCH_DTYPES[dtype_from_name(dtype, argument=argument).name]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where a stage's arithmetic runs: float32 for 16-bit storage (weights.compute_dtype)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def to_torch(array, device: torch.device | str | None = None) -> torch.Tensor:
    """A NumPy array (or anything np.asarray takes) as a torch tensor; tensors pass through."""
    if isinstance(array, torch.Tensor):
        return array if device is None else array.to(device)
    array = np.asarray(array)
    if not (array.flags.c_contiguous and array.flags.writeable):  # torch.from_numpy wants memory it may write
        array = np.array(array, order="C", copy=True)
    if array.dtype == DTYPES["bfloat16"]:
        bits = torch.from_numpy(array.view(np.int16))
        tensor = bits.view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(array)
    return tensor if device is None else tensor.to(device)


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A tensor as a C-contiguous NumPy array on the host (bfloat16 as ml_dtypes.bfloat16)."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(DTYPES["bfloat16"]).copy()
    return tensor.numpy().copy()
