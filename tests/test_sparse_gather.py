"""The mirrors' gather of a decode step's selected keys (issue 39 item 5): a one-token latent (MLA) call over a
selection attends to the selected rows of the cache alone instead of masking the whole cache (impl_numpy's
chunked._selected_columns; impl_torch.attention._selected_columns, the union of every row's columns as NumPy's;
impl_jax.latent.gather_selected, each row's k by index, as jax.jit needs a static width).

Each mirror's gathering paths are held to impl_numpy's float64 stages (every key, the unselected masked) on a
step of two batch rows with their own selections, one with a -1 pad, one naming a key twice, both naming key 0;
each test first shows that the gather ran (so a pass is the gather's). The porting bugs a gather makes, a selected
key dropped or one counted twice, are planted and must fail. (numpy's own: tests/test_bench_sparse.py.) And
impl_tf's selection mask by scatter (a long cache's) against impl_numpy's.

impl_tf's and impl_mlx's gathers also take a selection per kv head (B, K, 1, k) (MiniMax M3's form): VARIANTS
(shared and per kv head, a mask per head joined to a shared selection, a fully masked row under masked_row
"zero", "uniform" and "nan": the last two stay with the masked core, as every mirror leaves them, and must
still be right), each judged against the float64 stages,
and a gather that reads another kv head's selection planted and failing. impl_tf's on Keras's jax and torch
backends: tests/test_keras_backends.py (keras_backend_runs.py's `gather`, VARIANTS there too)."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.suite.tolerance import assert_close

P = 80  # S_total 81: past impl_jax.latent.GATHER_MIN_KEYS (64)


def _step(per_kv_head=False, masked_row="zero", empty=False):
    """The latent family's quick layer (conformance/bench/latent.py), B 2, one new token over P 80 cached: each
    row selects 6 keys (row 0 key 0 and key 17 twice; row 1 key 0, a -1 pad and the new key P), or per kv head,
    each head its own draw. empty: row 1's selection (per kv head: its kv head 0's) all -1, a fully masked row
    that the config's masked_row fills. -> config, tensors, x, latent, rotary, topk_indices (int64)."""
    from conformance.bench import latent

    d = latent.QUICK
    config, tensors = latent.layer(d)
    config = config.replace(masked_row=masked_row)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 1, d.D)).astype(np.float32)
    lat = rng.standard_normal((2, 1, P, d.C)).astype(np.float32)
    rot = rng.standard_normal((2, 1, P, d.R)).astype(np.float32)
    heads = config.num_kv_heads if per_kv_head else 1
    idx = np.stack([[np.sort(rng.choice(np.arange(1, P + 1), 6, replace=False)) for _ in range(heads)]
                    for _ in range(2)])  # (2, Ks, 6)
    idx[:, :, 0] = 0  # key 0 selected (a gather that reads index 0 as a pad drops it)
    idx[0, :, 2] = 17
    idx[0, :, 3] = 17  # row 0 names key 17 twice: selected once
    idx[1, :, 1] = -1  # row 1 pads a slot
    idx[1, :, -1] = P  # and selects the new token
    if empty:
        idx[1, 0] = -1  # row 1 (its kv head 0) selects nothing: a fully masked row
    idx = idx[:, :, None] if per_kv_head else idx[:, 0, None]  # (2, Ks, 1, 6) or (2, 1, 6)
    return config, tensors, x, lat, rot, idx


def _expected(config, tensors, x, lat, rot, idx, mask=None):
    """impl_numpy's float64 stages (every key attended, the unselected masked) and their logits (the bar's size)."""
    from impl_numpy.attention import multi_head_attention

    trace = []
    out = np.asarray(multi_head_attention(config, tensors, x, past_key=lat, past_value=rot, topk_indices=idx, mask=mask,
                                          is_causal=True, causal_alignment="bottom_right", dtype="float64",
                                          trace=trace))
    return out, next(e.value for e in trace if e.stage == "logits")


# name -> (per_kv_head, masked_row, empty, head_mask): the gather runs where masked_row is "zero" (gathers_selection)
VARIANTS = {"shared": (False, "zero", False, False), "shared_head_mask": (False, "zero", False, True),
            "shared_nan_empty": (False, "nan", True, False), "per_kv_head_empty": (True, "zero", True, False),
            "per_kv_head_uniform_empty": (True, "uniform", True, False), "per_kv_head_nan_empty": (True, "nan", True, False)}


