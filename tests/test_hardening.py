"""Hardening (issue 6): bad files, bad inputs and interrupted writes never crash, mislead or lose data.

Every malformed weights file ends in `WeightsFormatError`, every malformed
inputs file in `InputsError`, each one line naming the file and the problem:
never another exception, never a hang, never a silently wrong result.

The fuzzers count the cases they run; the counts are printed at the end of the
session (terminal summary, and on stdout with -s) and each fuzzer asserts a
minimum so one that silently runs nothing fails. `pytest -m slow` runs the
long versions.

No framework is imported here: weights and conformance.io are NumPy-only.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import stat
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import weights
from conformance.io import InputsError, read_inputs
from weights import AttentionConfig, WeightsFormatError

# -- case counts ---------------------------------------------------------------------

COUNTS: collections.Counter[str] = collections.Counter()


class _CountsReport:
    """A plugin registered at run time: prints the fuzzers' case counts at the end."""

    def pytest_terminal_summary(self, terminalreporter):
        if COUNTS:
            terminalreporter.section("hardening: cases run")
            for name, count in sorted(COUNTS.items()):
                terminalreporter.write_line(f"{name:<48} {count:>8}")


@pytest.fixture(scope="module", autouse=True)
def _report_counts(request):
    manager = request.config.pluginmanager
    if not manager.has_plugin("hardening-counts"):
        manager.register(_CountsReport(), "hardening-counts")
    yield
    print("\nhardening cases run: " + ", ".join(f"{k}={v}" for k, v in sorted(COUNTS.items())))


@pytest.fixture(autouse=True)
def _no_hang(request):
    """A hang is a failure: SIGALRM after a generous bound per test."""
    limit = 900 if request.node.get_closest_marker("slow") else 120

    def on_alarm(signum, frame):
        raise TimeoutError(f"{request.node.name} ran past {limit} s: a hang")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(limit)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


# -- helpers ---------------------------------------------------------------------------

@pytest.fixture
def scratch(tmp_path):
    """A directory for files rewritten thousands of times: tmpfs when there is one.

    On ext4, truncating and rewriting a file forces its data to disk
    (auto_da_alloc), 1 ms a case; the fuzzers rewrite one file per case.
    """
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        import shutil
        import tempfile

        directory = Path(tempfile.mkdtemp(prefix="mha-hardening-", dir=shm))
        yield directory
        shutil.rmtree(directory, ignore_errors=True)
    else:
        yield tmp_path


SMALL = AttentionConfig(num_heads=2, query_dim=4, head_dim=2)


def header_of(data: bytes) -> dict:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n])


def raw_file(header, body: bytes = b"", *, length: int | None = None) -> bytes:
    """A safetensors file from a header (dict, str or bytes) and a body, as given: no checks."""
    if isinstance(header, dict):
        header = json.dumps(header, separators=(",", ":"))
    if isinstance(header, str):
        header = header.encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(header) if length is None else length) + header + body


def refusal(read, path, error: type[ValueError], *fragments: str) -> str:
    """Call read(path); it must raise exactly `error`, one line, naming the path and each fragment."""
    try:
        result = read(path)
    except error as err:
        caught = err
    except BaseException as err:  # any other exception is the failure tested for
        raise AssertionError(
            f"{read.__name__}({path}) raised {type(err).__name__}: {err}, not {error.__name__}"
        ) from err
    else:
        raise AssertionError(f"{read.__name__}({path}) accepted a bad file and returned {type(result).__name__}")
    message = str(caught)
    assert str(path) in message, f"message does not name the file {path}: {message!r}"
    assert "\n" not in message, f"message is not one line: {message!r}"
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def write(tmp_path: Path, data: bytes, name: str = "f.safetensors") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def st_bytes(arrays: dict, metadata: dict | None = None) -> bytes:
    """A valid safetensors file of these arrays, with any metadata (the format's own writer, no checks)."""
    from safetensors.numpy import save

    return weights.format.canonical_safetensors_bytes(save(arrays, metadata=metadata))


QUERY_ENTRY = {"dtype": "F32", "shape": [1, 1, 1], "data_offsets": [0, 4]}


# -- reader regressions: each crashed or was silently accepted before the fix --------------

