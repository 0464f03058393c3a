"""impl_tf's one Keras layer on Keras's jax and torch backends: the keras-jax and keras-torch columns of
`mha check` (each in a worker of its own), the porting bugs those columns catch, and the .keras round trip.

Keras fixes its backend when first imported, and this process's Keras (the tf tests') runs on TensorFlow:
every Keras-on-jax or Keras-on-torch call here runs in a process of its own (tests/keras_backend_runs.py,
or mha check's workers). The tests run in tox's `all` env, the one with keras, jax and torch together.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conformance.suite import check
from conformance.suite.cases import DTYPE_NAMES
from conformance.suite.compare import STATUS_PASS, STATUS_UNSUPPORTED, expected_for
from conformance.suite.tolerance import compare, policy_for

RUNS = Path(__file__).with_name("keras_backend_runs.py")
FRAMEWORK = {"keras-jax": "jax", "keras-torch": "torch"}
MARKS = {"keras-jax": [pytest.mark.keras_jax, pytest.mark.tf, pytest.mark.jax],
         "keras-torch": [pytest.mark.keras_torch, pytest.mark.tf, pytest.mark.torch]}


def per_backend(*names):
    return [pytest.param(name, marks=MARKS[name], id=name) for name in names]


def _needs(backend_id):
    missing = [m for m in ("keras", FRAMEWORK[backend_id]) if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{backend_id} needs {' and '.join(missing)}: pip install -c constraints/cpu.txt '.[all]'")


def _run(backend_id, *args) -> dict:
    """tests/keras_backend_runs.py in a process whose Keras runs on the backend's framework."""
    env = {**os.environ, "KERAS_BACKEND": FRAMEWORK[backend_id], "TF_CPP_MIN_LOG_LEVEL": "2"}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, str(RUNS), backend_id, *args], capture_output=True, text=True, env=env,
                          timeout=600, check=False)
    assert done.returncode == 0, f"{backend_id} {args[0]} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def _commands(folder: Path, backend_id: str) -> dict:
    """What the tests below read, as keras_backend_runs.py's batch runs it: one process per backend."""
    commands = {"judge": ["judge", ",".join(["none", *MUTANTS]),
                          *sorted({spec for spec, _ in MUTANTS.values()} | {FUSED_SCALE_STAGES})],
                "indexer": ["indexer", "none,keras_maximum"],
                "round_trip": ["round_trip", str(folder)],
                "verify": ["verify"],
                "v4": ["v4", str(V4_PREFILL), str(V4_STOP)],
                "gather": ["gather", "none,wrong_kv_head"]}
    if backend_id == "keras-jax":
        commands["programs"] = ["programs", str(folder / "programs")]
    return commands


def _batch(backend_id, tmp_path_factory) -> dict:
    """The batch's answers. Under pytest-xdist the first worker to ask runs it and writes them where every
    worker of the session finds them (the session's temp directory, behind a file lock); the others read them."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return _run(backend_id, "batch", json.dumps(_commands(tmp_path_factory.mktemp(backend_id), backend_id)))
    from filelock import FileLock  # tox's own dependency (the dev extra), and torch's

    shared = tmp_path_factory.getbasetemp().parent  # pytest-N/, above each worker's popen-gwN/
    done = shared / f"keras-backend-runs-{backend_id}.json"
    with FileLock(f"{done}.lock"):
        if not done.exists():
            answers = _run(backend_id, "batch", json.dumps(_commands(tmp_path_factory.mktemp(backend_id), backend_id)))
            done.write_text(json.dumps(answers))
        return json.loads(done.read_text())


@pytest.fixture(scope="session")
def keras_runs(tmp_path_factory):
    """keras_runs(backend_id, command): that command's answer from tests/keras_backend_runs.py on the backend.
    The four commands the tests below read run in one process per backend and session, not one each: every
    start imports Keras, TensorFlow and the framework (measured in docs/testing.md). A command that raised
    fails the test that reads it, with its traceback."""
    answers = {}

    def answer(backend_id, command):
        if backend_id not in answers:
            answers[backend_id] = _batch(backend_id, tmp_path_factory)
        got = answers[backend_id][command]
        assert "error" not in got, f"{backend_id} {command} raised:\n{got['error'][-3000:]}"
        return got["result"]

    return answer


@pytest.mark.parametrize("backend_id", per_backend("keras-jax", "keras-torch"))
def test_the_column_passes_every_path_and_dtype_in_a_worker_of_its_own(backend_id):
    """mha check's column on two cases, every path and dtype: the stages and the fused path pass (forward and
    gradients through the backend's own autodiff), the chunked path and the in-place cache are unsupported
    with their reason (TensorFlow only). run_check starts the backend's own worker."""
    _needs(backend_id)
    results, skipped = check.run_check([backend_id], dtypes=["float64", "float32", "float16", "bfloat16"],
                                       case_names=["causal_bottom_right", "decode_cache"], jobs=1, progress=False,
                                       compile_cache=None, path_kinds=check.PATH_KINDS)
    assert not skipped, skipped
    table = {(r.case, r.dtype, r.path): r for r in results}
    assert len(table) == 2 * 4 * 3 + 4, sorted(table)  # stages, fused, chunked each; in_place where a cache is
    for (case, dtype, path), r in table.items():
        if path in ("chunked", "in_place"):
            assert r.status == STATUS_UNSUPPORTED, (case, dtype, path, r.status, r.message)
            assert "needs Keras's TensorFlow backend" in r.message, r.message
        else:
            assert r.status == STATUS_PASS, (case, dtype, path, r.status, r.message)
            assert any(c.name.startswith("grad ") for c in r.comparisons), (case, dtype, path, "no gradient judged")