def gathers(variant: str) -> bool:
    return VARIANTS[variant][1] == "zero"


def _variant(variant: str):
    """-> the step (_step's tuple) and its mask: None, or with head_mask a mask per head (2, N 4, 1, P + 1) that
    hides from row 0's head 1 the key it selects twice (17), from row 1's head 2 the new key it selects, and
    every key from row 1's head 3 (a fully masked row): the selection and the mask joined per head."""
    per_kv_head, masked_row, empty, head_mask = VARIANTS[variant]
    step = _step(per_kv_head, masked_row, empty)
    if not head_mask:
        return step, None
    mask = np.ones((2, step[0].num_heads, 1, P + 1), bool)
    mask[0, 1, 0, 17] = mask[1, 2, 0, P] = False
    mask[1, 3] = False
    return step, mask


def _judge(name, got, expected, logits, config):
    assert_close(name, np.asarray(got), expected, config=config, dtype="float32", quantity="output", B=2, T=1,
                 S=P + 1, logits=logits)


# --- torch ----------------------------------------------------------------------------------------------------------


def _torch_paths(config, tensors, x, lat, rot, idx):
    """{path: output} of impl_torch's gathering paths: SDPA over the given cache, and the in-place cache (stages)."""
    import torch

    from impl_torch.attention import multi_head_attention

    t = {k: torch.from_numpy(v) for k, v in tensors.items()}
    common = dict(topk_indices=torch.from_numpy(idx), is_causal=True, causal_alignment="bottom_right")
    buffers = [torch.zeros((2, 1, P + 4, a.shape[-1])) for a in (lat, rot)]
    buffers[0][:, :, :P], buffers[1][:, :, :P] = torch.from_numpy(lat), torch.from_numpy(rot)
    with torch.no_grad():
        return {"sdpa": multi_head_attention(config, t, torch.from_numpy(x), past_key=torch.from_numpy(lat),
                                             past_value=torch.from_numpy(rot), use_sdpa=True, **common),
                "in_place": multi_head_attention(config, t, torch.from_numpy(x), past_key=buffers[0],
                                                 past_value=buffers[1], cache_length=P, **common)}


def _torch_spy(monkeypatch, change=None):
    """impl_torch's _selected_columns, recorded (and changed by `change`, a planted bug)."""
    import impl_torch.attention as attention

    right, taken = attention._selected_columns, []

    def spy(*args, **kwargs):
        cols = right(*args, **kwargs)
        taken.append(cols)
        return cols if cols is None or change is None else change(cols)

    monkeypatch.setattr(attention, "_selected_columns", spy)
    return taken


@pytest.mark.torch
def test_torch_gathers_the_selected_rows(monkeypatch):
    pytest.importorskip("torch")  # the numpy env runs every file with no framework installed
    step = _step()
    expected, logits = _expected(*step)
    taken = _torch_spy(monkeypatch)
    for path, got in _torch_paths(*step).items():
        _judge(f"torch {path}", got.numpy(), expected, logits, step[0])
    # both paths gathered: the union of the two rows' keys (-1 and row 0's repeat count once), not the 51
    union = sorted({int(j) for j in step[-1].ravel() if j >= 0})
    assert [c.tolist() for c in taken] == [union, union], (taken, union)


@pytest.mark.torch
@pytest.mark.parametrize("bug", ["drops_a_key", "counts_a_key_twice"])
def test_torch_gather_bugs_are_caught(monkeypatch, bug):
    pytest.importorskip("torch")  # the numpy env runs every file with no framework installed
    import torch

    change = {"drops_a_key": lambda cols: cols[1:],
              "counts_a_key_twice": lambda cols: torch.cat([cols, cols[:1]])}[bug]
    step = _step()
    expected, logits = _expected(*step)
    _torch_spy(monkeypatch, change)
    for path, got in _torch_paths(*step).items():
        with pytest.raises(AssertionError, match="FAIL"):
            _judge(f"torch {path} ({bug})", got.numpy(), expected, logits, step[0])