READER_CASES = [
        ("dtype is a list (unhashable)",
         raw_file({"query": {"dtype": ["F32"], "shape": [1, 1, 1], "data_offsets": [0, 4]}}, b"\0" * 4),
         ["'query'", "dtype"]),
        ("dtype is an object",
         raw_file({"query": {"dtype": {}, "shape": [1, 1, 1], "data_offsets": [0, 4]}}, b"\0" * 4), ["dtype"]),
        ("dimension beyond int64",
         raw_file('{"query":{"dtype":"F32","shape":[' + str(10**30) + '],"data_offsets":[0,4]}}', b"\0" * 4),
         ["'query'"]),
        ("dimensions whose product wraps int64 to 0",
         raw_file({"query": {"dtype": "F32", "shape": [2**32, 2**32], "data_offsets": [0, 0]}}), ["'query'"]),
        ("100 dimensions", raw_file({"query": {"dtype": "F32", "shape": [1] * 100, "data_offsets": [0, 4]}}, b"\0" * 4),
         ["'query'", "dimensions"]),
        ("zero-size but huge dimensions",
         raw_file({"query": {"dtype": "F32", "shape": [0, 2**62], "data_offsets": [0, 0]}}), ["'query'"]),
        ("deeply nested JSON header", raw_file("[" * 100_000 + "]" * 100_000), ["header"]),
        ("5000-digit integer in the header", raw_file('{"query":' + "1" * 5000 + "}"), ["header"]),
        ("NaN constant in the header",
         raw_file('{"query":{"dtype":"F32","shape":[NaN],"data_offsets":[0,4]}}', b"\0" * 4), ["header"]),
        ("duplicate tensor name",
         raw_file('{"query":{"dtype":"F32","shape":[1,1,1],"data_offsets":[0,4]},'
                  '"query":{"dtype":"F32","shape":[1,1,1],"data_offsets":[4,8]}}', b"\0" * 8),
         ["duplicate", "'query'"]),
        ("duplicate __metadata__",
         raw_file('{"__metadata__":{"a":"1"},"__metadata__":{"a":"2"},'
                  '"query":{"dtype":"F32","shape":[1,1,1],"data_offsets":[0,4]}}', b"\0" * 4),
         ["duplicate", "__metadata__"]),
        ("duplicate metadata key",
         raw_file('{"__metadata__":{"a":"1","a":"2"},"query":{"dtype":"F32","shape":[1,1,1],"data_offsets":[0,4]}}',
                  b"\0" * 4), ["duplicate", "'a'"]),
        ("duplicate field in a tensor entry",
         raw_file('{"query":{"dtype":"F32","dtype":"F16","shape":[1,1,1],"data_offsets":[0,4]}}', b"\0" * 4),
         ["duplicate", "'dtype'"]),
        ("__metadata__ is a list", raw_file({"__metadata__": [], "query": QUERY_ENTRY}, b"\0" * 4), ["__metadata__"]),
        ("__metadata__ is false", raw_file({"__metadata__": False, "query": QUERY_ENTRY}, b"\0" * 4), ["__metadata__"]),
        ("__metadata__ is an empty string",
         raw_file({"__metadata__": "", "query": QUERY_ENTRY}, b"\0" * 4), ["__metadata__"]),
        ("lone surrogate escape in a metadata value",
         raw_file('{"__metadata__":{"x":"\\ud800"},"query":{"dtype":"F32","shape":[1,1,1],"data_offsets":[0,4]}}',
                  b"\0" * 4), ["Unicode"]),
        ("lone surrogate escape in a tensor name",
         raw_file('{"\\udfff":{"dtype":"F32","shape":[1,1,1],"data_offsets":[0,4]}}', b"\0" * 4), ["Unicode"]),
        ("bytes after the last tensor", raw_file({"query": QUERY_ENTRY}, b"\0" * 4 + b"junk"), ["4 bytes after"]),
        ("a gap between tensors",
         raw_file({"query": QUERY_ENTRY, "key": {"dtype": "F32", "shape": [1, 1, 1], "data_offsets": [8, 12]}},
                  b"\0" * 12), ["gap", "'key'"]),
        ("data section but no tensors", raw_file({}, b"\0" * 4), ["4 bytes after"]),
        ("bool tensor holding the byte 2",
         raw_file({"query": QUERY_ENTRY, "mask": {"dtype": "BOOL", "shape": [1, 1], "data_offsets": [4, 5]}},
                  b"\0" * 4 + b"\x02"), ["'mask'", "BOOL"]),
]


