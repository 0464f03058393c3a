"""DeepSeek V4's attention (config.compressed, issue 41): the NumPy reference (impl_numpy/compressed.py) against
a hand port written apart from it (tests/v4_mutants.py: one query at a time from its own prefix), its cache
(a prefill split anywhere, and token by token, gives the prefill's rows), its refusals, the port's bugs caught,
and transformers' own deepseek_v4 (a tiny random model, one layer of each kind) reproduced, prefill and decode.

float64 throughout. The reference tests are marked `reference` (the numpy env, about 1 s in all); the
transformers test is unmarked (the `all` env, where the hf extra installs transformers; about 2 s after
transformers' import), as tests/test_indexer_transformers.py."""

from __future__ import annotations

import numpy as np
import pytest
from v4_mutants import MUTANTS, port

from conformance.suite import backends
from impl_numpy import multi_head_attention
from impl_numpy.compressed import cache_buffers, cache_names, compressed_attention, logical_cache
from weights import AttentionConfig, init
from weights.format import WeightsFormatError

D, T = 32, 21  # T: five CSA windows of 4 close, two HCA windows of 8; the window of 6 keys hides most keys
BASE = dict(num_heads=4, query_dim=D, head_dim=16, num_kv_heads=1, use_query_bias=False, use_key_bias=False,
            use_value_bias=False, use_output_bias=False, use_sinks=True, window_left=5,
            rope={"theta": 10000.0, "rotary_dim": 8, "interleaved": True})
LOW_RANK = {"query_rank": 12, "output_groups": 2, "output_rank": 8}
KINDS = {"sliding": {"kind": "sliding", **LOW_RANK},
         "csa": {"kind": "csa", **LOW_RANK, "ratio": 4, "overlap": True, "index_heads": 2, "index_head_dim": 8,
                 "index_topk": 2},
         "hca": {"kind": "hca", **LOW_RANK, "ratio": 8}}
