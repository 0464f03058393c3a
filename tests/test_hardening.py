"""Hardening: bad files, bad inputs and interrupted writes never crash, mislead or lose data.

Every malformed weights file ends in `WeightsFormatError`, every malformed
inputs file in `InputsError`, each one line naming the file and the problem:
never another exception, never a hang, never a silently wrong result.

The fuzzers count the cases they run; the counts are printed at the end of the
session (terminal summary, and on stdout with -s) and each fuzzer asserts a
minimum so one that silently runs nothing fails. `pytest -m slow` runs the
long versions.

No framework is imported here: weights, conformance.io and impl_numpy are NumPy-only.
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
import signal
import stat
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import weights
from conformance.io import InputsError, read_inputs
from impl_numpy import multi_head_attention
from weights import AttentionConfig, WeightsFormatError
from weights.format import _SAFETENSORS_NUMPY

pytestmark = pytest.mark.reference  # NumPy only, no framework looked for: the numpy env runs it, `all` does not again

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


def refusal_problems(read, path, error: type[ValueError], *fragments: str) -> tuple[str, list[str]]:
    """Call read(path): (its message, what is wrong with the refusal). Right means it raised exactly
    `error`, on one line, naming the path and each fragment; any other outcome is a problem."""
    try:
        result = read(path)
    except error as err:
        message = str(err)
    except BaseException as err:  # any other exception is the failure tested for
        return "", [f"{read.__name__}({path}) raised {type(err).__name__}: {err}, not {error.__name__}"]
    else:
        return "", [f"{read.__name__}({path}) accepted a bad file and returned {type(result).__name__}"]
    problems = [] if str(path) in message else [f"message does not name the file {path}: {message!r}"]
    problems += [f"message is not one line: {message!r}"] if "\n" in message else []
    problems += [f"{fragment!r} not in {message!r}" for fragment in fragments if fragment not in message]
    return message, problems


def refusal(read, path, error: type[ValueError], *fragments: str) -> str:
    """refusal_problems, asserting there are none; returns the message."""
    message, problems = refusal_problems(read, path, error, *fragments)
    assert not problems, "; ".join(problems)
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
    problems = (refusal_problems(weights.read_safetensors, path, WeightsFormatError, *fragments)[1]
                + refusal_problems(read_inputs, path, InputsError, *fragments)[1]
                + refusal_problems(weights.load, path, WeightsFormatError)[1])
    assert not problems, f"{label}: " + "; ".join(problems)
    COUNTS["crafted headers (reader regressions)"] += 1


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
    problems = (refusal_problems(weights.load, path, WeightsFormatError,
                                 "not a regular file" if kind != "directory" else "directory")[1]
                + refusal_problems(read_inputs, path, InputsError)[1])
    assert not problems, f"{kind}: " + "; ".join(problems)
    COUNTS["not regular files (FIFO, directory, device)"] += 1


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
    ('{"num_heads": 2, "query_dim": 4, "head_dim": 2, "scale": ' + "1" + "0" * 400 + "}", "scale must be a finite number or null"),
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


def reason_of(message: str, path: Path) -> str:
    """A refusal's reason: its message without the file name, quoted names and numbers, so that the
    refusals of one check count once however the file differed."""
    text = message.removeprefix(f"{path}: ")
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", text)
    text = re.sub(r"\[[^\]]*\]", "[…]", text)  # shapes
    text = re.sub(r"\b(?:BOOL|[A-Z]+\d+(?:_[A-Z0-9]+)?)\b", "DTYPE", text)  # safetensors dtype codes
    return re.sub(r"-?\d+", "#", text)


def load_or_refuse(path: Path, config: AttentionConfig, tensors: dict, what: str,
                   reasons: collections.Counter | None = None) -> str:
    """'refused' or 'identical'; anything else (another exception, a changed result) fails.
    reasons: counts each refusal's reason_of."""
    try:
        got = weights.load(path)
    except WeightsFormatError as err:
        message = str(err)
        assert message.startswith(f"{path}: ") and "\n" not in message, f"{what}: {message!r}"
        if reasons is not None:
            reasons[reason_of(message, path)] += 1
        return "refused"
    except BaseException as err:  # the failure tested for
        raise AssertionError(f"{what}: load raised {type(err).__name__}: {err}") from err
    difference = same_load(got, config, tensors)
    assert difference is None, f"{what}: loaded a silently different result: {difference}"
    return "identical"


def header_bit_flips(directory: Path, config: AttentionConfig, dtype: str, counter: str,
                     metadata: dict | None = None) -> tuple[bytes, collections.Counter, set[tuple[int, int]]]:
    """Flip every bit of the length prefix and the header, one at a time; load each.
    Returns the good file, the outcomes and the flips (byte, bit) that loaded identically."""
    tensors = weights.init(config, seed=5, dtype=dtype)
    good = weights.to_bytes(config, tensors, metadata=metadata)
    (n,) = struct.unpack("<Q", good[:8])
    path = directory / "flip.safetensors"
    outcomes: collections.Counter = collections.Counter()
    harmless: set[tuple[int, int]] = set()
    for byte in range(8 + n):
        for bit in range(8):
            data = bytearray(good)
            data[byte] ^= 1 << bit
            path.write_bytes(data)
            outcome = load_or_refuse(path, config, tensors, f"byte {byte} bit {bit}")
            outcomes[outcome] += 1
            if outcome == "identical":
                harmless.add((byte, bit))
            COUNTS[counter] += 1
    return good, outcomes, harmless


def legal_in_json_string(b: int) -> bool:
    """A byte that may stand unescaped inside a JSON string of a UTF-8 header: ASCII from the space
    up (DEL included), but not the quote or the backslash; control bytes and non-ASCII bytes (alone,
    not UTF-8) are not."""
    return 0x20 <= b < 0x80 and b not in (0x22, 0x5C)


def flips_inside_strings(good: bytes, strings) -> set[tuple[int, int]]:
    """The one-bit flips (byte, bit) of the header that land in the characters of one of `strings`
    (written as JSON strings, each once in the header) and leave a legal JSON string."""
    (n,) = struct.unpack("<Q", good[:8])
    flips = set()
    for text in strings:
        token = json.dumps(text).encode()
        assert good.count(token, 8, 8 + n) == 1, f"{token!r} is not once in the header"
        at = good.index(token, 8, 8 + n)
        flips |= {(byte, bit) for byte in range(at + 1, at + len(token) - 1) for bit in range(8)
                  if legal_in_json_string(good[byte] ^ (1 << bit))}
    return flips


def assert_harmless_flips_are(harmless: set, predicted: set, total: int, why: str) -> None:
    assert harmless == predicted, (
        f"{len(harmless)} of {total} header bit flips loaded identically, predicted {len(predicted)} ({why}); "
        f"loaded though not predicted (byte, bit): {sorted(harmless - predicted)[:12]}; "
        f"refused though predicted harmless: {sorted(predicted - harmless)[:12]}")


# Which flips a correct reader cannot notice, worked out from the format: the weights header is
# covered by header_sha256, except the metadata key that names it. Renamed by a flip to another legal
# key, the file reads as one written before header_sha256 (accepted: the tensors' sha256 map still
# checks every byte of data) with one unknown metadata key (ignored): the same config and tensors.
# Every other flip must be refused.
WEIGHTS_HEADER_UNCHECKED = ("header_sha256",)


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
    good, outcomes, harmless = header_bit_flips(scratch, config, dtype, "header bit flips (exhaustive)", metadata)
    assert_harmless_flips_are(harmless, flips_inside_strings(good, WEIGHTS_HEADER_UNCHECKED), sum(outcomes.values()),
                              "the letters of the header_sha256 key")