@pytest.mark.parametrize("label, data, fragments", [pytest.param(*case, id=case[0]) for case in READER_CASES])
def test_reader_refuses_with_its_own_error(tmp_path, label, data, fragments):
    path = write(tmp_path, data)
    refusal(weights.read_safetensors, path, WeightsFormatError, *fragments)
    refusal(read_inputs, path, InputsError, *fragments)
    refusal(weights.load, path, WeightsFormatError)


@pytest.mark.parametrize("kind", ["fifo", "directory", "char device"])
def test_reader_refuses_what_is_not_a_regular_file_without_blocking(tmp_path, kind):
    if kind == "fifo":
        path = tmp_path / "pipe.safetensors"
        os.mkfifo(path)  # nobody writes: opening and reading it naively blocks forever
    elif kind == "directory":
        path = tmp_path / "dir.safetensors"
        path.mkdir()
    else:
        path = Path("/dev/zero")  # reading it naively never ends and fills memory
    signal.alarm(10)
    refusal(weights.load, path, WeightsFormatError, "not a regular file" if kind != "directory" else "directory")
    refusal(read_inputs, path, InputsError)


def test_reader_refuses_a_header_above_the_safetensors_limit_before_reading_it(tmp_path):
    path = tmp_path / "big-header.safetensors"
    with open(path, "wb") as handle:
        handle.write(raw_file(b"{}", length=100_000_001))
        handle.truncate(8 + 100_000_001)  # sparse: the header is really there, 100 MB of NUL
    tracemalloc.start()
    try:
        refusal(weights.load, path, WeightsFormatError, "100000001", "limit")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 10_000_000, f"refusing a 100 MB header allocated {peak} bytes"


# -- determinism of the writers -----------------------------------------------------------

def test_to_bytes_is_deterministic_within_and_across_calls():
    """safetensors 0.8 writes __metadata__ from a Rust HashMap: random key order on every call."""
    tensors = weights.init(SMALL, seed=0)
    outputs = {weights.to_bytes(SMALL, tensors, metadata={"a": "1", "note": "x", "z": "2"}) for _ in range(40)}
    assert len(outputs) == 1, f"40 calls gave {len(outputs)} different byte strings"


def test_write_arrays_is_deterministic(tmp_path):
    from conformance.io import write_arrays

    arrays = {"output": np.arange(6, dtype=np.float32).reshape(1, 2, 3), "weights": np.ones((1, 1, 2, 2), np.float32)}
    contents = set()
    for i in range(20):
        write_arrays(tmp_path / f"o{i}", arrays, metadata={"backend": "numpy", "dtype": "float32", "x": "y"})
        contents.add((tmp_path / f"o{i}").read_bytes())
    assert len(contents) == 1, f"20 writes gave {len(contents)} different files"


@pytest.mark.parametrize("dtype", list(weights.DTYPES))
def test_written_files_are_plain_safetensors(tmp_path, dtype):
    """Whatever writes our files, safetensors' own reader must read them back identically."""
    from safetensors import safe_open

    tensors = weights.init(SMALL, seed=3, dtype=dtype)
    path = tmp_path / "w.safetensors"
    weights.save(path, SMALL, tensors, metadata={"note": "interop"})
    with safe_open(str(path), framework="numpy") as handle:
        metadata = handle.metadata()
        names = list(handle.keys())
        if dtype != "bfloat16":  # safetensors' NumPy binding cannot build bfloat16 arrays
            for name in names:
                got = handle.get_tensor(name)
                assert got.dtype == tensors[name].dtype and got.tobytes() == tensors[name].tobytes(), name
    assert sorted(names) == sorted(tensors)
    assert metadata["note"] == "interop" and metadata["format"] == "mha-weights"
    assert metadata == weights.read_safetensors(path)[0]


# -- crafted weight files: one problem each, checksums valid --------------------------------

def craft_weights(tensors: dict, *, config: str | None = None, sums: dict | None = None, **metadata: str) -> bytes:
    """A weights file with exactly the given problems: the sha256 map is right unless `sums` is given."""
    meta = {
        "format": weights.FORMAT,
        "format_version": weights.FORMAT_VERSION,
        "config": SMALL.to_json() if config is None else config,
        "sha256": json.dumps({n: weights.tensor_sha256(a) for n, a in tensors.items()} if sums is None else sums),
    }
    meta.update(metadata)
    return st_bytes(tensors, metadata=meta)