# csa and hca turn by the compress table: YaRN as V4's (factor 4 over 16 positions, attention factor forced to 1)
COMPRESS_ROPE = {"theta": 160000.0, "rotary_dim": 8, "interleaved": True, "scaling": {
    "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "attention_factor": 1.0}}
# Which kinds each bug touches (a bug in a stage a kind lacks changes nothing there).
BUG_KINDS = {"entries_one_token_early": ("csa", "hca"), "hca_gate_mean": ("hca",), "csa_overlap_dropped": ("csa",),
             "entry_positions_one_window_late": ("csa", "hca"), "entries_one_token_late": ("csa", "hca"),
             "yarn_dropped": ("csa", "hca"), "yarn_attention_factor_applied": ("csa", "hca"),
             "indexer_pairing_swapped": ("csa",), "decode_drops_buffer": ("csa", "hca"), "topk_lowest": ("csa",),
             "topk_one_rank_late": ("csa",)}
# The hand port and the reference compute the same float64 sums in other orders: a few ulps of the output's size.
PORT_BOUND = 1e-12


def _layer(kind, seed=1):
    rope = BASE["rope"] if kind == "sliding" else COMPRESS_ROPE
    config = AttentionConfig(**{**BASE, "rope": rope}, compressed=KINDS[kind])
    return config, init(config, seed=seed, dtype="float64")


def _x(seed=0, length=T):
    return np.random.default_rng(seed).standard_normal((2, length, D))


def source_mutant(module, old: str, new: str, name: str):
    """module's source with one passage replaced (it must stand there once), run as a module of its own named
    name in module's package: a planted porting bug that leaves the module under test untouched."""
    import types

    source = open(module.__file__).read()
    assert source.count(old) == 1, f"the passage the mutant replaces is not in {module.__name__} once: {old!r}"
    mutant = types.ModuleType(f"{module.__package__}.{name}")
    mutant.__package__ = module.__package__
    exec(compile(source.replace(old, new), module.__file__, "exec"), mutant.__dict__)
    return mutant


@pytest.mark.reference
@pytest.mark.parametrize("kind", list(KINDS))
def test_the_hand_port_reproduces_the_reference(kind):
    config, t = _layer(kind)
    x = _x()
    out = compressed_attention(config, t, x, np.arange(T))
    assert np.abs(port(config, t, x) - out).max() <= PORT_BOUND * np.abs(out).max()


@pytest.mark.reference
@pytest.mark.parametrize("kind,bug", [(k, b) for b in MUTANTS for k in BUG_KINDS.get(b, KINDS)])
def test_each_port_bug_fails_the_reproduction(kind, bug):
    config, t = _layer(kind)
    x = _x()
    out = compressed_attention(config, t, x, np.arange(T))
    wrong = np.abs(port(config, t, x, bug) - out).max()
    assert wrong > 1e3 * PORT_BOUND * np.abs(out).max(), f"{bug} ({MUTANTS[bug]}) not caught on {kind}"


@pytest.mark.reference
def test_the_csa_selection_drops_entries():
    """The prefill exercises the top-k: queries that see more entries than index_topk keep index_topk."""
    config, t = _layer("csa")
    _, selection = compressed_attention(config, t, _x(), np.arange(T), return_selection=True)
    visible = (np.arange(T) + 1) // 4
    assert (visible > 2).sum() >= 8 and ((selection >= 0).sum(-1) == np.minimum(visible, 2)).all()


@pytest.mark.reference
@pytest.mark.parametrize("kind", list(KINDS))
def test_the_cache_gives_the_prefill_rows(kind):
    """Calls of 5, 1, 7 and 8 tokens, then 21 calls of one, through present_* -> past_*: the one prefill's rows
    (the open windows, csa's overlap half and the last W - 1 keys carried across every boundary)."""
    config, t = _layer(kind)
    x = _x()
    whole = compressed_attention(config, t, x, np.arange(T))
    for cuts in ([0, 5, 6, 13, T], list(range(T + 1))):
        past, rows = None, []
        for a, b in zip(cuts, cuts[1:]):
            out, past = compressed_attention(config, t, x[:, a:b], np.arange(a, b), past, return_cache=True)
            rows.append(out)
        assert sorted(past) == sorted(cache_names(config))
        np.testing.assert_allclose(np.concatenate(rows, axis=1), whole, rtol=0, atol=PORT_BOUND)


# The in-place cache's calls: a prefill of 5, then 1 and 7 tokens (a window closing inside a multi-token call), then
# one token at a time from 13 across csa's (16, 20) and hca's (16) window boundaries.
IN_PLACE_CUTS = [0, 5, 6, 13, *range(14, T + 1)]


def _in_place_decode(kind, cuts=IN_PLACE_CUTS):
    """Each call of `cuts` through the copying reference (present -> past) and in place (one set of buffers):
    yields (copying output, in-place output, the copying cache, the buffers read as one, the present returned)."""
    config, t = _layer(kind)
    x = _x()
    buffers, past = cache_buffers(config, 2, T), None
    for a, b in zip(cuts, cuts[1:]):
        want, past = compressed_attention(config, t, x[:, a:b], np.arange(a, b), past, return_cache=True)
        got, present = compressed_attention(config, t, x[:, a:b], np.arange(a, b), buffers, return_cache=True,
                                            in_place=True)
        yield want, got, past, logical_cache(config, buffers, b), present is buffers


@pytest.mark.reference
@pytest.mark.parametrize("kind", list(KINDS))
def test_the_in_place_cache_is_the_copying_cache(kind):
    """Batch 2, every call of IN_PLACE_CUTS: the in-place output is the copying reference's and the buffers hold
    its cache. Bound PORT_BOUND of the output's size: the in-place call sums the window's and the entries' shares
    of the context in two products and reads the ring's keys in slot order (float64 round-off); the cache rows
    are the same computations' values, moved."""
    steps = 0
    for want, got, past, held, same in _in_place_decode(kind):
        assert same  # the present cache is the buffers themselves
        np.testing.assert_allclose(got, want, rtol=0, atol=PORT_BOUND * np.abs(want).max())
        assert sorted(held) == sorted(past)
        for name in past:
            assert held[name].shape == past[name].shape, name
            np.testing.assert_allclose(held[name], past[name], rtol=0, atol=PORT_BOUND * (1 + np.abs(past[name]).max(
                initial=0)), err_msg=name)
        steps += 1
    assert steps == len(IN_PLACE_CUTS) - 1


def _drops_buffered_token(real):
    """An in-place step that closes no window and forgets to write its token's projections into the open
    window's slots (the window, when it closes, pools what the buffers held before)."""
    def step(config, params, prefix, x, p0, buffers, rec):
        cache = "index_" if prefix.startswith("indexer") else ""
        kept = {n: buffers[cache + n].copy() for n in ("window_kv", "window_gate")}
        count = real(config, params, prefix, x, p0, buffers, rec)
        if (p0 % config.compressed.ratio + x.shape[1]) // config.compressed.ratio == 0:
            for n, a in kept.items():
                buffers[cache + n][...] = a
        return count
    return step


def _overlap_not_written(real):
    """An in-place step that closes a window but leaves the overlap halves of the window before it."""
    def step(config, params, prefix, x, p0, buffers, rec):
        cache = "index_" if prefix.startswith("indexer") else ""
        kept = {n: buffers[cache + n].copy() for n in ("overlap_kv", "overlap_gate")}
        count = real(config, params, prefix, x, p0, buffers, rec)
        for n, a in kept.items():
            buffers[cache + n][...] = a
        return count
    return step


@pytest.mark.reference
@pytest.mark.parametrize("kind,bug", [("csa", _drops_buffered_token), ("hca", _drops_buffered_token),
                                      ("csa", _overlap_not_written)])
def test_an_in_place_bug_fails_against_the_copying_cache(kind, bug, monkeypatch):
    import impl_numpy.compressed as v4

    monkeypatch.setattr(v4, "compress_in_place", bug(v4.compress_in_place))
    wrong = max(np.abs(got - want).max() / np.abs(want).max() for want, got, *_ in _in_place_decode(kind))
    assert wrong > 1e3 * PORT_BOUND, f"{bug.__name__} not caught on {kind}: {wrong}"


def _reads_no_buffered_tokens(real):
    """An in-place step that closes a window from the call's tokens alone: the open window's buffered rows are
    never read (as zeros), as a port that keeps the open window in a buffer it forgets to pass on would."""
    def step(config, params, prefix, x, p0, buffers, rec):
        cache = "index_" if prefix.startswith("indexer") else ""
        for n in ("window_kv", "window_gate"):
            buffers[cache + n][:, :p0 % config.compressed.ratio] = 0
        return real(config, params, prefix, x, p0, buffers, rec)
    return step


# The ring written before the attention (one line of impl_numpy/compressed.py, moved): the call's key lands in the
# slot of the oldest key its query still sees (position p0 - W + 1), read then as that key.
RING_WRITTEN_FIRST = ("        blocks = [ring[:, :, :min(p0, W - 1)], k]\n",
                      "        ring[:, :, positions[-1:] % max(W - 1, 1)] = k[:, :, -1:]\n"
                      "        blocks = [ring[:, :, :min(p0, W - 1)], k]\n")


@pytest.mark.reference
def test_a_ring_written_before_the_attention_fails_against_the_copying_cache():
    import impl_numpy.compressed as v4

    mutant = source_mutant(v4, *RING_WRITTEN_FIRST, "_v4_ring_mutant")
    config, t = _layer("sliding")
    x = _x()
    buffers, past, wrong = mutant.cache_buffers(config, 2, T), None, 0.0
    for a, b in zip(IN_PLACE_CUTS, IN_PLACE_CUTS[1:]):
        want, past = compressed_attention(config, t, x[:, a:b], np.arange(a, b), past, return_cache=True)
        got = mutant.compressed_attention(config, t, x[:, a:b], np.arange(a, b), buffers, in_place=True)
        wrong = max(wrong, np.abs(got - want).max() / np.abs(want).max())
    assert wrong > 1e3 * PORT_BOUND, wrong


@pytest.mark.reference
@pytest.mark.parametrize("bug", [None, _reads_no_buffered_tokens])
def test_the_suite_judges_the_in_place_cache_on_its_path(bug, monkeypatch):
    """`mha check`'s in_place row of v4_hca_decode (P 9: the open window's token 8 closes window 2 with the call's
    9..11) runs the in-place call: it passes, and a bug in the in-place code alone fails it there."""
    import impl_numpy.compressed as v4
    from conformance.suite.cases import CASES
    from conformance.suite.compare import run_case

    if bug is not None:
        monkeypatch.setattr(v4, "compress_in_place", bug(v4.compress_in_place))
    result = run_case(CASES["v4_hca_decode"], "numpy", dtype="float32", path="in_place")
    assert result.status == ("pass" if bug is None else "fail"), (result.status, result.message)
    if bug is not None:
        failed = {c.name for c in result.comparisons if not c.ok}
        assert {"output", "present_entries"} <= failed, failed


@pytest.mark.reference
def test_in_place_calls_that_cannot_write_are_refused():
    config, t = _layer("csa")
    x = _x(length=3)
    buffers = cache_buffers(config, 2, 8)

    def call(given, **kw):
        return compressed_attention(config, t, x[:, :1], np.array([3]), given, in_place=True, **kw)
    with pytest.raises(ValueError, match=r"past\['entries'\] with in_place is written in place: it must be a "
                                         r"writeable numpy array of the storage dtype float64: got dtype float32"):
        call({**buffers, "entries": buffers["entries"].astype(np.float32)})
    readonly = buffers["window_kv"].copy()
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match=r"past\['window_kv'\] .* got a read-only float64 array"):
        call({**buffers, "window_kv": readonly})
    with pytest.raises(ValueError, match=r"past\['index_entries'\] with in_place must have shape \(2, >= 2, 8\) "
                                         r"\(room for the \(p0 \+ T\) // m = \(7 \+ 1\) // 4 entries"):
        compressed_attention(config, t, x[:, :1], np.array([7]), {**buffers, "index_entries": buffers[
            "index_entries"][:, :1]}, in_place=True)
    with pytest.raises(ValueError, match=r"past\['key'\] with in_place must have shape \(2, 1, 5, 16\) .*, or "
                                         r"\(2, 1, L, 16\) with p0 \+ T = 4 <= L < W - 1 = 5 .*got \(2, 1, 3, 16\)"):
        call({**buffers, "key": buffers["key"][:, :, :3]})
    with pytest.raises(ValueError, match=r"exactly the buffers .*: got missing overlap_gate"):
        call({n: a for n, a in buffers.items() if n != "overlap_gate"})
    with pytest.raises(ValueError, match=r"past with in_place must be the dict of buffers .*: got NoneType"):
        call(None)
    with pytest.raises(ValueError, match=r"trace must be None with in_place"):
        call(buffers, trace=[])


@pytest.mark.reference
def test_calls_that_cannot_be_computed_are_refused():
    config, t = _layer("csa")
    x = _x(length=3)
    with pytest.raises(ValueError, match=r"positions must start at 0 without a cache .* got p0=4"):
        compressed_attention(config, t, x, np.arange(4, 7))
    with pytest.raises(ValueError, match=r"positions must be consecutive"):
        compressed_attention(config, t, x, np.array([0, 2, 3]))
    _, past = compressed_attention(config, t, x, np.arange(3), return_cache=True)
    with pytest.raises(ValueError, match=r"past must hold the cache of the p0=4 tokens"):
        compressed_attention(config, t, x[:, :1], np.array([4]), past)  # the cache holds 3 tokens
    with pytest.raises(ValueError, match=r"past must hold .*: got window_kv \(2, 1, 32\), expected \(2, 3, 32\)"):
        compressed_attention(config, t, x[:, :1], np.array([3]), {**past, "window_kv": past["window_kv"][:, :1]})


@pytest.mark.reference
def test_multi_head_attention_refuses_the_layer_and_every_column_judges_it():
    """The reference's own multi_head_attention (weights.contract.check_call, which every mirror calls) refuses
    config.compressed with the reason; the suite runs the layer through each adapter's compressed_call instead,
    so no column's NOT_YET names it."""
    config, t = _layer("hca")
    with pytest.raises(ValueError, match=r"config.compressed \(a DeepSeek V4 layer\) is not taken"):
        multi_head_attention(config, t, _x(length=2))
    for column in ("numpy", "torch", "tf", "keras-jax", "keras-torch", "jax", "mlx"):
        assert backends.not_yet(column, config) is None


class _PortAdapter:
    """A backend whose forward is tests/v4_mutants.py's hand port (no cache: prefill cases run without
    return_cache, _no_cache), with a bug or not; csa's selection returned as compressed_call returns it."""

    def __init__(self, bug, ties="earlier"):
        self.bug, self.ties = bug, ties

    def forward(self, config, tensors, inputs, options, *, device="cpu", precision="highest", trace=False):
        out, selection = port(config, tensors, inputs["query"], self.bug, return_selection=True, ties=self.ties)
        answer = {"output": out.astype(next(iter(tensors.values())).dtype)}
        return answer | ({"selection": selection} if config.compressed.kind == "csa" else {})


def _no_cache(case):
    """The grid case without its present cache (the hand port has none; the same inputs: the seed is the name's)."""
    import dataclasses

    return dataclasses.replace(case, return_cache=False)


@pytest.mark.reference
@pytest.mark.parametrize("case,bug", [(case, bug) for case, bugs in (
    ("v4_csa_prefill", ("sinks_dropped", "csa_overlap_dropped", "indexer_pairing_swapped", "entries_one_token_late")),
    ("v4_sliding_prefill", ("sinks_dropped", "window_one_too_wide"))) for bug in (None, *bugs)])
def test_a_port_bug_fails_the_grid_case_through_run_case(case, bug):
    """`mha check`'s own judgement (run_case, float32, the policy's bar) passes the hand port on the grid's csa
    and sliding prefills and fails each of these port bugs there."""
    from conformance.suite.cases import CASES
    from conformance.suite.compare import run_case

    result = run_case(_no_cache(CASES[case]), "v4-port", dtype="float32", adapter=_PortAdapter(bug),
                      gradients=False)  # the port is a forward: its backward's bugs, test_compressed_v4_backward
    assert result.status == ("pass" if bug is None else "fail"), (bug, result.status, result.message,
                                                                  [c.margin for c in result.comparisons])


@pytest.mark.reference
@pytest.mark.parametrize("bug", [None, "topk_lowest", "topk_one_rank_late"])
def test_a_wrong_csa_selection_fails_at_the_selection(bug):
    """run_case judges csa's selection as a comparison of its own (the top-k rule over the float64 index scores,
    conformance.suite.selection.judge_compressed_selection): the hand port's own selection passes it at margin 0
    on the grid's csa prefill, and a top-k that keeps the lowest scores, or skips the best entry, fails there,
    named "selection", with the failing queries in its reason."""
    from conformance.suite.cases import CASES
    from conformance.suite.compare import run_case

    result = run_case(_no_cache(CASES["v4_csa_prefill"]), "v4-port", dtype="float32", adapter=_PortAdapter(bug),
                      gradients=False)
    verdict = {c.name: c for c in result.comparisons}["selection"]
    if bug is None:
        assert result.status == "pass" and verdict.ok and verdict.margin == 0, (result.status, verdict.describe())
        return
    assert result.status == "fail" and not verdict.ok and verdict.margin > 1, (bug, verdict.describe())
    assert "query [" in verdict.tolerance.reason, verdict.tolerance.reason


@pytest.mark.reference
@pytest.mark.parametrize("change,message", [
    ({"compressed": {**KINDS["hca"], "index_topk": 2}}, r"compressed.index_topk must be null with kind hca"),
    ({"compressed": {**KINDS["sliding"], "ratio": 4}}, r"compressed.ratio must be null with kind sliding"),
    ({"compressed": {**KINDS["csa"], "ratio": 0}}, r"compressed.ratio must be a positive integer: got 0"),
    ({"compressed": {**KINDS["csa"], "kind": "dense"}}, r"compressed.kind must be one of sliding, csa, hca"),
    ({"num_kv_heads": 2}, r"num_kv_heads must be 1 with compressed .* got 2"),
    ({"window_left": -1}, r"window_left must be >= 0 .* got window_left=-1"),
    ({"rope": {"rotary_dim": 8}}, r"rope must be set, interleaved"),
    ({"compressed": {**KINDS["csa"], "index_head_dim": 4}}, r"compressed.index_head_dim must be at least rope"),
])
def test_config_errors_name_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        AttentionConfig(**{**BASE, "compressed": KINDS["csa"], **change})


@pytest.mark.reference
def test_the_config_round_trips():
    config, _ = _layer("csa")
    assert AttentionConfig.from_json(config.to_json()) == config
    assert "compressed" not in AttentionConfig(num_heads=2, query_dim=4, head_dim=2).to_json()


# -- transformers' deepseek_v4 ----------------------------------------------------------------------------

# transformers computes in float32 inside a float64 model: the RoPE angles (`position_ids.float()`,
# modeling_deepseek_v4.py:150), every RMS norm (`.to(torch.float32)`, :56, :72) and the compressors' gate
# softmax (dtype=torch.float32, :685): each output is off by some float32 roundings, carried through
# softmaxes of logits of size ~10. 64 float32 ulps of the output's size; measured 1.6e-6 of 13, 1.2e-7
# relative (2-core AMD EPYC VM, 2026-11-29), so the bound holds with a margin of ~60 and every port bug above
# moves outputs by tenths.
HF_BOUND = 64 * float(np.finfo(np.float32).eps)
P = 13  # decode from 13 to 20: csa's windows close at 15 and 19, hca's at 15, the window of 6 keys slides on


_MODEL: dict = {}


def _hf_model(torch, transformers):
    """(config, model, seen): the tiny model, built once for the module's tests; seen[layer] lists the
    (input, output) of each call of that layer's attention since this call (emptied here)."""
    if not _MODEL:
        _MODEL["built"] = _build_hf_model(torch, transformers)
    cfg, model, seen = _MODEL["built"]
    for calls in seen.values():
        calls.clear()
    return cfg, model, seen


def _build_hf_model(torch, transformers):
    cfg = transformers.DeepseekV4Config(
        vocab_size=64, hidden_size=D, moe_intermediate_size=8, num_hidden_layers=3, num_attention_heads=4,
        head_dim=16, q_lora_rank=12, num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1,
        partial_rotary_factor=0.5, layer_types=["sliding_attention", "compressed_sparse_attention",
                                                "heavily_compressed_attention"],
        mlp_layer_types=["moe"] * 3, compress_rates={"compressed_sparse_attention": 4,
                                                     "heavily_compressed_attention": 8},
        sliding_window=6, o_groups=2, o_lora_rank=8, index_n_heads=2, index_head_dim=8, index_topk=2, hc_mult=2,
        max_position_embeddings=64, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 16},
        attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(cfg).double().eval()
    with torch.no_grad():  # the init's zeros (sinks, position biases) and 0.02 would hide bugs: draw everything
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.4 * torch.randn_like(p))

    class NoMLP(torch.nn.Module):  # the attention's input is recorded: the MoE (float64-less grouped_mm) is not needed
        def forward(self, h, input_ids=None):
            return torch.zeros_like(h)

    seen = {i: [] for i in range(3)}
    for i, layer in enumerate(model.model.layers):
        layer.mlp = NoMLP()
        layer.self_attn.register_forward_hook(
            lambda mod, args, kwargs, out, i=i: seen[i].append(
                ((args[0] if args else kwargs["hidden_states"]).numpy().copy(), out[0].numpy().copy())),
            with_kwargs=True)
    return cfg, model, seen


