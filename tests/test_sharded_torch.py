"""impl_torch.sharded (heads and sequence sharding on gloo processes) against
the float64 NumPy reference, forward and gradients, under the tolerance
policy (conformance.suite.compare.judge, as `mha check` judges).

Starting the processes costs seconds (each imports torch), so each (kind,
devices) pair runs all its cases in one start (a module-scoped fixture) and
the tests read its answers.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch not installed: pip install -c constraints/cpu.txt '.[torch]'")

import impl_torch.sharded as sharded  # noqa: E402
import weights  # noqa: E402
from conformance.suite.cases import CASES, Case  # noqa: E402
from conformance.suite.compare import expected_for, judge  # noqa: E402

pytestmark = pytest.mark.torch


def _cfg(**kw) -> weights.AttentionConfig:
    return weights.AttentionConfig(**{"num_heads": 2, "query_dim": 8, "head_dim": 4, **kw})


# Cases the grid does not hold (names start with "sharded_" so that no grid case shares their seeds).
EXTRA = {case.name: case for case in (
    # kv heads split with the query heads on 2 and 4 processes (K >= n, K % n == 0)
    Case("sharded_gqa_split", _cfg(num_heads=8, num_kv_heads=4, rope={}), T=9, S=9, is_causal=True),
    # K = 3 on 2 processes: a rank's query heads straddle kv groups (each gets its own copy); QK-norm over
    # every head (its statistics summed over the ranks, the shared kv head counted once)
    Case("sharded_kv_straddle", _cfg(num_heads=6, num_kv_heads=3, window_left=2,
                                     qk_norm={"type": "layer", "scope": "all", "eps": 1e-5}),
         self_attention=False, T=5, S=7, mask="padding"),
    # dropout with rows that see no key: their uniform weights on every key (hidden ones too) are dropped too
    Case("sharded_dropout_uniform_rows", _cfg(dropout=0.3, masked_row="uniform"), training=True, mask="empty_rows",
         self_attention=False, T=5, S=7, is_causal=True),
    # MQA (K = 1 < n: the kv head on every rank) with QK-norm over every head
    Case("sharded_norm_all_mqa", _cfg(num_heads=4, num_kv_heads=1, qk_norm={"type": "rms", "scope": "all"}, rope={}),
         self_attention=False, T=4, S=6, is_causal=True),
    # a cache split by position, causal under bottom_right, MQA and sinks
    Case("sharded_decode_sinks_mqa", _cfg(num_heads=4, num_kv_heads=1, use_sinks=True, rope={}),
         self_attention=False, T=3, S=3, P=6, is_causal=True, causal_alignment="bottom_right", return_cache=True,
         return_weights=False),
)}

SEQUENCE_CASES = (
    "causal_top_left", "causal_bottom_right", "causal_bottom_right_long_query", "window_left_causal",
    "window_both_bottom_right", "padding_mask", "mask_bnts", "bias_neg_inf", "masked_rows_uniform",
    "masked_rows_nan", "sinks", "sinks_masked_rows", "segments_packed", "rope_yarn", "cache_window_gqa",
    "decode_cache", "qk_norm_layer_all", "softcap", "mqa", "dropout_train", "sharded_gqa_split",
    "sharded_decode_sinks_mqa", "sharded_dropout_uniform_rows",
)
HEADS_CASES = {
    2: ("gqa", "mqa", "causal_bottom_right", "padding_mask", "bias", "masked_rows_nan", "sinks", "segments_packed",
        "rope_yarn", "cache_window_gqa", "dropout_train", "qk_norm_layer_all", "sharded_gqa_split",
        "sharded_kv_straddle", "sharded_norm_all_mqa", "sharded_decode_sinks_mqa"),
    # K = 2 < 4 (replicated per group), MQA, K = 4 (split); every case here has num_heads divisible by 4
    4: ("mqa", "mask_and_bias_causal", "decode_cache", "sinks", "sharded_gqa_split", "sharded_norm_all_mqa"),
}
BFLOAT16 = {"sequence": ("causal_bottom_right", "segments_packed"), "heads": ("gqa", "sinks")}
# Sequence cases again with each ring block cut into 2 x 2 sub-blocks (options["chunk_size"]).
CHUNKED = ("window_left_causal", "segments_packed", "masked_rows_uniform", "sinks_masked_rows", "decode_cache",
           "bias_neg_inf", "sharded_dropout_uniform_rows")


def _case(name: str, kind: str) -> Case:
    case = EXTRA.get(name) or CASES[name]
    # A query's whole row of weights is never on one rank under sequence sharding: not asked for there.
    return dataclasses.replace(case, return_weights=False) if kind == "sequence" else case


def _plan(kind: str, devices: int):
    names = SEQUENCE_CASES if kind == "sequence" else HEADS_CASES[devices]
    plan = ([(name, "float32", None) for name in names] + [(name, "bfloat16", None) for name in BFLOAT16[kind]]
            + [(name, "float32", 2) for name in (CHUNKED if kind == "sequence" else ())])
    jobs = []
    for name, dtype, chunk in plan:
        case = _case(name, kind)
        exp = expected_for(case, dtype)
        options = case.options(dtype) | ({} if chunk is None else {"chunk_size": chunk})
        base = dict(config=case.config, tensors=exp["tensors"], inputs=exp["inputs"], options=options)
        d_out = exp["d_output"].astype(exp["tensors"]["query.kernel"].dtype)
        jobs += [dict(op="forward", **base), dict(op="vjp", d_output=d_out, **base)]
    return plan, jobs


_RUNS: dict = {}


def _answers(kind: str, devices: int) -> dict:
    """Every case of (kind, devices), run in one start of the processes: (name, dtype, chunk_size) -> (forward,
    vjp, stats)."""
    if (kind, devices) not in _RUNS:
        plan, jobs = _plan(kind, devices)
        results = sharded.run_jobs(jobs, kind=kind, devices=devices)
        _RUNS[(kind, devices)] = {
            key: (results[2 * i]["result"], results[2 * i + 1]["result"], results[2 * i]["stats"])
            for i, key in enumerate(plan)}
    return _RUNS[(kind, devices)]


def _params():
    for kind, devices in (("sequence", 2), ("sequence", 4), ("heads", 2), ("heads", 4)):
        plan, _ = _plan(kind, devices)
        for name, dtype, chunk in plan:
            yield pytest.param(kind, devices, name, dtype, chunk,
                               id=f"{kind}{devices}-{name}-{dtype}" + ("" if chunk is None else f"-chunk{chunk}"))


@pytest.mark.parametrize("kind,devices,name,dtype,chunk", list(_params()))
def test_sharded_equals_reference(kind, devices, name, dtype, chunk):
    case = _case(name, kind)
    fwd, vjp, _ = _answers(kind, devices)[(name, dtype, chunk)]
    comparisons = judge(case, dtype, fwd, vjp["grads"], precision="highest")
    failures = [c.describe() for c in comparisons if not c.ok]
    assert not failures, f"{kind}:{devices} {name} {dtype}:\n" + "\n".join(failures)
    assert np.asarray(fwd["output"]).dtype.name == dtype, f"output dtype {np.asarray(fwd['output']).dtype.name}"
    # vjp's output is the forward output, computed again
    worst = float(np.nanmax(np.abs(np.asarray(vjp["output"], np.float64) - np.asarray(fwd["output"], np.float64))))
    assert worst == 0.0, f"vjp's output differs from forward's by up to {worst}"


def test_ring_traffic_is_every_block_n_minus_1_hops():
    """Each key/value block travels n-1 hops: over the ranks the ring sends (n-1) times the call's key/value
    bytes (keys after projection, the cache's included), and no gradient bytes in a forward."""
    for name in ("causal_bottom_right", "decode_cache", "segments_packed"):
        case = _case(name, "sequence")
        c = case.config
        kv_bytes = case.B * c.num_kv_heads * case.S_total * (c.head_dim + c.value_head_dim) * 4  # float32
        stats = _answers("sequence", 4)[(name, "float32", None)][2]
        sent = sum(s["kv"] for s in stats)
        assert sent == 3 * kv_bytes, f"{name}: ring sent {sent} bytes, expected 3 x {kv_bytes}"
        assert all(s["grad"] == 0 for s in stats), f"{name}: gradient bytes in a forward: {stats}"
        ids = sum(s["ids"] for s in stats)
        expected_ids = 3 * 8 * case.B * case.S_total if case.positions == "packed" else 0  # int64 key ids
        assert ids == expected_ids, f"{name}: {ids} id bytes, expected {expected_ids}"


def test_measure_against_the_ring_minimum():
    """measure(): an even split sends exactly the ring's minimum, (n-1)/n of the key/value bytes, per rank."""
    case = Case("sharded_measure", _cfg(num_heads=4, num_kv_heads=2), T=8, S=8, is_causal=True,
                return_weights=False)
    exp = expected_for(case, "float32")
    got = sharded.measure(case.config, exp["tensors"], exp["inputs"], case.options("float32"), devices=2)
    kv_bytes = case.B * 2 * 8 * (4 + 4) * 4
    assert got["kv_bytes"] == kv_bytes, got
    assert got["kv_bytes_sent"] == [kv_bytes // 2, kv_bytes // 2], got
    assert got["ratio_to_minimum"] == 1.0, got
    assert all(peak >= before > 0 for peak, before in zip(got["peak_rss_bytes"], got["rss_before_bytes"])), got


def test_zigzag_split():
    assert [b.tolist() for b in sharded.split(8, 2, zigzag=True)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [b.tolist() for b in sharded.split(5, 2, zigzag=False)] == [[0, 1, 2], [3, 4]]
    blocks = sharded.split(13, 4, zigzag=True)
    assert sorted(np.concatenate(blocks).tolist()) == list(range(13)), blocks


def _call(name="causal_bottom_right", dtype="float32"):
    case = CASES[name]
    exp = expected_for(case, dtype)
    return case.config, exp["tensors"], exp["inputs"], case.options(dtype)


@pytest.mark.parametrize("kind,devices,options,expected", [
    ("heads", 4, {}, "num_heads=2 does not divide by devices=4"),
    ("sequence", 2, {"return_weights": True}, "return_weights is not available"),
])
def test_refusals_name_the_reason(kind, devices, options, expected):
    config, tensors, inputs, base = _call()
    with pytest.raises(NotImplementedError, match=expected):
        sharded.forward(config, tensors, inputs, {**base, **options}, kind=kind, devices=devices)


def test_refusal_past_key_positions():
    """The engines place a cache's keys at 0..P-1: past_key_positions is refused by name, before any process."""
    config, tensors, inputs, options = _call("decode_cache")
    inputs = dict(inputs, past_key_positions=np.arange(inputs["past_key"].shape[2]))
    with pytest.raises(NotImplementedError, match="past_key_positions is not taken"):
        sharded.forward(config, tensors, inputs, options, kind="heads", devices=2)


def test_refusal_topk_indices():
    """The engines are not wired for a selection: topk_indices is refused by name, before any process."""
    config, tensors, inputs, options = _call("decode_cache")
    inputs = dict(inputs, topk_indices=np.zeros((inputs["query"].shape[0], inputs["query"].shape[1], 2), np.int64))
    with pytest.raises(NotImplementedError, match="topk_indices is not taken"):
        sharded.forward(config, tensors, inputs, options, kind="heads", devices=2)


def test_refusal_trace():
    config, tensors, inputs, options = _call()
    with pytest.raises(NotImplementedError, match="no trace"):
        sharded.forward(config, tensors, inputs, options | {"return_weights": False}, kind="sequence", devices=2,
                        trace=True)


@pytest.mark.parametrize("kind,devices,expected", [
    ("rows", 2, "kind must be one of heads, sequence: got 'rows'"),
    ("heads", 0, "devices must be a positive integer: got 0"),
    ("sequence", True, "devices must be a positive integer: got True"),
])
def test_bad_arguments(kind, devices, expected):
    config, tensors, inputs, options = _call()
    with pytest.raises(ValueError) as info:
        sharded.forward(config, tensors, inputs, options, kind=kind, devices=devices)
    assert str(info.value) == expected


def test_bad_input_is_the_contracts_error_before_any_process_starts():
    config, tensors, inputs, options = _call()
    with pytest.raises(ValueError, match="causal_alignment"):
        sharded.forward(config, tensors, inputs, options | {"causal_alignment": "middle"}, kind="heads", devices=2)


def test_bad_chunk_size():
    config, tensors, inputs, options = _call()
    with pytest.raises(ValueError, match="chunk_size must be a positive integer: got 0"):
        sharded.forward(config, tensors, inputs, options | {"return_weights": False, "chunk_size": 0},
                        kind="sequence", devices=2)


def test_run_in_group_leaves_a_group_it_did_not_start_running(tmp_path, monkeypatch):
    """Under torchrun the caller owns the group: run_in_group must not end it. (Its job timer once shared
    the name of the "I started the group" flag, so the group was destroyed after any job.)"""
    import torch.distributed as dist

    from impl_torch.sharded import launch

    monkeypatch.setattr(launch, "_run_job", lambda job, kind, rank, world: {"rank": rank})
    monkeypatch.setattr(launch, "_assemble", lambda job, kind, pieces: pieces)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        answers = launch.run_in_group([{"op": "forward"}], kind="heads")
        assert [a["result"] for a in answers] == [[{"rank": 0}]]
        assert dist.is_initialized(), "run_in_group ended the caller's process group"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_mha_run_shard_gives_the_unsharded_output(tmp_path):
    """`mha run --backend torch --shard`: heads:4 and sequence:2 on packed documents, heads:2 and sequence:4 on a
    cache (present key and value written), as a user runs it: tests/sharded_runs.py, as test_sharded_jax.py
    runs it for jax."""
    from sharded_runs import assert_run_shard_gives_the_unsharded_output

    assert_run_shard_gives_the_unsharded_output(tmp_path, "torch")
