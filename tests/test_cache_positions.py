"""past_key_positions (the cache's keys at positions of the caller's, docs/spec-modern.md) and the query
temperature's position source (query_temperature.position, docs/spec-frontier.md) in the NumPy reference,
on each of its paths, against an independent formulation: the same keys without a cache, their positions
given as key_positions. Validation in the contract's words, the inputs file, the JSON round trip, and two
porting bugs the suite catches (a cache read at 0..P-1, a temperature read from the positions). The
mirrors run the same cases in tests/test_mirrors_modern.py; transformers' left-padded generation in
tests/test_left_padded_generation.py."""

from __future__ import annotations

import numpy as np
import pytest
from assertions import assert_bit_equal
from modern_checks import CACHE_POSITION_CASES as CASES
from reference_checks import error_of

import impl_numpy
import impl_numpy.adapter as numpy_adapter
import weights
from conformance.cli.commands import main as mha
from conformance.io import write_arrays
from conformance.suite.cases import _cfg
from conformance.suite.compare import STATUS_FAIL, STATUS_PASS, run_case
from conformance.suite.tolerance import assert_close
from weights import AttentionConfig, save
from weights.config import QueryTemperature

pytestmark = pytest.mark.reference

B, L, P, D = 2, 12, 9, 16
PADS = np.array([0, 2])  # row 1 left-padded by 2, as transformers pads a batch
CONFIGS = {
    "alibi": AttentionConfig(num_heads=4, query_dim=D, head_dim=4, alibi=True),
    "chunk_rope": AttentionConfig(num_heads=4, query_dim=D, head_dim=4, num_kv_heads=2, local_chunk=4,
                                  rope={"interleaved": True},
                                  qk_norm={"type": "rms", "weight": False, "after_rope": True}),
    "temperature": AttentionConfig(num_heads=4, query_dim=D, head_dim=4,
                                   query_temperature={"beta": 0.5, "floor": 3.0, "offset": 1}),
}
PATHS = {"stages": dict(return_weights=True), "fused": {}, "chunked": dict(chunk_size=2), "in_place": {}}


def _left_padded(config_name: str):
    """(config, tensors, x (B, L, D), positions (B, L) with the pads at 0, key mask (B, L, L))."""
    config = CONFIGS[config_name]
    tensors = weights.init(config, seed=3, dtype="float64")
    x = np.random.default_rng(5).standard_normal((B, L, D))
    index = np.arange(L)[None].repeat(B, 0)
    positions = np.maximum(index - PADS[:, None], 0)
    real = index >= PADS[:, None]  # the pads are masked as keys
    return config, tensors, x, positions, np.broadcast_to(real[:, None, :], (B, L, L))


def _cached_call(config, tensors, x, positions, mask, path, **extra):
    """The prefix x[:, :P] in one causal call, then x[:, P:] on its cache with the cached keys at
    positions[:, :P] (past_key_positions), on `path`."""
    _, pk, pv = impl_numpy.multi_head_attention(config, tensors, x[:, :P], positions=positions[:, :P],
                                                key_positions=positions[:, :P], mask=mask[:, :P, :P],
                                                is_causal=True, return_cache=True)
    if path == "in_place":
        buffers = []
        for past in (pk, pv):
            buffer = np.zeros((*past.shape[:2], L + 1, past.shape[3]))
            buffer[:, :, :P] = past
            buffers.append(buffer)
        pk, pv = buffers
        extra = dict(extra, cache_length=P)
    q = x[:, P:]
    out = impl_numpy.multi_head_attention(
        config, tensors, q, q, q, positions=positions[:, P:], key_positions=positions[:, P:], past_key=pk,
        past_value=pv, is_causal=True, causal_alignment="bottom_right", mask=mask[:, P:], **PATHS[path], **extra)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_cached_call_equals_the_keys_given_whole(config_name, path):
    """The independent formulation: the same queries over every key passed as key and value (no cache),
    each key at its position (key_positions), equal the cached call's, on each path of the reference."""
    config, tensors, x, positions, mask = _left_padded(config_name)
    cached = _cached_call(config, tensors, x, positions, mask, path, past_key_positions=positions[:, :P])
    q = x[:, P:]
    whole = impl_numpy.multi_head_attention(config, tensors, q, x, x, positions=positions[:, P:],
                                            key_positions=positions, is_causal=True,
                                            causal_alignment="bottom_right", mask=mask[:, P:])
    assert_close(f"{config_name} {path}: cached vs whole", cached, whole, config=config, dtype="float64",
                 quantity="output", B=B, T=L - P, S=L)
    if config_name != "temperature":  # ALiBi and the chunks read the cached keys' positions: a default cache differs
        default = _cached_call(config, tensors, x, positions, mask, path)
        differ = float(np.abs(default - whole).max())
        assert differ > 1e-3, f"{config_name} {path}: the cache at 0..P-1 gave nearly the same output ({differ})"