def _tied(trace, k):
    """(B, T) rows whose top-k boundary is a tie (equal k-th and k+1-th visible scores: ReLU's exact zeros),
    where transformers' torch.topk picks either entry and the spec the earlier one."""
    score = next(e.value for e in trace if e.stage == "indexer.score")  # (B, T, E), -inf where not visible
    ranked = -np.sort(-score, axis=-1)
    if ranked.shape[-1] <= k:
        return np.zeros(score.shape[:2], bool)
    return np.isfinite(ranked[..., k]) & (ranked[..., k - 1] == ranked[..., k])


def test_transformers_deepseek_v4_is_reproduced_prefill_and_decode():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers", reason="transformers not installed: pip install '.[hf]'")
    if not hasattr(transformers, "DeepseekV4Config"):
        pytest.skip(f"transformers {transformers.__version__} has no deepseek_v4")
    from weights import layouts

    cfg, model, seen = _hf_model(torch, transformers)
    ids = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(ids, use_cache=False)  # causal prefill of T
        out = model(ids[:, :P], use_cache=True)  # a prefill of P, then one token at a time across window ends
        for s in range(P, T):
            out = model(ids[:, s:s + 1], past_key_values=out.past_key_values, use_cache=True)
    state, checked, excluded = model.state_dict(), 0, 0
    gap = {k: v for k, v in state.items() if k != "model.layers.1.self_attn.compressor.indexer.position_bias"}
    with pytest.raises(WeightsFormatError, match=r"hf-deepseek: missing model.layers.1.self_attn.compressor.indexer"):
        layouts.to_canonical("hf-deepseek", gap, hf_config=cfg.to_dict(), layer=1)
    for i, kind in enumerate(("sliding", "csa", "hca")):
        config, t = layouts.to_canonical("hf-deepseek", state, hf_config=cfg.to_dict(), layer=i)
        assert config.compressed.kind == kind
        calls = [(seen[i][0], np.arange(T), False)] + [(seen[i][1], np.arange(P), True)]
        calls += [(seen[i][2 + s - P], np.array([s]), True) for s in range(P, T)]
        past = None
        for (x, expected), positions, cached in calls:
            trace = []
            got, present = compressed_attention(config, t, x, positions, past if cached else None, return_cache=True,
                                                trace=trace)
            past = present if cached else past
            rows = np.ones(got.shape[:2], bool) if kind != "csa" else ~_tied(trace, config.compressed.index_topk)
            excluded += (~rows).sum()
            err = np.abs(got - expected).max(-1)[rows]
            assert err.max(initial=0) <= HF_BOUND * np.abs(expected).max(), (kind, positions[0], err.max())
            checked += rows.sum()
    assert checked == 3 * 2 * (T + T) - excluded and excluded <= 12, (checked, excluded)


