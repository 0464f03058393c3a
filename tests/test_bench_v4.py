"""`mha bench --shapes v4` (conformance/bench/v4.py): a DeepSeek V4 decode step against a dense MQA step.

The cache bytes the bench reports are held to a count written from the spec's prose (entries every m tokens, the
open window's buffered tokens, csa's overlap half and its indexer's own compressor; csa's top-k does not shrink
the cache), at --quick sizes on the caches the steps return and at DeepSeek V4's sizes on the caches the bench
draws; the bounds to a count from the reference's own arrays (the keys its mask leaves, the entries its indexer
keeps); the steps the bench times (numpy, torch, tf in place: its buffers too) to the float64 reference on the
cache of a real prefill, at small P; the --quick family runs end to end in NumPy. No assertion is about speed:
benchmarks are not tests. The reference-marked tests about 4 s (the end-to-end run 3.4 s of it: a worker process),
the torch one under 1 s after torch's import, the tf one about 3.5 s after TensorFlow's (tracing the four kinds'
tf.functions, 2.6 s of it csa's; 2-core AMD EPYC VM, loaded, 2026-11-29)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conformance.bench import v4
from conformance.cli.commands import main
from impl_numpy.compressed import buffer_shapes, cache_shapes, compressed_attention, logical_cache

# float32 steps against the float64 reference: every stage rounds to float32 through softmaxes of logits of size
# ~1, as tests/test_compressed_v4_torch.py's layers (256 float32 ulps of the output's size; measured there 3.2e-7
# relative at most)
BOUND = 256 * float(np.finfo(np.float32).eps)


def _count(d: v4.Dims, kind: str, n: int) -> int:
    """float32 bytes of a layer's cache after n tokens, from the spec's prose (docs/spec-frontier.md#deepseek-v4):
    the last W - 1 keys of width H (dense: every key); one entry per m tokens; the open window's n mod m tokens,
    each with its projections and its raw gates, twice the width with overlap (csa); csa's last closed window's
    first half (m rows of projections and gates) once a window has closed; csa's indexer the same at width J. Every
    entry stays (csa's top-k picks among them per query, it drops none)."""
    if kind == "dense":
        return 4 * n * d.H
    floats = min(n, d.W - 1) * d.H
    if kind in ("csa", "hca"):
        m, slots = (d.csa_m, 2) if kind == "csa" else (d.hca_m, 1)
        for width in [d.H] + ([d.J] if kind == "csa" else []):
            floats += (n // m) * width + (n % m) * 2 * slots * width
            if kind == "csa" and n >= m:
                floats += 2 * m * width
    return 4 * floats


@pytest.mark.reference
def test_cache_bytes_are_the_count_from_the_config():
    """--quick: the caches the bench draws and the present cache each step returns (P + 1 tokens, windows open and
    closing); DeepSeek V4's sizes: the shapes of the caches the bench draws, at 8192 and two lengths inside a
    window (no step: 481 MiB of weights)."""
    d = v4.dims(True)
    layer = v4.layers(d)
    for P in (16, 31, 35, 64):
        data = v4.inputs(d, layer, P)
        calls = v4.numpy_paths(layer, data, P)
        for kind in v4.KINDS:
            assert v4.cache_bytes(data["past"][kind]) == _count(d, kind, P), (kind, P)
            config = layer[kind][0]
            present = calls[kind]()[1]  # in place: the buffers (the open windows' m slots whatever P is)
            slots = sum(4 * int(np.prod(shape)) for shape in buffer_shapes(config, d.B, P + 1).values())
            assert v4.cache_bytes(present) == slots, (kind, P)
            got = v4.cache_bytes(logical_cache(config, present, P + 1))
            assert got == _count(d, kind, P + 1), (kind, P, got, _count(d, kind, P + 1))
    full = v4.dims(False)
    for kind, config in v4.configs(full).items():  # the shapes v4.cache draws (cache_shapes), not drawn: 1 s saved
        for P in (8192, 8195, 8318):
            nbytes = sum(4 * int(np.prod(shape)) for shape in cache_shapes(config, full.B, P).values())
            assert nbytes == _count(full, kind, P), (kind, P)
    per_token = {kind: _count(full, kind, 8192) / 8192 for kind in v4.KINDS}  # V4's own figures at 8k
    assert per_token["dense"] == 2048 and 0.3 < per_token["csa"] / per_token["dense"] < 0.34, per_token


@pytest.mark.reference
@pytest.mark.parametrize("P", [35, 39])
def test_bounds_count_what_the_step_reads_and_computes(P):
    """bounds() against the reference's own arrays: the keys its mask leaves (the trace's mask stage), the
    entries csa's indexer keeps (its selection), the entries and index entries it holds, the kernels' sizes.
    P 35 closes a csa window (it reads the open window), P 39 closes both kinds' (hca's m is 8)."""
    d = v4.dims(True)
    layer = v4.layers(d)
    data = v4.inputs(d, layer, P)
    for kind, (config, tensors) in layer.items():
        trace = []
        result = compressed_attention(config, tensors, data["x"], np.array([P]), data["past"][kind],
                                      return_cache=True, return_selection=kind == "csa", trace=trace)
        stages = {e.stage: e.value for e in trace}
        attended = int(np.isfinite(stages["mask"][0, 0, 0]).sum())  # keys and entries in the softmax
        past = data["past"][kind]
        weights = sum(t.nbytes for t in tensors.values())
        nbytes = weights + past["key"].nbytes  # the window's cached keys (the new one is computed)
        flops = sum(2 * t.size for n, t in tensors.items() if n.endswith("kernel")) + 4 * d.N * d.H * attended
        if kind == "hca":
            nbytes += result[1]["entries"][0, :attended - past["key"].shape[2] - 1].nbytes
        if kind == "csa":
            kept = int((result[1] >= 0).sum())
            assert kept == d.k < result[2]["entries"].shape[1], (kept, result[2]["entries"].shape)  # entries dropped
            index = result[2]["index_entries"]
            nbytes += kept * d.H * 4 + index.nbytes
            flops += 2 * d.I * index.shape[1] * (d.J + 1)
        m = {"csa": d.csa_m, "hca": d.hca_m}.get(kind)
        if m and (P + 1) % m == 0:  # a closing step reads the compressors' buffered tokens and overlap halves
            nbytes += sum(a.nbytes for n, a in past.items() if "window" in n or "overlap" in n)
        got = v4.bounds(d, kind, P, weights, sum(t.size for n, t in tensors.items() if n.endswith("kernel")))
        assert got == {"bytes": nbytes, "flops": flops}, (kind, got, nbytes, flops)


def _prefilled(d, layer, P):
    """x (B, 1, D) float32 and each kind's cache after a real prefill of P tokens by the float64 reference, rounded
    to float32 (what the bench's steps are handed)."""
    rng = np.random.default_rng(11)
    history = rng.standard_normal((d.B, P, d.D))
    past = {}
    for kind, (config, tensors) in layer.items():
        wide = {n: t.astype(np.float64) for n, t in tensors.items()}
        _, present = compressed_attention(config, wide, history, np.arange(P), return_cache=True)
        past[kind] = {n: a.astype(np.float32) for n, a in present.items()}
    return {"x": rng.standard_normal((d.B, 1, d.D)).astype(np.float32), "past": past}


def _expected(layer, data, P, kind):
    config, tensors = layer[kind]
    return compressed_attention(config, {n: t.astype(np.float64) for n, t in tensors.items()},
                                data["x"].astype(np.float64), np.array([P]),
                                {n: a.astype(np.float64) for n, a in data["past"][kind].items()})


def _assert_steps_agree(paths, to_numpy, P=35):
    d = v4.dims(True)
    layer = v4.layers(d)
    data = _prefilled(d, layer, P)
    calls = paths(layer, data, P)
    presents = {}
    for kind in v4.KINDS:
        want = _expected(layer, data, P, kind)
        got, presents[kind] = calls[kind]()
        err, scale = np.abs(to_numpy(got) - want).max(), np.abs(want).max()
        assert err <= BOUND * scale, f"{kind}: max |step - reference| {err:.3g} > {BOUND * scale:.3g}"
    return d, layer, data, presents


@pytest.mark.reference
def test_numpy_steps_agree_with_the_float64_reference_on_a_prefilled_cache():
    """P 35: csa holds 8 entries and keeps 2, hca 4, both with tokens in the open window; the bar could fail:
    the same step with csa's open window dropped from its cache (a decode that forgets the buffered tokens)
    lands far outside it."""
    d, layer, data, _ = _assert_steps_agree(v4.numpy_paths, np.asarray)
    config, tensors = layer["csa"]
    past = dict(data["past"]["csa"])
    want = _expected(layer, data, 35, "csa")
    emptied = {n: (a[:, :0] if "window" in n else a) for n, a in past.items()}
    # the open window's 3 tokens dropped: the step is then the one at position 32 (a new window's first token)
    wrong = compressed_attention(config, tensors, data["x"], np.array([32]), {**emptied, "key": past["key"]},
                                 return_cache=False)
    assert np.abs(wrong - want).max() > 100 * BOUND * np.abs(want).max()


@pytest.mark.torch
def test_torch_steps_agree_with_the_float64_reference_on_a_prefilled_cache():
    pytest.importorskip("torch")
    _assert_steps_agree(v4.torch_paths, lambda t: t.double().numpy())


@pytest.mark.tf
def test_tf_steps_in_place_agree_with_the_float64_reference_on_a_prefilled_cache():
    """tf steps in place as the others (layer's buffers=, tf.Variables for P + 1 tokens): its output as numpy's
    and torch's above, and the buffers it returns are its own variables, counted as the others' in-place cache (the
    buffer_shapes for P + 1 tokens), holding the float64 reference's present cache after the step (logical_cache:
    the ring, the entries, the open windows and overlap halves the step wrote; P 35 closes a csa window)."""
    pytest.importorskip("tensorflow")
    P = 35
    d, layer, data, presents = _assert_steps_agree(v4.tf_paths, lambda t: np.asarray(t, np.float64), P)
    for kind, present in presents.items():
        config, tensors = layer[kind]
        assert all(type(b).__name__.endswith("Variable") for b in present.values()), (kind, present)
        held = {n: np.asarray(b) for n, b in present.items()}
        assert v4.cache_bytes(held) == sum(4 * int(np.prod(s)) for s in buffer_shapes(config, d.B, P + 1).values())
        _, want = compressed_attention(config, {n: t.astype(np.float64) for n, t in tensors.items()},
                                       data["x"].astype(np.float64), np.array([P]),
                                       {n: a.astype(np.float64) for n, a in data["past"][kind].items()},
                                       return_cache=True)
        got = logical_cache(config, held, P + 1)
        assert set(got) == set(want), (kind, set(got) ^ set(want))
        for name, w in want.items():
            err, scale = np.abs(got[name] - w).max(initial=0), np.abs(w).max(initial=0)
            assert err <= BOUND * scale, f"{kind} {name}: max |buffer - reference| {err:.3g} > {BOUND * scale:.3g}"


@pytest.mark.reference
def test_quick_family_runs_in_numpy(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--shapes", "v4", "--backends", "numpy", "--json", str(out)]) == 0
    record = json.loads(out.read_text())["v4"]
    assert record["backends"]["numpy"]["status"] == "ok"
    rows = {(r["P"], r["path"]): r for r in record["rows"]}
    assert set(rows) == {(P, p) for P in v4.QUICK_V4_LENGTHS for p in v4.PATHS}
    d = v4.dims(True)
    for (P, path), r in rows.items():
        assert r["status"] == "ok", r
        if path != "read":
            assert r["x_bound"] > 0 and r["bound"] in ("read", "flops"), r
            config = v4.configs(d)[path]  # in place: the buffers for P + 1 tokens
            assert r["cache_bytes"] == sum(4 * int(np.prod(s)) for s in buffer_shapes(config, d.B, P + 1).values()), r
        if path in ("csa", "hca", "sliding"):
            assert r["x_dense"] > 0 and r["cache_x_dense"] == r["cache_bytes"] / rows[(P, "dense")]["cache_bytes"], r
    assert "v4: DeepSeek V4 decode step" in capsys.readouterr().out


@pytest.mark.reference
def test_v4_max_below_the_first_length_is_one_line(capsys):
    code = main(["bench", "--shapes", "v4", "--backends", "numpy", "--v4-max", "100"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == "mha: error: --v4-max must be at least 8192: got 100", err