# --- jax ------------------------------------------------------------------------------------------------------------


def _jax_in_place(config, tensors, x, lat, rot, idx):
    """impl_jax's in-place step under jax.jit (the bench's and mha check's form): the gathering fused path."""
    import jax
    import jax.numpy as jnp

    from impl_jax.attention import apply

    buffers = [jnp.zeros((2, 1, P + 4, a.shape[-1]), jnp.float32).at[:, :, :P].set(a) for a in (lat, rot)]
    step = jax.jit(lambda p, inp, k, v, sel: apply(config, p, inp, past_key=k, past_value=v, cache_length=P,
                                                   topk_indices=sel, return_cache=True, is_causal=True,
                                                   causal_alignment="bottom_right")[0])
    return step(tensors, x, *buffers, idx)


def _jax_spy(monkeypatch, bug=None):
    """impl_jax's gather, recorded; bug: its slots kept as a porting bug would keep them (latent.kept_slots):
    index 0 read as a pad (key 0 dropped), or every slot that names a key (a key named twice counted twice)."""
    import jax.numpy as jnp

    import impl_jax.latent as latent

    right, taken = latent.kept_slots, []

    def spy(idx):
        taken.append(idx.shape)
        if bug == "drops_key_0":
            idx = jnp.sort(idx, axis=-1)
            return idx, idx > 0
        if bug == "counts_a_key_twice":
            idx = jnp.sort(idx, axis=-1)
            return idx, idx >= 0
        return right(idx)

    monkeypatch.setattr(latent, "kept_slots", spy)
    return taken


@pytest.mark.jax
@pytest.mark.parametrize("per_kv_head, block", [(False, 256), (True, 256), (False, 4)])
def test_jax_gathers_the_selected_rows(monkeypatch, per_kv_head, block):
    """block: the in-place gather's slots per loop turn (latent.GATHER_BLOCK); 4 of k 6: two turns, the second
    clamped back over two slots of the first."""
    pytest.importorskip("jax")  # the numpy env runs every file with no framework installed
    import impl_jax.latent as latent

    monkeypatch.setattr(latent, "GATHER_BLOCK", block)
    step = _step(per_kv_head)
    expected, logits = _expected(*step)
    taken = _jax_spy(monkeypatch)
    _judge("jax in_place", _jax_in_place(*step), expected, logits, step[0])
    shape = step[-1].shape
    assert taken == [(2, shape[1] if per_kv_head else 1, shape[-1])], taken  # the gather ran (once: one trace)


@pytest.mark.jax
@pytest.mark.parametrize("bug", ["drops_key_0", "counts_a_key_twice"])
def test_jax_gather_bugs_are_caught(monkeypatch, bug):
    pytest.importorskip("jax")  # the numpy env runs every file with no framework installed
    step = _step()
    expected, logits = _expected(*step)
    _jax_spy(monkeypatch, bug)
    with pytest.raises(AssertionError, match="FAIL"):
        _judge(f"jax in_place ({bug})", _jax_in_place(*step), expected, logits, step[0])


# --- tf -------------------------------------------------------------------------------------------------------------


@pytest.mark.tf
def test_tf_selection_mask_by_scatter_is_numpys(monkeypatch):
    """impl_tf.functional.selection_mask's scatter (the form a long cache takes: one-hot past ONE_HOT_MAX_BYTES,
    forced here) against impl_numpy's, shared and per kv head, with -1 pads and a key named twice."""
    pytest.importorskip("tensorflow")  # the numpy env runs every file with no framework installed
    import impl_numpy.functional as npF
    import impl_tf.functional as tfF

    monkeypatch.setattr(tfF, "ONE_HOT_MAX_BYTES", 0)
    rng = np.random.default_rng(7)
    for shape in ((2, 3, 4), (2, 2, 3, 4)):  # (B, T, k), (B, K, T, k)
        idx = rng.integers(-1, 9, size=shape)
        idx[..., 1] = idx[..., 0]  # a key (or a pad) named twice
        got = np.asarray(tfF.keras.ops.convert_to_numpy(tfF.selection_mask(idx, 4, 9)))
        expected = npF.selection_mask(idx, 4, 9)
        assert got.shape == expected.shape and (got == expected).all(), (shape, np.argwhere(got != expected))