def _o_a_blocks_untransposed(name, value):
    """A writer's port bug: o_a_proj's G blocks (R, N*H/G) written as the canonical (G, N*H/G, R) reshaped, each
    block's rows and columns not swapped (the same shape, so transformers loads it)."""
    from weights.layouts import deepseek_v4

    if name == "output.group.kernel":
        return value.reshape(value.shape[0] * value.shape[2], value.shape[1])
    return deepseek_v4._right_from_canonical(name, value)


@pytest.mark.parametrize("bug", [None, "o_a_blocks_untransposed"])
def test_a_v4_layer_written_back_is_what_transformers_loads_and_computes(bug, monkeypatch):
    """from_canonical("hf-deepseek") of layers drawn by weights.init (not the model's own), loaded into the tiny
    model by its own load_state_dict (every written key taken, none left over): its attention reproduces the
    reference on those tensors, every kind, a causal prefill of T, under the bound above; a writer that does
    not turn o_a_proj's blocks fails every kind."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers", reason="transformers not installed: pip install '.[hf]'")
    if not hasattr(transformers, "DeepseekV4Config"):
        pytest.skip(f"transformers {transformers.__version__} has no deepseek_v4")
    from weights import layouts
    from weights.layouts import deepseek_v4

    if bug:
        monkeypatch.setattr(deepseek_v4, "_right_from_canonical", deepseek_v4._from_canonical, raising=False)
        monkeypatch.setattr(deepseek_v4, "_from_canonical", _o_a_blocks_untransposed)

    cfg, model, seen = _hf_model(torch, transformers)
    own = {k: v.clone() for k, v in model.state_dict().items()}
    drawn, written = {}, {}
    for i in range(3):
        config, _ = layouts.to_canonical("hf-deepseek", own, hf_config=cfg.to_dict(), layer=i)
        drawn[i] = (config, init(config, seed=40 + i, dtype="float64"))
        written.update(layouts.from_canonical("hf-deepseek", *drawn[i], hf_config=cfg.to_dict(), layer=i,
                                              prefix="model."))
    ids = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(7))
    try:
        result = model.load_state_dict({k: torch.from_numpy(v) for k, v in written.items()}, strict=False)
        assert not result.unexpected_keys and not set(written) & set(result.missing_keys), result
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        model.load_state_dict(own)
    for i, (config, t) in drawn.items():
        (x, expected), = seen[i]
        trace = []
        got = compressed_attention(config, t, x, np.arange(T), trace=trace)
        rows = ~_tied(trace, config.compressed.index_topk) if config.compressed.kind == "csa" else slice(None)
        err = np.abs(got - expected).max(-1)[rows]
        assert (err.max() <= HF_BOUND * np.abs(expected).max()) == (bug is None), (config.compressed.kind, err.max())


@pytest.mark.reference
def test_equal_index_scores_go_to_the_earlier_entry():
    """The spec's tie rule (docs/spec-frontier.md#deepseek-v4): with every head weight 0 every score is 0, and
    each query keeps its first index_topk visible entries."""
    config, t = _layer("csa")
    t = {**t, "indexer.weights.kernel": np.zeros_like(t["indexer.weights.kernel"])}
    _, selection = compressed_attention(config, t, _x(), np.arange(T), return_selection=True)
    visible = (np.arange(T) + 1) // 4
    expected = np.where(np.arange(2)[None] < np.minimum(visible, 2)[:, None], np.arange(2)[None], -1)
    np.testing.assert_array_equal(selection, np.broadcast_to(expected, selection.shape))


@pytest.mark.reference
def test_the_reader_refuses_what_transformers_computes_otherwise():
    from weights.layouts.deepseek_v4 import v4_config

    hf = {"model_type": "deepseek_v4", "layer_types": ["heavily_compressed_attention"], "head_dim": 16,
          "partial_rotary_factor": 0.5, "q_lora_rank": 12, "o_groups": 2, "o_lora_rank": 8, "rms_norm_eps": 1e-6,
          "compress_rates": {"heavily_compressed_attention": 8}, "num_attention_heads": 4, "hidden_size": D,
          "sliding_window": 6, "rope_parameters": {
              "main": {"rope_type": "default", "rope_theta": 10000.0},
              "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 4.0,
                           "original_max_position_embeddings": 16, "attention_factor": 1.0, "truncate": False}}}
    with pytest.raises(ValueError, match=r"rope_parameters.compress.truncate must be true or absent: transformers"):
        v4_config(hf, 0)
    del hf["rope_parameters"]["compress"]["truncate"]
    assert v4_config(hf, 0).rope.scaling.truncate is True
    with pytest.raises(ValueError, match=r"attention_bias must be false for deepseek_v4"):
        v4_config({**hf, "attention_bias": True}, 0)


@pytest.mark.reference
def test_a_weight_file_round_trips(tmp_path):
    """The config in the safetensors metadata (to_json) and every V4 tensor come back as saved."""
    from weights import load, save

    config, t = _layer("csa")
    save(tmp_path / "v4.safetensors", config, t)
    again, tensors = load(tmp_path / "v4.safetensors")
    assert again == config and sorted(tensors) == sorted(t)
    assert all(np.array_equal(tensors[name], t[name]) for name in t)


def test_what_transformers_leaves_ill_defined_is_as_the_spec_says():
    """docs/spec-frontier.md#deepseek-v4's first and third points, shown on transformers itself: (1) without a
    cache, windows start at the call's first token while visibility reads position_ids: a call at positions
    2..13 pools positions 2..9 into hca's entry 0, which the row at position 7 sees, so the token at position 9
    changes that earlier row; (3) YaRN's truncate is read from the top-level rope_parameters: the compress
    table's truncate false changes nothing in transformers' frequencies, where the contract's differ."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers", reason="transformers not installed: pip install '.[hf]'")
    if not hasattr(transformers, "DeepseekV4Config"):
        pytest.skip(f"transformers {transformers.__version__} has no deepseek_v4")
    from weights.config import Rope
    from weights.rope import inverse_frequencies

    cfg, model, seen = _hf_model(torch, transformers)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(5))
    later = ids.clone()
    later[0, 7] = (ids[0, 7] + 1) % 64  # the token at position 2 + 7 = 9
    with torch.no_grad():
        for tokens in (ids, later):
            model(tokens, position_ids=torch.arange(2, 14)[None], use_cache=False)
    (_, before), (_, after) = seen[2]  # hca's outputs, rows at positions 2..13
    assert np.abs(after[0, 5] - before[0, 5]).max() > 1e-3  # position 7's row moved with position 9's token
    assert np.abs(after[0, :5] - before[0, :5]).max() == 0  # (the rows before it see no entry: unchanged)

    # a table where truncating moves the ramp's ends (theta 1e4, 2048 original positions: ends 1.01 and 2.51)
    table = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048, "rope_theta": 10000.0,
             "partial_rotary_factor": 0.5, "attention_factor": 1.0}
    rotary = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4RotaryEmbedding
    theirs = [rotary(transformers.DeepseekV4Config(**{**cfg.to_dict(), "max_position_embeddings": 8192,
                                                      "rope_parameters": {"main": cfg.rope_parameters["main"],
                                                                          "compress": {**table, "truncate": flag}}}))
              .compress_inv_freq.numpy() for flag in (True, False)]
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048, "attention_factor": 1.0}
    ours = [inverse_frequencies(Rope.from_value({"theta": 10000.0, "rotary_dim": 8, "interleaved": True,
                                                 "scaling": {**yarn, "truncate": flag}})) for flag in (True, False)]
    assert np.array_equal(theirs[0], theirs[1]) and not np.allclose(ours[0], ours[1], rtol=1e-3)
    np.testing.assert_allclose(theirs[0], ours[0], rtol=1e-6)  # float32 frequencies: truncate true, as ours