@pytest.mark.slow
@pytest.mark.parametrize("config, dtype, metadata", HEADER_FLIP_SLOW_CASES)
def test_every_single_bit_flip_in_the_header_is_refused_or_harmless_slow(scratch, config, dtype, metadata):
    good, outcomes, harmless = header_bit_flips(scratch, config, dtype, "header bit flips (exhaustive, slow configs)",
                                                metadata)
    assert_harmless_flips_are(harmless, flips_inside_strings(good, WEIGHTS_HEADER_UNCHECKED), sum(outcomes.values()),
                              "the letters of the header_sha256 key")


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
    COUNTS["Ctrl-C injected into a write"] += 1
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
    outcomes = kill_writer_repeatedly(tmp_path, iterations=500, budget_s=90, counter="writer SIGKILLs (slow)")
    print(f"\nSIGKILL outcomes: {dict(outcomes)}")
    assert outcomes["kills"] >= 200, outcomes
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
    COUNTS["inputs masks (0/1 and not)"] += 1


@pytest.mark.parametrize("mask_dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("value", [0.5, -1.0, np.nan, np.inf, -np.inf, 2.0])
def test_inputs_float_masks_other_than_0_and_1_are_refused(tmp_path, mask_dtype, value):
    mask = np.ones((3, 3), dtype=np.float64)
    mask[1, 2] = value
    path = inputs_file(tmp_path, query=Q, mask=mask.astype(weights.DTYPES[mask_dtype]))
    _, problems = refusal_problems(read_inputs, path, InputsError, "mask must be bool or 0/1",
                                   "floats other than 0 and 1", mask_dtype)
    assert not problems, "; ".join(problems)
    COUNTS["inputs masks (0/1 and not)"] += 1


# -- truncation at every byte -------------------------------------------------------------------

def sample_inputs_bytes(dtype: str = "float32") -> bytes:
    rng = np.random.default_rng(3)
    dt = weights.DTYPES[dtype]
    return st_bytes({
        "query": rng.standard_normal((2, 3, 4)).astype(dt),
        "key": rng.standard_normal((2, 5, 4)).astype(dt),
        "value": rng.standard_normal((2, 5, 4)).astype(dt),
        "mask": rng.random((2, 3, 5)) < 0.7,
        "bias": np.where(rng.random((3, 5)) < 0.2, -np.inf, rng.standard_normal((3, 5))).astype(dt),
        "dropout_mask": rng.random((2, 2, 3, 5)) < 0.9,
    }, {"note": "inputs"})


TRUNCATION_REASONS = {
    "length prefix": re.compile(r"not a safetensors file: (\d+) bytes, shorter than the 8-byte header length"),
    "header": re.compile(r"not a safetensors file: header length (\d+) exceeds the file's remaining (\d+) bytes"),
    "data": re.compile(r"tensor '([^']+)' claims bytes (\d+)\.\.(\d+) for shape \[([\d, ]*)\] (\w+), "
                       r"but the data section has (\d+) bytes"),
}


def truncate_everywhere(directory: Path, data: bytes, read, error, counter: str) -> collections.Counter:
    """Every proper prefix data[:n] (n = 0 .. len-1) of a valid file is refused by `read` with `error`,
    for the reason the layout gives: n < 8, the length prefix is cut; n < 8 + H (H the header length),
    the header; else the data section, and the tensor named is one whose bytes the prefix cuts, with its
    offsets, shape and dtype as the header has them. Returns the refusals by the reason read gave."""
    (H,) = struct.unpack("<Q", data[:8])
    entries = {name: entry for name, entry in header_of(data).items() if name != "__metadata__"}
    path = directory / "cut.safetensors"
    read(write(directory, data, "whole.safetensors"))  # the whole file is valid
    reasons: collections.Counter = collections.Counter()
    for n in range(len(data)):
        path.write_bytes(data[:n])
        message = refusal(read, path, error)[len(f"{path}: "):]
        kind, found = next(((kind, m) for kind, pattern in TRUNCATION_REASONS.items()
                            if (m := pattern.fullmatch(message))), ("unrecognised", None))
        if kind == "length prefix":
            assert found.groups() == (str(n),), f"prefix {n}: {message!r}"
        elif kind == "header":
            assert found.groups() == (str(H), str(n - 8)), f"prefix {n}: {message!r} (header length {H})"
        elif kind == "data":
            name, start, end, shape, code, have = found.groups()
            entry = entries.get(name)
            assert entry is not None and [int(start), int(end)] == entry["data_offsets"] and shape == ", ".join(
                map(str, entry["shape"])) and code == entry["dtype"], f"prefix {n}: {message!r}, header has {entry}"
            assert int(have) == n - 8 - H < int(end), f"prefix {n} (data section {n - 8 - H} bytes): {message!r}"
        else:
            kind = f"unrecognised: {message}"
        reasons[kind] += 1
        COUNTS[counter] += 1
    return reasons


def assert_truncations_refused_by_layout(reasons: collections.Counter, data: bytes) -> None:
    """Refusals by the reason given against the file's layout: 8 prefixes cut the length, H the header, the
    rest the data section (a reader that blamed the wrong part, or gave another reason, is counted apart)."""
    (H,) = struct.unpack("<Q", data[:8])
    expected = {"length prefix": 8, "header": H, "data": len(data) - 8 - H}
    assert reasons == expected, f"refusals by reason {dict(reasons)}, by the layout {expected}"


def test_truncated_weights_files_are_refused_at_every_byte(scratch):
    data = weights.to_bytes(SMALL, small_tensors(), metadata={"note": "x"})
    reasons = truncate_everywhere(scratch, data, weights.load, WeightsFormatError, "truncations: weights (exhaustive)")
    assert_truncations_refused_by_layout(reasons, data)


def test_truncated_inputs_files_are_refused_at_every_byte(scratch):
    data = sample_inputs_bytes()
    reasons = truncate_everywhere(scratch, data, read_inputs, InputsError, "truncations: inputs (exhaustive)")
    assert_truncations_refused_by_layout(reasons, data)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", list(weights.DTYPES))
def test_truncated_files_are_refused_at_every_byte_slow(scratch, dtype):
    config = AttentionConfig(num_heads=4, query_dim=6, head_dim=3, num_kv_heads=2, use_value_bias=False)
    data = weights.to_bytes(config, weights.init(config, seed=1, dtype=dtype))
    reasons = truncate_everywhere(scratch, data, weights.load, WeightsFormatError,
                                  "truncations: weights (exhaustive, slow configs)")
    assert_truncations_refused_by_layout(reasons, data)
    data = sample_inputs_bytes(dtype)
    reasons = truncate_everywhere(scratch, data, read_inputs, InputsError, "truncations: inputs (exhaustive, slow dtypes)")
    assert_truncations_refused_by_layout(reasons, data)


# -- checksums: every bit of the data section ---------------------------------------------------

def data_bit_flips(directory: Path, config: AttentionConfig, dtype: str, counter: str) -> tuple[dict, collections.Counter]:
    """Flip each bit of each tensor byte, one at a time: load names exactly that tensor's sha256 mismatch,
    and no other. Returns the tensors and how many flips each refusal blamed on each tensor."""
    tensors = weights.init(config, seed=9, dtype=dtype)
    good = weights.to_bytes(config, tensors)
    header = header_of(good)
    start = len(good) - sum(a.nbytes for a in tensors.values())
    owner = {}
    for name, entry in header.items():
        if name != "__metadata__":
            for offset in range(*entry["data_offsets"]):
                owner[start + offset] = name
    assert sorted(owner) == list(range(start, len(good))), "the data section is not fully owned"
    path = directory / "bits.safetensors"
    blamed: collections.Counter = collections.Counter()
    for byte in range(start, len(good)):
        for bit in range(8):
            data = bytearray(good)
            data[byte] ^= 1 << bit
            path.write_bytes(data)
            message = refusal(weights.load, path, WeightsFormatError, f"sha256 mismatch for {owner[byte]} ")
            names = re.findall(r"sha256 mismatch for (\S+) ", message)
            assert names == [owner[byte]], f"byte {byte} bit {bit} of {owner[byte]}: blamed {names}: {message!r}"
            blamed.update(names)
            COUNTS[counter] += 1
    return tensors, blamed


def assert_every_bit_blamed_on_its_tensor(tensors: dict, blamed: collections.Counter, parameters: int, dtype: str):
    """Each tensor was blamed once for each of its bits (8 per byte of its array), and no tensor was missed."""
    expected = {name: 8 * array.nbytes for name, array in tensors.items()}
    assert blamed == expected, f"flips blamed per tensor {dict(blamed)}, bits per tensor {expected}"
    assert sum(expected.values()) == 8 * parameters * weights.DTYPES[dtype].itemsize, expected


@pytest.mark.parametrize("dtype", list(weights.DTYPES))
def test_a_single_flipped_bit_in_any_tensor_byte_is_caught(scratch, dtype):
    tensors, blamed = data_bit_flips(scratch, SMALL, dtype, "data-section bit flips (exhaustive)")
    # SMALL: q, k, v kernels 4x2x2 and biases 2x2, output 2x2x4 and bias 4: 80 parameters
    assert_every_bit_blamed_on_its_tensor(tensors, blamed, 80, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", list(weights.DTYPES))
def test_a_single_flipped_bit_in_any_tensor_byte_is_caught_slow(scratch, dtype):
    config = AttentionConfig(num_heads=4, query_dim=8, head_dim=3, key_dim=5, value_head_dim=2, num_kv_heads=2)
    tensors, blamed = data_bit_flips(scratch, config, dtype, "data-section bit flips (exhaustive, slow configs)")
    # query 8x4x3 + 4x3, key 5x2x3 + 2x3, value 5x2x2 + 2x2, output 4x2x8 + 8
    assert_every_bit_blamed_on_its_tensor(tensors, blamed, 96 + 12 + 30 + 6 + 20 + 4 + 64 + 8, dtype)


# -- hypothesis fuzzers -------------------------------------------------------------------------




def fuzz_settings(at_least: int) -> settings:
    """The active profile ("ci" by default), with at least `at_least` examples: a case takes ~1 ms."""
    return settings(max_examples=max(at_least, settings().max_examples), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def assert_reasons_reached(reasons: collections.Counter, at_least: int, what: str) -> None:
    """A fuzzer must reach many of the readers' checks: at least `at_least` distinct reasons (reason_of).
    Fewer means the generator stopped reaching them, or the readers stopped telling them apart."""
    assert len(reasons) >= at_least, (
        f"{what}: {len(reasons)} distinct refusal reasons, expected at least {at_least}: {dict(reasons.most_common())}")


# The distinct reasons each fuzzer reaches: the minimums are about two thirds of what was measured, the
# `ci` profile's examples (derandomized: the same every run) 23 for the mutations, 9 for the structured
# headers and 23 for random JSON (each reader's reasons counted apart), the slow fuzzers' 8000 random
# examples 73, 57 and 16.
MUTATION_REASONS_MIN = 15
STRUCTURED_REASONS_MIN = 6
RANDOM_JSON_REASONS_MIN = 15
LONG_REASONS_MIN = {"mutations": 48, "structured": 38, "random JSON": 10}


def slow_fuzz_settings(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, derandomize=False, database=None,
                    suppress_health_check=list(HealthCheck))


@st.composite
def file_mutations(draw, good: bytes) -> tuple[bytes, str]:
    """A valid file with 1-8 random edits: bit flips, byte sets, insertions, deletions, in the header
    (the 8-byte length then rewritten, or not) or anywhere in the file."""
    (n,) = struct.unpack("<Q", good[:8])
    header_only = draw(st.booleans())
    fix_length = header_only and draw(st.booleans())
    target = bytearray(good[8 : 8 + n] if header_only else good)
    edits = []
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["flip", "set", "insert", "delete"]))
        at = draw(st.integers(0, max(len(target) - 1, 0)))
        if kind == "flip" and target:
            target[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set" and target:
            target[at] = draw(st.sampled_from([0, 0x22, 0x2C, 0x3A, 0x5C, 0x7B, 0x7D, 0x80, 0xFF, 0x20, 0x30]))
        elif kind == "insert":
            target[at:at] = draw(st.binary(min_size=1, max_size=4) | st.sampled_from([b'"', b",", b"1", b"e5"]))
        elif kind == "delete" and target:
            del target[at : at + draw(st.integers(1, 4))]
        edits.append(f"{kind}@{at}")
    if header_only:
        length = len(target) if fix_length else n
        data = struct.pack("<Q", length) + bytes(target) + good[8 + n :]
    else:
        data = bytes(target)
    return data, f"{'header' if header_only else 'file'}{'+length' if fix_length else ''}: {', '.join(edits)}"


def test_fuzz_weights_file_mutations(scratch):
    config = AttentionConfig(num_heads=2, query_dim=4, head_dim=2, scale=0.5, dropout=0.25, num_kv_heads=1)
    tensors = weights.init(config, seed=2)
    good = weights.to_bytes(config, tensors, metadata={"note": "n"})
    path = scratch / "m.safetensors"
    outcomes, reasons = collections.Counter(), collections.Counter()

    @fuzz_settings(400)
    @given(file_mutations(good))
    def check(mutation):
        data, what = mutation
        path.write_bytes(data)
        outcomes[load_or_refuse(path, config, tensors, what, reasons)] += 1
        COUNTS["weights file mutations (hypothesis)"] += 1

    check()
    print(f"\nweights mutations: {dict(outcomes)}, {len(reasons)} reasons: {dict(reasons.most_common())}")
    assert_reasons_reached(reasons, MUTATION_REASONS_MIN, "weights file mutations")


def test_fuzz_inputs_file_header_bit_flips_exhaustive(scratch):
    """Every bit of an inputs file's header: refused, or read back exactly as before (inputs have no checksums,
    so the data section is not covered; the header is)."""
    good = sample_inputs_bytes()
    original = read_inputs(write(scratch, good, "good.safetensors"))
    (n,) = struct.unpack("<Q", good[:8])
    path = scratch / "flip.safetensors"
    harmless = set()
    for byte in range(8 + n):
        for bit in range(8):
            data = bytearray(good)
            data[byte] ^= 1 << bit
            path.write_bytes(data)
            try:
                got = read_inputs(path)
            except InputsError as err:
                assert str(err).startswith(f"{path}: ") and "\n" not in str(err), str(err)
            else:
                assert list(got) == list(original) and all(
                    got[k].dtype == original[k].dtype and got[k].shape == original[k].shape
                    and got[k].tobytes() == original[k].tobytes() for k in got), f"byte {byte} bit {bit}: changed"
                harmless.add((byte, bit))
            COUNTS["inputs header bit flips (exhaustive)"] += 1
    # read_inputs returns the arrays, not the metadata: a flip inside a metadata key or value that leaves a
    # legal string cannot be noticed (and changes nothing read); every other flip of the header must be refused.
    metadata = header_of(good)["__metadata__"]
    assert_harmless_flips_are(harmless, flips_inside_strings(good, [*metadata, *metadata.values()]), 8 * (8 + n),
                              f"the letters of the metadata {metadata}")


# A structured generator: entries built consistently, then perhaps broken in one way. The oracle
# decodes the bytes itself: an accepted file must give exactly those arrays, and a file the generator
# built valid must be accepted.

SAFE_CODES = list(_SAFETENSORS_NUMPY)


@st.composite
def safetensors_files(draw):
    names = draw(st.lists(st.sampled_from(["query", "key", "value", "mask", "bias", "dropout_mask", "extra",
                                           "query.kernel", "é", ""]), min_size=0, max_size=4))
    entries, chunks, offset = [], [], 0
    for name in names:
        code = draw(st.sampled_from(SAFE_CODES))
        shape = draw(st.lists(st.integers(0, 3), min_size=0, max_size=3))
        dtype = np.dtype(_SAFETENSORS_NUMPY[code])
        nbytes = math.prod(shape) * dtype.itemsize
        raw = draw(st.binary(min_size=nbytes, max_size=nbytes))
        if code == "BOOL" and draw(st.booleans()):
            raw = bytes(b & 1 for b in raw)
        entries.append([name, {"dtype": code, "shape": shape, "data_offsets": [offset, offset + nbytes]}])
        chunks.append(raw)
        offset += nbytes
    metadata = draw(st.none() | st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=3))
    body = b"".join(chunks)
    breakage = draw(st.sampled_from(["none"] * 4 + ["offset", "shape", "dtype", "duplicate", "body+", "body-",
                                                    "metadata", "entry", "surrogate", "order"]))
    if breakage == "offset" and entries:
        entry = draw(st.sampled_from(entries))[1]
        entry["data_offsets"][draw(st.integers(0, 1))] += draw(st.sampled_from([-8, -1, 1, 2, 8, 2**40, 2**64]))
    elif breakage == "shape" and entries:
        entry = draw(st.sampled_from(entries))[1]
        entry["shape"] = draw(st.sampled_from([[-1], [2**62, 4], [1.5], ["2"], [True], 3, None, [2**64]]))
    elif breakage == "dtype" and entries:
        draw(st.sampled_from(entries))[1]["dtype"] = draw(st.sampled_from(["F8_E4M3", "f32", "", 32, None, ["F32"]]))
    elif breakage == "duplicate" and entries:
        entries.append(list(draw(st.sampled_from(entries))))
    elif breakage == "body+":
        body += draw(st.binary(min_size=1, max_size=8))
    elif breakage == "body-" and body:
        body = body[: -draw(st.integers(1, len(body)))]
    elif breakage == "metadata":
        metadata = draw(st.sampled_from([[], 5, "x", {"a": 1}, {"a": None}, {"a": ["b"]}, False]))
    elif breakage == "entry" and entries:
        entry = draw(st.sampled_from(entries))
        entry[1] = draw(st.sampled_from([None, [], "F32", {"dtype": "F32"}, {**entry[1], "extra": 1}]))
    elif breakage == "surrogate":
        metadata = {"x": "\ud800"}
    elif breakage == "order" and len(entries) > 1:
        a, b = entries[0][1], entries[1][1]
        if isinstance(a, dict) and isinstance(b, dict):
            a["data_offsets"], b["data_offsets"] = b["data_offsets"], a["data_offsets"]
    pairs = ([["__metadata__", metadata]] if metadata is not None or draw(st.booleans()) else []) + entries
    text = "{" + ",".join(json.dumps(k) + ":" + json.dumps(v) for k, v in pairs) + "}"
    return raw_file(text + " " * draw(st.integers(0, 7)), body), entries, metadata, body


def decode_expected(entries, metadata, body):
    """The independent oracle: the arrays a correct strict reader returns, or None if it must refuse."""
    names = [name for name, _ in entries]
    if len(set(names)) != len(names) or "__metadata__" in names:
        return None
    if metadata is not None and (not isinstance(metadata, dict)
                                 or not all(isinstance(v, str) for v in metadata.values())):
        return None
    try:
        for text in [*names, *(metadata or {}), *(metadata or {}).values()]:
            text.encode("utf-8")
    except UnicodeEncodeError:
        return None
    spans, arrays = [], {}
    for name, entry in entries:
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            return None
        code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(code, str) or code not in _SAFETENSORS_NUMPY or not isinstance(shape, list):
            return None
        if not all(type(d) is int and d >= 0 for d in shape) or not isinstance(offsets, list) or len(offsets) != 2:
            return None
        dtype = np.dtype(_SAFETENSORS_NUMPY[code])
        start, end = offsets
        if not (0 <= start <= end <= len(body)) or end - start != math.prod(shape) * dtype.itemsize:
            return None
        raw = body[start:end]
        if code == "BOOL" and any(b > 1 for b in raw):
            return None
        spans.append((start, end))
        arrays[name] = np.frombuffer(raw, dtype=dtype).reshape(shape)
    position = 0
    for start, end in sorted(spans):
        if start != position:
            return None
        position = end
    return arrays if position == len(body) else None


def test_fuzz_structured_safetensors_headers(scratch):
    path = scratch / "s.safetensors"
    outcomes = collections.Counter()

    @fuzz_settings(400)
    @given(safetensors_files())
    def check(case):
        data, entries, metadata, body = case
        path.write_bytes(data)
        expected = decode_expected(entries, metadata, body)
        try:
            got_metadata, got = weights.read_safetensors(path)
        except WeightsFormatError as err:
            assert expected is None, f"a valid file was refused: {err}"
            assert str(err).startswith(f"{path}: ") and "\n" not in str(err), str(err)
            outcomes["refused"] += 1
            reasons[reason_of(str(err), path)] += 1
        else:
            assert expected is not None, f"an invalid file was accepted: {data[:200]!r}"
            assert got_metadata == (metadata or {})
            assert list(got) == list(expected)
            for name, array in expected.items():
                assert got[name].dtype == array.dtype and got[name].shape == array.shape, name
                assert got[name].tobytes() == array.astype(array.dtype.newbyteorder("=")).tobytes(), name
            outcomes["accepted"] += 1
        # The other two readers never raise anything else, and name the file.
        for read, error in ((read_inputs, InputsError), (weights.load, WeightsFormatError)):
            try:
                read(path)
            except error as err:
                assert str(err).startswith(f"{path}: ") and "\n" not in str(err), str(err)
        COUNTS["structured safetensors headers (hypothesis)"] += 1

    reasons = collections.Counter()
    check()
    print(f"\nstructured headers: {dict(outcomes)}, {len(reasons)} reasons: {dict(reasons.most_common())}")
    assert outcomes["accepted"] >= 30 and outcomes["refused"] >= 30, outcomes
    assert_reasons_reached(reasons, STRUCTURED_REASONS_MIN, "structured safetensors headers")


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=20,
)