def small_tensors(dtype="float32", seed=0) -> dict:
    return weights.init(SMALL, seed=seed, dtype=dtype)


BAD_CONFIGS = [
    ("{nope", "not valid JSON"),
    ("", "not valid JSON"),
    ("[]", "must be a JSON object"),
    ("null", "must be a JSON object"),
    ("5", "must be a JSON object"),
    ("[" * 100_000 + "]" * 100_000, "config"),
    ('{"num_heads": ' + "9" * 5000 + ', "query_dim": 4, "head_dim": 2}', "config"),
    ('{"num_heads": 2, "query_dim": 4, "head_dim": 2, "scale": ' + "1" + "0" * 400 + "}", "too large"),
    ('{"num_heads": 2, "query_dim": 4, "head_dim": 2, "scale": 1e400}', "scale"),
    ('{"num_heads": 2, "query_dim": 4, "head_dim": 2, "scale": NaN}', "contains NaN"),
    ('{"num_heads": 2, "query_dim": 4, "head_dim": 2, "dropout": -Infinity}', "contains -Infinity"),
    ('{"num_heads": 2, "query_dim": 4, "head_dim": 2, "heads": 2}', "unknown fields"),
    ('{"num_heads": 2, "query_dim": 4}', "missing required fields: head_dim"),
    ('{"num_heads": 2, "query_dim": 4, "head_dim": 2, "num_kv_heads": 3}', "num_kv_heads must divide num_heads"),
    ('{"num_heads": 0, "query_dim": 4, "head_dim": 2}', "num_heads must be a positive integer"),
    ('{"num_heads": 2.0, "query_dim": 4, "head_dim": 2}', "num_heads must be a positive integer"),
    ('{"num_heads": true, "query_dim": 4, "head_dim": 2}', "num_heads must be a positive integer"),
    ('{"num_heads": 2, "query_dim": 4, "head_dim": 2, "masked_row": ["zero"]}', "masked_row"),
    ('{"num_heads": 2, "query_dim": 4, "head_dim": 2, "use_key_bias": 1}', "use_key_bias"),
    ('{"num_heads": 2, "query_dim": 4, "head_dim": 2, "num_heads": 3}', "'num_heads' twice"),
]


@pytest.mark.parametrize("config, fragment", BAD_CONFIGS, ids=[f"config{i}" for i in range(len(BAD_CONFIGS))])
def test_load_refuses_a_bad_config(tmp_path, config, fragment):
    path = write(tmp_path, craft_weights(small_tensors(), config=config))
    message = refusal(weights.load, path, WeightsFormatError, "bad config", fragment)
    assert "bad config: '" not in message, f"the reason is quoted as a repr: {message!r}"
    COUNTS["crafted: bad config"] += 1


def test_load_without_a_config_or_checksums(tmp_path):
    tensors = small_tensors()
    data = st_bytes(tensors, metadata={"format": "mha-weights", "format_version": "1"})
    refusal(weights.load, write(tmp_path, data), WeightsFormatError, "config")
    for sums in ("", "[]", "{", "[" * 100_000 + "]" * 100_000, '"x"'):
        data = craft_weights(tensors, sha256=sums)
        refusal(weights.load, write(tmp_path, data), WeightsFormatError, "sha256 metadata is not a JSON object")


@pytest.mark.parametrize("name", ["extra\nline", "\x1b[2Jclear", "a, b", "x" * 10_000])
def test_messages_stay_one_short_line_whatever_the_tensor_names(tmp_path, name):
    tensors = {**small_tensors(), name: np.zeros(2, np.float32)}
    path = write(tmp_path, craft_weights(tensors))
    message = refusal(weights.load, path, WeightsFormatError, "unexpected tensors")
    assert len(message) < 400 + len(str(path)), f"{len(message)} characters"
    assert "\x1b" not in message
    inputs = write(tmp_path, st_bytes({"query": np.zeros((1, 1, 4), np.float32),
                                                               name: np.zeros(1, np.float32)}), "i.safetensors")
    message = refusal(read_inputs, inputs, InputsError, "unexpected tensors")
    assert len(message) < 400 + len(str(inputs)) and "\x1b" not in message


# -- header corruption: every bit of the header, exhaustively -------------------------------

