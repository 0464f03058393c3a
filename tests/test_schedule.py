"""conformance/suite/schedule.py: how `mha check` spreads its chunks over workers. The schedule decides
how long a check takes, never what it finds: the last test runs a split column on two workers and on one
process and asks for the same results in the same order."""

from conformance.suite import schedule
from conformance.suite.schedule import Chunk, ChunkQueue, ChunkWorker, split_column, worker_groups

CORE_SHARED = ["numpy", "torch", "tf", "jax", "mlx"]


def _loads(warm: bool, cases=(92, 68, 68, 68), jax_cases=(92, 68)):
    return {b: schedule.case_seconds(b, warm) * sum(jax_cases if b == "jax" else cases) for b in CORE_SHARED}


def test_the_workers_each_import_their_own_frameworks_and_the_groups_follow_the_estimates():
    """A framework's backends run in one worker (it alone imports that framework); on two cores a warm check
    gives TensorFlow a worker and the rest the other, a cold one JAX (its programs compiled in the run) a
    worker and TensorFlow with the rest the other; processes beyond the families share the heaviest
    family's chunks, never more than it has."""
    def as_sets(groups):
        return [(set(group), n) for group, n in groups]
    assert as_sets(worker_groups(_loads(True), 2)) == [({"tf"}, 1), ({"numpy", "torch", "jax", "mlx"}, 1)]
    assert as_sets(worker_groups(_loads(False), 2)) == [({"jax"}, 1), ({"numpy", "torch", "tf", "mlx"}, 1)]
    natives = {b: 1.0 for b in ["tf", "keras-native-mha", "torch", "torch-sdpa", "jax", "jax-dpa", "numpy"]}
    families = [set(group) for group, _ in worker_groups(natives, 3)]
    for together in ({"tf", "keras-native-mha"}, {"torch", "torch-sdpa"}, {"jax", "jax-dpa"}):
        assert any(together <= group for group in families), families
    assert worker_groups({"jax": 5.0}, 2) == [(["jax"], 2)]  # one family: its chunks in parallel
    assert worker_groups({"jax": 5.0}, 8, {"jax": 2}) == [(["jax"], 2)]
    many = worker_groups(_loads(True), 16, {"jax": 2})
    assert sorted(b for group, _ in many for b in group) == sorted(CORE_SHARED)
    assert sum(n for _, n in many) <= 16 and all(n <= (2 if group == ["jax"] else 4) for group, n in many), many


def test_a_column_is_cut_in_order_into_chunks_of_bounded_estimates():
    cases = [f"c{i}" for i in range(92)]
    cold = split_column("jax", "cpu", "float32", cases, warm=False)
    assert [c for chunk in cold for c in chunk.cases] == cases and [c.part for c in cold] == list(range(len(cold)))
    assert len(cold) > 1 and all(c.seconds <= schedule.CHUNK_SECONDS for c in cold), cold
    assert max(len(c.cases) for c in cold) - min(len(c.cases) for c in cold) <= 1
    warm = split_column("jax", "cpu", "float32", cases, warm=True)
    assert len(warm) < len(cold), "a warm JAX column costs a sixth of a cold one: fewer, larger chunks"
    whole = split_column("jax", "cpu", "float32", cases, warm=False, most=None)
    assert len(whole) == 1 and whole[0].cases == tuple(cases)
    assert split_column("numpy", "cpu", "float16", ["a", "b"], warm=True) == [
        Chunk("numpy", "cpu", "float16", ("a", "b"), 0, 2 * schedule.case_seconds("numpy", True))]


