"""Reading `mha run` inputs files and writing outputs files (safetensors).

Inputs file: `query` and optionally `key`, `value`, `mask` (bool, or 0/1
integers / floats, True = may attend), `bias` (float, -inf allowed),
`dropout_mask` (bool or 0/1, True = keep), `positions` / `key_positions`
(integer, RoPE positions), `past_key` / `past_value` (float, the KV cache),
`segment_ids` / `key_segment_ids` (integer, packed sequences),
`past_key_positions` (integer), `topk_indices` (integer, the keys each query
may see, -1 an unused slot), `past_index_keys` (float, a config with `indexer`:
its cache of index keys). Anything else is refused.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
from safetensors.numpy import save as _safetensors_bytes

from weights import read_safetensors
from weights.atomic import write_bytes_atomic
from weights.dtypes import is_float
from weights.format import canonical_safetensors_bytes, show_names

INPUT_NAMES = ("query", "key", "value", "mask", "bias", "dropout_mask", "positions", "key_positions", "past_key",
               "past_value", "segment_ids", "key_segment_ids", "past_key_positions", "topk_indices",
               "past_index_keys")
INTEGER_INPUTS = ("positions", "key_positions", "segment_ids", "key_segment_ids", "past_key_positions",
                  "topk_indices")


class InputsError(ValueError):
    """An inputs file that cannot be used: names the file and the problem."""


def _as_bool(path, name: str, array: np.ndarray) -> np.ndarray:
    if array.dtype == bool:
        return array
    numeric = array.dtype.kind in "iu" or is_float(array.dtype)  # bfloat16 has kind 'V'
    if numeric and (array.size == 0 or np.isin(array, (0, 1)).all()):
        return array.astype(bool)
    if is_float(array.dtype):
        kind = "floats other than 0 and 1 (an additive mask belongs in `bias`)"
    else:
        kind = "values other than 0 and 1"
    meaning = "keep" if name == "dropout_mask" else "may attend"
    raise InputsError(f"{path}: {name} must be bool or 0/1 (True = {meaning}): got dtype {array.dtype} with {kind}")


def read_inputs(path: str | os.PathLike) -> dict[str, np.ndarray]:
    _, arrays = read_safetensors(path, error=InputsError)
    unknown = sorted(set(arrays) - set(INPUT_NAMES))
    if unknown:
        raise InputsError(
            f"{path}: unexpected tensors {show_names(unknown)}; an inputs file holds {', '.join(INPUT_NAMES)}"
        )
    if "query" not in arrays:
        raise InputsError(f"{path}: no `query` tensor")
    if "value" in arrays and "key" not in arrays:
        raise InputsError(f"{path}: `value` without `key`")
    inputs: dict[str, np.ndarray] = {}
    for name in INPUT_NAMES:
        if name not in arrays:
            continue
        array = arrays[name]
        if name in ("mask", "dropout_mask"):
            inputs[name] = _as_bool(path, name, array)
        elif name in INTEGER_INPUTS:
            if array.dtype.kind not in "iu":
                raise InputsError(f"{path}: {name} must be an integer tensor: got dtype {array.dtype}")
            inputs[name] = array.astype(np.int64)
        elif not is_float(array.dtype):
            raise InputsError(f"{path}: {name} must be a float tensor: got dtype {array.dtype}")
        else:
            inputs[name] = array
    return inputs


def write_arrays(path: str | os.PathLike, arrays: Mapping[str, np.ndarray], *, overwrite: bool = False,
                 metadata: Mapping[str, str] | None = None) -> None:
    """Atomic safetensors write (old file or new file, never a mix)."""
    contiguous = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    data = canonical_safetensors_bytes(_safetensors_bytes(contiguous, metadata=dict(metadata or {}) or None))
    write_bytes_atomic(path, data, overwrite=overwrite)