def same_load(got, config: AttentionConfig, tensors: dict) -> str | None:
    """None if a loaded (config, tensors) is exactly the original, else what differs."""
    got_config, got_tensors = got
    if got_config != config:
        return f"config {got_config} != {config}"
    if list(got_tensors) != list(tensors):
        return f"tensor names {list(got_tensors)} != {list(tensors)}"
    for name, array in tensors.items():
        other = got_tensors[name]
        if other.dtype != array.dtype or other.shape != array.shape or other.tobytes() != array.tobytes():
            return f"{name} differs: {other.dtype}{other.shape} vs {array.dtype}{array.shape}"
    return None


def load_or_refuse(path: Path, config: AttentionConfig, tensors: dict, what: str) -> str:
    """'refused' or 'identical'; anything else (another exception, a changed result) fails."""
    try:
        got = weights.load(path)
    except WeightsFormatError as err:
        message = str(err)
        assert message.startswith(f"{path}: ") and "\n" not in message, f"{what}: {message!r}"
        return "refused"
    except BaseException as err:  # the failure tested for
        raise AssertionError(f"{what}: load raised {type(err).__name__}: {err}") from err
    difference = same_load(got, config, tensors)
    assert difference is None, f"{what}: loaded a silently different result: {difference}"
    return "identical"


def header_bit_flips(directory: Path, config: AttentionConfig, dtype: str, counter: str,
                     metadata: dict | None = None) -> collections.Counter:
    """Flip every bit of the length prefix and the header, one at a time; load each."""
    tensors = weights.init(config, seed=5, dtype=dtype)
    good = weights.to_bytes(config, tensors, metadata=metadata)
    (n,) = struct.unpack("<Q", good[:8])
    path = directory / "flip.safetensors"
    outcomes: collections.Counter = collections.Counter()
    for byte in range(8 + n):
        for bit in range(8):
            data = bytearray(good)
            data[byte] ^= 1 << bit
            path.write_bytes(data)
            outcomes[load_or_refuse(path, config, tensors, f"byte {byte} bit {bit}")] += 1
            COUNTS[counter] += 1
    return outcomes


# An explicit scale, dropout and user metadata: before header_sha256 one flipped bit
# turned scale 0.125 into 8.125 (or dropout 0.25 into 0.65, or the note) and the file loaded.
SCALED = AttentionConfig(num_heads=2, query_dim=4, head_dim=2, scale=0.125, dropout=0.25, num_kv_heads=1)
HEADER_FLIP_CASES = [
    pytest.param(SMALL, "float32", None, id="small-float32"),
    pytest.param(SCALED, "bfloat16", {"note": "hello"}, id="scaled-bfloat16-note"),
]
HEADER_FLIP_SLOW_CASES = [
    pytest.param(AttentionConfig(num_heads=4, query_dim=6, head_dim=3, key_dim=5, value_dim=7, value_head_dim=2,
                                 out_dim=3, num_kv_heads=2, use_key_bias=False, masked_row="uniform"),
                 "float16", {"a": "1", "b": "x"}, id="gqa-float16"),
    pytest.param(AttentionConfig(num_heads=1, query_dim=2, head_dim=1, use_query_bias=False, use_value_bias=False,
                                 use_output_bias=False, scale=-1.5, masked_row="nan"), "float64", None, id="nobias-float64"),
]


@pytest.mark.parametrize("config, dtype, metadata", HEADER_FLIP_CASES)
def test_every_single_bit_flip_in_the_header_is_refused_or_harmless(scratch, config, dtype, metadata):
    outcomes = header_bit_flips(scratch, config, dtype, "header bit flips (exhaustive)", metadata)
    assert sum(outcomes.values()) >= 8 * 1000, outcomes
    assert outcomes["refused"] >= 0.99 * sum(outcomes.values()), outcomes


@pytest.mark.slow
@pytest.mark.parametrize("config, dtype, metadata", HEADER_FLIP_SLOW_CASES)
def test_every_single_bit_flip_in_the_header_is_refused_or_harmless_slow(scratch, config, dtype, metadata):
    outcomes = header_bit_flips(scratch, config, dtype, "header bit flips (exhaustive, slow configs)", metadata)
    assert sum(outcomes.values()) >= 8 * 1000, outcomes
    assert outcomes["refused"] >= 0.99 * sum(outcomes.values()), outcomes


