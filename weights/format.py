"""The common weight file: safetensors with a strict, checksummed header.

`__metadata__` holds `format` ("mha-weights"), `format_version` ("1"),
`config` (AttentionConfig as JSON, every field resolved), `sha256` (JSON map
tensor name -> hex digest of the tensor's little-endian C-order bytes) and
`header_sha256` (hex digest of the rest of the header: see `header_sha256`).
`sha256` alone left the header unprotected: one flipped bit turned
`"scale": 0.125` into `8.125`, or `"dropout": 0.0` into `0.8`, and the file
still loaded. `header_sha256` is verified when present, so files written
before it existed still load.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from safetensors.numpy import save as _safetensors_bytes

from .atomic import write_bytes_atomic
from .config import DIFFERENTIAL_TENSORS, AttentionConfig
from .dtypes import DTYPES, dtype_from_name, extremes_finite, for_value_checks, resolve_dtype
from .strict_json import _HeaderProblem, _parse_header, _parse_json_text, _short, _show_name, show_names  # noqa: F401

FORMAT = "mha-weights"
FORMAT_VERSION = "1"
RESERVED_METADATA = ("format", "format_version", "config", "sha256", "header_sha256")

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


def header_sha256(metadata: Mapping[str, str], tensors: Mapping[str, np.ndarray]) -> str:
    """Hex sha256 of a weight file's header content.

    Covers every `__metadata__` entry except `header_sha256` itself (so the
    config, the tensor checksums and user metadata) and each tensor's name,
    dtype and shape, as the canonical JSON
    `{"metadata": {...}, "tensors": {name: [dtype name, shape]}}` with sorted
    keys, no spaces and ASCII escapes. Data offsets are not covered: the
    reader checks that the tensors tile the data section, and `sha256` covers
    their bytes.
    """
    content = {
        "metadata": {k: v for k, v in metadata.items() if k != "header_sha256"},
        "tensors": {name: [np.dtype(a.dtype).name, [int(d) for d in a.shape]] for name, a in tensors.items()},
    }
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


class CheckedTensors(Mapping):
    """Tensors whose values validate_tensors has proven finite once: read-only copies, so a call need not read
    them again (a decode step reads its weights for the projections; a second read, for NaN, was 2.8 of the
    8.0 ms a NumPy DSA step took at `mha bench --shapes sparse`'s sizes, 55 MB of float32, 2-core AMD EPYC VM,
    2026-11-30). validate_tensors still checks their names, shapes and dtype against each call's config.

    The arrays are the mapping's own (copied at construction, writeable False): only a caller who turns the
    flag back on can change them, and then owns the consequence. impl_numpy's layer holds its tensors so, as
    torch's layer and the adapters check values once when they load tensors."""

    def __init__(self, config: AttentionConfig, tensors: Mapping[str, np.ndarray], *, source: str = "tensors"):
        validate_tensors(config, tensors, source=source)
        self._arrays = {}
        for name, array in tensors.items():
            own = np.array(array)  # a copy: no other reference can write it
            own.flags.writeable = False
            self._arrays[name] = own

    def __getitem__(self, name: str) -> np.ndarray:
        return self._arrays[name]

    def __iter__(self):
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)


def validate_tensors(
    config: AttentionConfig, tensors: Mapping[str, np.ndarray], *, source: str = "tensors"
) -> np.dtype:
    """Check names, shapes and dtype against the config; return the one dtype.

    Values too (no NaN or Inf), unless tensors is a CheckedTensors (proven at its construction).
    Raises one WeightsFormatError listing every problem.
    """
    values_checked = isinstance(tensors, CheckedTensors)
    expected = config.tensor_shapes()
    problems: list[str] = []
    missing = [name for name in expected if name not in tensors]
    unexpected = sorted(name for name in tensors if name not in expected)
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {show_names(unexpected)}")
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
        if array.size and not values_checked and not extremes_finite(for_value_checks(array)):
            problems.append(f"{name} contains NaN or Inf")
    if len(dtypes) > 1:
        listing = "; ".join(f"{d}: {', '.join(names)}" for d, names in dtypes.items())
        problems.append(f"tensors must share one dtype, got {listing}")
    if problems:
        raise WeightsFormatError(f"{source}: " + "; ".join(problems))
    if not dtypes:
        raise WeightsFormatError(f"{source}: no tensors")
    return DTYPES[next(iter(dtypes))]


