"""`mha bench --shapes latent` (conformance/bench/latent.py): the latent cache against the per-head one.

The cache-bytes ratio is checked exactly, from the formula and from the arrays the family builds; each
backend's two steps (absorbed: the layer's own in-place decode; expanded: frameworks/latent.py's step over
the per-head cache) are held to the float64 reference under the suite's policy, so what is timed is the
layer; the targets follow the numbers they are given; the --quick family runs end to end. No assertion is
about speed: benchmarks are not tests."""

from __future__ import annotations

import importlib.util
import json
from fractions import Fraction

import numpy as np
import pytest

from conformance.bench import latent, shapes
from conformance.cli.commands import main
from conformance.suite.tolerance import assert_close

INSTALL = {"torch": "PyTorch not installed: pip install -c constraints/cpu.txt '.[torch]'",
           "tf": "TensorFlow not installed: pip install -c constraints/cpu.txt '.[tf]'",
           "jax": "JAX not installed: pip install -c constraints/cpu.txt '.[jax]'"}
MODULE = {"torch": "torch", "tf": "tensorflow", "jax": "jax"}


def test_cache_bytes_per_token_are_the_contracts():
    """DeepSeek-V3's heads at N 16: the latent cache is (512 + 64) float32 per token, the per-head one
    16 (192 + 128): 2304 B against 20480 B, 9/80 exactly; the arrays the family builds hold just that."""
    d = latent.FULL
    assert (d.N, d.C, d.R, d.H, d.V) == (16, 512, 64, 192, 128), d
    assert (d.latent_bytes_per_token(), d.expanded_bytes_per_token()) == (2304, 20480)
    # per cached token: 2N(2C + R) FLOPs absorbed (logits over C + R, context over C), 2N(H + V) expanded
    assert d.absorbed_flops(1) - d.absorbed_flops(0) == 2 * 16 * (1024 + 64) == 34816
    assert d.expanded_flops(1) - d.expanded_flops(0) == 2 * 16 * 320 == 10240
    assert latent.expected_ratio(d) == Fraction(576, 5120) == Fraction(9, 80)
    config, tensors = latent.layer(d)
    P = 3
    x, past_latent, rotary = latent.inputs(d, P)
    keys, values = latent.expand_cache(config, tensors, past_latent, rotary)
    assert keys.shape == (1, 16, P, 192) and values.shape == (1, 16, P, 128), (keys.shape, values.shape)
    held = Fraction(past_latent.nbytes + rotary.nbytes, keys.nbytes + values.nbytes)
    assert held == latent.expected_ratio(d), held
    assert keys.nbytes + values.nbytes == P * d.expanded_bytes_per_token()


def _reference(config, tensors, x, past_latent, rotary):
    """The float64 expanded form (the stages: the spec) and its logits, for the policy's logit scale."""
    from impl_numpy.attention import multi_head_attention

    trace = []
    out = multi_head_attention(config, tensors, x, past_key=past_latent, past_value=rotary, is_causal=True,
                               causal_alignment="bottom_right", dtype="float64", trace=trace)
    logits = next(e.value for e in trace if e.stage == "logits")
    return np.asarray(out), logits


@pytest.mark.parametrize("backend", [
    "numpy", pytest.param("torch", marks=pytest.mark.torch), pytest.param("tf", marks=pytest.mark.tf),
    pytest.param("jax", marks=pytest.mark.jax)])