def test_header_sha256_is_written_and_verified(tmp_path):
    tensors = small_tensors()
    path = tmp_path / "w.safetensors"
    weights.save(path, SCALED.replace(num_kv_heads=2), tensors, metadata={"note": "hello"})
    metadata, arrays = weights.read_safetensors(path)
    assert metadata["header_sha256"] == weights.format.header_sha256(metadata, arrays)
    # The header changed, the tensors did not: caught only by header_sha256.
    data = path.read_bytes().replace(b'\\"scale\\": 0.125', b'\\"scale\\": 8.125')
    assert data != path.read_bytes(), "the test did not find the scale in the header"
    refusal(weights.load, write(tmp_path, data, "scale.safetensors"), WeightsFormatError, "header_sha256 mismatch")
    data = path.read_bytes().replace(b'"note":"hello"', b'"note":"jello"')
    refusal(weights.load, write(tmp_path, data, "note.safetensors"), WeightsFormatError, "header_sha256 mismatch")
    # A file written before header_sha256 existed (no such key) still loads.
    old = craft_weights(tensors)
    assert "header_sha256" not in weights.format.canonical_safetensors_bytes(old).decode("latin-1")
    config, loaded = weights.load(write(tmp_path, old, "old.safetensors"))
    assert config == SMALL and same_load((config, loaded), SMALL, tensors) is None
    with pytest.raises(ValueError, match="reserved keys: got header_sha256"):
        weights.to_bytes(SMALL, tensors, metadata={"header_sha256": "0" * 64})


# -- atomic writes: permissions, interrupts, kills, races ----------------------------------

def temp_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp"))


def test_saved_files_get_the_umask_permissions_not_0600(tmp_path):
    """mkstemp creates 0600 files; a weights file shared on a cluster must be readable like any other."""
    old = os.umask(0o022)
    try:
        weights.save(tmp_path / "w.safetensors", SMALL, small_tensors())
        from conformance.io import write_arrays

        write_arrays(tmp_path / "o.safetensors", {"output": np.zeros((1, 1, 4), np.float32)})
        (tmp_path / "plain").write_bytes(b"")
    finally:
        os.umask(old)
    expected = stat.S_IMODE((tmp_path / "plain").stat().st_mode)
    for name in ("w.safetensors", "o.safetensors"):
        mode = stat.S_IMODE((tmp_path / name).stat().st_mode)
        assert mode == expected == 0o644, f"{name} has mode {oct(mode)}, a plain new file {oct(expected)}"


@pytest.mark.parametrize("where", ["os.open", "write", "os.fsync", "os.replace", "os.link"])
@pytest.mark.parametrize("overwrite", [True, False])
def test_keyboard_interrupt_during_a_write_leaves_no_temp_file(tmp_path, monkeypatch, where, overwrite):
    """Ctrl-C at each step of write_bytes_atomic: no temp file, the destination old or new, never a mix.

    "os.open" raises just after the temporary file was created, as a signal
    arriving between the system call and Python storing its result would.
    """
    path = tmp_path / "w.safetensors"
    old_tensors, new_tensors = small_tensors(seed=1), small_tensors(seed=2)
    if overwrite:
        weights.save(path, SMALL, old_tensors)
    before = path.read_bytes() if overwrite else None
    real = {"os.open": os.open, "os.fsync": os.fsync, "os.replace": os.replace, "os.link": os.link}
    calls = collections.Counter()

    def interrupt(name):
        def wrapper(*args, **kwargs):
            if name == "os.open":
                flags = args[1] if len(args) > 1 else kwargs.get("flags", 0)
                if not (flags & os.O_CREAT and str(args[0]).startswith(str(tmp_path))):
                    return real[name](*args, **kwargs)
                os.close(real[name](*args, **kwargs))  # the file now exists; the caller never learns its fd
            calls[name] += 1
            raise KeyboardInterrupt
        return wrapper

    if where == "write":
        import io

        class Interrupting(io.BufferedWriter):
            def write(self, data):
                calls["write"] += 1
                raise KeyboardInterrupt

        real_fdopen = os.fdopen
        monkeypatch.setattr(os, "fdopen", lambda fd, mode="r", *a, **k: Interrupting(real_fdopen(fd, "wb", buffering=0))
                            if "w" in mode else real_fdopen(fd, mode, *a, **k))
    else:
        monkeypatch.setattr(os, where.split(".")[1], interrupt(where))
    if where == "os.replace" and not overwrite or where == "os.link" and overwrite:
        weights.save(path, SMALL, new_tensors, overwrite=overwrite)  # this path does not call it
        assert not calls and temp_files(tmp_path) == []
        return
    with pytest.raises(KeyboardInterrupt):
        weights.save(path, SMALL, new_tensors, overwrite=overwrite)
    monkeypatch.undo()
    assert calls[where] == 1, f"the interrupt at {where} was not reached: {calls}"
    assert temp_files(tmp_path) == [], f"Ctrl-C at {where} left {temp_files(tmp_path)}"
    if overwrite:
        assert path.read_bytes() == before, "the old file was changed by an interrupted write"
    else:
        assert not path.exists(), "an interrupted first write left a destination file"


