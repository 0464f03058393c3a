"""The contract: config, the common weight format, and dtype names.

NumPy, safetensors and ml_dtypes only; never a framework.
"""

from .config import MASKED_ROW_POLICIES, AttentionConfig
from .dtypes import DTYPES, compute_dtype, dtype_from_name, dtype_name
from .format import (
    FORMAT,
    FORMAT_VERSION,
    CheckedTensors,
    WeightsFormatError,
    init,
    load,
    read_safetensors,
    save,
    tensor_sha256,
    to_bytes,
    validate_tensors,
)

__all__ = [
    "AttentionConfig", "CheckedTensors", "MASKED_ROW_POLICIES", "DTYPES", "FORMAT", "FORMAT_VERSION", "WeightsFormatError",
    "compute_dtype", "dtype_from_name", "dtype_name", "init", "load", "read_safetensors", "save",
    "tensor_sha256", "to_bytes", "validate_tensors",
]