def test_fuzz_random_json_headers_and_raw_bytes(scratch):
    path = scratch / "j.safetensors"

    @fuzz_settings(300)
    @given(header=JSON_VALUES | st.dictionaries(st.sampled_from(["query", "__metadata__", "key"]), JSON_VALUES),
           body=st.binary(max_size=64), raw=st.none() | st.binary(max_size=80), length=st.none() | st.integers(0, 2**64 - 1))
    def check(header, body, raw, length):
        data = raw if raw is not None else raw_file(json.dumps(header), body, length=length)
        path.write_bytes(data)
        for read, error in ((weights.read_safetensors, WeightsFormatError), (read_inputs, InputsError),
                            (weights.load, WeightsFormatError)):
            try:
                read(path)
            except error as err:
                assert str(err).startswith(f"{path}: ") and "\n" not in str(err), str(err)
                reasons[f"{read.__name__}: {reason_of(str(err), path)}"] += 1
        COUNTS["random JSON headers and raw bytes (hypothesis)"] += 1

    reasons = collections.Counter()
    check()
    print(f"\nrandom JSON: {len(reasons)} reasons: {dict(reasons.most_common())}")
    assert_reasons_reached(reasons, RANDOM_JSON_REASONS_MIN, "random JSON headers and raw bytes")