def _random_layer(rng):
    """A random small V4 layer: kind, window (1 to 7 keys), ratio (1 to 5), overlap, index sizes and top-k."""
    kind = str(rng.choice(list(KINDS)))
    compressed = {"kind": kind, "query_rank": int(rng.integers(2, 9)), "output_groups": int(rng.choice([1, 2, 4])),
                  "output_rank": int(rng.integers(1, 6))}
    if kind != "sliding":
        compressed.update(ratio=int(rng.integers(1, 6)), overlap=bool(rng.integers(2)))
    if kind == "csa":
        compressed.update(index_heads=int(rng.integers(1, 4)), index_head_dim=int(rng.choice([4, 6])),
                          index_topk=int(rng.integers(1, 5)))
    rope = {**(BASE["rope"] if kind == "sliding" else COMPRESS_ROPE), "rotary_dim": 4}
    config = AttentionConfig(**{**BASE, "num_heads": int(rng.choice([1, 2, 4])), "head_dim": 8, "rope": rope,
                                "window_left": int(rng.integers(0, 7)), "use_sinks": bool(rng.integers(2))},
                             compressed=compressed)
    return config, init(config, seed=int(rng.integers(1 << 30)), dtype="float64")


@pytest.mark.slow  # 300 random layers, ~3 s (2-core AMD EPYC VM, 2026-11-29): tox -e full
@pytest.mark.reference
def test_a_sweep_of_random_layers_agrees_with_the_hand_port_and_its_own_cache():
    """Seeds 41000-41299 (unseen by the tests above): the hand port reproduces the reference's prefill, and calls
    split at random points through the cache give the prefill's rows."""
    for seed in range(41000, 41300):
        rng = np.random.default_rng(seed)
        config, t = _random_layer(rng)
        B, length = int(rng.integers(1, 3)), int(rng.integers(1, 18))
        x = rng.standard_normal((B, length, D))
        whole = compressed_attention(config, t, x, np.arange(length))
        bound = PORT_BOUND * max(np.abs(whole).max(), 1e-300)
        assert np.abs(port(config, t, x) - whole).max() <= bound, (seed, config.compressed)
        cuts = [0, *sorted(set(rng.integers(1, length, size=3).tolist()) if length > 1 else []), length]
        past, rows = None, []
        for a, b in zip(cuts, cuts[1:]):
            out, past = compressed_attention(config, t, x[:, a:b], np.arange(a, b), past, return_cache=True)
            rows.append(out)
        assert np.abs(np.concatenate(rows, axis=1) - whole).max() <= bound, (seed, cuts, config.compressed)


