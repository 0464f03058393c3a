"""The common weight file: safetensors with a strict, checksummed header.

`__metadata__` holds `format` ("mha-weights"), `format_version` ("1"),
`config` (AttentionConfig as JSON, every field resolved) and `sha256` (JSON map
tensor name -> hex digest of the tensor's little-endian C-order bytes).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from safetensors.numpy import save as _safetensors_bytes

from .atomic import write_bytes_atomic
from .config import AttentionConfig
from .dtypes import DTYPES, dtype_from_name, resolve_dtype

FORMAT = "mha-weights"
FORMAT_VERSION = "1"
RESERVED_METADATA = ("format", "format_version", "config", "sha256")

# safetensors' header dtype codes -> little-endian NumPy dtypes (bytes are stored little-endian).
_SAFETENSORS_NUMPY = {
    "BOOL": np.dtype(bool), "U8": "<u1", "I8": "<i1", "U16": "<u2", "I16": "<i2", "U32": "<u4",
    "I32": "<i4", "U64": "<u8", "I64": "<i8", "F16": "<f2", "BF16": DTYPES["bfloat16"], "F32": "<f4", "F64": "<f8",
}


class WeightsFormatError(ValueError):
    """A weight file or tensor set that does not satisfy the format."""


def tensor_sha256(array: np.ndarray) -> str:
    """Hex sha256 of an array's bytes as stored: little-endian, C order."""
    array = np.ascontiguousarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return hashlib.sha256(array.tobytes(order="C")).hexdigest()


def validate_tensors(config: AttentionConfig, tensors: Mapping[str, np.ndarray], *, source: str = "tensors") -> np.dtype:
    """Check names, shapes and dtype against the config; return the one dtype.

    Raises one WeightsFormatError listing every problem.
    """
    expected = config.tensor_shapes()
    problems: list[str] = []
    missing = [name for name in expected if name not in tensors]
    unexpected = sorted(name for name in tensors if name not in expected)
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected)}")
    dtypes: dict[str, list[str]] = {}
    for name, shape in expected.items():
        if name not in tensors:
            continue
        array = tensors[name]
        if not isinstance(array, np.ndarray):
            problems.append(f"{name} is a {type(array).__name__}, not a numpy array")
            continue
        if tuple(array.shape) != shape:
            problems.append(f"{name} has shape {tuple(array.shape)}, expected {shape}")
        try:
            dtypes.setdefault(resolve_dtype(array.dtype).name, []).append(name)
        except (ValueError, TypeError):
            problems.append(f"{name} has dtype {array.dtype}, expected one of {', '.join(DTYPES)}")
            continue
        if array.size and not np.isfinite(array.astype(np.float64)).all():
            problems.append(f"{name} contains NaN or Inf")
    if len(dtypes) > 1:
        listing = "; ".join(f"{d}: {', '.join(names)}" for d, names in dtypes.items())
        problems.append(f"tensors must share one dtype, got {listing}")
    if problems:
        raise WeightsFormatError(f"{source}: " + "; ".join(problems))
    if not dtypes:
        raise WeightsFormatError(f"{source}: no tensors")
    return DTYPES[next(iter(dtypes))]


def to_bytes(config: AttentionConfig, tensors: Mapping[str, np.ndarray], *, metadata: Mapping[str, str] | None = None) -> bytes:
    """The file's bytes. Deterministic: the same inputs give the same bytes."""
    validate_tensors(config, tensors)
    extra = dict(metadata or {})
    clash = sorted(set(extra) & set(RESERVED_METADATA))
    if clash:
        raise ValueError(f"metadata may not set reserved keys: got {', '.join(clash)}")
    for key, value in extra.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(f"metadata must map str to str: got {key!r}: {type(value).__name__}")
    arrays = {name: np.ascontiguousarray(tensors[name]) for name in config.tensor_shapes()}
    header = {
        **extra,
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "config": config.to_json(),
        "sha256": json.dumps({name: tensor_sha256(a) for name, a in arrays.items()}, sort_keys=True),
    }
    return canonical_safetensors_bytes(_safetensors_bytes(arrays, metadata=header))


def canonical_safetensors_bytes(raw: bytes) -> bytes:
    """The same safetensors file with its JSON header keys sorted.

    safetensors writes header keys (notably __metadata__'s) in hash-map order,
    which varies between runs; sorting them makes the bytes a function of the
    content, so regenerated files and test vectors are byte-identical. The data
    section is unchanged; the header is padded with spaces to 8 bytes, as
    safetensors itself does.
    """
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + raw[8 + n :]