def test_save_without_overwrite_refuses_an_existing_file_and_leaves_it_byte_identical(tmp_path):
    path = tmp_path / "w.safetensors"
    weights.save(path, SMALL, small_tensors(seed=1))
    before, mtime = path.read_bytes(), path.stat().st_mtime_ns
    for target in (path, tmp_path / "link"):
        if target.name == "link":
            target.symlink_to(path)
        with pytest.raises(FileExistsError, match="exists; pass overwrite=True"):
            weights.save(target, SMALL, small_tensors(seed=2))
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileExistsError, match="exists; pass overwrite=True"):
        weights.save(dangling, SMALL, small_tensors(seed=2))
    assert path.read_bytes() == before and path.stat().st_mtime_ns == mtime
    assert not (tmp_path / "nowhere").exists(), "a dangling symlink was followed"
    assert temp_files(tmp_path) == []


def test_overwriting_keeps_the_destination_permissions(tmp_path):
    path = tmp_path / "w.safetensors"
    weights.save(path, SMALL, small_tensors(seed=1))
    path.chmod(0o640)
    weights.save(path, SMALL, small_tensors(seed=2), overwrite=True)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640, oct(stat.S_IMODE(path.stat().st_mode))


def fork(child) -> int:
    """Run child() in a forked process that exits with its return value (never returns to pytest)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            code = child() or 0
        except BaseException:  # the child's own failure, reported by its exit code
            code = 3
        finally:
            os._exit(code)
    return pid


def two_contents():
    """Two different valid weight files, big enough (~260 kB) that a write takes a while."""
    config = AttentionConfig(num_heads=8, query_dim=64, head_dim=16)
    a, b = weights.init(config, seed=11, dtype="float64"), weights.init(config, seed=12, dtype="float64")
    return config, (a, b), (weights.to_bytes(config, a), weights.to_bytes(config, b))


def kill_writer_repeatedly(directory: Path, iterations: int, budget_s: float, counter: str) -> collections.Counter:
    """Fork a writer that replaces one file forever, alternating two contents; SIGKILL it at a random
    moment while this process keeps loading the file; after each kill the file must be one of the two,
    complete, and load and verify."""
    import random
    import time

    config, tensors, contents = two_contents()
    path = directory / "w.safetensors"
    weights.save(path, config, tensors[0])
    rng = random.Random(6)
    outcomes: collections.Counter = collections.Counter()
    deadline = time.monotonic() + budget_s
    for iteration in range(iterations):
        if time.monotonic() > deadline:
            break
        ready_r, ready_w = os.pipe()

        def writer(ready_w=ready_w, start=iteration):
            os.write(ready_w, b"r")
            i = start
            while True:
                weights.save(path, config, tensors[i % 2], overwrite=True)
                i += 1

        pid = fork(writer)
        os.close(ready_w)
        assert os.read(ready_r, 1) == b"r"
        os.close(ready_r)
        stop = time.monotonic() + rng.uniform(0.0, 0.03)
        while time.monotonic() < stop:  # concurrent readers see old or new, never a mix
            try:
                got = weights.load(path)
            except WeightsFormatError as err:
                raise AssertionError(f"a reader saw a partial file while the writer ran: {err}") from None
            assert same_load(got, config, tensors[0]) is None or same_load(got, config, tensors[1]) is None
            outcomes["concurrent loads"] += 1
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"writer ended with {status}"
        data = path.read_bytes()
        assert data in contents, f"kill {iteration}: the file is neither old nor new ({len(data)} bytes)"
        outcomes[f"left content {'AB'[contents.index(data)]}"] += 1
        got = weights.load(path)
        assert same_load(got, config, tensors[contents.index(data)]) is None
        leftovers = temp_files(directory)
        outcomes["kills mid-write (temp file left)" if leftovers else "kills between writes"] += 1
        for name in leftovers:  # a SIGKILLed writer cannot clean up; the next save does not need it
            (directory / name).unlink()
        outcomes["kills"] += 1
        COUNTS[counter] += 1
    return outcomes


def test_sigkill_during_save_leaves_the_old_file_or_the_new_one(tmp_path):
    outcomes = kill_writer_repeatedly(tmp_path, iterations=60, budget_s=15, counter="writer SIGKILLs")
    print(f"\nSIGKILL outcomes: {dict(outcomes)}")
    assert outcomes["kills"] >= 20, outcomes
    assert outcomes["kills mid-write (temp file left)"] >= 1, f"no kill landed inside a write: {outcomes}"


@pytest.mark.slow
def test_sigkill_during_save_leaves_the_old_file_or_the_new_one_slow(tmp_path):
    outcomes = kill_writer_repeatedly(tmp_path, iterations=1000, budget_s=240, counter="writer SIGKILLs (slow)")
    print(f"\nSIGKILL outcomes: {dict(outcomes)}")
    assert outcomes["kills"] >= 300, outcomes
    assert outcomes["kills mid-write (temp file left)"] >= 10, outcomes


def test_a_clean_exit_leaves_no_temp_files(tmp_path):
    config, tensors, contents = two_contents()

    def writer():
        for i in range(20):
            weights.save(tmp_path / "w.safetensors", config, tensors[i % 2], overwrite=True)
            weights.save(tmp_path / f"new{i}.safetensors", config, tensors[i % 2])
        return 0

    pid = fork(writer)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert temp_files(tmp_path) == [], temp_files(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["w.safetensors"] + [f"new{i}.safetensors" for i in range(20)])
    assert (tmp_path / "w.safetensors").read_bytes() == contents[1]


def test_concurrent_first_writes_without_overwrite_exactly_one_wins(tmp_path):
    config, tensors, contents = two_contents()
    path = tmp_path / "w.safetensors"
    go_r, go_w = os.pipe()
    pids = []
    for k in range(6):
        def writer(k=k):
            os.read(go_r, 1)  # all start together
            try:
                weights.save(path, config, tensors[k % 2])
            except FileExistsError:
                return 17
            return 10 + k % 2
        pids.append(fork(writer))
    os.close(go_r)
    os.write(go_w, b"x" * len(pids))
    os.close(go_w)
    codes = [os.WEXITSTATUS(os.waitpid(pid, 0)[1]) for pid in pids]
    winners = [c for c in codes if c in (10, 11)]
    assert len(winners) == 1 and codes.count(17) == len(pids) - 1, f"exit codes {codes}"
    assert path.read_bytes() == contents[winners[0] - 10]
    assert temp_files(tmp_path) == []
    COUNTS["concurrent first writers"] += len(pids)


# -- inputs files -------------------------------------------------------------------------------

def inputs_file(directory: Path, name: str = "i.safetensors", **arrays) -> Path:
    return write(directory, st_bytes(arrays), name)


Q = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)


@pytest.mark.parametrize("mask_dtype", ["bool", "uint8", "int8", "int64", "float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("name", ["mask", "dropout_mask"])
def test_inputs_masks_of_0_and_1_in_any_numeric_dtype_read_as_bool(tmp_path, name, mask_dtype):
    pattern = np.array([[1, 0, 1], [0, 1, 1], [1, 1, 0]], dtype=np.int64)
    path = inputs_file(tmp_path, query=Q, **{name: pattern.astype(weights.DTYPES.get(mask_dtype, mask_dtype))})
    got = read_inputs(path)[name]
    assert got.dtype == bool and np.array_equal(got, pattern.astype(bool)), got


@pytest.mark.parametrize("mask_dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("value", [0.5, -1.0, np.nan, np.inf, -np.inf, 2.0])
def test_inputs_float_masks_other_than_0_and_1_are_refused(tmp_path, mask_dtype, value):
    mask = np.ones((3, 3), dtype=np.float64)
    mask[1, 2] = value
    path = inputs_file(tmp_path, query=Q, mask=mask.astype(weights.DTYPES[mask_dtype]))
    refusal(read_inputs, path, InputsError, "mask must be bool or 0/1", "floats other than 0 and 1", mask_dtype)