@pytest.mark.reference
def test_a_selection_that_breaks_exact_ties_otherwise_is_judged_by_its_own_entries():
    """v4_csa_prefill has exact ties at the k-th place (two entries whose index scores are both exactly 0: rows
    (0, 11) and (1, 9)). A port that keeps the later of them passes `selection` by the top-k rule (a swap at
    distance 0) and its output is judged against the float64 reference attending to its own selection (compare's
    expected_for with the selection, impl_numpy.compressed's topk_indices): it passes. Against the reference's own
    selection that output fails, so the re-referencing is what passes it."""
    from conformance.suite.cases import CASES
    from conformance.suite.compare import case_policy, expected_for, run_case
    from conformance.suite.tolerance import compare

    case = _no_cache(CASES["v4_csa_prefill"])
    adapter = _PortAdapter(None, ties="later")
    result = run_case(case, "v4-port", dtype="float32", adapter=adapter, gradients=False)
    verdict = {c.name: c for c in result.comparisons}["selection"]
    assert result.status == "pass" and verdict.ok and "admissible swaps" in verdict.tolerance.reason, (
        result.status, [c.describe() for c in result.comparisons])
    exp = expected_for(case, "float32")
    got = adapter.forward(case.config, exp["tensors"], exp["inputs"], case.options("float32"))
    assert not np.array_equal(got["selection"], exp["selection"])
    plain = compare("output", got["output"], exp["output"],
                    case_policy(case, "float32", "output", "output", exp["output"]))
    assert not plain.ok, plain.describe()