@pytest.mark.slow
def test_fuzz_long(scratch):
    """The three hypothesis file fuzzers above, 8000 examples each, not derandomized."""
    config = AttentionConfig(num_heads=2, query_dim=4, head_dim=2, scale=0.5, dropout=0.25, num_kv_heads=1)
    tensors = weights.init(config, seed=2)
    good = weights.to_bytes(config, tensors, metadata={"note": "n"})
    path = scratch / "long.safetensors"

    reasons = {name: collections.Counter() for name in LONG_REASONS_MIN}

    def refused(kind, read, error):
        try:
            read(path)
        except error as err:
            reasons[kind][f"{read.__name__}: {reason_of(str(err), path)}"] += 1

    @slow_fuzz_settings(8_000)
    @given(file_mutations(good))
    def mutations(mutation):
        path.write_bytes(mutation[0])
        load_or_refuse(path, config, tensors, mutation[1], reasons["mutations"])
        COUNTS["weights file mutations (hypothesis, slow)"] += 1

    @slow_fuzz_settings(8_000)
    @given(safetensors_files())
    def structured(case):
        data, entries, metadata, body = case
        path.write_bytes(data)
        expected = decode_expected(entries, metadata, body)
        try:
            _, got = weights.read_safetensors(path)
        except WeightsFormatError as err:
            assert expected is None, f"a valid file was refused: {err}"
            reasons["structured"][f"read_safetensors: {reason_of(str(err), path)}"] += 1
        else:
            assert expected is not None and list(got) == list(expected), data[:200]
            assert all(got[k].tobytes() == expected[k].tobytes() for k in got)
        for read, error in ((read_inputs, InputsError), (weights.load, WeightsFormatError)):
            refused("structured", read, error)
        COUNTS["structured safetensors headers (hypothesis, slow)"] += 1

    @slow_fuzz_settings(8_000)
    @given(header=JSON_VALUES, body=st.binary(max_size=64), raw=st.none() | st.binary(max_size=200))
    def random_json(header, body, raw):
        path.write_bytes(raw if raw is not None else raw_file(json.dumps(header), body))
        for read, error in ((read_inputs, InputsError), (weights.load, WeightsFormatError)):
            refused("random JSON", read, error)
        COUNTS["random JSON headers and raw bytes (hypothesis, slow)"] += 1

    mutations()
    structured()
    random_json()
    print("\n" + "; ".join(f"{kind}: {len(found)} reasons" for kind, found in reasons.items()))
    for kind, at_least in LONG_REASONS_MIN.items():
        assert_reasons_reached(reasons[kind], at_least, f"{kind} (slow)")