def shuffled_call():
    """A decode step of 3 queries over a cache of 10 whose keys sit at shuffled positions (a different order
    per row, some shared, some past the queries'): chunks of 4 and ALiBi with RoPE, float32 inputs.
    -> (config, tensors, inputs, options) in the adapters' interface."""
    config = AttentionConfig(num_heads=4, query_dim=D, head_dim=4, num_kv_heads=2, rope={}, alibi=True,
                             local_chunk=4)
    rng = np.random.default_rng(11)
    P, T = 10, 3
    tensors = {k: v.astype(np.float32) for k, v in weights.init(config, seed=4, dtype="float32").items()}
    inputs = {"query": rng.standard_normal((B, T, D)).astype(np.float32),
              "past_key": rng.standard_normal((B, 2, P, 4)).astype(np.float32),
              "past_value": rng.standard_normal((B, 2, P, 4)).astype(np.float32),
              "past_key_positions": np.stack([rng.permutation(P), rng.integers(0, P + T, P)]),
              "positions": np.array([[10, 11, 12], [5, 9, 12]]), "key_positions": np.array([[10, 11, 12], [5, 9, 12]])}
    return config, tensors, inputs, {"is_causal": True, "causal_alignment": "bottom_right", "dtype": "float32"}


def test_shuffled_cache_positions_keep_the_chunked_paths_exact():
    """Key blocks are skipped by the chunks of positions they hold, not by their indices: with the cache's
    keys at shuffled positions the fused and chunked cores (blocks of 2 and 4) equal the stages."""
    config, tensors, inputs, options = shuffled_call()
    wide = {k: v.astype(np.float64) for k, v in tensors.items()}
    ins = {k: (v.astype(np.float64) if v.dtype == np.float32 else v) for k, v in inputs.items()}
    want = numpy_adapter.forward(config, wide, ins, options | {"return_weights": True, "dtype": "float64"})["output"]
    for extra in ({}, {"chunk_size": 2}, {"chunk_size": 4}):
        got = numpy_adapter.forward(config, wide, ins, options | {"dtype": "float64"} | extra)["output"]
        assert_close(f"shuffled {extra or 'fused'}", got, want, config=config, dtype="float64", quantity="output",
                     B=B, T=3, S=13)


def test_default_past_key_positions_are_0_to_p():
    """past_key_positions = arange(P), (P,) or (B, P), is the default bit for bit, on every path."""
    config, tensors, x, positions, mask = _left_padded("alibi")
    default_positions = np.broadcast_to(np.arange(L), (B, L))
    for path in PATHS:
        default = _cached_call(config, tensors, x, default_positions, mask, path)
        for given in (np.arange(P), np.broadcast_to(np.arange(P), (B, P)).astype(np.int32)):
            got = _cached_call(config, tensors, x, default_positions, mask, path, past_key_positions=given)
            assert_bit_equal(f"{path}: past_key_positions {given.shape} = arange(P)", got, default)