def _tf_paths(config, tensors, x, lat, rot, idx, mask=None):
    """{path: output} of impl_tf's gathering paths on TensorFlow: the fused path over the given cache, and the
    in-place cache (tf.Variables) in a tf.function, as the bench runs it."""
    from impl_tf._keras import tf
    from impl_tf.attention import multi_head_attention

    t = {k: tf.constant(v) for k, v in tensors.items()}
    common = dict(topk_indices=tf.constant(idx), is_causal=True, causal_alignment="bottom_right",
                  mask=None if mask is None else tf.constant(mask))
    buffers = [np.zeros((2, 1, P + 4, a.shape[-1]), np.float32) for a in (lat, rot)]
    buffers[0][:, :, :P], buffers[1][:, :, :P] = lat, rot
    bk, bv = (tf.Variable(b) for b in buffers)
    step = tf.function(lambda inp: multi_head_attention(config, t, inp, past_key=bk, past_value=bv, cache_length=P,
                                                        **common))
    return {"fused": multi_head_attention(config, t, tf.constant(x), past_key=tf.constant(lat),
                                          past_value=tf.constant(rot), **common),
            "in_place": step(tf.constant(x))}


@pytest.mark.tf
@pytest.mark.parametrize("bug", [None, "drops_key_0", "counts_a_key_twice"])
def test_tf_gathers_the_selected_rows(monkeypatch, bug):
    """impl_tf's gather (keras.ops on TensorFlow) against the float64 stages; its slots kept as a porting bug
    would keep them must fail."""
    pytest.importorskip("tensorflow")  # the numpy env runs every file with no framework installed
    import impl_tf.attention as attention

    right, taken = attention.kept_slots, []

    def spy(idx):
        taken.append(tuple(idx.shape))
        if bug is None:
            return right(idx)
        idx = attention.ops.sort(idx, axis=-1)
        return idx, (idx > 0) if bug == "drops_key_0" else (idx >= 0)

    monkeypatch.setattr(attention, "kept_slots", spy)
    step = _step()
    expected, logits = _expected(*step)
    for path, got in _tf_paths(*step).items():
        if bug is None:
            _judge(f"tf {path}", np.asarray(got), expected, logits, step[0])
        else:
            with pytest.raises(AssertionError, match="FAIL"):
                _judge(f"tf {path} ({bug})", np.asarray(got), expected, logits, step[0])
    assert taken == [(2, 6), (2, 6)], taken  # both paths gathered (the tf.function traced once)


def roll_kv_heads(rows, Ks: int, ops):
    """The porting bug planted below: (B * Ks, k) selection rows, each batch row's kv heads taken one over (head h
    reads head h + 1's selection: the heads' order lost between the indexer and the gather)."""
    B, k = rows.shape[0] // Ks, rows.shape[-1]
    heads = ops.reshape(rows, (B, Ks, k))
    return ops.reshape(ops.concatenate([heads[:, 1:], heads[:, :1]], axis=1), (B * Ks, k))


@pytest.mark.tf
@pytest.mark.parametrize("variant, bug", [(v, None) for v in VARIANTS if v not in ("shared", "shared_nan_empty")]
                         + [("per_kv_head_empty", "wrong_kv_head")])  # shared: the test above (and mlx's, keras's)
def test_tf_gathers_a_selection_per_kv_head(monkeypatch, variant, bug):
    """impl_tf's gather of a selection per kv head (and a fully masked row, under each masked_row) on TensorFlow,
    fused and in place, against the float64 stages; a gather reading another kv head's selection fails."""
    pytest.importorskip("tensorflow")  # the numpy env runs every file with no framework installed
    import impl_tf.attention as attention

    right, taken = attention.selection_rows, []

    def spy(topk):
        rows, Ks = right(topk)
        taken.append(tuple(rows.shape))
        return (rows if bug is None else roll_kv_heads(rows, Ks, attention.ops)), Ks

    monkeypatch.setattr(attention, "selection_rows", spy)
    step, mask = _variant(variant)
    expected, logits = _expected(*step, mask=mask)
    for path, got in _tf_paths(*step, mask=mask).items():
        if bug is None:
            _judge(f"tf {path} {variant}", np.asarray(got), expected, logits, step[0])
        else:
            with pytest.raises(AssertionError, match="FAIL"):
                _judge(f"tf {path} {variant} ({bug})", np.asarray(got), expected, logits, step[0])
    rows = 2 * step[-1].shape[1] if VARIANTS[variant][0] else 2
    assert taken == ([(rows, 6)] * 2 if gathers(variant) else []), taken  # "uniform" and "nan": the masked core


