"""Run in a process of its own with KERAS_BACKEND set (tests/test_keras_backends.py starts it): impl_tf's
Keras layer on that backend, judged by run_case on a few cases, with and without planted bugs, and its
.keras round trip.

    python tests/keras_backend_runs.py BACKEND_ID judge MUTANT[,MUTANT...] CASE[:DTYPE[:PATH]] ...
    python tests/keras_backend_runs.py BACKEND_ID round_trip DIR
    python tests/keras_backend_runs.py BACKEND_ID verify
    python tests/keras_backend_runs.py BACKEND_ID indexer MUTANT[,MUTANT...]
    python tests/keras_backend_runs.py BACKEND_ID v4 PREFILL STOP
    python tests/keras_backend_runs.py BACKEND_ID gather MUTANT[,MUTANT...]
    python tests/keras_backend_runs.py BACKEND_ID batch '{"NAME": ["COMMAND", "ARG", ...], ...}'
    python tests/keras_backend_runs.py keras-jax programs DIR

judge prints one JSON line, {mutant: [[case, dtype, path, status, message], ...]} (MUTANT: names joined by
commas, each planted alone and undone after); "none" runs the layer as it is, the others (_plant) are porting bugs a Keras-on-jax or Keras-on-torch port makes, planted in that
backend's run alone, that the keras-jax and keras-torch columns must catch. round_trip saves the layer and a
functional Model holding it as .keras files in DIR, loads them, and prints what it compared. indexer runs
impl_tf.indexer.lightning_indexer itself in float64 on the indexer cases' inputs, judged (index scores and
selection) by conformance.suite.selection.judge_indexer, with each mutant planted alone, then the layer on
two indexer cases judged by run_case ("layer": judge's rows). v4 runs impl_tf.compressed (DeepSeek V4's layer)
in float32 on tests/test_compressed_v4.py's three layers, batch 2: a prefill of PREFILL tokens returning its
cache, then the tokens up to STOP one at a time from the returned cache, and prints the outputs (and csa's selection)
for the test to judge against the float64 reference. gather runs impl_tf's fused path in float32 on
tests/test_sparse_gather.py's VARIANTS (a decode step over a selection shared or per kv head, batch 2) with each
mutant planted alone ("wrong_kv_head": each kv head reads the next one's selection, on the per-kv-head variant
the gather runs on) and prints the outputs and the gather's selection rows, for the test to judge. programs (keras-jax) runs a few cases' forward
and vjp by jax.jit, then through the on-disk program cache in DIR (compiled and stored, then loaded as a new
process would), then the cases' twins (same shapes, other values) through the cache, judged by run_case, and
prints what it compared. batch runs several of these one after another in one process (the framework imported
once) and prints {NAME: {"result": what the command prints} or {"error": its traceback}}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def _plant(mutant: str) -> list:
    """Plant the bug; returns what undoes it ([(module, name, value before)])."""
    from impl_tf import attention, backend, fused, indexer, masks
    from impl_tf import functional as F

    ops = backend.ops
    undo = []

    def put(module, name, value):
        undo.append((module, name, getattr(module, name)))
        setattr(module, name, value)

    def primitives(**changed):  # backend.py's primitives, some replaced by their keras.ops forms
        return type("bk", (), {**{n: getattr(backend, n) for n in backend.__all__}, **changed})

    if mutant == "fused_scale":  # the fast path's scale 10% off, the stages untouched (the other backends' plant)
        original = attention._attention
        put(attention, "_attention", lambda q, k, v, scale, **kw: original(q, k, v, scale=scale * 1.1, **kw))
    elif mutant == "keras_matmul":  # the fused core's matmuls as keras.ops.matmul (float64 in float32 on torch)
        put(fused, "matmul", ops.matmul)
        put(fused, "matmul_nt", lambda a, b: ops.matmul(a, ops.swapaxes(b, -1, -2)))
    elif mutant == "keras_trig":  # RoPE's cos and sin as keras.ops' (float64 in float32 on jax)
        put(F, "bk", primitives(cos=ops.cos, sin=ops.sin))
    elif mutant == "keras_mean":  # the norms' mean as keras.ops.mean (float64 in float32 on jax and torch)
        put(F, "bk", primitives(mean=ops.mean))
    elif mutant == "causal_top_left_only":  # the causal mask aligned top-left whatever the call asks
        original_mask = masks.causal_mask
        put(F, "causal_mask", lambda T, S, alignment="top_left": original_mask(T, S, "top_left"))
    elif mutant == "keras_maximum":  # the indexer's ReLU as keras.ops.maximum cast back to the scores' dtype
        # (torch: float64 computed in float32, the dtype restored, the digits float32's)
        put(indexer, "bk", primitives(maximum=lambda a, b: ops.cast(ops.maximum(a, b), F.dtype_name(a))))
    elif mutant != "none":
        raise SystemExit(f"unknown mutant {mutant!r}")
    return undo


def judge(backend_id: str, mutant: str, specs: list[str]) -> list:
    """[[case, dtype, path, status, message], ...] of the specs (CASE[:DTYPE[:PATH]]) with the mutant planted,
    then undone."""
    from conformance.suite import backends
    from conformance.suite.cases import ALL_CASES
    from conformance.suite.compare import run_case_paths

    adapter = backends.load(backend_id)
    undo = _plant(mutant)
    _forget_programs()
    rows = []
    groups: dict = {}  # (case, dtype) -> its paths, run together as `mha check` runs them (run_case_paths: on
    # keras-jax the stages and the fused path are one program)
    for spec in specs:
        name, dtype, path = (spec.split(":") + ["float32", "stages"][spec.count(":"):])[:3]
        groups.setdefault((name, dtype), []).append(path)
    try:
        for (name, dtype), paths in groups.items():
            results = {r.path: r for r in run_case_paths(ALL_CASES[name], backend_id, paths, dtype=dtype,
                                                         adapter=adapter)}
            for path in paths:
                result = results.get(path)
                rows.append([name, dtype, path, None if result is None else result.status,
                             None if result is None else result.message])
    finally:
        for module, name, value in reversed(undo):
            setattr(module, name, value)
        _forget_programs()
    return rows


def _forget_programs() -> None:
    """On keras-jax, drop the programs traced so far: jax.jit keeps a call's program for the next call of the
    same structure and shapes, and would not trace the planted (or the undone) code again."""
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()


def judge_indexer_stage(backend_id: str, mutant: str, names: list[str]) -> dict:
    """{case: [ok, [names of the failing comparisons]]}: impl_tf's lightning_indexer run directly on this
    backend in float64 (eagerly, NumPy in) on the case's inputs, its index scores and selection judged against
    the float64 reference by the tolerance policy, with the mutant planted, then undone."""
    from conformance.suite import backends
    from conformance.suite.cases import ALL_CASES, make_inputs, make_tensors
    from conformance.suite.selection import judge_indexer
    from impl_tf.indexer import lightning_indexer

    backends.load(backend_id)  # the adapter's process set-up (jax: x64 mode)
    import keras

    undo = _plant(mutant)
    seen = {}
    try:
        for name in names:
            case = ALL_CASES[name]
            tensors, inputs = make_tensors(case), make_inputs(case)
            call = {n: inputs[n] for n in ("key", "past_index_keys") if inputs.get(n) is not None}
            result = lightning_indexer(case.config, tensors, inputs["query"], dtype="float64", return_scores=True,
                                       **call)
            result = {n: np.asarray(keras.ops.convert_to_numpy(v)) for n, v in result.items()}
            verdicts = judge_indexer(case.config, tensors, {"query": inputs["query"], **call}, result,
                                     dtype="float64")
            seen[name] = [all(c.ok for c in verdicts), [c.name for c in verdicts if not c.ok]]
    finally:
        for module, attr, value in reversed(undo):
            setattr(module, attr, value)
    return seen


def v4_calls(backend_id: str, prefill: int, stop: int) -> dict:
    """{kind: {"output": (B, stop, O) as lists, "selection": csa's prefill selection or None}}: impl_tf.compressed
    in float32 on tests/test_compressed_v4.py's layers (_layer, _x: batch 2, float64 weights cast by the mirror to
    x's float32), a prefill of `prefill` tokens with return_cache, then each token up to `stop` alone from the
    present cache fed back as past. The keras.ops code on this backend: on torch eagerly; on jax as the adapter
    runs it, one jax.jit program per call with impl_tf's FAST_CPU_COMPILE (eager jax compiles every op per shape:
    8.0 s of CPU for these calls of the three kinds against 1.6 s, 2-core AMD EPYC VM, 2026-11-29)."""
    from test_compressed_v4 import KINDS, _layer, _x

    from conformance.suite import backends
    from impl_tf.adapter import FAST_CPU_COMPILE
    from impl_tf.compressed import compressed_attention

    backends.load(backend_id)  # the adapter's process set-up (jax: x64 mode)
    import keras

    def numpy(a):
        return np.asarray(keras.ops.convert_to_numpy(a))

    jit = FAST_CPU_COMPILE if backend_id == "keras-jax" else None
    seen = {}
    for kind in KINDS:
        config, tensors = _layer(kind)
        x = _x().astype(np.float32)
        out, selection, past = compressed_attention(config, tensors, x[:, :prefill], np.arange(prefill),
                                                    return_cache=True, return_selection=True, jit=jit)
        rows = [numpy(out)]
        for s in range(prefill, stop):
            out, past = compressed_attention(config, tensors, x[:, s:s + 1], np.array([s]), past, return_cache=True,
                                             jit=jit)
            rows.append(numpy(out))
        seen[kind] = {"output": np.concatenate(rows, axis=1).astype(np.float64).tolist(),
                      "selection": None if selection is None else numpy(selection).tolist()}
    return seen


def gather_calls(backend_id: str, mutants: list[str]) -> dict:
    """{mutant: {variant: {"output": (2, 1, O) as lists, "rows": [the gather's selection rows' shape, ...]}}}:
    impl_tf's fused path (impl_tf.attention.gather_selected where it gathers) on this backend, eagerly on torch,
    under jax.jit on jax (as the adapter runs the layer: eager jax compiles every op per shape)."""
    from test_sparse_gather import VARIANTS, _variant, roll_kv_heads

    from conformance.suite import backends
    from impl_tf import attention

    backends.load(backend_id)  # the adapter's process set-up (jax: x64 mode)
    import keras

    right = attention.selection_rows
    seen = {}
    for mutant in mutants:
        taken = []

        def spy(topk, mutant=mutant, taken=taken):
            rows, Ks = right(topk)
            taken.append(list(rows.shape))
            return (rows if mutant == "none" else roll_kv_heads(rows, Ks, attention.ops)), Ks

        attention.selection_rows = spy
        seen[mutant] = {}
        try:
            for variant, (per_kv_head, masked_row, _, head_mask) in VARIANTS.items():
                if mutant != "none" and not (per_kv_head and masked_row == "zero" and not head_mask):
                    continue  # a planted gather bug, on the per-kv-head variant the gather runs on
                (config, tensors, x, lat, rot, idx), mask = _variant(variant)

                def call(t, x, lat, rot, idx, mask, config=config):
                    return attention.multi_head_attention(config, t, x, past_key=lat, past_value=rot,
                                                          topk_indices=idx, mask=mask, is_causal=True,
                                                          causal_alignment="bottom_right")
                if backend_id == "keras-jax":
                    import jax

                    call = jax.jit(call)
                del taken[:]
                out = np.asarray(keras.ops.convert_to_numpy(call(tensors, x, lat, rot, idx, mask)), np.float64)
                seen[mutant][variant] = {"output": out.tolist(), "rows": list(taken)}
        finally:
            attention.selection_rows = right
    return seen


def round_trip(backend_id: str, folder: str) -> dict:
    """The layer (bfloat16: the storage dtype Keras's torch backend converts by hand) and a float32 Model
    holding it, saved and loaded as .keras files: the loaded weights equal byte for byte, the loaded layer's
    outputs equal to the saved one's (the same computation, same process), the Model's predict within the
    float32 tolerance of the float64 reference."""
    from conformance.suite import backends
    from conformance.suite.cases import CASES
    from conformance.suite.compare import expected_for
    from impl_tf import MultiHeadAttention, keras

    backends.load(backend_id)  # x64 on jax, as the adapter sets it
    seen = {}
    case = CASES["mask_and_bias_causal"]
    exp = expected_for(case, "bfloat16")
    layer = MultiHeadAttention.from_tensors(case.config, exp["tensors"], dtype="bfloat16")
    x = np.asarray(exp["inputs"]["query"], np.float32)
    call = dict(mask=exp["inputs"]["mask"], bias=np.asarray(exp["inputs"]["bias"], np.float32), is_causal=True,
                return_weights=True)
    path = Path(folder) / "layer.keras"
    keras.saving.save_model(layer, path)
    loaded = keras.saving.load_model(path)
    seen["class"] = type(loaded).__name__
    seen["policy"] = loaded.dtype_policy.name
    seen["same_config"] = loaded.config == layer.config
    seen["same_bytes"] = all(a.tobytes() == b.tobytes() for a, b in zip(layer.to_tensors().values(),
                                                                        loaded.to_tensors().values()))
    got = [np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(t, "float32"))) for t in loaded(x, **call)]
    want = [np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(t, "float32"))) for t in layer(x, **call)]
    seen["same_outputs"] = all(np.array_equal(a, b) for a, b in zip(got, want))

    case = CASES["causal_top_left"]
    exp = expected_for(case, "float32")
    c = case.config
    inner = MultiHeadAttention.from_tensors(c, exp["tensors"], dtype="float32")
    q, k, v = keras.Input((case.T, c.query_dim)), keras.Input((case.S, c.key_dim)), keras.Input((case.S, c.value_dim))
    model = keras.Model([q, k, v], inner(q, k, v, is_causal=True))
    model_path = Path(folder) / "model.keras"
    model.save(model_path)
    loaded_model = keras.saving.load_model(model_path)
    args = [np.asarray(exp["inputs"][n], np.float32) for n in ("query", "key", "value")]
    predicted = loaded_model.predict(args, verbose=0)
    seen["model_same_predict"] = bool(np.array_equal(predicted, model.predict(args, verbose=0)))
    seen["model_predict"] = np.asarray(predicted, np.float64).tolist()
    return seen


def verify_keras_mha(backend_id: str) -> dict:
    """mha verify's keras_layer adapter (what `pytest --mha-impl` takes for a live Keras layer) on
    keras.layers.MultiHeadAttention, gradients required, on this backend: {vector: [status, detail]}."""
    from conformance.suite import adapters, backends
    from conformance.suite.verify import verify

    backends.load(backend_id)
    import keras

    def build(c):
        return keras.layers.MultiHeadAttention(c.num_heads, c.head_dim, value_dim=c.value_head_dim,
                                               output_shape=c.out_dim, use_bias=c.use_query_bias)

    def call(layer, x, options):
        out, scores = layer(x["query"], x["value"], key=x["key"], return_attention_scores=True)
        return {"output": out, "weights": scores}

    results = verify(adapters.keras_layer(build, "keras-mha", call), require_gradients=True,
                     only=["cross_basic", "value_head_dim"], dtypes=["float32", "bfloat16"])
    return {r.name: [r.status, r.detail] for r in results}


def _bits(answer) -> list:
    """(forward, grads) as a flat list of (name, array) in a fixed order."""
    forward, grads = answer
    return sorted((f"forward.{n}", np.asarray(x)) for n, x in forward.items()) + sorted(
        (f"grad.{n}", np.asarray(x)) for n, x in grads.items())


def _same_bits(a, b) -> bool:
    a, b = _bits(a), _bits(b)
    return [n for n, _ in a] == [n for n, _ in b] and all(
        x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes() for (_, x), (_, y) in zip(a, b))


def program_cache(backend_id: str, folder: str) -> dict:
    """{case: {...}}: the adapter's forward_and_vjp by jax.jit alone, then with the program cache in `folder`
    (compiled and stored, then loaded after the process's programs are dropped); then, through the cache,
    the case's twin (another name: other inputs, weights, masks and bias of the same shapes, so the same
    program) judged by run_case against the float64 reference: a stored program must give jax.jit's bits,
    and take every array as an argument (a mask or bias kept in a program as a constant of its first trace
    would answer the twin with the case's)."""
    import dataclasses

    from conformance.suite import backends
    from conformance.suite.cases import CASES
    from conformance.suite.compare import expected_for, run_case
    from impl_jax import programs

    adapter = backends.load(backend_id)
    folder = Path(folder)
    seen = {}
    for name in ("mask_and_bias_causal", "decode_cache", "dropout_train"):
        case = CASES[name]
        exp = expected_for(case, "float32")
        options = case.options("float32")
        d_out = exp["d_output"].astype(np.float32)

        def call(case=case, exp=exp, options=options, d_out=d_out):
            return adapter.forward_and_vjp(case.config, exp["tensors"], exp["inputs"], options, d_out)

        adapter.set_program_cache(None)
        by_jit = call()
        adapter.set_program_cache(folder)
        before = set(folder.iterdir()) if folder.exists() else set()
        compiled = call()
        stored = set(folder.iterdir()) - before
        programs.clear()  # as a new process: only the files remain
        loaded = call()
        twin = run_case(dataclasses.replace(case, name=f"{name}_twin"), backend_id, adapter=adapter)
        adapter.set_program_cache(None)
        seen[name] = {"stored": len(stored), "written_again": len(set(folder.iterdir()) - before - stored),
                      "same_compiled": _same_bits(by_jit, compiled), "same_loaded": _same_bits(by_jit, loaded),
                      "twin": [twin.status, twin.message]}
    return seen


def run_command(backend_id: str, command: str, rest: list[str]):
    """One command's answer (what it prints as JSON)."""
    if command == "judge":  # judge MUTANT[,MUTANT...] SPEC ...: {mutant: rows}
        return {mutant: judge(backend_id, mutant, rest[1:]) for mutant in rest[0].split(",")}
    if command == "verify":
        return verify_keras_mha(backend_id)
    if command == "indexer":  # indexer MUTANT[,MUTANT...]: {mutant: {case: [ok, failing]}, "layer": rows}
        cases = ["indexer_dsa_decode", "indexer_m3_blocks"]
        seen = {mutant: judge_indexer_stage(backend_id, mutant, cases) for mutant in rest[0].split(",")}
        # and the layer's call (the adapter's: under jax.jit on keras-jax), the selection judged by run_case
        # and the grid's near-tie case in every dtype (16-bit selections keep the other key of some ties)
        seen["layer"] = judge(backend_id, "none", ["indexer_dsa_decode:float64:stages",
                                                   "indexer_m3_blocks:float32:fused",
                                                   *(f"indexer_ties_near:{dtype}:stages" for dtype in
                                                     ("float64", "float32", "float16", "bfloat16"))])
        return seen
    if command == "v4":  # v4 PREFILL STOP: {kind: {"output", "selection"}}
        return v4_calls(backend_id, int(rest[0]), int(rest[1]))
    if command == "gather":  # gather MUTANT[,MUTANT...]: {mutant: {variant: {"output", "rows"}}}
        return gather_calls(backend_id, rest[0].split(","))
    if command == "round_trip":
        return round_trip(backend_id, rest[0])
    if command == "programs":
        return program_cache(backend_id, rest[0])
    raise SystemExit(f"unknown command {command!r}")


def batch(backend_id: str, commands: dict) -> dict:
    """{name: {"result": answer} or {"error": traceback}} for {name: [command, *args]}, one after another in
    this process: the backend's framework and Keras imported once for all of them (each start costs seconds of
    CPU). A command that raises is reported, the next ones still run."""
    import traceback

    answers = {}
    for name, (command, *rest) in commands.items():
        try:
            answers[name] = {"result": run_command(backend_id, command, rest)}
        except (Exception, SystemExit):  # noqa: BLE001 - reported to the test that reads this command's answer
            answers[name] = {"error": traceback.format_exc()}
    return answers


if __name__ == "__main__":
    backend_id, command, *rest = sys.argv[1:]
    if command == "batch":  # batch JSON ({name: [command, *args]}): {name: {"result" | "error": ...}}
        print(json.dumps(batch(backend_id, json.loads(rest[0]))))
    else:
        print(json.dumps(run_command(backend_id, command, rest)))