# Porting bugs planted in the Keras-on-jax or Keras-on-torch run alone, and a case each must fail on.
# keras_matmul, keras_trig and keras_mean are the float64 traps of Keras 3.15's jax and torch backends
# (impl_tf/backend.py): each fails float64 where its op computes in float32, and passes where it does not
# (measured: keras.ops.matmul keeps float64 on jax, keras.ops.cos and sin on torch).
MUTANTS = {
    "fused_scale": ("gqa:float32:fused", ("keras-jax", "keras-torch")),
    "causal_top_left_only": ("causal_bottom_right:float32:stages", ("keras-jax", "keras-torch")),
    "keras_mean": ("qk_norm_rms_head:float64:stages", ("keras-jax", "keras-torch")),
    "keras_matmul": ("causal_bottom_right:float64:fused", ("keras-torch",)),
    "keras_trig": ("rope_half:float64:stages", ("keras-jax",)),
}


# gqa's stages beside its fused path: on keras-jax the two run as one program (compare.run_case_paths, as `mha
# check` runs a case's paths), and fused_scale must fail the fused path there and leave the stages passing.
FUSED_SCALE_STAGES = "gqa:float32:stages"


@pytest.mark.parametrize("backend_id", per_backend("keras-jax", "keras-torch"))
def test_the_column_catches_the_porting_bugs_planted_in_it(backend_id, keras_runs):
    _needs(backend_id)
    judged = keras_runs(backend_id, "judge")
    clean = {row[0] + ":" + row[1] + ":" + row[2]: row[3] for row in judged["none"]}
    assert set(clean.values()) == {STATUS_PASS}, f"the layer as it is must pass every case first: {clean}"
    for mutant, (spec, caught_on) in MUTANTS.items():
        status = {row[0] + ":" + row[1] + ":" + row[2]: row[3] for row in judged[mutant]}[spec]
        want = "fail" if backend_id in caught_on else STATUS_PASS
        assert status == want, f"{mutant} on {backend_id}, {spec}: {status}, expected {want}"
    beside = {row[0] + ":" + row[1] + ":" + row[2]: row[3] for row in judged["fused_scale"]}[FUSED_SCALE_STAGES]
    assert beside == STATUS_PASS, f"fused_scale must leave {FUSED_SCALE_STAGES} passing: {beside}"


@pytest.mark.parametrize("backend_id", per_backend("keras-jax", "keras-torch"))
def test_the_indexer_runs_on_the_backend_and_catches_a_float64_relu(backend_id, keras_runs):
    """impl_tf's lightning indexer (keras.ops) on the backend: run directly in float64, its index scores and
    selection pass the tolerance policy against the float64 reference (DeepSeek's decode step, MiniMax M3's
    blocks); its ReLU through keras.ops.maximum (float64 computed in float32 on torch, cast back) fails
    DeepSeek's scores on torch alone (M3 has no ReLU; jax's maximum keeps float64). The layer with the indexer
    passes run_case (on keras-jax under the adapter's jax.jit: the indexer traced), the grid's near-tie case
    (indexer_ties_near) in every dtype."""
    _needs(backend_id)
    seen = keras_runs(backend_id, "indexer")
    assert seen["none"] == {"indexer_dsa_decode": [True, []], "indexer_m3_blocks": [True, []]}, seen["none"]
    caught = backend_id == "keras-torch"
    assert seen["keras_maximum"]["indexer_dsa_decode"] == ([False, ["index_scores"]] if caught else [True, []]), seen
    assert seen["keras_maximum"]["indexer_m3_blocks"] == [True, []], seen
    assert {dtype for case, dtype, *_ in seen["layer"] if case == "indexer_ties_near"} == set(DTYPE_NAMES), seen
    for case, dtype, path, status, message in seen["layer"]:
        assert status == STATUS_PASS, (case, dtype, path, status, message)