# --- mlx ------------------------------------------------------------------------------------------------------------


def _mlx_paths(config, tensors, x, lat, rot, idx, mask=None):
    """{path: output} of impl_mlx's gathering paths: the fused kernel over the given cache, and the in-place cache
    (mx.arrays written by slice assignment)."""
    import mlx.core as mx

    from impl_mlx.attention import multi_head_attention

    p = {k: mx.array(v) for k, v in tensors.items()}
    common = dict(topk_indices=idx, is_causal=True, causal_alignment="bottom_right", mask=mask)
    buffers = [mx.zeros((2, 1, P + 4, a.shape[-1])) for a in (lat, rot)]
    buffers[0][:, :, :P], buffers[1][:, :, :P] = mx.array(lat), mx.array(rot)
    return {"fused": np.array(multi_head_attention(config, p, x, past_key=lat, past_value=rot, **common)),
            "in_place": np.array(multi_head_attention(config, p, x, past_key=buffers[0], past_value=buffers[1],
                                                      cache_length=P, **common))}


@pytest.mark.mlx
@pytest.mark.parametrize("variant, bug", [(v, None) for v in VARIANTS]
                         + [("per_kv_head_empty", "wrong_kv_head"), ("shared", "drops_key_0"),
                            ("shared", "counts_a_key_twice")])
def test_mlx_gathers_the_selected_rows(monkeypatch, variant, bug):
    """impl_mlx's gather (impl_mlx.latent.gather_selected), shared and per kv head, fused and in place, against the
    float64 stages; the porting bugs a gather makes (another kv head's selection read, index 0 read as a pad, a
    key named twice counted twice) planted and failing."""
    pytest.importorskip("mlx.core")  # the numpy env runs every file with no framework installed
    import mlx.core as mx

    import impl_mlx.latent as latent

    heads, slots, taken = latent.selection_heads, latent.kept_slots, []

    def spy_heads(topk):
        idx = heads(topk)
        taken.append(tuple(idx.shape))
        return mx.concatenate([idx[:, 1:], idx[:, :1]], axis=1) if bug == "wrong_kv_head" else idx

    def spy_slots(idx):
        if bug in ("drops_key_0", "counts_a_key_twice"):
            idx = mx.sort(idx, axis=-1)
            return idx, (idx > 0) if bug == "drops_key_0" else (idx >= 0)
        return slots(idx)

    monkeypatch.setattr(latent, "selection_heads", spy_heads)
    monkeypatch.setattr(latent, "kept_slots", spy_slots)
    step, mask = _variant(variant)
    expected, logits = _expected(*step, mask=mask)
    for path, got in _mlx_paths(*step, mask=mask).items():
        if bug is None:
            _judge(f"mlx {path} {variant}", got, expected, logits, step[0])
        else:
            with pytest.raises(AssertionError, match="FAIL"):
                _judge(f"mlx {path} {variant} ({bug})", got, expected, logits, step[0])
    heads_of = step[-1].shape[1] if VARIANTS[variant][0] else 1
    assert taken == ([(2, heads_of, 6)] * 2 if gathers(variant) else []), taken  # "uniform", "nan": masked kernel