def test_both_steps_compute_the_layer(backend):
    """Each step, timed twice (the in-place one writes its new token again), equals the float64 expanded
    form of the layer over the latent cache, within the policy's float32 bar."""
    from conformance.bench.frameworks.latent import BUILDERS
    from conformance.bench.runners import RUNNERS

    if backend != "numpy" and importlib.util.find_spec(MODULE[backend]) is None:
        pytest.skip(INSTALL[backend])
    d, P = latent.QUICK, 40
    config, tensors = latent.layer(d)
    x, past_latent, rotary = latent.inputs(d, P)
    expected, logits = _reference(config, tensors, x, past_latent, rotary)
    paths, nbytes = BUILDERS[backend]("cpu", config, tensors, x, P, past_latent, rotary,
                                      latent.expand_cache(config, tensors, past_latent, rotary))
    assert [p.name for p in paths] == ["absorbed", "read.latent", "expanded", "read.expanded"], paths
    assert Fraction(nbytes["latent"], nbytes["expanded"]) == latent.expected_ratio(d) == Fraction(1, 4), nbytes
    to_numpy = RUNNERS[backend]("cpu", True, "float32").to_numpy
    for path in (p for p in paths if p.compare):
        for call in range(2):
            assert_close(f"{backend} {path.name} step (call {call + 1})", to_numpy(path.call()), expected,
                         config=config, dtype="float32", quantity="output", B=d.B, T=1, S=P + 1, logits=logits)


def _record(speed, read, *, extra_bytes=None, status="ok"):
    """A record with given paired times: speed[backend] = (absorbed, expanded) at the two largest lengths,
    read[backend] = absorbed over read.latent; extra_bytes[backend]: added to its per-head cache's bytes."""
    d = latent.FULL
    lengths = [16384, 32768, 65536]
    rec = {"family": latent.FAMILY, "quick": False, "dims": d.to_dict(), "lengths": lengths,
           "speedup_from": latent.SPEEDUP_FROM, "backends": {}, "rows": [], "caches": [], "matmul": []}
    for backend, (absorbed, expanded) in speed.items():
        rec["backends"][backend] = {"status": status}
        for P in lengths:
            latent_bytes, expanded_bytes = P * d.latent_bytes_per_token(), P * d.expanded_bytes_per_token()
            rec["caches"].append({"backend": backend, "P": P, "latent_bytes": latent_bytes,
                                  "expanded_bytes": expanded_bytes + (extra_bytes or {}).get(backend, 0)})
            times = {"absorbed": absorbed, "expanded": expanded, "read.latent": absorbed / read[backend],
                     "read.expanded": expanded}
            if P < latent.SPEEDUP_FROM:  # below the speed target's lengths: a slow expanded step does not count
                times["expanded"] = absorbed
            for path, ratio in times.items():
                row = latent._row(backend, P, None, "ok", path)
                row.update(matmul_ratio=ratio, median_s=ratio / 10, bytes_read=latent_bytes)
                rec["rows"].append(row)
    return rec


def _by_target(entries, backend, word):
    found = [e for e in entries if e["backend"] == backend and word in e["target"]]
    assert len(found) == 1, (backend, word, entries)
    return found[0]


def test_targets_follow_the_numbers():
    """numpy 5x, torch 4.5x, tf 3x, jax 6x faster: numpy and two frameworks pass the speed target; the
    read bound passes at 1.5x and misses at 2.5x; a byte count 4 B off (one float) misses the exact ratio."""
    record = _record({"numpy": (1.0, 5.0), "torch": (1.0, 4.5), "tf": (1.0, 3.0), "jax": (1.0, 6.0)},
                     {"numpy": 1.5, "torch": 2.5, "tf": 1.9, "jax": 2.0},
                     extra_bytes={"tf": 4})
    entries = latent.targets(record)
    assert all(e["shape"] == latent.FAMILY for e in entries) and len(entries) == 4 + 4 + 1 + 4, entries
    for backend, speedup in (("numpy", 5.0), ("torch", 4.5), ("tf", 3.0), ("jax", 6.0)):
        e = _by_target(entries, backend, "faster than expanded")
        assert e["measured"] == pytest.approx(speedup) and e["pass"] == (speedup >= 4.0), e
    summary = _by_target(entries, "numpy+2", "two frameworks")
    assert summary["pass"] is True and summary["measured"] == pytest.approx(4.5), summary
    assert summary["path"] == "numpy, jax, torch", summary
    for backend, over in (("numpy", 1.5), ("torch", 2.5), ("tf", 1.9), ("jax", 2.0)):
        e = _by_target(entries, backend, "one read")
        assert e["measured"] == pytest.approx(over) and e["pass"] == (over <= 2.0), e
    for backend in ("numpy", "torch", "jax"):
        assert _by_target(entries, backend, "cache bytes")["pass"] is True
    wrong = _by_target(entries, "tf", "cache bytes")
    assert wrong["pass"] is False and wrong["status"] == "miss", wrong