def test_cache_index_temperature_reads_no_positions():
    """query_temperature.position 'cache_index': the factor from P + t whatever the positions (a NoPE layer
    reads positions nowhere else, so shifted positions change nothing); 'positions' follows them."""
    config, tensors, x, positions, mask = _left_padded("temperature")
    by_index = config.replace(query_temperature={"beta": 0.5, "floor": 3.0, "offset": 1, "position": "cache_index"})
    shifted = positions + 0  # the pads' shift: row 1's positions 2 less than its cache index
    index = np.broadcast_to(np.arange(L), (B, L))
    for path in PATHS:
        a = _cached_call(by_index, tensors, x, shifted, mask, path)
        b = _cached_call(by_index, tensors, x, index, mask, path)
        assert_bit_equal(f"{path}: cache_index with shifted positions vs the index", a, b)
        c = _cached_call(config, tensors, x, shifted, mask, path)
        assert float(np.abs(c - b).max()) > 1e-3, f"{path}: 'positions' ignored the shifted positions"


def test_temperature_position_round_trips_and_defaults_stay_out_of_the_file():
    default = QueryTemperature(beta=0.1, floor=8192.0, offset=1)
    assert default.to_dict() == {"beta": 0.1, "floor": 8192.0, "offset": 1}  # a default file reads as before
    config = _cfg(query_temperature={"beta": 0.1, "floor": 8192, "offset": 1, "position": "cache_index"})
    assert config.query_temperature.position == "cache_index"
    assert AttentionConfig.from_json(config.to_json()) == config
    assert '"position": "cache_index"' in config.to_json()


def _bad_calls():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 1, 8))
    cache = dict(past_key=rng.standard_normal((2, 2, 4, 4)), past_value=rng.standard_normal((2, 2, 4, 4)))
    return {
        "without_cache": (dict(past_key_positions=np.arange(4)),
                          "past_key_positions was given without past_key/past_value (the cache whose keys it "
                          "places)"),
        "wrong_length": (dict(cache, past_key_positions=np.arange(5)),
                         "past_key_positions must be an integer array of shape (P,) or (B, P) = (4,) or (2, 4): "
                         "got dtype int64 shape (5,)"),
        "float": (dict(cache, past_key_positions=np.arange(4.0)),
                  "past_key_positions must be an integer array of shape (P,) or (B, P) = (4,) or (2, 4): got dtype "
                  "float64 shape (4,)"),
        "in_place_length": (dict(past_key=np.zeros((2, 2, 6, 4)), past_value=np.zeros((2, 2, 6, 4)), cache_length=3,
                                 past_key_positions=np.arange(4)),
                            "past_key_positions must be an integer array of shape (P,) or (B, P) = (3,) or (2, 3): "
                            "got dtype int64 shape (4,)"),
    }, x


@pytest.mark.parametrize("bad", ["without_cache", "wrong_length", "float", "in_place_length"])
def test_bad_past_key_positions_are_named(bad):
    calls, x = _bad_calls()
    call, message = calls[bad]
    config = _cfg(alibi=True)
    tensors = weights.init(config, seed=0, dtype="float64")
    assert error_of(impl_numpy.multi_head_attention, config, tensors, x, x, x, **call) == message