# -- crafted weight files: each bad-input class, checksums otherwise valid ------------------------

def _with(tensors: dict, **changes) -> dict:
    out = dict(tensors)
    for name, value in changes.items():
        name = name.replace("__", ".")
        if value is None:
            out.pop(name)
        else:
            out[name] = value
    return out


def _bad_value(value: float) -> dict:
    tensors = small_tensors()
    kernel = tensors["key.kernel"].copy()
    kernel[1, 0, 1] = value
    return _with(tensors, key__kernel=kernel)


T32 = small_tensors()
CRAFTED = [
    # wrong dtypes (every tensor, or one)
    *[(f"all tensors {dt}", lambda dt=dt: {n: a.astype(dt) for n, a in T32.items()}, {}, [f"has dtype {dt}"])
      for dt in ("int8", "uint8", "int16", "int32", "int64", "uint64", "bool")],
    ("one tensor int32", lambda: _with(T32, query__bias=T32["query.bias"].astype(np.int32)), {},
     ["query.bias has dtype int32"]),
    ("one tensor float64", lambda: _with(T32, value__bias=T32["value.bias"].astype(np.float64)), {},
     ["tensors must share one dtype"]),
    ("float16 and bfloat16 mixed", lambda: {n: a.astype(weights.DTYPES["float16" if i % 2 else "bfloat16"])
                                            for i, (n, a) in enumerate(T32.items())}, {}, ["share one dtype"]),
    # shapes that disagree with the config
    ("kernel transposed", lambda: _with(T32, query__kernel=np.ascontiguousarray(T32["query.kernel"].transpose(1, 0, 2))),
     {}, ["query.kernel has shape (2, 4, 2), expected (4, 2, 2)"]),
    ("kernel flattened", lambda: _with(T32, key__kernel=T32["key.kernel"].reshape(4, 4)), {},
     ["key.kernel has shape (4, 4), expected (4, 2, 2)"]),
    ("bias with an extra axis", lambda: _with(T32, output__bias=T32["output.bias"][None]), {},
     ["output.bias has shape (1, 4), expected (4,)"]),
    ("empty kernel", lambda: _with(T32, value__kernel=np.zeros((0, 2, 2), np.float32)), {},
     ["value.kernel has shape (0, 2, 2)"]),
    ("scalar bias", lambda: _with(T32, query__bias=np.array(1.0, np.float32)), {}, ["query.bias has shape ()"]),
    ("config says 3 heads", lambda: T32, {"config": SMALL.replace(num_heads=3, num_kv_heads=3).to_json()},
     ["query.kernel has shape (4, 2, 2), expected (4, 3, 2)"]),
    ("config without biases", lambda: T32, {"config": SMALL.replace(use_query_bias=False, use_key_bias=False).to_json()},
     ["unexpected tensors: key.bias, query.bias"]),
    # missing and extra tensors, and their checksums
    ("missing query.kernel", lambda: _with(T32, query__kernel=None), {}, ["missing tensors: query.kernel"]),
    ("missing two", lambda: _with(T32, key__bias=None, output__kernel=None), {},
     ["missing tensors: key.bias, output.kernel"]),
    ("no tensors at all", lambda: {}, {"sha256": "{}"}, ["missing tensors: query.kernel, query.bias"]),
    ("extra tensor", lambda: _with(T32, query__extra=np.zeros(2, np.float32)), {}, ["unexpected tensors: query.extra"]),
    ("sha256 map lacks a tensor", lambda: T32,
     {"sha256": json.dumps({n: weights.tensor_sha256(a) for n, a in T32.items() if n != "value.bias"})},
     ["no sha256 for value.bias"]),
    ("sha256 map lists a ghost", lambda: T32,
     {"sha256": json.dumps({**{n: weights.tensor_sha256(a) for n, a in T32.items()}, "ghost": "0" * 64})},
     ["sha256 lists tensors not in the file: ghost"]),
    ("sha256 entry not a string", lambda: T32,
     {"sha256": json.dumps({**{n: weights.tensor_sha256(a) for n, a in T32.items()}, "key.bias": 7})},
     ["sha256 mismatch for key.bias"]),
    ("sha256 of another tensor", lambda: T32,
     {"sha256": json.dumps({**{n: weights.tensor_sha256(a) for n, a in T32.items()},
                            "key.bias": weights.tensor_sha256(T32["query.bias"])})}, ["sha256 mismatch for key.bias"]),
    # NaN and Inf in a tensor (the checksum is right: the writer wrote them)
    *[(f"{v} in a kernel", lambda v=v: _bad_value(v), {}, ["key.kernel contains NaN or Inf"])
      for v in (np.nan, np.inf, -np.inf)],
    # format and version
    ("format missing", lambda: T32, {"format": None}, ["format is None, expected 'mha-weights'"]),
    ("another format", lambda: T32, {"format": "mha-vectors"}, ["format is 'mha-vectors'"]),
    ("format_version 2", lambda: T32, {"format_version": "2"}, ["format_version is '2'; this reader knows '1'"]),
    ("format_version 1.0", lambda: T32, {"format_version": "1.0"}, ["format_version is '1.0'"]),
]