def test_a_worker_out_of_its_own_chunks_takes_another_family_only_where_it_pays():
    """A worker runs its own backends' chunks first, longest first; out of them, it takes the smallest queued
    chunk of the family with the most seconds left when that family's own worker would still be busy longer
    than the chunk plus the import costs this one: a cold check's JAX parts go to TensorFlow's worker once
    its own are done, and a warm check's last TensorFlow chunk stays with TensorFlow's worker."""
    dtypes = ["float64", "float32", "float16", "bfloat16"]
    cases = [f"c{i}" for i in range(68)]
    jax_parts = split_column("jax", "cpu", "float32", cases, warm=False)
    tf_chunks = [c for t in dtypes for c in split_column("tf", "cpu", t, cases, warm=False)]
    queue = ChunkQueue(jax_parts + tf_chunks)
    jax_worker, tf_worker = ChunkWorker(None, {"jax"}), ChunkWorker(None, {"tf"})
    first = queue.next_for(jax_worker)
    assert first.backend == "jax" and first.seconds == max(c.seconds for c in jax_parts)
    assert [queue.next_for(tf_worker).backend for _ in tf_chunks] == ["tf"] * len(tf_chunks)
    stolen = queue.next_for(tf_worker)  # its own are done while JAX's worker has parts queued
    assert stolen is not None and stolen.backend == "jax" and "jax" in tf_worker.backends
    while queue.chunks:
        assert queue.next_for(jax_worker) is not None
    assert queue.next_for(tf_worker) is None and queue.next_for(jax_worker) is None

    # a warm check: the other worker is done with two TensorFlow chunks still queued: it leaves them
    queue = ChunkQueue([c for t in dtypes for c in split_column("tf", "cpu", t, cases, warm=True)]
                       + split_column("numpy", "cpu", "float32", cases, warm=True))
    tf_worker, other = ChunkWorker(None, {"tf"}), ChunkWorker(None, {"numpy"})
    assert queue.next_for(tf_worker).backend == "tf" and queue.next_for(tf_worker).backend == "tf"
    assert queue.next_for(other).backend == "numpy"
    assert queue.next_for(other) is None, "two chunks left: importing TensorFlow for one does not pay"
    assert "tf" not in other.backends


def test_a_check_is_scheduled_as_warm_only_after_one_with_these_sources_ended(tmp_path):
    assert not schedule.is_warm(None) and not schedule.is_warm(tmp_path)
    (tmp_path / "warm-of-older-sources").touch()
    assert not schedule.is_warm(tmp_path)
    schedule.mark_warm(tmp_path)
    assert schedule.is_warm(tmp_path)
    assert [p.name for p in tmp_path.glob("warm-*")] == [schedule._marker_name()], "the old marker stays"


def test_a_split_schedule_gives_the_results_of_one_process_in_the_same_order(tmp_path, monkeypatch):
    """Two workers, each column cut into chunks of one case (CHUNK_SECONDS tiny), against one process."""
    from conformance.suite import check

    cases = ["self_basic", "gqa", "mask_bts", "causal_square", "decode_cache"]
    run = dict(dtypes=["float32", "float16"], case_names=cases, progress=False, gradients=False)
    one, skipped_one = check.run_check(["numpy"], jobs=1, **run)
    monkeypatch.setattr(schedule, "CHUNK_SECONDS", 1e-9)
    two, skipped_two = check.run_check(["numpy"], jobs=2, compile_cache=tmp_path, **run)
    key = [(r.backend, r.path, r.device, r.dtype, r.case, r.status) for r in one]
    assert key == [(r.backend, r.path, r.device, r.dtype, r.case, r.status) for r in two] and skipped_one == skipped_two
    assert len(one) >= 2 * len(cases) and all(r.status == "pass" for r in one), [r.status for r in one]
    assert not schedule.is_warm(tmp_path), "5 cases: the default grid's programs are not all on disk"


def test_in_a_warm_check_the_workers_with_much_less_to_do_yield_the_busiest_the_cpu():
    loads = [22.2, 16.4, 6.3, 8.05]  # a warm check's TensorFlow worker, the other shared one, the Keras ones
    assert schedule.niceness(loads, warm=True) == [0, schedule.NICE, schedule.NICE, schedule.NICE]
    assert schedule.niceness(loads, warm=False) == [0, 0, 0, 0], "cold: the fair shares balance better"
    assert schedule.niceness([5.0, 4.9], warm=True) == [0, 0] and schedule.niceness([], warm=True) == []