# DeepSeek V4's layer (impl_tf.compressed): a prefill of 14 of tests/test_compressed_v4.py's tokens, then 14, 15, 16
# one at a time from the returned cache: the step at 15 closes csa's window 3 (of 4: tokens 12 and 13 buffered by the
# prefill, 14 by a decode step) and hca's window 1 (of 8: 8 .. 13 from the prefill), with csa's overlap half and the
# last 5 keys (the window of 6) carried in the cache; 16 opens the next window.
V4_PREFILL, V4_STOP = 14, 17


@pytest.mark.parametrize("backend_id", per_backend("keras-jax", "keras-torch"))
def test_the_keras_v4_layer_reproduces_the_reference_prefill_and_decode(backend_id, keras_runs):
    """impl_tf.compressed in float32 on the backend (keras.ops on jax under jax.jit as the adapter runs it, on torch
    eagerly), the three kinds, batch 2: the prefill's rows and the decode's from its cache judged against the
    float64 reference's one prefill of the 17 tokens (impl_numpy.compressed) by the tolerance policy's float32 bar for an output (policy_for, the logits'
    sizes giving z, S every key of the call), as the round trip's predict is; csa's selection is the reference's
    (its smallest score gap at the top-k boundary is 0.014 of scores of size 0.7: float32 cannot swap it)."""
    _needs(backend_id)
    from test_compressed_v4 import KINDS, _layer, _x

    from impl_numpy.compressed import compressed_attention

    seen = keras_runs(backend_id, "v4")
    assert sorted(seen) == sorted(KINDS), sorted(seen)
    for kind, got in seen.items():
        config, tensors = _layer(kind)
        trace = []
        T = V4_STOP
        x = _x()[:, :T].astype(np.float32).astype(np.float64)  # the inputs the mirror had
        want, selection = compressed_attention(config, tensors, x, np.arange(T), trace=trace, return_selection=True)
        logits = dict((e.stage, e.value) for e in trace)["logits"]
        tol = policy_for(config, dtype="float32", quantity="output", B=x.shape[0], T=T, S=logits.shape[-1],
                         reference=want, logits=logits, max_position=T)
        for rows, name in ((slice(0, V4_PREFILL), "prefill"), (slice(V4_PREFILL, T), "decode")):
            c = compare(f"{kind} {name}", np.asarray(got["output"])[:, rows], want[:, rows], tol)
            assert c.ok, c
        if kind == "csa":
            np.testing.assert_array_equal(np.asarray(got["selection"]), selection[:, :V4_PREFILL])
        else:
            assert got["selection"] is None, got["selection"]


@pytest.mark.parametrize("backend_id", per_backend("keras-jax", "keras-torch"))
def test_the_keras_gather_takes_a_selection_per_kv_head_on_the_backend(backend_id, keras_runs):
    """impl_tf's gather of a decode step's selected keys (impl_tf.attention.gather_selected) on the backend:
    tests/test_sparse_gather.py's VARIANTS (shared and per kv head, a mask per head, a fully masked row under
    masked_row "zero", "uniform" and "nan", batch 2) against the float64 stages, the gather run where masked_row is "zero" alone
    (the others stay with the masked core); each kv head reading the next one's selection fails."""
    _needs(backend_id)
    from test_sparse_gather import VARIANTS, _expected, _judge, _variant, gathers

    seen = keras_runs(backend_id, "gather")
    for mutant, variants in seen.items():
        for variant, got in variants.items():
            step, mask = _variant(variant)
            expected, logits = _expected(*step, mask=mask)
            output = np.asarray(got["output"], np.float64)
            rows = 2 * (step[-1].shape[1] if VARIANTS[variant][0] else 1)
            assert got["rows"] == ([[rows, 6]] if gathers(variant) else []), (mutant, variant, got["rows"])
            if mutant == "none":
                _judge(f"{backend_id} {variant}", output, expected, logits, step[0])
            else:
                with pytest.raises(AssertionError, match="FAIL"):
                    _judge(f"{backend_id} {variant} ({mutant})", output, expected, logits, step[0])
    assert set(seen) == {"none", "wrong_kv_head"} and set(seen["none"]) == set(VARIANTS), seen.keys()
    assert list(seen["wrong_kv_head"]) == ["per_kv_head_empty"], list(seen["wrong_kv_head"])