def save(
    path: str | os.PathLike,
    config: AttentionConfig,
    tensors: Mapping[str, np.ndarray],
    *,
    overwrite: bool = False,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write a weight file atomically; refuse to replace one unless overwrite."""
    write_bytes_atomic(path, to_bytes(config, tensors, metadata=metadata), overwrite=overwrite)


def read_safetensors(path: str | os.PathLike, *, error: type[ValueError] = WeightsFormatError) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """Read any safetensors file strictly: (metadata, arrays) or `error`.

    The header is checked by hand before the safetensors parser sees it, so a
    header length beyond the file is refused without allocating it.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except IsADirectoryError:
        raise error(f"{path}: is a directory, not a safetensors file") from None
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except OSError as err:
        raise error(f"{path}: cannot read: {err.strerror or err}") from None
    if len(data) < 8:
        raise error(f"{path}: not a safetensors file: {len(data)} bytes, shorter than the 8-byte header length")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > len(data) - 8:
        raise error(f"{path}: not a safetensors file: header length {header_len} exceeds the file's remaining {len(data) - 8} bytes")
    try:
        header = json.loads(data[8 : 8 + header_len].decode("utf-8"))
    except UnicodeDecodeError:
        raise error(f"{path}: safetensors header is not UTF-8") from None
    except json.JSONDecodeError as err:
        raise error(f"{path}: safetensors header is not JSON: {err.msg} at byte {err.pos}") from None
    if not isinstance(header, dict):
        raise error(f"{path}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise error(f"{path}: __metadata__ must map strings to strings")
    body = len(data) - 8 - header_len
    arrays: dict[str, np.ndarray] = {}
    spans = []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise error(f"{path}: tensor {name!r} has a malformed header entry")
        dtype_code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype_code not in _SAFETENSORS_NUMPY:
            raise error(f"{path}: tensor {name!r} has unsupported dtype {dtype_code!r}")
        dtype = np.dtype(_SAFETENSORS_NUMPY[dtype_code])
        if (
            not isinstance(shape, list)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
            or not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            raise error(f"{path}: tensor {name!r} has a malformed shape or data_offsets")
        start, end = offsets
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if not 0 <= start <= end <= body or end - start != count * dtype.itemsize:
            raise error(
                f"{path}: tensor {name!r} claims bytes {start}..{end} for shape {shape} {dtype_code}, "
                f"but the data section has {body} bytes"
            )
        spans.append((start, end, name))
        raw = data[8 + header_len + start : 8 + header_len + end]
        arrays[name] = np.frombuffer(raw, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))
    spans.sort()
    for (_, e1, n1), (s2, _, n2) in zip(spans, spans[1:]):
        if s2 < e1:
            raise error(f"{path}: tensors {n1!r} and {n2!r} overlap in the data section")
    return metadata, arrays


def load(path: str | os.PathLike) -> tuple[AttentionConfig, dict[str, np.ndarray]]:
    """Load and verify a weight file; one WeightsFormatError lists every problem."""
    metadata, tensors = read_safetensors(path)
    problems: list[str] = []
    if metadata.get("format") != FORMAT:
        raise WeightsFormatError(f"{path}: format is {metadata.get('format')!r}, expected {FORMAT!r}")
    if metadata.get("format_version") != FORMAT_VERSION:
        raise WeightsFormatError(
            f"{path}: format_version is {metadata.get('format_version')!r}; this reader knows {FORMAT_VERSION!r}"
        )
    try:
        config = AttentionConfig.from_json(metadata.get("config", ""))
    except ValueError as err:
        raise WeightsFormatError(f"{path}: bad config: {err}") from None
    try:
        checksums = json.loads(metadata.get("sha256", ""))
        if not isinstance(checksums, dict):
            raise ValueError
    except ValueError:
        raise WeightsFormatError(f"{path}: sha256 metadata is not a JSON object") from None
    try:
        validate_tensors(config, tensors, source=str(path))
    except WeightsFormatError as err:
        problems.append(str(err).removeprefix(f"{path}: "))
    for name, array in tensors.items():
        if name not in checksums:
            problems.append(f"no sha256 for {name}")
        elif tensor_sha256(array) != checksums[name]:
            problems.append(f"sha256 mismatch for {name} (the tensor's bytes changed after it was written)")
    extra_sums = sorted(set(checksums) - set(tensors))
    if extra_sums:
        problems.append(f"sha256 lists tensors not in the file: {', '.join(extra_sums)}")
    if problems:
        raise WeightsFormatError(f"{path}: " + "; ".join(problems))
    return config, {name: tensors[name] for name in config.tensor_shapes()}  # canonical order


def init(config: AttentionConfig, *, seed: int, dtype: str | np.dtype = "float32") -> dict[str, np.ndarray]:
    """Random weights: every tensor uniform in [-1/sqrt(fan_in), 1/sqrt(fan_in)].

    That is torch nn.Linear's default range (biases included, so a test that
    drops a bias sees it); drawn in float64 from numpy's PCG64 with `seed` and
    rounded to `dtype`, so a seed gives the same values on every machine.
    """
    dtype = dtype_from_name(dtype) if isinstance(dtype, str) else resolve_dtype(dtype)
    rng = np.random.default_rng(seed)
    fan_in = {
        "query": config.query_dim,
        "key": config.key_dim,
        "value": config.value_dim,
        "output": config.num_heads * config.value_head_dim,
    }
    tensors = {}
    for name, shape in config.tensor_shapes().items():
        bound = 1.0 / np.sqrt(fan_in[name.split(".")[0]])
        tensors[name] = rng.uniform(-bound, bound, size=shape).astype(dtype)
    return tensors
