"""The long-cache sweep (cases.random_long_cache_case, `python -m conformance.suite.sweep --long-cache`):
random_case's draws over a cache of 64-4200 keys, so the decode fast paths that random_case's 1-4-key caches
never reach run, ANDed with whatever else the seed drew, and pass in every dtype.

Each backend's fast paths are probed: the function that takes the fast form (or the predicate that chooses it)
is wrapped and counted while the sweep runs, and every probe must fire on SEEDS. A threshold raised past the
long caches, or a condition that no longer lets a path run, fails here instead of leaving the sweep to pass
without reaching it. SEEDS were chosen (docs/conformance.md, "The long-cache sweep") as seeds whose cases take
each probed path; they are taken, no longer unseen.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest

from conformance.suite import backends
from conformance.suite.cases import DTYPE_NAMES, LONG_CACHE_RANGES, random_case, random_long_cache_case
from conformance.suite.sweep import sweep

SEEDS = (2_100_005, 2_100_007, 2_100_029, 2_100_092, 2_100_114)

# backend -> (module, function, what counts: None every call, "true" a true result, "not_none" a result)
PROBES = {
    "numpy": [("impl_numpy.indexer", "_decode_scores", None),  # one query's index scores, keys as rows
              ("impl_numpy.indexer", "_select_topk_partitioned", None),  # the top-k of few among many
              ("impl_numpy.chunked", "_selected_columns", "not_none")],  # the gather of a selection
    "torch": [("impl_torch.attention", "splits_keys", "true"),  # the absorbed key's two parts
              ("impl_torch.attention", "_selected_columns", "not_none"),
              ("impl_torch.indexer", "_decode_scores", None),
              ("impl_torch.indexer", "_select_few", None)],
    "jax": [("impl_jax.attention", "gathers_selection", "true"),
            ("impl_jax.attention", "decodes_in_blocks", "true"),  # fused.absorbed_decode's loop over key blocks
            ("impl_jax.indexer", "_one_query_scores", None),
            ("impl_jax.indexer", "_select_topk_partitioned", None)],
    "tf": [("impl_tf.attention", "gathers_selection", "true"),
           ("impl_tf.indexer", "_decode_scores", None),
           ("impl_tf.indexer", "_select_few", None)],
    "mlx": [("impl_mlx.attention", "gathers_selection", "true")],
}


def _counted(monkeypatch, probes) -> dict[str, list]:
    """Wrap each probed function in its module (the callers read it from there) and count what it takes."""
    counts: dict[str, list] = {}
    for module_name, name, taken in probes:
        module = importlib.import_module(module_name)
        original, hits = getattr(module, name), counts.setdefault(f"{module_name}.{name}", [])

        def probe(*args, _original=original, _hits=hits, _taken=taken, **kwargs):
            result = _original(*args, **kwargs)
            if _taken is None or (_taken == "true" and bool(result)) or (_taken == "not_none" and result is not None):
                _hits.append(1)
            return result

        monkeypatch.setattr(module, name, probe)
    return counts


# each backend in its own tox env (numpy: NumPy alone, the numpy env; `all` does not run them again)
MARKS = {"numpy": pytest.mark.reference, "torch": pytest.mark.torch, "tf": pytest.mark.tf, "jax": pytest.mark.jax,
         "mlx": pytest.mark.mlx}


@pytest.mark.parametrize("backend_id", [pytest.param(b, marks=MARKS[b]) for b in PROBES])
def test_the_long_caches_reach_the_fast_paths_and_pass(backend_id, monkeypatch):
    ok, reason = backends.availability(backend_id)
    if not ok:
        pytest.skip(reason)
    counts = _counted(monkeypatch, PROBES[backend_id])
    summary = sweep(backend_id, SEEDS, DTYPE_NAMES, make_case=random_long_cache_case)
    assert not summary["failures"], "\n".join(summary["failures"])
    assert summary["runs"] >= len(SEEDS) * len(DTYPE_NAMES), summary["runs"]
    missed = [name for name, hits in counts.items() if not hits]
    assert not missed, f"the long-cache seeds {SEEDS} no longer reach {missed} on {backend_id}"


@pytest.mark.slow
@pytest.mark.parametrize("backend_id", [pytest.param(b, marks=MARKS[b]) for b in PROBES])
def test_long_cache_sweep_200(backend_id):
    """`tox -e full`: 200 long-cache seeds on the backend's default paths in every dtype."""
    ok, reason = backends.availability(backend_id)
    if not ok:
        pytest.skip(reason)
    summary = sweep(backend_id, range(2_101_000, 2_101_200), DTYPE_NAMES, make_case=random_long_cache_case)
    assert not summary["failures"], f"{len(summary['failures'])} of {summary['runs']} runs failed:\n" + \
        "\n".join(summary["failures"][:20])