@pytest.mark.mlx
def test_mlx_sparse_bench_steps_give_the_reference(monkeypatch):
    """`mha bench --shapes sparse`'s mlx runner (conformance/bench/sparse.mlx_paths) on the quick layer at P 80:
    its dense and sparse steps against impl_numpy's float64 calls (sparse.reference), the sparse one gathered
    (twice: the in-place step writes its token again), the indexer's selection of k keys."""
    pytest.importorskip("mlx.core")  # the numpy env runs every file with no framework installed
    import impl_mlx.latent as latent
    from conformance.bench import sparse
    from impl_numpy.attention import multi_head_attention

    right, taken = latent.selection_heads, []
    monkeypatch.setattr(latent, "selection_heads", lambda topk: taken.append(tuple(topk.shape)) or right(topk))
    d, ix = sparse.dims(True)
    config, tensors = sparse.layer(d, ix)
    data = sparse.inputs(d, ix, P)
    calls = sparse.mlx_paths(config, tensors, data, P)
    ac = sparse.attention_config(config)
    for name, topk in (("dense", None), ("sparse", data["topk"]), ("sparse", data["topk"])):
        trace = []
        expected = np.asarray(multi_head_attention(ac, sparse._split(tensors)[0], data["x"], past_key=data["latent"],
                                                   past_value=data["rotary"], topk_indices=topk, is_causal=True,
                                                   causal_alignment="bottom_right", dtype="float64", trace=trace))
        logits = next(e.value for e in trace if e.stage == "logits")
        assert_close(f"mlx bench {name}", np.array(calls[name]()), expected, config=ac, dtype="float32",
                     quantity="output", B=d.B, T=1, S=P + 1, logits=logits)
    assert taken == [(d.B, 1, ix.k)] * 2, taken  # the sparse step gathered, the dense one did not
    assert tuple(calls["indexer"]().shape) == (d.B, 1, ix.k)


@pytest.mark.mlx
@pytest.mark.parametrize("variant", ["shared_head_mask", "per_kv_head_empty"])
def test_mlx_gathered_step_gradients_are_the_references(monkeypatch, variant):
    """mx.vjp through impl_mlx's gathered step (the fused path over the given cache: the gather's gradient a
    scatter into the selected rows, a key named twice getting its gradient once) against impl_numpy's float64
    VJP of the masked form: every parameter's, the query's and the cache's (past_key: the latent, past_value:
    the rotary key) gradient, each judged with its terms' magnitude as the floor (assert_close's scale_floor)."""
    pytest.importorskip("mlx.core")  # the numpy env runs every file with no framework installed
    import mlx.core as mx

    import impl_mlx.latent as latent
    from impl_mlx.attention import multi_head_attention
    from impl_numpy import multi_head_attention_vjp

    right, taken = latent.selection_heads, []
    monkeypatch.setattr(latent, "selection_heads", lambda topk: taken.append(tuple(topk.shape)) or right(topk))
    (config, tensors, x, lat, rot, idx), mask = _variant(variant)
    d_out = np.random.default_rng(2).standard_normal((2, 1, config.out_dim)).astype(np.float32)
    common = dict(topk_indices=idx, mask=mask, is_causal=True, causal_alignment="bottom_right")
    _, want, magnitudes = multi_head_attention_vjp(config, tensors, x, d_output=d_out, past_key=lat, past_value=rot,
                                                   dtype="float64", gradient_magnitudes=True, **common)
    names = list(tensors)

    def f(*args):
        *params, query, past_key, past_value = args
        return [multi_head_attention(config, dict(zip(names, params)), query, past_key=past_key,
                                     past_value=past_value, **common)]

    arrays = [mx.array(tensors[n]) for n in names] + [mx.array(a) for a in (x, lat, rot)]
    _, grads = mx.vjp(f, arrays, [mx.array(d_out)])
    got = dict(zip([*names, "query", "past_key", "past_value"], (np.array(g) for g in grads)))
    assert taken, "the gather did not run"
    assert set(want) <= set(got), (sorted(want), sorted(got))
    for name, expected in want.items():
        assert_close(f"mlx grad {name} ({variant})", got[name], expected, config=config, dtype="float32",
                     quantity="grad", B=2, T=1, S=P + 1,
                     scale_floor=float(np.nanmax(np.abs(magnitudes[name]))))


