"""`mha bench --shapes sequence-sharded` (conformance/bench/sharded.py): the family runs
and writes its record and targets; the ring's minimum comes from the shape;
pass and miss follow from the measured numbers. No assertion is about how
much memory a run took (the machine is shared): only that the figures exist
and that each is judged against its target."""

from __future__ import annotations

import json

import pytest

from conformance.bench import sharded
from conformance.cli.commands import main

MiB = 2**20


def _record(growths, base, sent, minimum=1000.0, status="ok"):
    return {"family": sharded.FAMILY, "shape": sharded.shape(quick=False), "status": status, "quick": False,
            "ring_minimum_bytes": minimum, "unsharded": {"growth_bytes": base},
            "ranks": [{"rank": r, "growth_bytes": g, "kv_bytes_sent": s, "ids_bytes_sent": 0}
                      for r, (g, s) in enumerate(zip(growths, sent))]}


def test_ring_minimum_is_three_quarters_of_the_key_value_bytes():
    """T = S = 32768, D 512, N 8 = K, float32, 4 processes: keys and values are two (1, 32768, 512) float32
    arrays; each rank must pass on the other three ranks' blocks, 3/4 of them."""
    full = sharded.shape(quick=False)
    assert (full["T"], full["S"], full["D"], full["N"], full["devices"], full["causal"]) == (32768, 32768, 512, 8, 4,
                                                                                             True), full
    kv = 2 * 32768 * 512 * 4
    assert sharded.ring_minimum_bytes(full) == 3 * kv / 4, (sharded.ring_minimum_bytes(full), 3 * kv / 4)
    quick = sharded.shape(quick=True)
    kv_quick = 2 * quick["B"] * quick["S"] * quick["D"] * 4
    assert sharded.ring_minimum_bytes(quick) == 3 * kv_quick / 4, (sharded.ring_minimum_bytes(quick), kv_quick)


@pytest.mark.parametrize("growths,base,sent,memory_pass,bytes_pass", [
    ((30 * MiB, 35 * MiB), 100 * MiB, (1000, 1000), True, True),  # 0.35x exactly: "at most" passes
    ((30 * MiB, 36 * MiB), 100 * MiB, (1000, 1000), False, True),  # the largest rank decides
    ((10 * MiB, 10 * MiB), 100 * MiB, (1000, 1101), True, False),  # 1.101x the minimum
    ((10 * MiB, 10 * MiB), 100 * MiB, (1100, 1000), True, True),  # 1.1x exactly
])
def test_targets_follow_the_measured_numbers(growths, base, sent, memory_pass, bytes_pass):
    record = _record(growths, base, sent)
    record.update(sharded.ratios(record))
    memory, traffic = sharded.targets(record)
    assert memory["measured"] == pytest.approx(max(growths) / base), memory
    assert traffic["measured"] == pytest.approx(max(sent) / 1000.0), traffic
    assert (memory["pass"], traffic["pass"]) == (memory_pass, bytes_pass), (memory, traffic)
    assert (memory["threshold"], traffic["threshold"]) == (0.35, 1.1), (memory, traffic)
    assert memory["status"] == ("pass" if memory_pass else "miss"), memory


def test_a_family_that_did_not_run_is_not_measured():
    record = {"family": sharded.FAMILY, "shape": sharded.shape(quick=True), "status": "failed: RuntimeError: x",
              "quick": True, "ring_minimum_bytes": 1.0}
    record.update(sharded.ratios(record))
    for entry in sharded.targets(record):
        assert entry["pass"] is None and entry["measured"] is None, entry
        assert entry["status"] == "not measured: failed: RuntimeError: x", entry


@pytest.mark.torch
def test_quick_family_runs_and_judges_what_it_measured(tmp_path, capsys):
    pytest.importorskip("torch", reason="PyTorch not installed: pip install -c constraints/cpu.txt '.[torch]'")
    out = tmp_path / "bench.json"
    code = main(["bench", "--quick", "--shapes", "sequence-sharded", "--json", str(out)])
    printed, err = capsys.readouterr()
    assert code == 0, f"mha bench exited {code}; stderr tail: {err[-2000:]}"
    data = json.loads(out.read_text())
    record = data["sequence_sharded"]
    assert record["status"] == "ok", record["status"]
    assert data["results"] == [], "sequence-sharded alone started the backend workers"
    s = record["shape"]
    assert len(record["ranks"]) == s["devices"] == 4, record["ranks"]
    assert record["ring_minimum_bytes"] == 3 / 4 * (2 * s["B"] * s["S"] * s["D"] * 4), record
    for rank in record["ranks"]:
        assert rank["peak_rss_bytes"] >= rank["rss_before_bytes"] > 0, rank
        assert rank["growth_bytes"] == rank["peak_rss_bytes"] - rank["rss_before_bytes"], rank
        # an even split: every rank forwards three blocks of a quarter of the key/value bytes
        assert rank["kv_bytes_sent"] == record["ring_minimum_bytes"] and rank["ids_bytes_sent"] == 0, rank
    base = record["unsharded"]["growth_bytes"]
    assert base > 0, record["unsharded"]
    assert record["memory_ratio"] == pytest.approx(max(r["growth_bytes"] for r in record["ranks"]) / base), record
    assert record["bytes_ratio"] == pytest.approx(1.0), record
    entries = [e for e in data["targets"] if e["shape"] == sharded.FAMILY]
    assert len(entries) == 2, entries
    for entry, measured in zip(entries, (record["memory_ratio"], record["bytes_ratio"])):
        assert entry["measured"] == pytest.approx(measured), entry
        assert entry["pass"] == (measured <= entry["threshold"]), entry
    assert "targets: sequence sharding" in printed, printed[-2000:]
    assert f"{sharded.FAMILY}: T=S={s['T']}" in printed, printed[-2000:]