@pytest.mark.parametrize("label, make, metadata, fragments", CRAFTED, ids=[c[0] for c in CRAFTED])
def test_crafted_weight_files_are_refused_with_the_reason(tmp_path, label, make, metadata, fragments):
    tensors = make()
    meta = {k: v for k, v in metadata.items() if v is not None}
    data = craft_weights(tensors, **meta)
    if any(v is None for v in metadata.values()):  # drop a key craft_weights always writes
        header = header_of(data)
        for key in [k for k, v in metadata.items() if v is None]:
            header["__metadata__"].pop(key)
        data = raw_file(header, data[8 + struct.unpack("<Q", data[:8])[0] :])
    _, problems = refusal_problems(weights.load, write(tmp_path, data), WeightsFormatError, *fragments)
    assert not problems, f"{label}: " + "; ".join(problems)
    COUNTS["crafted weight files (one class each)"] += 1


def test_load_lists_every_problem_at_once(tmp_path):
    tensors = _with(T32, query__kernel=None, query__bias=T32["query.bias"].astype(np.int32),
                    value__bias=T32["value.bias"][:1], junk=np.zeros(1, np.float32))
    sums = {n: weights.tensor_sha256(a) for n, a in tensors.items() if n != "junk"}
    sums["output.bias"] = "0" * 64
    message = refusal(weights.load, write(tmp_path, craft_weights(tensors, sums=sums)), WeightsFormatError)
    for part in ("missing tensors: query.kernel", "unexpected tensors: junk", "query.bias has dtype int32",
                 "value.bias has shape (1, 2), expected (2, 2)", "no sha256 for junk", "sha256 mismatch for output.bias"):
        assert part in message, f"{part!r} not in {message!r}"


def _entries_of(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def test_overlapping_and_shuffled_data_offsets(tmp_path):
    header, body = _entries_of(weights.to_bytes(SMALL, T32))
    qb, kb = header["query.bias"]["data_offsets"], header["key.bias"]["data_offsets"]
    overlapping = json.loads(json.dumps(header))
    overlapping["key.bias"]["data_offsets"] = list(qb)  # two tensors read the same 16 bytes
    _, overlap_problems = refusal_problems(weights.load, write(tmp_path, raw_file(overlapping, body), "o.safetensors"),
                                           WeightsFormatError, "'key.bias' overlap" if qb[0] < kb[0] else "overlap")
    shuffled = json.loads(json.dumps(header))  # two same-size tensors swap their bytes: checksums catch it
    shuffled["query.bias"]["data_offsets"], shuffled["key.bias"]["data_offsets"] = kb, qb
    _, shuffle_problems = refusal_problems(weights.load, write(tmp_path, raw_file(shuffled, body), "s.safetensors"),
                                           WeightsFormatError, "sha256 mismatch for query.bias",
                                           "sha256 mismatch for key.bias")
    assert not overlap_problems and not shuffle_problems, "; ".join(overlap_problems + shuffle_problems)
    COUNTS["crafted weight files (one class each)"] += 2


@pytest.mark.parametrize("bad", [b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80", b"\xe2\x82"])
@pytest.mark.parametrize("where", ["metadata value", "metadata key", "tensor name", "config"])
def test_non_utf8_bytes_in_the_header_are_refused(tmp_path, bad, where):
    data = weights.to_bytes(SMALL, T32, metadata={"note": "AB"})
    (n,) = struct.unpack("<Q", data[:8])
    header = data[8 : 8 + n]
    anchor = {"metadata value": b'"AB"', "metadata key": b'"note"', "tensor name": b'"key.bias"',
              "config": b"zero"}[where]
    assert anchor in header
    header = header.replace(anchor, anchor[:2] + bad + anchor[2:], 1)
    path = write(tmp_path, struct.pack("<Q", len(header)) + header + data[8 + n :])
    refusal(weights.load, path, WeightsFormatError, "not UTF-8")
    refusal(read_inputs, path, InputsError, "not UTF-8")
    COUNTS["non-UTF-8 headers"] += 1


# -- resource limits: sizes the file does not have are refused before anything is allocated -------

def problems_refusing_without_allocating(path: Path, *fragments: str) -> list[str]:
    """refusal_problems for both readers, plus any that allocated 1 MB or more to refuse."""
    problems = []
    for read, error in ((weights.load, WeightsFormatError), (read_inputs, InputsError)):
        tracemalloc.start()
        try:
            problems += refusal_problems(read, path, error, *fragments)[1]
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        problems += [f"{read.__name__} allocated {peak} bytes to refuse {path.name}"] if peak >= 1_000_000 else []
    return problems


@pytest.mark.parametrize("length", [2**60, 2**64 - 1, 2**63, 2**32, 10**12, 1000])
def test_a_header_length_beyond_the_file_is_refused_up_front(tmp_path, length):
    path = write(tmp_path, raw_file(b'{"query":{"dtype":"F32","shape":[1,1,1],"data_offsets":[0,4]}}', b"\0" * 4,
                                    length=length))
    problems = problems_refusing_without_allocating(path, f"header length {length} exceeds the file's remaining")
    assert not problems, "; ".join(problems)
    COUNTS["resource limits"] += 1


@pytest.mark.parametrize("shape, offsets", [
    ([2**40], [0, 2**42]), ([2**31, 2**31, 4], [0, 2**66]), ([1, 1, 1], [0, 2**62]), ([8, 8, 8], [0, 2048]),
    ([2**20, 2**20], [0, 4]),
])
def test_a_tensor_claiming_more_bytes_than_the_file_is_refused_up_front(tmp_path, shape, offsets):
    path = write(tmp_path, raw_file({"query": {"dtype": "F32", "shape": shape, "data_offsets": offsets}}, b"\0" * 4))
    problems = problems_refusing_without_allocating(path, "'query' claims bytes", "but the data section has 4 bytes")
    assert not problems, "; ".join(problems)
    COUNTS["resource limits"] += 1


# -- inputs to multi_head_attention (impl_numpy; the contract in weights.contract) ---------------


CALL_CONFIG = AttentionConfig(num_heads=2, query_dim=4, head_dim=3, key_dim=5, value_dim=6, out_dim=7)
CALL_TENSORS = weights.init(CALL_CONFIG, seed=4)
RNG = np.random.default_rng(8)
XQ = RNG.standard_normal((2, 3, 4)).astype(np.float32)
XK = RNG.standard_normal((2, 5, 5)).astype(np.float32)
XV = RNG.standard_normal((2, 5, 6)).astype(np.float32)


def call(**changes):
    args = {"query": XQ, "key": XK, "value": XV, **changes}
    return multi_head_attention(CALL_CONFIG, CALL_TENSORS, args.pop("query"), args.pop("key"), args.pop("value"),
                                **args)


BAD_CALL_CASES = [
    # wrong ranks
    *[(f"query rank {r}", {"query": np.zeros((2, 3, 4, 1)[:r] if r <= 4 else (1, 2, 3, 4, 1), np.float32)},
       ["query", "rank"]) for r in (0, 1, 2, 4, 5)],
    ("key rank 2", {"key": np.zeros((5, 5), np.float32)}, ["key", "rank 2 shape (5, 5)"]),
    ("value rank 4", {"value": np.zeros((2, 5, 6, 1), np.float32)}, ["value", "rank 4 shape (2, 5, 6, 1)"]),
    # mismatched batch or feature sizes
    ("key batch 3", {"key": np.zeros((3, 5, 5), np.float32), "value": np.zeros((3, 5, 6), np.float32)},
     ["batch size B: got 2, 3, 3"]),
    ("value batch 1", {"value": np.zeros((1, 5, 6), np.float32)}, ["batch size B: got 2, 2, 1"]),
    ("key and value lengths", {"value": np.zeros((2, 4, 6), np.float32)}, ["key and value must share the length S",
                                                                            "(2, 4, 6)"]),
    ("query features", {"query": np.zeros((2, 3, 5), np.float32)}, ["query must have query_dim=4", "(2, 3, 5)"]),
    ("key features", {"key": np.zeros((2, 5, 4), np.float32)}, ["key must have key_dim=5", "(2, 5, 4)"]),
    ("value features", {"value": np.zeros((2, 5, 5), np.float32)}, ["value must have value_dim=6", "(2, 5, 5)"]),
    # empty batches and sequences: refused (the contract's choice)
    ("T = 0", {"query": np.zeros((2, 0, 4), np.float32)}, ["query is empty", "(2, 0, 4)"]),
    ("S = 0", {"key": np.zeros((2, 0, 5), np.float32), "value": np.zeros((2, 0, 6), np.float32)},
     ["key is empty", "(2, 0, 5)"]),
    ("B = 0", {"query": np.zeros((0, 3, 4), np.float32), "key": np.zeros((0, 5, 5), np.float32),
               "value": np.zeros((0, 5, 6), np.float32)}, ["query is empty", "(0, 3, 4)"]),
    # masks of the wrong shape or dtype
    ("mask (S, T)", {"mask": np.ones((5, 3), bool)}, ["mask has shape (5, 3)", "does not broadcast"]),
    ("mask (B, T)", {"mask": np.ones((2, 3), bool)}, ["mask has shape (2, 3)"]),
    ("mask rank 1", {"mask": np.ones((5,), bool)}, ["mask must have shape", "rank 1 shape (5,)"]),
    ("mask rank 5", {"mask": np.ones((1, 2, 2, 3, 5), bool)}, ["mask must have shape", "rank 5"]),
    ("mask (B, 3 heads, T, S)", {"mask": np.ones((2, 3, 3, 5), bool)}, ["mask has shape (2, 3, 3, 5)"]),
    ("mask float", {"mask": np.ones((3, 5), np.float32)}, ["mask must be bool", "got dtype float32", "bias="]),
    ("mask uint8", {"mask": np.ones((3, 5), np.uint8)}, ["mask must be bool", "got dtype uint8"]),
    ("mask int64", {"mask": np.ones((3, 5), np.int64)}, ["mask must be bool", "got dtype int64"]),
    ("bias bool", {"bias": np.ones((3, 5), bool)}, ["bias must be a float array", "got dtype bool"]),
    ("bias int", {"bias": np.ones((3, 5), np.int32)}, ["bias must be a float array", "got dtype int32"]),
    ("bias wrong shape", {"bias": np.zeros((3, 4), np.float32)}, ["bias has shape (3, 4)"]),
    ("bias NaN", {"bias": np.where(np.eye(3, 5, dtype=bool), np.nan, 0.0)}, ["bias must not contain NaN or +inf"]),
    ("bias +inf", {"bias": np.where(np.eye(3, 5, dtype=bool), np.inf, 0.0)}, ["bias must not contain NaN or +inf"]),
    # other arguments
    ("query int", {"query": np.zeros((2, 3, 4), np.int32)}, ["query must be a float array", "int32"]),
    ("key bool", {"key": np.zeros((2, 5, 5), bool)}, ["key must be a float array", "bool"]),
    ("is_causal string", {"is_causal": "yes"}, ["is_causal must be true or false", "'yes'"]),
    ("causal_alignment", {"is_causal": True, "causal_alignment": "left"}, ["causal_alignment", "'left'"]),
    ("dtype", {"dtype": "float8"}, ["dtype must be one of", "'float8'"]),
]


@pytest.mark.parametrize("label, changes, fragments", BAD_CALL_CASES, ids=[c[0] for c in BAD_CALL_CASES])
def test_bad_calls_raise_value_error_naming_the_argument_and_value(label, changes, fragments):
    try:
        result = call(**changes)
    except ValueError as err:
        message = str(err)
    except Exception as err:  # another exception type is the failure tested for
        raise AssertionError(f"{label}: {type(err).__name__}: {err}") from err
    else:
        raise AssertionError(f"{label}: accepted, returned {type(result).__name__}")
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, f"{label}: {fragment!r} not in {message!r}"
    COUNTS["bad multi_head_attention calls (explicit)"] += 1


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 3), (3, 2), (2, 4), (5, 0)])
def test_heads_that_do_not_divide_are_refused_by_the_config(num_heads, num_kv_heads):
    with pytest.raises(ValueError, match="num_kv_heads must (divide num_heads|be a positive integer)") as info:
        AttentionConfig(num_heads=num_heads, query_dim=4, head_dim=2, num_kv_heads=num_kv_heads)
    assert f"{num_kv_heads}" in str(info.value)


