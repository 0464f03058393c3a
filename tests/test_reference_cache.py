"""conformance/suite/reference_cache.py: the float64 references kept on disk between `mha check` runs.

A reference read from the cache must be the one expected_for computes (every array, bit for bit), and the key
must change with everything that changes its bits, or a warm check would judge against a stale reference.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from conformance.suite import compare, reference_cache
from conformance.suite.cases import CASES
from conformance.suite.compare import chunked_same_precision, expected_for, flush_references

pytestmark = pytest.mark.reference


@pytest.fixture
def cache_dir(tmp_path):
    compare.clear_cache()
    reference_cache.set_directory(tmp_path)
    yield tmp_path
    reference_cache.set_directory(None)
    compare.clear_cache()


def _flat(value, prefix=""):
    """Every array and scalar of a reference, by path (dicts, lists and tuples walked)."""
    if isinstance(value, dict):
        return [item for k in sorted(value, key=str) for item in _flat(value[k], f"{prefix}/{k}")]
    if isinstance(value, (list, tuple)):
        return [item for i, v in enumerate(value) for item in _flat(v, f"{prefix}[{i}]")]
    return [(prefix, value)]


def _assert_same(a: dict, b: dict):
    fa, fb = _flat(a), _flat(b)
    assert [p for p, _ in fa] == [p for p, _ in fb]
    for (path, x), (_, y) in zip(fa, fb):
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), path
        elif isinstance(x, float) and np.isnan(x):
            assert np.isnan(y), path
        else:
            assert x == y, path


@pytest.mark.parametrize("name, dtype", [("modern_everything", "float32"), ("decode_cache", "bfloat16"),
                                         ("masked_rows_nan", "float16")])
def test_a_reference_read_from_disk_is_the_one_computed(cache_dir, name, dtype, monkeypatch):
    reference_cache.set_directory(None)
    computed = expected_for(CASES[name], dtype)
    compare.clear_cache()
    reference_cache.set_directory(cache_dir)
    written = expected_for(CASES[name], dtype)
    flush_references()
    assert len(list(cache_dir.iterdir())) == 1
    compare.clear_cache()  # as a new process: only the file remains

    def computing(*args, **kwargs):
        raise AssertionError("the reference was computed, not read")

    monkeypatch.setattr(compare.reference, "forward", computing)
    read = expected_for(CASES[name], dtype)
    assert read is not written
    _assert_same(computed, written)
    _assert_same(computed, read)


def test_what_is_computed_later_is_written_when_flushed(cache_dir):
    """A 16-bit reference's chunked error is computed the first time a chunked result is judged, after the
    reference was written: flush writes it too, so the next run reads it instead of computing it."""
    case = CASES["self_basic"]
    exp = expected_for(case, "bfloat16")
    flush_references()
    chunked = chunked_same_precision(case, "bfloat16", exp, 2)
    flush_references()
    compare.clear_cache()
    read = expected_for(case, "bfloat16")
    assert read["same_precision_chunked"] == {2: exp["same_precision_chunked"][2]}, "computed later, not written"
    assert chunked_same_precision(case, "bfloat16", read, 2) == chunked


def test_an_unreadable_file_is_computed_again(cache_dir):
    case = CASES["self_basic"]
    expected_for(case, "float32")
    flush_references()
    (path,) = cache_dir.iterdir()
    path.write_bytes(path.read_bytes()[:100])  # truncated
    compare.clear_cache()
    again = expected_for(case, "float32")
    reference_cache.set_directory(None)
    compare.clear_cache()
    _assert_same(expected_for(case, "float32"), again)


def test_the_key_changes_with_what_changes_the_reference(monkeypatch):
    case = CASES["self_basic"]
    base = reference_cache.key(case, "float32")
    assert reference_cache.key(case, "float32") == base, "an equal reference must be found"
    changed = {
        "the dtype": reference_cache.key(case, "float16"),
        "the case": reference_cache.key(CASES["gqa"], "float32"),
        "a field of the case": reference_cache.key(dataclasses.replace(case, input_scale=2.0), "float32"),
        "the config": reference_cache.key(dataclasses.replace(
            case, config=dataclasses.replace(case.config, scale=0.5)), "float32"),
    }
    other_kernel = "Sandybridge" if os.environ.get("OPENBLAS_CORETYPE") != "Sandybridge" else "Haswell"
    monkeypatch.setenv("OPENBLAS_CORETYPE", other_kernel)
    changed["NumPy's BLAS kernel"] = reference_cache.key(case, "float32")
    monkeypatch.undo()
    monkeypatch.setattr(reference_cache, "source_digest", lambda packages: b"edited source")
    changed["the source"] = reference_cache.key(case, "float32")
    monkeypatch.undo()
    monkeypatch.setattr(reference_cache, "cpu_flags", lambda: "flags: another CPU")
    changed["the CPU"] = reference_cache.key(case, "float32")
    monkeypatch.undo()
    monkeypatch.setattr(np, "__version__", "0.0")
    changed["NumPy's version"] = reference_cache.key(case, "float32")
    same = [what for what, key in changed.items() if key == base]
    assert not same, f"the key ignores: {', '.join(same)}"


def test_without_a_directory_nothing_is_kept(tmp_path):
    reference_cache.set_directory(None)
    compare.clear_cache()
    expected_for(CASES["self_basic"], "float32")
    flush_references()
    assert not list(tmp_path.iterdir())
    assert reference_cache.load(reference_cache.key(CASES["self_basic"], "float32")) is None