def test_summary_needs_two_frameworks_and_a_failed_backend_is_not_measured():
    record = _record({"numpy": (1.0, 5.0), "torch": (1.0, 5.0), "tf": (1.0, 3.0)}, {"numpy": 1, "torch": 1, "tf": 1})
    record["backends"]["jax"] = {"status": "unavailable: ModuleNotFoundError: No module named 'jax'"}
    entries = latent.targets(record)
    summary = _by_target(entries, "numpy+2", "two frameworks")
    assert summary["pass"] is False and summary["measured"] == pytest.approx(3.0), summary  # tf is the second
    for e in (e for e in entries if e["backend"] == "jax"):
        assert e["pass"] is None and e["status"] == "not measured: unavailable: ModuleNotFoundError: No module " \
                                                   "named 'jax'", e
    del record["backends"]["tf"]
    record["rows"] = [r for r in record["rows"] if r["backend"] != "tf"]
    summary = _by_target(latent.targets(record), "numpy+2", "two frameworks")
    assert summary["pass"] is None and summary["status"] == "not measured: needs numpy and two frameworks", summary


def test_latent_max_refuses_one_line(capsys):
    code = main(["bench", "--shapes", "latent", "--latent-max", "100"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == "mha: error: --latent-max must be at least 4096: got 100", err


def test_quick_family_runs_and_reports(tmp_path, capsys):
    """`mha bench --quick --shapes latent --backends numpy`: every length and path timed and compared, the
    bytes ratio exact from the arrays held, every target of the backend judged, the tables printed."""
    out = tmp_path / "bench.json"
    code = main(["bench", "--quick", "--shapes", "latent", "--backends", "numpy", "--json", str(out)])
    printed, err = capsys.readouterr()
    assert code == 0, f"mha bench exited {code}; stderr tail: {err[-2000:]}"
    data = json.loads(out.read_text())
    record = data["latent"]
    assert data["results"] == [], "latent alone started the shape workers"
    assert record["backends"]["numpy"]["status"] == "ok", record["backends"]
    assert record["lengths"] == list(shapes.QUICK_LATENT_LENGTHS) and record["quick"] is True, record["lengths"]
    rows = record["rows"]
    for P in shapes.QUICK_LATENT_LENGTHS:
        here = {r["path"]: r for r in rows if r["P"] == P}
        assert sorted(here) == ["absorbed", "expanded", "read.expanded", "read.latent"], here
        for r in here.values():
            assert r["status"] == "ok" and r["median_s"] > 0 and r["matmul_ratio"] > 0, r
            assert r["repeats"] == 2 and r["bytes_read"] > 0, r
        for name in ("absorbed", "expanded"):
            r = here[name]
            assert r["flops"] == getattr(latent.QUICK, f"{name}_flops")(P), r
            assert r["max_abs_diff"] <= 1e-4 * max(1.0, r["reference_max_abs"]), r  # a record, not the judge
    caches = record["caches"]
    assert [c["P"] for c in caches] == list(shapes.QUICK_LATENT_LENGTHS), caches
    d = latent.QUICK
    for c in caches:
        assert c["latent_bytes"] == c["P"] * d.latent_bytes_per_token(), c
        assert c["expanded_bytes"] == c["P"] * d.expanded_bytes_per_token(), c
        assert Fraction(c["latent_bytes"], c["expanded_bytes"]) == Fraction(*record["expected_ratio"]), c
    entries = [e for e in data["targets"] if e["shape"] == latent.FAMILY]
    assert len(entries) == 4, entries  # bytes, speed, the numpy+2 summary, the read bound
    assert [e["status"] in ("pass", "miss") for e in entries] == [True, True, False, True], entries
    assert _by_target(entries, "numpy", "cache bytes")["pass"] is True
    assert "targets: latent attention (MLA) decode" in printed and "latent: one token after P cached" in printed
    assert "latent numpy: read bandwidth" in printed, printed[-2000:]