@pytest.mark.parametrize("value", [np.nan])
def test_nan_or_inf_in_query_comes_out_as_nan(value):
    """Documented choice: NaN in the query is not refused; it propagates as NaN to the outputs that read
    it (cross-attention: that query row; self-attention: the whole sequence, through keys). +-inf is
    refused (tests/test_numpy_errors.py): an infinite logit would look like a masked one."""
    query = XQ.copy()
    query[1, 2, 3] = value
    with np.errstate(invalid="ignore", over="ignore"):
        out = call(query=query)
        self_out = multi_head_attention(CALL_CONFIG.replace(key_dim=4, value_dim=4),
                                        weights.init(CALL_CONFIG.replace(key_dim=4, value_dim=4), seed=4), query)
    assert np.isnan(out[1, 2]).all(), f"query[1, 2] = {value}: output row {out[1, 2]}"
    clean = np.ones(out.shape[:2], bool)
    clean[1, 2] = False
    assert np.isfinite(out[clean]).all(), "other rows must stay finite"
    assert np.isnan(self_out[1]).all() and np.isfinite(self_out[0]).all(), "self-attention: the whole sequence 1"


def test_nan_in_a_value_vector_reaches_every_row_that_may_attend_to_it_and_rows_that_mask_it():
    """Documented: 0 * NaN = NaN, so even a masked position's NaN value reaches the output (as in every framework)."""
    value = XV.copy()
    value[0, 4, 1] = np.nan
    mask = np.ones((3, 5), bool)
    mask[0, 4] = False  # row 0 may not attend to key 4
    with np.errstate(invalid="ignore"):
        out = call(value=value, mask=mask)
    assert np.isnan(out[0]).all() and np.isfinite(out[1]).all(), out[0]


def test_minus_inf_in_bias_masks_like_false_in_mask():
    bias = RNG.standard_normal((2, 1, 3, 5))
    bias[0, 0, 1, 2] = bias[1, 0, 0, 4] = -np.inf
    mask = np.isfinite(bias)
    out_b, w_b = call(bias=bias, return_weights=True)
    out_m, w_m = call(bias=np.where(mask, bias, 0.0), mask=mask, return_weights=True)
    assert (w_b[0, :, 1, 2] == 0).all() and (w_b[1, :, 0, 4] == 0).all(), "a -inf bias gives weight exactly 0"
    np.testing.assert_allclose(out_b, out_m, rtol=1e-6, atol=1e-6)
    everything = np.full((3, 5), -np.inf)
    out, w = call(bias=everything, return_weights=True)
    assert (w == 0).all() and np.isfinite(out).all(), "an all -inf row follows masked_row='zero'"


