"""The mirrors' modern attention (RoPE, QK-norm, softcap, windows, sinks, the KV cache, segment ids)
against the float64 NumPy reference: one suite, run on each mirror (impl_torch, impl_tf, impl_jax, impl_mlx)
through its handle in tests/mirrors.py.

The named modern cases of conformance/suite/cases.py already run through each mirror's grid (tests/test_torch.py,
test_tf.py, test_jax.py); this suite adds the combinations the grids leave out, on each mirror's paths, the
stage-by-stage trace of the new stages, token-by-token decoding with the cache (whole and in place), the
layer's new parameters, masks and error wording. What only one framework has (SDPA routing and
torch.compile, tf.function and XLA, jax.jit and its programs) stays in tests/test_<framework>_modern.py.
Each parameter carries its framework's marker (`tox -e torch` runs the torch ones) and skips where that
framework is missing. Expected values come from impl_numpy in float64; tolerances from conformance.suite.tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest
from assertions import assert_bit_equal
from mirrors import (
    DECODE_PATHS,
    EXTRA_CASES,
    GPU_CASES,
    GPU_PATHS,
    IN_PLACE_VARIANTS,
    NAMES_CASES,
    PATHS,
    PERTURB_NORMS,
    TRACE_CASES,
    TRACE_DTYPES,
    bad_calls,
    grid,
    layer_cases,
    over_mirrors,
)
from modern_checks import (
    CACHE_POSITION_CASES,
    DECODE_CONFIGS,
    PROMPT,
    TOTAL,
    cfg,
    check_in_place_decode,
    decode_reference,
)
from reference_checks import assert_case_conforms, assert_gradients_conform, describe, error_of

import impl_numpy
import impl_numpy.adapter as numpy_adapter
import weights
from conformance.suite.cases import DTYPE_NAMES, cast_inputs, cast_tensors, make_inputs, make_tensors, output_cotangent
from conformance.suite.compare import expected_for
from conformance.suite.tolerance import assert_close
from weights.call import INDEXER_STAGES, LATENT_STAGES, stage_order

FRAMEWORKS = ("torch", "tf", "jax", "mlx")


def each(rows=lambda framework: [pytest.param()]):
    """parametrize's arguments over every mirror: rows(framework) -> its pytest.params (the ids its own file
    gave them)."""
    return over_mirrors({framework: list(rows(framework)) for framework in FRAMEWORKS})


def parametrize(names: str, rows=lambda framework: [pytest.param()]):
    """@pytest.mark.parametrize over ("mirror", *names), the mirror indirect (the `mirror` fixture)."""
    argnames = ["mirror", *(n.strip() for n in names.split(",") if n.strip())]
    return pytest.mark.parametrize(argnames, each(rows), indirect=["mirror"])


def _slow(condition: bool):
    return (pytest.mark.slow,) if condition else ()


# -- the extra combinations, every dtype, each mirror's paths -------------------------------

# JAX's chunked path compiles nested scans and their VJP (2-4 s each): every extra case in float32 by
# default, the other dtypes for three of them; the rest is `slow`.
JAX_CHUNKED_OTHER_DTYPES = {"jax_sinks_cache_mqa_empty_rows", "jax_softcap_window_segments",
                            "jax_dropout_cache_rope_sinks"}


def _rounded_alibi_slow(name, dtype, **_):
    """The rounded-ALiBi extra case (alibi_bias_dtype) runs in float32 in the framework envs, its other dtypes
    in `tox -e full` (the same bias code; the decode configs' alibi_rounded runs float32 too). MLX's run every
    dtype (0.05 s a row: it is eager): its float64 is where the rounding's straight-through gradient failed."""
    return _slow(name.endswith("_alibi_bf16_cache") and dtype != "float32" and not name.startswith("mlx_"))


def _extra_rows(framework):
    if framework != "jax":
        yield from grid(("path", "name", "dtype"), ("name", "dtype", "path"), marks=_rounded_alibi_slow,
                        path=PATHS[framework], name=list(EXTRA_CASES[framework]), dtype=DTYPE_NAMES)
        return
    for name in EXTRA_CASES["jax"]:
        for dtype in DTYPE_NAMES:
            yield pytest.param(name, dtype, "stages", id=f"{name}-{dtype}-stages",
                               marks=_rounded_alibi_slow(name, dtype))
            if dtype in ("float64", "float32"):  # 16-bit storage always takes the stages
                yield pytest.param(name, dtype, "fused", id=f"{name}-{dtype}-fused",
                                   marks=_rounded_alibi_slow(name, dtype))
            yield pytest.param(name, dtype, "chunked", id=f"{name}-{dtype}-chunked",
                               marks=_slow(dtype != "float32" and name not in JAX_CHUNKED_OTHER_DTYPES))


@parametrize("name, dtype, path", _extra_rows)
def test_extra_modern_case_matches_reference(mirror, name, dtype, path):
    """Output, weights (stages), present_key/value and every gradient (norm tensors, sinks, past_key and
    past_value included) judged as `mha check` judges them, on each of the mirror's paths (torch: the
    stages and SDPA; Keras: the stages, the fused core and chunk_size=2; JAX: the stages with weights, the
    fused expression, chunk_size=2)."""
    assert_case_conforms(mirror.path_case(mirror.extra_cases()[name], path), dtype, mirror.name,
                         mirror.path_adapter(path))


# -- names: inputs, answers, gradients -------------------------------------------------------

@parametrize("")
def test_optional_inputs_are_the_signatures(mirror):
    """Every optional input of the contract (weights.call.OPTIONAL_INPUTS, which the adapters pass through
    by name) is a keyword of the mirror's call."""
    from weights.call import OPTIONAL_INPUTS

    missing = [name for name in OPTIONAL_INPUTS if name not in mirror.optional_input_signature()]
    assert not missing, f"{mirror.module.__name__}.multi_head_attention lacks {missing}"


@parametrize("name", lambda fw: [pytest.param(n, id=n) for n in NAMES_CASES[fw]])
def test_answer_and_gradient_names_are_the_references(mirror, name):
    """forward's dict (output, weights, present_key, present_value) and vjp's grads (query, key, value,
    past_key, past_value, then every tensor) name and order their entries as impl_numpy.adapter does."""
    case = mirror.case(name)
    tensors, inputs, options = make_tensors(case), make_inputs(case), case.options("float64")
    d_out = output_cotangent(case)
    want_fwd = numpy_adapter.forward(case.config, tensors, inputs, options)
    got_fwd = mirror.adapter.forward(case.config, tensors, inputs, options)
    assert list(got_fwd) == list(want_fwd), f"forward names {list(got_fwd)} != reference {list(want_fwd)}"
    want = list(numpy_adapter.vjp(case.config, tensors, inputs, options, d_out)["grads"])
    got = list(mirror.adapter.vjp(case.config, tensors, inputs, options, d_out)["grads"])
    assert got == want, f"gradient names {got} != reference {want}"
    if inputs.get("past_key") is not None:
        assert "past_key" in got and "present_key" in got_fwd, f"{name} has a cache: grads {got}, answer {list(got_fwd)}"


# -- the trace, stage by stage ---------------------------------------------------------------

def _trace_rows(framework):
    if len(TRACE_DTYPES[framework]) == 1:
        return [pytest.param(n, TRACE_DTYPES[framework][0], id=n) for n in TRACE_CASES[framework]]
    return grid(("name", "dtype"), ("name", "dtype"), name=TRACE_CASES[framework], dtype=TRACE_DTYPES[framework])


@parametrize("name, dtype", _trace_rows)
def test_modern_trace_matches_reference_stage_by_stage(mirror, name, dtype):
    """The new stages appear under their exact names, in STAGES order (weights.call.stage_order: a latent
    layer's own, a norm after RoPE after it) (and, where the mirror says which
    stages a config traces, those), each equal to the reference's (norm on the flat projection in both
    scopes)."""
    case = mirror.case(name)
    exp = expected_for(case, dtype)
    got = mirror.adapter.forward(case.config, exp["tensors"], exp["inputs"], case.options(dtype), trace=True)["trace"]
    got_names, want_names = [s for s, _ in got], [s for s, _ in exp["trace"]]
    assert got_names == want_names, f"stages {got_names} != reference {want_names}"
    assert got_names == [s for s in stage_order(case.config) if s in got_names], f"{got_names} out of order"
    assert set(got_names) <= set(mirror.module.STAGES) | set(LATENT_STAGES) | set(INDEXER_STAGES), \
        "a stage no mirror names"
    if mirror.trace_stages is not None:
        assert tuple(got_names) == mirror.trace_stages(case.config), (
            f"{got_names} != {mirror.trace_stages(case.config)}")
    c = case.config
    wanted = {"query.norm", "key.norm"} if c.qk_norm else set()
    wanted |= {"query.rope", "key.rope"} if c.rope else set()
    wanted |= {"softcap"} if c.logit_softcap else set()
    assert wanted <= set(got_names), f"missing stages {sorted(wanted - set(got_names))}"
    failures = []
    for (stage, value), (_, expected) in zip(got, exp["trace"]):
        try:
            with np.errstate(invalid="ignore"):  # -inf on both sides of the mask stage
                assert_close(stage, value, expected, config=c, dtype=dtype, quantity="stage", B=case.B, T=case.T,
                             S=case.S_total, logits=exp["logits"])
        except AssertionError as err:
            failures.append(str(err))
    assert not failures, "\n".join(failures)


# -- decoding token by token with the cache ---------------------------------------------------

def _frontier_slow(config_name, dtype, **_):
    """The latent_frontier decode runs in float32 in the framework envs, its other dtypes (the same code,
    other roundings) in `tox -e full`: each of its rows costs 2-4 s (8 s JAX's op-by-op eager), a row of
    the other configs about 1 (measured 2026-11-27: it took the fresh-clone tox 5 s past its 15 minutes)."""
    return _slow(config_name in _FLOAT32_ONLY and dtype != "float32")


# decode configs whose other dtypes run in `tox -e full` only (alibi_rounded: its other dtypes are the same
# code with other roundings, which tests/test_mirrors_modern.py's extra alibi cases run on every path)
_FLOAT32_ONLY = ("latent_frontier", "alibi_rounded")


def _decode_rows(framework):
    if framework != "jax":
        yield from grid(("path", "config_name", "dtype"), ("config_name", "dtype", "path"), marks=_frontier_slow,
                        path=DECODE_PATHS[framework], config_name=list(DECODE_CONFIGS), dtype=DTYPE_NAMES)
        return
    for config_name in DECODE_CONFIGS:
        for dtype in DTYPE_NAMES:
            for path in DECODE_PATHS["jax"]:
                if path == "stages" and dtype in ("float16", "bfloat16"):
                    continue  # 16-bit "plain" is the stages already
                slow = (path == "chunked" and dtype != "float32" and config_name != "everything") or (
                    config_name in _FLOAT32_ONLY and dtype != "float32")
                yield pytest.param(config_name, dtype, path, id=f"{config_name}-{dtype}-{path}", marks=_slow(slow))


@parametrize("config_name, dtype, path", _decode_rows)
def test_decoding_with_the_cache_equals_the_full_causal_call(mirror, config_name, dtype, path):
    """Row for row: the prompt's rows and each decoded token's row equal the full causal call's, and the
    final cache its present_key / present_value, each in the storage dtype."""
    config = DECODE_CONFIGS[config_name]
    tensors, x, want, logits, errors = decode_reference(config_name, dtype, perturb_norms=PERTURB_NORMS[mirror.name])
    got = dict(zip(("output", "present_key", "present_value"), mirror.decode(config, tensors, x, path)))
    failures = []
    for name, value in got.items():
        assert value.dtype == weights.dtype_from_name(dtype), f"{name}: dtype {value.dtype}, expected {dtype}"
        try:
            assert_close(f"decoded {name}", value, want[name], config=config, dtype=dtype, quantity="output", B=2,
                         T=TOTAL, S=TOTAL, logits=logits, same_precision_error=errors.get(name))
        except AssertionError as err:
            failures.append(str(err))
    assert not failures, "\n".join(failures)


@parametrize("")
def test_layer_decodes_with_the_cache(mirror):
    config = DECODE_CONFIGS["everything"]
    tensors, x, want, logits, _ = decode_reference("everything", "float32", perturb_norms=PERTURB_NORMS[mirror.name])
    out, pk, pv = mirror.decode(config, tensors, x, mirror.layer_decode_path(), layer=True)
    for name, value in (("output", out), ("present_key", pk), ("present_value", pv)):
        assert_close(f"layer decoded {name}", value, want[name], config=config, dtype="float32", quantity="output",
                     B=2, T=TOTAL, S=TOTAL, logits=logits)


@parametrize("")
def test_decoding_with_explicit_positions_equals_the_defaults(mirror):
    """positions = P + arange(T) given explicitly is the default (the cache's offset), bit for bit;
    positions 0 (the offset forgotten) is not."""
    config = DECODE_CONFIGS["rope_norm_gqa"]
    tensors, x, *_ = decode_reference("rope_norm_gqa", "float64", perturb_norms=PERTURB_NORMS[mirror.name])
    _, pk, pv = mirror.call(config, tensors, x[:, :PROMPT], is_causal=True, return_cache=True)
    step = dict(past_key=pk, past_value=pv, is_causal=True, causal_alignment="bottom_right")
    token = x[:, PROMPT:PROMPT + 1]
    default = mirror.to_numpy(mirror.call(config, tensors, token, **step))
    given = mirror.to_numpy(mirror.call(config, tensors, token, **step, positions=np.array([PROMPT]),
                                        key_positions=np.array([PROMPT])))
    forgot = mirror.to_numpy(mirror.call(config, tensors, token, **step, positions=np.array([0]),
                                         key_positions=np.array([0])))
    assert_bit_equal("explicit positions P + arange(T) vs the defaults", given, default)
    differ = float(np.abs(default - forgot).max())
    assert differ > 1e-3, f"positions 0 (the offset forgotten) gave nearly the same output (max difference {differ})"


# -- an in-place cache (cache_length=): the caller's buffers, written where the new keys go ----------------

def _in_place_rows(framework):
    if framework != "jax":
        yield from grid(("variant", "config_name", "dtype"), ("config_name", "dtype", "variant"), marks=_frontier_slow,
                        variant=IN_PLACE_VARIANTS[framework], config_name=list(DECODE_CONFIGS), dtype=DTYPE_NAMES)
        return
    for config_name in DECODE_CONFIGS:
        for dtype in DTYPE_NAMES:
            for mode in IN_PLACE_VARIANTS["jax"]:
                slow = mode == "eager" and dtype != "float32"  # op by op: 4-9 s each, the jitted code's ops
                slow = slow or (config_name in _FLOAT32_ONLY and (dtype != "float32" or mode == "eager"))
                yield pytest.param(config_name, dtype, mode, id=f"{config_name}-{dtype}-{mode}", marks=_slow(slow))


@parametrize("config_name, dtype, variant", _in_place_rows)
def test_decoding_in_place_equals_the_full_causal_call(mirror, config_name, dtype, variant):
    """The prompt and then one token at a time into one zeroed buffer pair (modern_checks.decode_in_place,
    each mirror's buffers and its own checks of what a step hands back): the rows equal the full causal
    call's (float64 reference), the buffers' first TOTAL positions its present cache, the SPARE positions
    past them still zero."""
    config = DECODE_CONFIGS[config_name]
    tensors, x, want, logits, errors = decode_reference(config_name, dtype, perturb_norms=PERTURB_NORMS[mirror.name])
    outputs, pk, pv = mirror.in_place_decode(config, dtype, tensors, x, variant)

    def compare(name, got, expected):
        assert_close(f"in place ({variant}) {name}", got, expected, config=config, dtype=dtype, quantity="output",
                     B=2, T=TOTAL, S=TOTAL, logits=logits, same_precision_error=errors.get(name))

    check_in_place_decode(outputs, pk, pv, want, compare)


# -- the cache's keys at the caller's positions (past_key_positions), a left-padded row ------------------

# Each mirror's paths as `mha check` runs them (its adapter's PATHS, checked below: the stages, its fast
# path, chunk_size=2 where it has one, the in-place cache), float32; the other dtypes are the same code in
# other roundings. JAX compiles a program per row (0.3-2.6 s): by default the temperature case (whose
# position source every JAX path reads through the same Call.temperature_positions) on its stages, and the
# chunked path (its forward and VJP, 2.6 s) in `tox -e full`, its forward over shuffled positions below.
ADAPTER_PATHS = {"torch": ("stages", "sdpa", "in_place"), "tf": ("stages", "fused", "chunked", "in_place"),
                 "jax": ("stages", "fused", "chunked", "in_place"), "mlx": ("stages", "fused", "chunked", "in_place")}


def _cache_position_rows(framework):
    for case_name in CACHE_POSITION_CASES:
        for path in ADAPTER_PATHS[framework]:
            slow = framework == "jax" and path != "stages" and (case_name != "cache_positions_alibi_chunk"
                                                                or path == "chunked")
            yield pytest.param(case_name, path, id=f"{case_name}-{path}", marks=_slow(slow))


@parametrize("case_name, path", _cache_position_rows)
def test_cache_positions_match_reference_on_every_path(mirror, case_name, path):
    """The last row left-padded by 2 (past_key_positions 2 less than the cache index, the pads at 0): ALiBi
    and chunks over a RoPE cache, and the temperature from the cache index over chunks; output, present
    cache and (where the path has them) gradients judged as `mha check` judges them."""
    from conformance.suite.compare import STATUS_PASS, run_case

    assert mirror.adapter.PATHS == ADAPTER_PATHS[mirror.name], (mirror.adapter.PATHS, ADAPTER_PATHS[mirror.name])
    result = run_case(CACHE_POSITION_CASES[case_name], mirror.name, dtype="float32", path=path)
    assert result is not None, f"{mirror.name} {path} does not run {case_name}"
    assert result.status == STATUS_PASS, describe(result)


@parametrize("path", lambda fw: [pytest.param(p, id=p, marks=_slow(fw == "jax" and p == "fused"))
                                  for p in ADAPTER_PATHS[fw] if p != "stages"])
def test_shuffled_cache_positions_on_the_fast_and_chunked_paths(mirror, path):
    """The cache's keys at shuffled positions (tests/test_cache_positions.shuffled_call): each fast,
    chunked (blocks of 2, skipped by their chunks of positions) and in-place path against the float64
    reference's stages (JAX's fused expression, a program of its own with no block to skip: `slow`)."""
    from test_cache_positions import shuffled_call

    from weights.paths import common_path_options

    config, tensors, inputs, options = shuffled_call()
    want, *_ = impl_numpy.multi_head_attention(
        config, {k: v.astype(np.float64) for k, v in tensors.items()}, inputs["query"].astype(np.float64),
        return_weights=True, trace=(trace := []), is_causal=True, causal_alignment="bottom_right",
        **{k: (v.astype(np.float64) if v.dtype == np.float32 else v) for k, v in inputs.items() if k != "query"})
    if path in ("chunked", "in_place"):
        options = common_path_options(path, inputs, options, paths=ADAPTER_PATHS[mirror.name])
    else:
        options = options | ({"use_sdpa": True} if path == "sdpa" else {})
    got = mirror.adapter.forward(config, tensors, inputs, options)["output"]
    assert_close(f"shuffled {path}", got, want, config=config, dtype="float32", quantity="output", B=2, T=3, S=13,
                 logits=dict((e.stage, e.value) for e in trace)["alibi"])


@parametrize("", lambda fw: [pytest.param(marks=_slow(fw == "jax"))])
def test_layer_takes_past_key_positions(mirror):
    """The mirror's layer passes past_key_positions (and the rest of a left-padded decode step) through to
    its call: the float32 output against the float64 reference's. (JAX's layer is apply() with **options,
    op by op here: 3 s, so `slow`.)"""
    case = CACHE_POSITION_CASES["cache_positions_alibi_chunk"]
    exp = expected_for(case, "float32")
    inputs = exp["inputs"]
    layer = mirror.module.MultiHeadAttention.from_tensors(case.config, exp["tensors"])
    out = layer(inputs["query"], inputs["key"], inputs["value"], is_causal=True, causal_alignment="bottom_right",
                **{n: inputs[n] for n in ("mask", "positions", "key_positions", "past_key", "past_value",
                                          "past_key_positions")})
    got = mirror.to_numpy(out)
    assert_close("layer output", got, exp["output"], config=case.config, dtype="float32", quantity="output", B=case.B,
                 T=case.T, S=case.S_total, logits=exp["logits"])


# -- the layer -------------------------------------------------------------------------------

@parametrize("name, dtype", lambda fw: grid(("name", "dtype"), ("name", "dtype"), name=layer_cases(fw),
                                             dtype=DTYPE_NAMES))
def test_layer_round_trip_with_norm_and_sinks_is_bit_exact(mirror, name, dtype):
    """from_tensors then to_tensors gives every tensor back bit for bit, under its name and in order, and the
    layer holds exactly the canonical tensors' parameters: with the initial tensors, and with the norm
    scales and sinks moved off their initial 1 and 0 (which a missed assignment would keep)."""
    config = mirror.case(name).config
    for perturbed in (False, True):
        tensors = weights.init(config, seed=3, dtype=dtype)
        if perturbed:
            rng = np.random.default_rng(3)
            for key in tensors:
                if ".norm." in key or key == "sinks":
                    tensors[key] = rng.standard_normal(tensors[key].shape).astype(tensors[key].dtype)
        back, n_params = mirror.layer_round_trip(config, tensors)
        assert list(back) == list(tensors), f"names {list(back)} != {list(tensors)}"
        for key, original in tensors.items():
            assert_bit_equal(f"{key} after the round trip (perturbed={perturbed})", back[key], original)
        n_tensors = sum(t.size for t in tensors.values())
        assert n_params == n_tensors, f"the layer holds {n_params} parameters, the canonical tensors {n_tensors}"


@parametrize("name, dtype", lambda fw: grid(("name", "dtype"), ("name", "dtype"), name=layer_cases(fw),
                                             dtype=["float64", "float32"]))
def test_layer_forward_and_parameter_gradients_match_reference(mirror, name, dtype):
    """The layer passes positions, the cache and segment ids through, and its norm and sink parameters get
    the reference's gradients (torch: autograd on its parameters; Keras: GradientTape on its variables;
    JAX: nnx.grad under nnx.jit), reshaped to the canonical shapes."""
    case = mirror.case(name)
    exp = expected_for(case, dtype)
    inputs = cast_inputs(make_inputs(case), dtype)
    layer = mirror.module.MultiHeadAttention.from_tensors(case.config, cast_tensors(make_tensors(case), dtype))
    d_out = output_cotangent(case).astype(weights.dtype_from_name(dtype))
    out, grads = mirror.layer_output_and_grads(case, layer, inputs, d_out)
    assert_close(f"{name} layer output", out, exp["output"], config=case.config, dtype=dtype, quantity="output",
                 B=case.B, T=case.T, S=case.S_total, logits=exp["logits"])
    assert_gradients_conform(case, dtype, grads)


# -- masks and error wording -------------------------------------------------------------------

@parametrize("")
def test_window_and_segment_masks_equal_reference(mirror):
    from impl_numpy import masks as numpy_masks

    for T in range(1, 6):
        for S in range(1, 7):
            for left, right in ((-1, -1), (0, -1), (2, -1), (-1, 0), (-1, 1), (1, 1), (0, 0)):
                for alignment in ("top_left", "bottom_right"):
                    want = numpy_masks.window_mask(T, S, left, right, alignment)
                    for label, fn in mirror.window_mask_calls(T, S, left, right, alignment):
                        got = fn()
                        assert got.dtype == want.dtype and np.array_equal(got, want), (
                            f"{label} window_mask({T}, {S}, {left}, {right}, {alignment!r}): differs at "
                            f"{np.argwhere(got != want).tolist()}")
    rng = np.random.default_rng(0)
    for q_shape, k_shape in (((5,), (5,)), ((2, 5), (2, 7)), ((5,), (2, 7)), ((2, 5), (7,))):
        q_ids, k_ids = rng.integers(0, 3, q_shape), rng.integers(0, 3, k_shape)
        got = mirror.segment_mask(q_ids, k_ids)
        want = numpy_masks.segment_mask(q_ids, k_ids)
        assert got.shape == want.shape and np.array_equal(got, want), f"segment_mask {q_shape} x {k_shape} differs"
    with pytest.raises(ValueError) as want:
        numpy_masks.window_mask(3, 4, 1, 1, "centre")
    with pytest.raises(ValueError) as got:
        mirror.module.window_mask(3, 4, 1, 1, "centre")
    assert str(got.value) == str(want.value), f"{str(got.value)!r} != {str(want.value)!r}"


@parametrize("bad", lambda fw: [pytest.param(bad, id=bad) for bad in bad_calls(fw)])
def test_modern_error_wording_matches_reference(mirror, bad):
    """Each of the mirror's ways in (functional, layer; JAX: jax arrays, jit, the adapter) says the
    reference's words."""
    config = cfg(num_kv_heads=1, rope={}, window_left=2)
    tensors = weights.init(config, seed=0, dtype="float64")
    call = dict(bad_calls(mirror.name)[bad])
    query = np.random.default_rng(1).standard_normal((2, 5, 8))
    want = error_of(impl_numpy.multi_head_attention, config, tensors, query, **call)
    for label, got, reference in mirror.error_calls(config, tensors, query, call):
        expected = want if reference is None else reference
        assert got == expected, f"{label}:\n{mirror.name}: {got!r}\nnumpy: {expected!r}"


@parametrize("change", lambda fw: [pytest.param(c, id=c) for c in (
    "norm_missing", "norm_shape", "norm_bias_missing", "sinks_missing", "sinks_shape")])
def test_modern_tensor_errors_match_reference(mirror, change):
    config = cfg(qk_norm={"type": "layer", "scope": "all"}, use_sinks=True)
    tensors = weights.init(config, seed=0, dtype="float32")
    broken = dict(tensors)
    if change == "norm_missing":
        del broken["key.norm.scale"]
    elif change == "norm_shape":
        broken["query.norm.scale"] = np.ones(4, np.float32)  # (H,): the head scope's shape, not (N, H)
    elif change == "norm_bias_missing":
        del broken["query.norm.bias"]
    elif change == "sinks_missing":
        del broken["sinks"]
    else:
        broken["sinks"] = np.zeros((2, 1), np.float32)
    query = np.zeros((1, 3, 8), np.float32)
    want = error_of(impl_numpy.multi_head_attention, config, broken, query)
    for label, got, reference in mirror.tensor_error_calls(config, broken, query):
        expected = want if reference is None else reference
        assert got == expected, f"{label}:\n{mirror.name}: {got!r}\nnumpy: {expected!r}"


# -- GPU ------------------------------------------------------------------------------------

@pytest.mark.gpu
@parametrize("name, dtype, path", lambda fw: grid(("name", "dtype", "path"), ("name", "dtype", "path"),
                                                   name=[*GPU_CASES, f"{fw}_window_segments_norm"],
                                                   dtype=DTYPE_NAMES, path=GPU_PATHS[fw]))
def test_gpu_modern_matches_reference(mirror, name, dtype, path):
    if (reason := mirror.gpu_missing()) is not None:
        pytest.skip(reason)
    assert_case_conforms(mirror.path_case(mirror.case(name), path), dtype, mirror.name, mirror.path_adapter(path),
                         device="gpu")


# -- multimodal RoPE (rope.mrope_section, issue 42) ------------------------------------------------------------

MROPE_CASES = ("mrope_image", "mrope_interleaved_video_decode")


@parametrize("name, path", lambda fw: grid(("path", "name"), ("name", "path"), path=PATHS[fw], name=list(MROPE_CASES)))
def test_mrope_case_matches_reference_on_every_path(mirror, name, path):
    """The grid's multimodal RoPE cases (positions (3, B, T): an image span, a video span over a cache) in
    float32 on each of the mirror's paths, the chunked one included (the framework's own grid test runs every
    dtype on its default path), judged against the float64 reference as `mha check` judges them."""
    from conformance.suite.cases import CASES

    assert_case_conforms(mirror.path_case(CASES[name], path), "float32", mirror.name, mirror.path_adapter(path))