def test_the_inputs_file_takes_past_key_positions(tmp_path, capsys):
    """`mha run` reads past_key_positions from an inputs file (an integer tensor): its output is the
    functional call's; a float one is a one-line error, and a wrong length the contract's."""
    config, tensors, x, positions, mask = _left_padded("alibi")
    config32 = config
    save(tmp_path / "w.safetensors", config32, {k: v.astype(np.float32) for k, v in tensors.items()})
    rng = np.random.default_rng(2)
    inputs = {"query": x[:, P:P + 1].astype(np.float32), "positions": positions[:, P:P + 1],
              "key_positions": positions[:, P:P + 1],
              "past_key": rng.standard_normal((B, 4, P, 4)).astype(np.float32),
              "past_value": rng.standard_normal((B, 4, P, 4)).astype(np.float32),
              "past_key_positions": positions[:, :P].astype(np.int32)}
    write_arrays(tmp_path / "in.safetensors", inputs)
    rc = mha(["run", "--backend", "numpy", "--weights", str(tmp_path / "w.safetensors"), "--inputs",
              str(tmp_path / "in.safetensors"), "--causal", "--causal-alignment", "bottom_right", "--out",
              str(tmp_path / "out.safetensors")])
    assert rc == 0, capsys.readouterr().err
    got = weights.read_safetensors(tmp_path / "out.safetensors")[1]["output"]
    want = numpy_adapter.forward(config32, {k: v.astype(np.float32) for k, v in tensors.items()}, inputs,
                                 {"is_causal": True, "causal_alignment": "bottom_right"})["output"]
    assert_bit_equal("mha run vs the adapter", got, want)
    for name, value, words in (("float", positions[:, :P].astype(np.float32),
                                "past_key_positions must be an integer tensor: got dtype float32"),
                               ("length", positions[:, :P - 1], "past_key_positions must be an integer array of "
                                                                "shape (P,) or (B, P)")):
        write_arrays(tmp_path / f"{name}.safetensors", dict(inputs, past_key_positions=value))
        rc = mha(["run", "--backend", "numpy", "--weights", str(tmp_path / "w.safetensors"), "--inputs",
                  str(tmp_path / f"{name}.safetensors"), "--causal", "--causal-alignment", "bottom_right",
                  "--out", str(tmp_path / "bad.safetensors")])
        err = capsys.readouterr().err.strip()
        assert rc != 0 and words in err and len(err.splitlines()) == 1 and "Traceback" not in err, (name, rc, err)


# -- what the suite catches: two porting bugs, as a port would make them -----------------------------------

class _Port:
    """impl_numpy's adapter with one realistic bug: "cache_at_index" drops past_key_positions (the port
    places the cache's keys at 0..P-1, as the contract did before the input existed); "temperature_from_positions"
    reads the temperature's position from the positions instead of the cache index."""

    def __init__(self, bug):
        self.bug = bug

    def devices(self):
        return ["cpu"]

    def _call(self, config, inputs):
        if self.bug == "cache_at_index":
            inputs = {k: v for k, v in inputs.items() if k != "past_key_positions"}
        if self.bug == "temperature_from_positions" and config.query_temperature is not None:
            t = config.query_temperature.to_dict()
            t.pop("position", None)
            config = config.replace(query_temperature=t)
        return config, inputs

    def forward(self, config, tensors, inputs, options, **kwargs):
        config, inputs = self._call(config, inputs)
        return numpy_adapter.forward(config, tensors, inputs, options, **kwargs)

    def vjp(self, config, tensors, inputs, options, d_output, **kwargs):
        config, inputs = self._call(config, inputs)
        return numpy_adapter.vjp(config, tensors, inputs, options, d_output, **kwargs)


@pytest.mark.parametrize("bug, case", [("cache_at_index", "cache_positions_alibi_chunk"),
                                       ("temperature_from_positions", "cache_positions_temperature")])
def test_porting_bugs_are_caught(bug, case):
    """The reference passes its own cases on every path; each bug fails its case in float32 (the port
    without the bug: the reference itself)."""
    for path in numpy_adapter.PATHS:
        result = run_case(CASES[case], "numpy", dtype="float32", path=path)
        assert result is None or result.status == STATUS_PASS, (path, result.message)
    caught = run_case(CASES[case], "port", dtype="float32", adapter=_Port(bug), gradients=False)
    assert caught.status == STATUS_FAIL, f"{bug} not caught on {case}: {caught.status} {caught.message}"
    print(f"{bug}: caught on {case}, worst margin {caught.worst.margin:.3g}")