def _random_step(seed: int):
    """A random decode step for the gathers (slow sweep below): the quick latent layer, B 1-2, P 63-120 (the
    gather from S_total 64 on), k 1-12, a selection shared or per kv head drawn over -1 .. P (pads and repeats
    wherever they fall; a row all -1 one time in six), a mask none, per row or per head (each key shown with
    probability 0.8; a head shown nothing now and then). -> (config, tensors, x, lat, rot, idx), mask, S_total."""
    from conformance.bench import latent

    rng = np.random.default_rng([seed, 39, 5])
    d = latent.QUICK
    config, tensors = latent.layer(d)
    B, P_, k = int(rng.integers(1, 3)), int(rng.integers(63, 121)), int(rng.integers(1, 13))
    S = P_ + 1
    x = rng.standard_normal((B, 1, d.D)).astype(np.float32)
    lat = rng.standard_normal((B, 1, P_, d.C)).astype(np.float32)
    rot = rng.standard_normal((B, 1, P_, d.R)).astype(np.float32)
    heads = config.num_kv_heads if rng.random() < 0.5 else 1
    idx = rng.integers(-1, S, size=(B, heads, 1, k))
    empty = rng.random((B, heads)) < 1 / 6
    idx[empty] = -1
    idx = idx if heads > 1 else idx[:, 0]
    kind = rng.integers(3)
    mask = None if kind == 0 else rng.random((B, 1 if kind == 1 else config.num_heads, 1, S)) < 0.8
    return (config, tensors, x, lat, rot, idx), mask, S


def _judge_random(name, got, step, mask, S):
    config = step[0]
    expected, logits = _expected(*step, mask=mask)
    assert_close(name, np.asarray(got), expected, config=config, dtype="float32", quantity="output",
                 B=expected.shape[0], T=1, S=S, logits=logits)


SEEDS = 300  # the slow sweeps' seeds per backend


@pytest.mark.mlx
@pytest.mark.slow
def test_mlx_gather_over_random_steps(monkeypatch):
    """impl_mlx's gather (fused, in place) on SEEDS random decode steps (_random_step) against the float64 stages:
    none may fail, and every step gathers."""
    pytest.importorskip("mlx.core")  # the numpy env runs every file with no framework installed
    import mlx.core as mx

    import impl_mlx.latent as latent
    from impl_mlx.attention import multi_head_attention

    right, taken = latent.selection_heads, []
    monkeypatch.setattr(latent, "selection_heads", lambda topk: taken.append(1) or right(topk))

    for seed in range(SEEDS):
        step, mask, S = _random_step(seed)
        config, tensors, x, lat, rot, idx = step
        p = {k: mx.array(v) for k, v in tensors.items()}
        common = dict(topk_indices=idx, mask=mask, is_causal=True, causal_alignment="bottom_right")
        buffers = [mx.zeros((x.shape[0], 1, S + 2, a.shape[-1])) for a in (lat, rot)]
        buffers[0][:, :, :S - 1], buffers[1][:, :, :S - 1] = mx.array(lat), mx.array(rot)
        _judge_random(f"mlx fused seed {seed}", np.array(multi_head_attention(config, p, x, past_key=lat,
                                                                              past_value=rot, **common)),
                      step, mask, S)
        _judge_random(f"mlx in_place seed {seed}", np.array(multi_head_attention(
            config, p, x, past_key=buffers[0], past_value=buffers[1], cache_length=S - 1, **common)), step, mask, S)
    assert len(taken) == 2 * SEEDS, len(taken)  # every step gathered, on both paths


@pytest.mark.tf
@pytest.mark.slow
def test_tf_gather_over_random_steps(monkeypatch):
    """impl_tf's gather (fused path, TensorFlow eager) on SEEDS random decode steps against the float64 stages."""
    pytest.importorskip("tensorflow")  # the numpy env runs every file with no framework installed
    import impl_tf.attention as attention
    from impl_tf._keras import tf

    right, taken = attention.selection_rows, []
    monkeypatch.setattr(attention, "selection_rows", lambda topk: taken.append(1) or right(topk))
    for seed in range(SEEDS):
        step, mask, S = _random_step(seed)
        config, tensors, x, lat, rot, idx = step
        got = attention.multi_head_attention(config, {k: tf.constant(v) for k, v in tensors.items()}, tf.constant(x),
                                             past_key=tf.constant(lat), past_value=tf.constant(rot),
                                             topk_indices=tf.constant(idx),
                                             mask=None if mask is None else tf.constant(mask), is_causal=True,
                                             causal_alignment="bottom_right")
        _judge_random(f"tf fused seed {seed}", got, step, mask, S)
    assert len(taken) == SEEDS, len(taken)  # every step gathered