def to_bytes(
    config: AttentionConfig, tensors: Mapping[str, np.ndarray], *, metadata: Mapping[str, str] | None = None
) -> bytes:
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
    header["header_sha256"] = header_sha256(header, arrays)
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


# safetensors' own limit on the JSON header; a longer one is refused before it is read.
MAX_HEADER_BYTES = 100_000_000
# NumPy 1.x's limit on dimensions; the format's tensors have at most 3.
MAX_NDIM = 32


def _read_exactly(handle, count: int) -> bytes:
    chunks, left = [], count
    while left:
        chunk = handle.read(left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_safetensors(
    path: str | os.PathLike, *, error: type[ValueError] = WeightsFormatError
) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """Read any safetensors file strictly: (metadata, arrays) or `error`.

    Only regular files are read (a FIFO or a device could block or never end).
    The 8-byte header length is checked against the file's size before the
    header is read, and every tensor's claimed bytes against the data section
    before any of it is read, so nothing is allocated for a size the file does
    not have. As safetensors itself requires, the tensors must tile the data
    section exactly: no overlap, no gap, no trailing bytes. Duplicate keys,
    NaN/Infinity and lone surrogate escapes in the header are refused, and so
    are BOOL bytes other than 0 and 1.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except IsADirectoryError:
        raise error(f"{path}: is a directory, not a safetensors file") from None
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except OSError as err:
        raise error(f"{path}: cannot read: {err.strerror or err}") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise error(f"{path}: is a directory, not a safetensors file")
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{path}: not a regular file (a FIFO, device or socket); give the path of a safetensors file")
    except BaseException:
        os.close(fd)
        raise
    size = info.st_size
    with os.fdopen(fd, "rb") as handle:
        try:
            return _read_open_file(path, handle, size, error)
        except OSError as err:
            raise error(f"{path}: cannot read: {err.strerror or err}") from None


def _read_open_file(
    path: Path, handle, size: int, error: type[ValueError]
) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    prefix = _read_exactly(handle, 8)
    if len(prefix) < 8:
        raise error(f"{path}: not a safetensors file: {len(prefix)} bytes, shorter than the 8-byte header length")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > size - 8:
        raise error(
            f"{path}: not a safetensors file: header length {header_len} exceeds the file's remaining {size - 8} bytes"
        )
    if header_len > MAX_HEADER_BYTES:
        raise error(f"{path}: safetensors header length {header_len} is above the limit of {MAX_HEADER_BYTES} bytes")
    raw_header = _read_exactly(handle, header_len)
    if len(raw_header) < header_len:
        raise error(f"{path}: the file shrank while it was read ({8 + len(raw_header)} of {size} bytes)")
    try:
        header = _parse_header(raw_header)
    except _HeaderProblem as err:
        raise error(f"{path}: safetensors header {err}") from None
    if not isinstance(header, dict):
        raise error(f"{path}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise error(f"{path}: __metadata__ must map strings to strings")
    body = size - 8 - header_len
    layout: list[tuple[int, int, str, np.dtype, tuple[int, ...], str]] = []
    for name, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise error(f"{path}: tensor {_short(name)} has a malformed header entry")
        dtype_code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype_code, str) or dtype_code not in _SAFETENSORS_NUMPY:
            raise error(f"{path}: tensor {_short(name)} has unsupported dtype {_short(dtype_code)}")
        dtype = np.dtype(_SAFETENSORS_NUMPY[dtype_code])
        if (
            not isinstance(shape, list)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
            or not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            raise error(f"{path}: tensor {_short(name)} has a malformed shape or data_offsets")
        if len(shape) > MAX_NDIM:
            raise error(f"{path}: tensor {_short(name)} has {len(shape)} dimensions; at most {MAX_NDIM} are supported")
        start, end = offsets
        nbytes = math.prod(shape) * dtype.itemsize  # Python integers: no overflow
        if not 0 <= start <= end <= body or end - start != nbytes:
            raise error(
                f"{path}: tensor {_short(name)} claims bytes {start}..{end} for shape {_short(shape)} {dtype_code}, "
                f"but the data section has {body} bytes"
            )
        layout.append((start, end, name, dtype, tuple(shape), dtype_code))
    layout.sort(key=lambda item: (item[0], item[1]))
    position, previous = 0, None
    for start, end, name, *_ in layout:
        if start < position:
            raise error(f"{path}: tensors {_short(previous)} and {_short(name)} overlap in the data section")
        if start > position:
            raise error(f"{path}: the data section has a gap of {start - position} bytes before tensor {_short(name)}")
        position, previous = end, name
    if position != body:
        raise error(f"{path}: the data section has {body - position} bytes after the last tensor that no tensor claims")
    data = _read_exactly(handle, body)
    if len(data) != body or handle.read(1):
        raise error(f"{path}: the file changed size while it was read")
    arrays: dict[str, np.ndarray] = {}
    for start, end, name, dtype, shape, dtype_code in layout:
        try:
            flat = np.frombuffer(data, dtype=dtype, count=(end - start) // dtype.itemsize, offset=start)
            array = flat.reshape(shape)
        except ValueError as err:
            raise error(
                f"{path}: tensor {_short(name)} with shape {_short(list(shape))} cannot be held: {err}"
            ) from None
        if dtype_code == "BOOL" and flat.view(np.uint8).max(initial=0) > 1:
            raise error(f"{path}: tensor {_short(name)} is BOOL but holds bytes other than 0 and 1")
        arrays[name] = array.astype(dtype.newbyteorder("="))
    arrays = {name: arrays[name] for name in header}  # the header's order
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
    if "config" not in metadata:
        raise WeightsFormatError(f"{path}: bad config: the metadata has no config")
    try:
        # Strict JSON first (no duplicate keys, NaN or deep nesting), then the config's own checks.
        config = AttentionConfig.from_dict(_parse_json_text(metadata["config"]))
    except _HeaderProblem as err:
        raise WeightsFormatError(f"{path}: bad config: config is not valid JSON: {err}") from None
    except OverflowError as err:  # config.py lets `"scale": 1000...0` (400 digits) raise this
        raise WeightsFormatError(f"{path}: bad config: a number in the config is too large ({err})") from None
    except (ValueError, TypeError) as err:
        reason = str(err).splitlines()[0] if str(err) else repr(err)
        raise WeightsFormatError(f"{path}: bad config: {reason}") from None
    try:
        checksums = _parse_json_text(metadata.get("sha256", ""))
    except _HeaderProblem:
        checksums = None
    if not isinstance(checksums, dict):
        raise WeightsFormatError(f"{path}: sha256 metadata is not a JSON object")
    try:
        validate_tensors(config, tensors, source=str(path))
    except WeightsFormatError as err:
        problems.append(str(err).removeprefix(f"{path}: "))
    for name, array in tensors.items():
        if name not in checksums:
            problems.append(f"no sha256 for {_show_name(name)}")
        elif tensor_sha256(array) != checksums[name]:
            problems.append(f"sha256 mismatch for {name} (the tensor's bytes changed after it was written)")
    extra_sums = sorted(set(checksums) - set(tensors))
    if extra_sums:
        problems.append(f"sha256 lists tensors not in the file: {show_names(extra_sums)}")
    if "header_sha256" in metadata and header_sha256(metadata, tensors) != metadata["header_sha256"]:
        problems.append("header_sha256 mismatch (the config, metadata, dtypes or shapes changed after it was written)")
    if problems:
        raise WeightsFormatError(f"{path}: " + "; ".join(problems))
    return config, {name: tensors[name] for name in config.tensor_shapes()}  # canonical order


def init(config: AttentionConfig, *, seed: int, dtype: str | np.dtype = "float32") -> dict[str, np.ndarray]:
    """Random weights: every projection tensor uniform in [-1/sqrt(fan_in), 1/sqrt(fan_in)].

    That is torch nn.Linear's default range (biases included, so a test that
    drops a bias sees it); drawn in float64 from numpy's PCG64 with `seed` and
    rounded to `dtype`, so a seed gives the same values on every machine.
    QK-norm scales are drawn in [0.5, 1.5] (around a trained norm's 1, far
    enough from it that a scale applied to the wrong feature shows), their
    biases and the sinks in [-0.5, 0.5] and [-1, 1] (a sink of the size of
    the logits, so that it takes a visible share of every row); ALiBi slopes
    in [1/16, 1/2] (the range of BLOOM's and MPT's rules for 2 to 16 heads,
    drawn so that a slope read from the wrong head shows); the output gate's
    kernel and bias as a projection from the query input; the indexer's
    projections as projections from their inputs. Tensors are
    drawn in `config.tensor_shapes()` order, so a plain config draws what it
    drew before the modern tensors existed.
    """
    dtype = dtype_from_name(dtype) if isinstance(dtype, str) else resolve_dtype(dtype)
    rng = np.random.default_rng(seed)
    fan_in = {
        "query": config.query_dim,
        "key": config.key_dim,
        "value": config.value_dim,
        "output": config.num_heads * config.value_head_dim,
        "gate": config.query_dim,
    }
    ranges = {"norm.scale": (0.5, 1.5), "norm.bias": (-0.5, 0.5), "sinks": (-1.0, 1.0), "alibi.slopes": (1 / 16, 0.5)}
    # differential's lambda vectors in [-0.5, 0.5]: their dot products of H terms move lambda away from lambda_init
    # by tenths (diffllama draws N(0, 0.1)), so a lambda read wrong shows
    ranges.update({name: (-0.5, 0.5) for name in DIFFERENTIAL_TENSORS})
    tensors = {}
    latent = config.latent
    if latent is not None:  # the up-projections read the latent (or the query's low-rank latent)
        fan_in.update(latent=config.key_dim, key=latent.kv_rank, value=latent.kv_rank)
        if latent.query_rank is not None:
            fan_in["query"] = latent.query_rank
    indexer_fan_in = {}  # the indexer's projections (indexer.query / key / weights), from their own sources
    if config.indexer is not None:
        indexer_fan_in = {"indexer.query.": config.indexer_query_width, "indexer.key.": config.key_dim,
                          "indexer.weights.": config.query_dim, "indexer.pool.gate.": config.key_dim}
        ranges["pool.position"] = (-1.0, 1.0)  # the k-pool's gate bias per slot, of the size of the gate logits
    compressed = config.compressed
    if compressed is not None:  # issue 41: DeepSeek V4's projections, each from its own input
        G, R = compressed.output_groups, compressed.output_rank
        fan_in.update(query=compressed.query_rank, compressor=config.query_dim, output=G * R)
        indexer_fan_in = {"indexer.query.": compressed.query_rank, "indexer.": config.query_dim}
        ranges["position_bias"] = (-1.0, 1.0)  # a gate bias per slot of the size of the gates
    for name, shape in config.tensor_shapes().items():
        kind = next((k for k in ranges if name.endswith(k)), None)
        if compressed is not None and name == "output.group.kernel":
            low, high = -(G / (config.num_heads * config.head_dim)) ** 0.5, (G / (config.num_heads * config.head_dim)) ** 0.5
        elif kind is None and name.startswith("indexer."):
            bound = 1.0 / np.sqrt(next(v for k, v in indexer_fan_in.items() if name.startswith(k)))
            low, high = -bound, bound
        elif kind is None:
            bound = 1.0 / np.sqrt(config.query_dim if name.startswith("query.down.") else fan_in[name.split(".")[0]])
            low, high = -bound, bound
        else:
            low, high = ranges[kind]
        tensors[name] = rng.uniform(low, high, size=shape).astype(dtype)
    return tensors