@pytest.mark.reference
@pytest.mark.parametrize("ties,bug,status", [("later", None, "pass"), ("earlier", "topk_lowest", "fail")])
def test_verify_judges_a_returned_v4_selection(ties, bug, status):
    """`mha verify` on the shipped v4_csa_prefill.float32 vector: the hand port's selection judged by the top-k
    rule (verify.compressed_selection_verdict); one that breaks the exact ties the other way passes, its output
    judged against the reference attending to its selection; one that keeps the lowest scores fails at it."""
    from conformance.suite.vectors import DEFAULT_DIR, Vector
    from conformance.suite.verify import verify_vector
    from weights import AttentionConfig

    def fn(config, tensors, inputs, options):
        config = AttentionConfig.from_dict(config)
        out, selection = port(config, tensors, inputs["query"], bug, return_selection=True, ties=ties)
        return {"output": out, "selection": selection,
                "not_returned": {f"present_{n}": "the hand port has no cache" for n in cache_names(config)}}

    result = verify_vector(fn, Vector(DEFAULT_DIR / "v4_csa_prefill.float32.safetensors"))
    verdict = {c.name: c for c in result.comparisons}["selection"]
    assert result.status == status and verdict.ok == (status == "pass"), (result.status, result.message)


class _CacheBugAdapter:
    """NumPy's own V4 call with one port bug in its present cache: the open window's (or, with overlap, the
    last closed window's) gates stored with compressor.position_bias already added, where the cache holds raw
    gates (the next call adds the bias again: impl_numpy.compressed.compress)."""

    def __init__(self, name):
        self.name = name

    def forward(self, config, tensors, inputs, options, *, device="cpu", precision="highest", trace=False):
        from impl_numpy import adapter

        answer = adapter.forward(config, tensors, inputs, options, trace=trace)
        if trace:
            return answer
        gate = answer[self.name]
        bias = np.asarray(tensors["compressor.position_bias"])[:gate.shape[1], :gate.shape[2]]
        return answer | {self.name: (gate + bias).astype(gate.dtype)}