CALL_ARGUMENTS = ("query", "key", "value", "mask", "bias", "is_causal", "causal_alignment", "training",
                  "dropout_mask", "seed", "dtype", "num_kv_heads", "chunk_size", "return_weights")
ARRAY_DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "uint8", "bool", "complex64"]
SMALL_FLOATS = st.floats(-3, 3, width=32)
MOSTLY_FLOAT = ["float32"] * 8 + ["float64"] * 4 + ARRAY_DTYPES


@st.composite
def arrays_near(draw, shape: tuple[int, ...], dtypes=MOSTLY_FLOAT, fill=SMALL_FLOATS):
    """Mostly the right shape, sometimes a wrong rank or size; any dtype; now and then a NaN/inf."""
    rank_change = draw(st.sampled_from([0] * 20 + [-1, 1, -2]))
    shape = list(shape)
    if rank_change < 0:
        shape = shape[: max(len(shape) + rank_change, 0)]
    elif rank_change > 0:
        shape = shape + [1]
    if shape and draw(st.integers(0, 15)) == 0:
        shape[draw(st.integers(0, len(shape) - 1))] = draw(st.integers(0, 4))
    dtype = draw(st.sampled_from(dtypes))
    values = np.full(shape, draw(fill), dtype=np.float64)
    if values.size and draw(st.integers(0, 6)) == 0:
        values.flat[draw(st.integers(0, values.size - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    if dtype in ("float16", "bfloat16"):
        values = np.where(np.isfinite(values), values.round(1), values)
    if dtype == "bool":
        return values > 0
    if dtype in ("int32", "uint8"):
        return np.nan_to_num(values, posinf=1, neginf=0).astype(dtype)
    return values.astype(weights.DTYPES.get(dtype, dtype))


@st.composite
def calls(draw):
    B, T, S = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    kwargs = {
        "query": draw(arrays_near((B, T, 4))),
        "key": draw(st.none() | arrays_near((B, S, 4))),
        "value": draw(st.none() | arrays_near((B, S, 4))),
    }
    S_eff = S if kwargs["key"] is not None else T
    if draw(st.booleans()):
        kwargs["mask"] = draw(arrays_near(draw(st.sampled_from([(T, S_eff), (B, T, S_eff), (B, 1, T, S_eff),
                                                                (B, 2, T, S_eff)])), dtypes=["bool"] * 4 + ARRAY_DTYPES,
                                          fill=st.sampled_from([0.0, 1.0])))
    if draw(st.booleans()):
        kwargs["bias"] = draw(arrays_near(draw(st.sampled_from([(T, S_eff), (B, 2, T, S_eff)])),
                                          fill=st.floats(-3, 3, width=32) | st.just(-np.inf)))
    if draw(st.booleans()):
        kwargs["is_causal"] = draw(st.sampled_from([True, False, True, False, 1, "yes", None]))
        kwargs["causal_alignment"] = draw(st.sampled_from(["top_left", "bottom_right"] * 3 + ["left", 3]))
    if draw(st.integers(0, 3)) == 0:
        kwargs["training"] = draw(st.booleans())
        kwargs["dropout_mask"] = draw(st.none() | arrays_near((B, 2, T, S_eff), dtypes=["bool", "bool", "float32"],
                                                              fill=st.sampled_from([0.0, 1.0])))
        kwargs["seed"] = draw(st.none() | st.integers(0, 5) | st.sampled_from([1.5, "1", True]))
    if draw(st.integers(0, 3)) == 0:
        kwargs["dtype"] = draw(st.sampled_from(["float16", "bfloat16", "float32", "float64", "int8", "double", None]))
    if draw(st.integers(0, 3)) == 0:
        kwargs["chunk_size"] = draw(st.sampled_from([1, 2, 0, -1, 2.5, True]))
    if draw(st.integers(0, 3)) == 0:
        kwargs["return_weights"] = draw(st.booleans())
    return kwargs


FUZZ_CONFIG = AttentionConfig(num_heads=2, query_dim=4, head_dim=3, out_dim=7, dropout=0.25)
FUZZ_TENSORS = weights.init(FUZZ_CONFIG, seed=4)


def argument_named(message: str) -> str:
    """The call argument a ValueError names first."""
    return min((m.start(), name) for name in CALL_ARGUMENTS if (m := re.search(rf"\b{name}\b", message)))[1]


def check_one_call(kwargs: dict, outcomes: collections.Counter, named: collections.Counter | None = None) -> None:
    """Runs one call: it raises a one-line ValueError naming an argument (counted in `named` by the argument
    it names first), or returns an output of the right shape, finite for finite inputs."""
    args = dict(kwargs)
    try:
        with np.errstate(all="ignore"):
            result = multi_head_attention(FUZZ_CONFIG, FUZZ_TENSORS, args.pop("query"), args.pop("key"),
                                          args.pop("value"), **args)
    except ValueError as err:
        message = str(err)
        assert "\n" not in message, message
        assert any(name in message for name in CALL_ARGUMENTS), f"no argument named in {message!r}"
        outcomes["ValueError"] += 1
        if named is not None:
            named[argument_named(message)] += 1
        return
    except Exception as err:  # the failure tested for
        shapes = {k: (getattr(v, "shape", v), getattr(v, "dtype", None)) for k, v in kwargs.items()}
        raise AssertionError(f"{type(err).__name__}: {err} for {shapes}") from err
    out = result[0] if kwargs.get("return_weights") else result
    B, T = kwargs["query"].shape[:2]
    assert out.shape == (B, T, FUZZ_CONFIG.out_dim), out.shape
    inputs_finite = all(np.isfinite(np.asarray(kwargs[k], np.float64)).all()
                        for k in ("query", "key", "value") if kwargs[k] is not None)
    if inputs_finite and kwargs.get("dtype") != "float16" and kwargs["query"].dtype != np.float16:
        assert np.isfinite(np.asarray(out, np.float64)).all(), "finite inputs gave a non-finite output"
    outcomes["ran"] += 1


# The arguments the call fuzzer's refusals name: the minimums are about two thirds of what was measured
# (the `ci` profile's examples: 12 of the 14 arguments; the slow fuzzer's 5000 random examples: 12).
CALL_ARGUMENTS_NAMED_MIN = 8
CALL_ARGUMENTS_NAMED_MIN_SLOW = 8


def test_fuzz_multi_head_attention_calls():
    outcomes, named = collections.Counter(), collections.Counter()

    @fuzz_settings(400)
    @given(calls())
    def check(kwargs):
        check_one_call(kwargs, outcomes, named)
        COUNTS["multi_head_attention calls (hypothesis)"] += 1

    check()
    print(f"\ncall fuzz: {dict(outcomes)}, refusals by the argument named: {dict(named.most_common())}")
    assert outcomes["ran"] >= 30 and outcomes["ValueError"] >= 30, outcomes
    assert len(named) >= CALL_ARGUMENTS_NAMED_MIN, (
        f"the refusals named {len(named)} arguments, expected at least {CALL_ARGUMENTS_NAMED_MIN}: {dict(named)}")


@pytest.mark.slow
def test_fuzz_multi_head_attention_calls_slow():
    outcomes, named = collections.Counter(), collections.Counter()

    @slow_fuzz_settings(5_000)
    @given(calls())
    def check(kwargs):
        check_one_call(kwargs, outcomes, named)
        COUNTS["multi_head_attention calls (hypothesis, slow)"] += 1

    check()
    print(f"\ncall fuzz (slow): {dict(outcomes)}, refusals by the argument named: {dict(named.most_common())}")
    assert len(named) >= CALL_ARGUMENTS_NAMED_MIN_SLOW, (
        f"the refusals named {len(named)} arguments, expected at least {CALL_ARGUMENTS_NAMED_MIN_SLOW}: {dict(named)}")