@pytest.mark.parametrize("backend_id", per_backend("keras-jax", "keras-torch"))
def test_keras_file_round_trip(backend_id, keras_runs):
    """The layer (bfloat16) and a Model holding it (float32) saved and loaded as .keras on the backend."""
    _needs(backend_id)
    seen = keras_runs(backend_id, "round_trip")
    assert seen["class"] == "MultiHeadAttention" and seen["policy"] == "bfloat16" and seen["same_config"], seen
    assert seen["same_bytes"], "the weights changed in the .keras round trip"
    assert seen["same_outputs"] and seen["model_same_predict"], "the loaded layer computes otherwise"
    from conformance.suite.cases import CASES

    case = CASES["causal_top_left"]
    expected = expected_for(case, "float32")  # the float64 reference's
    tol = policy_for(case.config, dtype="float32", quantity="output", B=case.B, T=case.T, S=case.S_total,
                     reference=expected["output"], logits=expected["logits"])
    c = compare("model.predict after load", np.asarray(seen["model_predict"]), expected["output"], tol)
    assert c.ok, c


@pytest.mark.parametrize("backend_id", per_backend("keras-jax", "keras-torch"))
def test_the_keras_layer_adapter_takes_a_layer_on_the_backend(backend_id, keras_runs):
    """mha verify's keras_layer adapter (the pytest plugin's, for a live Keras layer) on
    keras.layers.MultiHeadAttention, gradients required: through jax.vjp or torch.autograd."""
    _needs(backend_id)
    results = keras_runs(backend_id, "verify")
    assert sorted(results) == ["cross_basic.bfloat16", "cross_basic.float32", "value_head_dim.bfloat16",
                               "value_head_dim.float32"], sorted(results)
    for name, (status, detail) in results.items():
        assert status == STATUS_PASS, (name, status, detail)


@pytest.mark.parametrize("backend_id", per_backend("keras-jax"))
def test_keras_jax_programs_kept_on_disk_give_the_bits_jit_gives(backend_id, keras_runs):
    """keras-jax's programs through impl_jax's on-disk cache (what a warm `mha check` runs): a program loaded
    from a file gives jax.jit's bits, a loaded program is not compiled and written again, and the case's twin
    (other inputs, weights, masks and bias of the same shapes: the same program) passes against the float64
    reference through the cache: every array is an argument, none a constant of a stored trace."""
    _needs(backend_id)
    seen = keras_runs(backend_id, "programs")
    assert sorted(seen) == ["decode_cache", "dropout_train", "mask_and_bias_causal"], seen
    for name, found in seen.items():
        assert found["stored"] >= 1 and found["written_again"] == 0, (name, found)
        assert found["same_compiled"] and found["same_loaded"], (name, found)
        assert found["twin"][0] == STATUS_PASS, (name, found)


@pytest.mark.parametrize("backend_id", per_backend("keras-jax"))
def test_mha_verify_names_the_keras_backend_of_impl_tf(backend_id, tmp_path):
    """`mha verify --impl impl_tf.adapter:attention` under KERAS_BACKEND=jax runs as keras-jax, the column `mha
    check` names (its line, its JSON and the NOT_YET it reads: tests/test_verify.py), not tf."""
    _needs(backend_id)
    env = {**os.environ, "KERAS_BACKEND": FRAMEWORK[backend_id], "TF_CPP_MIN_LOG_LEVEL": "2"}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    out = tmp_path / "verify.json"
    done = subprocess.run([sys.executable, "-m", "conformance", "verify", "--impl", "impl_tf.adapter:attention",
                           "--cases", "self_basic", "--dtypes", "float32", "--require-gradients", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"impl_tf.adapter:attention (backend {backend_id}): 1 vectors: 1 pass" in done.stdout, done.stdout
    payload = json.loads(out.read_text())
    assert payload["backend"] == backend_id and payload["results"][0]["status"] == STATUS_PASS, payload


@pytest.mark.tf
@pytest.mark.jax
def test_keras_jax_compiles_its_cpu_programs_with_impl_jax_options():
    """keras-jax's CPU programs compile with impl_jax's FAST_CPU_COMPILE, which impl_tf copies (impl_jax.adapter
    is the jax column's entry point, with its own set-up): with XLA's defaults the column of a cold `mha
    check` took 5x the CPU. The two must not drift apart; an unknown mode is refused."""
    pytest.importorskip("tensorflow")
    pytest.importorskip("flax")
    from impl_jax import adapter as jax_adapter
    from impl_tf import adapter as tf_adapter

    assert tf_adapter.FAST_CPU_COMPILE == jax_adapter.FAST_CPU_COMPILE
    assert tf_adapter.cpu_compile() == "fast"
    with pytest.raises(ValueError, match="cpu compile mode must be one of fast, default: got 'O3'"):
        tf_adapter.set_cpu_compile("O3")