@pytest.mark.reference
@pytest.mark.parametrize("case,name", [("v4_hca_decode", "present_window_gate"),
                                       ("v4_csa_prefill", "present_overlap_gate")])
def test_a_cache_bug_fails_at_its_cache_comparison(case, name):
    """run_case judges every array of the present cache (cache_names) as a comparison of its own: gates stored
    with their position bias fail at that array alone, the output (which the call computed right) passing."""
    from conformance.suite.cases import CASES
    from conformance.suite.compare import run_case

    result = run_case(CASES[case], "v4-cache-bug", dtype="float32", adapter=_CacheBugAdapter(name),
                      gradients=False)
    failed = [c.name for c in result.comparisons if not c.ok]
    assert result.status == "fail" and failed == [name], (failed, result.message)


@pytest.mark.reference
def test_a_given_selection():
    """compressed_attention's topk_indices (the suite's reference for a port's own selection): its own selection
    given back reproduces the call, an entry the query cannot see counts as padding, and a wrong array or kind
    is refused naming the argument."""
    config, t = _layer("csa")
    x = _x()
    out, selection = compressed_attention(config, t, x, np.arange(T), return_selection=True)
    again, same = compressed_attention(config, t, x, np.arange(T), return_selection=True, topk_indices=selection)
    np.testing.assert_array_equal(again, out)
    np.testing.assert_array_equal(same, selection)
    m = config.compressed.ratio
    last = T // m - 1  # the last entry (tokens 16..19): visible from row 19 on (last < (t + 1) // m)
    future = np.full_like(selection, last)
    _, cleaned = compressed_attention(config, t, x, np.arange(T), return_selection=True, topk_indices=future)
    seen = last < (np.arange(T) + 1) // m
    assert (cleaned[:, ~seen] == -1).all() and (cleaned[:, seen] == last).all() and seen.sum() == 2
    with pytest.raises(ValueError, match=r"topk_indices must be integers of shape \(B, T, k\) = \(2, 21, k\)"):
        compressed_attention(config, t, x, np.arange(T), topk_indices=selection[:, :3])
    hca, th = _layer("hca")
    with pytest.raises(ValueError, match=r"topk_indices must be None for a compressed layer of kind hca"):
        compressed_attention(hca, th, x, np.arange(T), topk_indices=selection)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_the_reference_stores_each_stage_in_16_bits(kind, dtype):
    """The 16-bit precision rule (impl_numpy/compressed.py's docstring): every traced stage stored in the storage
    dtype, except the index scores (float32, the compute dtype, as impl_numpy.indexer's) and the selection."""
    from weights import dtype_from_name

    config, t = _layer(kind)
    dt = dtype_from_name(dtype)
    trace = []
    compressed_attention(config, {name: a.astype(dt) for name, a in t.items()}, _x().astype(dt), np.arange(T),
                         trace=trace)
    kept = {"indexer.score": "float32", "indexer.selection": "int64"}
    assert [(e.stage, e.value.dtype.name) for e in trace] == [(e.stage, kept.get(e.stage, dtype)) for e in trace]


def stage_dtypes(backend, dtype, adapter=None):
    """[(stage, dtype name)] of the backend's trace (the mirrors' V4 test files compare theirs with NumPy's) of v4_csa_prefill in `dtype` (every stage kind: the query, the
    key, both compressors, the indexer, the attention)."""
    from conformance.suite import backends
    from conformance.suite.cases import CASES
    from conformance.suite.compare import expected_for

    case = CASES["v4_csa_prefill"]
    exp = expected_for(case, dtype)
    adapter = adapter or backends.load(backend)
    traced = adapter.forward(case.config, exp["tensors"], exp["inputs"], case.options(dtype), trace=True)["trace"]
    return [(stage, np.asarray(value).dtype.name) for stage, value in traced]