@pytest.mark.reference
def test_a_long_cache_case_keeps_the_seeds_draws():
    """random_long_cache_case changes the cache, the call's length and what a cache refuses, nothing else of
    random_case(seed); half the draws clear the features the fast paths step aside for."""
    cleared = kept = 0
    for seed in range(2_100_000, 2_100_200):
        case, long = random_case(seed), random_long_cache_case(seed)
        assert long.name == f"random_long_{seed}"
        assert any(low <= long.P < high for low, high in LONG_CACHE_RANGES), long.P
        assert long.causal_alignment == "bottom_right" and not long.self_attention
        assert long.T in (1, case.T) and long.S in (long.T, case.S)
        assert long.positions == (None if case.positions == "packed" else case.positions)
        as_drawn = (case.config, case.mask, case.bias, case.training)
        cleared_way = (case.config.replace(window_left=-1, window_right=-1, local_chunk=None, alibi=False,
                                           logit_softcap=None, use_sinks=False, dropout=0.0, masked_row="zero"),
                       None, None, False)
        got = (long.config, long.mask, long.bias, long.training)
        assert got in (as_drawn, cleared_way), got
        kept += got == as_drawn and got != cleared_way
        cleared += got == cleared_way and got != as_drawn
        rest = {"name", "P", "T", "S", "self_attention", "positions", "causal_alignment", "config", "mask", "bias",
                "training"}
        assert all(getattr(long, f.name) == getattr(case, f.name) for f in dataclasses.fields(case)
                   if f.name not in rest)
    # (a seed with nothing to clear counts in neither: both halves drawn, neither empty)
    assert cleared > 50 and kept > 50, (cleared, kept)


@pytest.mark.torch
def test_a_gather_that_drops_a_selected_key_fails_the_long_caches(monkeypatch):
    """A planted bug in torch's gather of the selected keys (the last selected column dropped): random_case's
    caches are under the gathers' 64 keys and never take it (its seeds 0-199 pass with this bug); the long
    caches do, and fail. (A NumPy mutant would move the float64 reference too: the reference is NumPy.)"""
    ok, reason = backends.availability("torch")
    if not ok:
        pytest.skip(reason)
    import impl_torch.attention as torch_attention

    original = torch_attention._selected_columns

    def one_key_fewer(*args, **kwargs):
        columns = original(*args, **kwargs)
        return columns if columns is None else columns[:-1]

    monkeypatch.setattr(torch_attention, "_selected_columns", one_key_fewer)
    summary = sweep("torch", SEEDS, ("float32",), make_case=random_long_cache_case)
    assert summary["failures"], "the gather's planted bug passed the long-cache seeds"


@pytest.mark.reference
def test_a_fused_kernel_rounds_alibi_s_bias_to_the_inputs_dtype():
    """The long-cache sweep's first find (seeds 2200000-, docs/conformance.md): ALiBi over 1038 keys in bfloat16
    (random_long_2200020). A fused kernel takes its additive mask in the inputs' dtype (MLX's must promote to
    the output type), so ALiBi's bias, up to -65 here, is rounded to bfloat16 before it joins the logits: MLX's
    fused output was 9x the stages' error from float64 (margin 2.46). The kernel formulation of the policy
    (compare.kernel_same_precision, fused) rounds it so too: its error is several times the stages'."""
    from conformance.suite.compare import expected_for, kernel_same_precision

    case = random_long_cache_case(2_200_020)
    assert case.config.alibi and case.P + case.S > 1000
    exp = expected_for(case, "bfloat16")
    stages = exp["same_precision"]["output"]
    kernel = kernel_same_precision(case, "bfloat16", exp, fused=True)["output"]
    assert kernel > 4 * stages, (kernel, stages)


@pytest.mark.mlx
def test_mlx_s_fused_kernel_passes_a_long_alibi_row():
    from conformance.suite.compare import run_case

    ok, reason = backends.availability("mlx")
    if not ok:
        pytest.skip(reason)
    for path in ("fused", "in_place"):
        result = run_case(random_long_cache_case(2_200_020), "mlx", dtype="bfloat16", path=path)
        assert result.status == "pass", result.message
