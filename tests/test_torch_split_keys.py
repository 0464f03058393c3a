"""impl_torch's one-query absorbed latent call with the key read as its two parts (issue 39 item 5): a decode step
over at least SPLIT_MIN_KEYS keys (the whole cache, or the gathered selection) runs its core as the stages, the
logits of [latent | rotary] taken part by part in blocks of KEY_BLOCK keys (attention.absorbed_logits), instead of
joining the whole cache and handing SDPA one shared head of width C + R.

Each call is held to impl_numpy's float64 stages (every key, the unselected masked): dense and over a selection
(tests/test_sparse_gather.py's step and VARIANTS: a -1 pad, a key named twice, a mask per head, fully masked rows
under "zero", "uniform" and "nan"), on the SDPA path and on the in-place cache, with the thresholds lowered
(SPLIT_MIN_KEYS 1, KEY_BLOCK 16: 81 keys in six blocks, the last a partial one) and, once, at the real ones (P
4200). Each test first shows that absorbed_logits ran (so a pass is the split path's). The porting bugs a split
makes, the rotary part dropped and a block's rotary keys read from the first block, are planted and must fail.
Under autograd (float64) the split core's gradients are held to SDPA's over the joined key. The attend's two forms
(absorbed_attend: latent^T w^T from ATTEND_COLUMNS_MIN_THREADS threads on, else F.attend's) are each held, whatever
the machine's thread count."""

from __future__ import annotations

import numpy as np
import pytest
from test_sparse_gather import VARIANTS, _expected, _step, _variant

from conformance.suite.tolerance import assert_close

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")  # the numpy env runs every file with no framework installed


def _spy(monkeypatch, mutant=None, low=True):
    """Record absorbed_logits' calls (and run `mutant` instead where given); low: the thresholds lowered."""
    from impl_torch import attention

    if low:
        monkeypatch.setattr(attention, "SPLIT_MIN_KEYS", 1)
        monkeypatch.setattr(attention, "KEY_BLOCK", 16)
    right, ran = attention.absorbed_logits, []

    def spy(q, latent, rotary, scale):
        ran.append(latent.shape[2])
        return right(q, latent, rotary, scale) if mutant is None else mutant(right, q, latent, rotary, scale)

    monkeypatch.setattr(attention, "absorbed_logits", spy)
    return ran


def _paths(config, tensors, x, lat, rot, idx, mask=None):
    """{path: output} of impl_torch: SDPA over the given cache, and the in-place cache (its capacity 4 over)."""
    from impl_torch.attention import multi_head_attention

    P = lat.shape[2]
    t = {k: torch.from_numpy(v) for k, v in tensors.items()}
    common = dict(topk_indices=None if idx is None else torch.from_numpy(idx), is_causal=True,
                  causal_alignment="bottom_right", mask=None if mask is None else torch.from_numpy(mask))
    buffers = [torch.zeros((lat.shape[0], 1, P + 4, a.shape[-1])) for a in (lat, rot)]
    buffers[0][:, :, :P], buffers[1][:, :, :P] = torch.from_numpy(lat), torch.from_numpy(rot)
    with torch.no_grad():
        return {"sdpa": multi_head_attention(config, t, torch.from_numpy(x), past_key=torch.from_numpy(lat),
                                             past_value=torch.from_numpy(rot), use_sdpa=True, **common),
                "in_place": multi_head_attention(config, t, torch.from_numpy(x), past_key=buffers[0],
                                                 past_value=buffers[1], cache_length=P, **common)}


def _judge(name, got, expected, logits, config):
    assert_close(name, np.asarray(got), expected, config=config, dtype="float32", quantity="output", B=2, T=1,
                 S=logits.shape[-1], logits=logits)


def _check(step, mask=None):
    config, tensors, x, lat, rot, idx = step
    expected, logits = _expected(config, tensors, x, lat, rot, idx, mask=mask)
    for path, got in _paths(config, tensors, x, lat, rot, idx, mask).items():
        _judge(f"torch {path}", got.numpy(), expected, logits, config)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_split_keys_over_a_selection_match_the_float64_stages(monkeypatch, variant):
    ran = _spy(monkeypatch)
    step, mask = _variant(variant)
    _check(step, mask)
    assert len(ran) == 2, ran  # both paths split (gathered where masked_row is "zero", the whole cache otherwise)


# absorbed_attend's two forms, whatever the machine's thread count: latent^T w^T (1: from one thread on) and F.attend's
# (10**6: never)
ATTEND_FORMS = pytest.mark.parametrize("columns_from", [1, 10**6], ids=["columns", "rows"])


@ATTEND_FORMS
def test_split_keys_over_the_whole_cache_match_the_float64_stages(monkeypatch, columns_from):
    from impl_torch import attention

    monkeypatch.setattr(attention, "ATTEND_COLUMNS_MIN_THREADS", columns_from)
    ran = _spy(monkeypatch)
    config, tensors, x, lat, rot, _ = _step()
    _check((config, tensors, x, lat, rot, None))
    assert ran == [lat.shape[2] + 1] * 2, ran  # every key, in six blocks of 16 (the last 1)


def test_split_keys_at_the_real_threshold(monkeypatch):
    """P 4200 (past SPLIT_MIN_KEYS 1024, in blocks of KEY_BLOCK): dense, the thresholds as shipped."""
    from impl_torch import attention

    ran = _spy(monkeypatch, low=False)
    config, tensors, x, _, _, _ = _step()
    rng = np.random.default_rng(11)
    lat, rot = (rng.standard_normal((2, 1, 4200, n)).astype(np.float32) for n in (16, 4))
    _check((config, tensors, x, lat, rot, None))
    assert ran == [4201] * 2 and attention.KEY_BLOCK < 4201, ran


def _rotary_dropped(right, q, latent, rotary, scale):
    """A split that forgets the rotary part of the absorbed key (q's last R features)."""
    return right(q, latent, torch.zeros_like(rotary), scale)


def _rotary_of_the_first_block(right, q, latent, rotary, scale):
    """A split whose blocks all read the first block's rotary keys (the block's start applied to the latent alone)."""
    from impl_torch import attention

    block, S = attention.KEY_BLOCK, rotary.shape[2]
    return right(q, latent, rotary[:, :, :block].repeat(1, 1, -(-S // block), 1)[:, :, :S], scale)


@pytest.mark.parametrize("mutant", [_rotary_dropped, _rotary_of_the_first_block], ids=lambda m: m.__name__)
def test_split_key_bugs_are_caught(monkeypatch, mutant):
    _spy(monkeypatch, mutant=mutant)
    config, tensors, x, lat, rot, _ = _step()
    expected, logits = _expected(config, tensors, x, lat, rot, None)
    for path, got in _paths(config, tensors, x, lat, rot, None).items():
        with pytest.raises(AssertionError, match="FAIL"):
            _judge(f"torch {path} ({mutant.__name__})", got.numpy(), expected, logits, config)


def test_an_attend_left_untransposed_is_caught(monkeypatch):
    """The porting bug of latent^T w^T: its (B, C, N T) result reshaped to (B, N, T, C) without turning it back (the
    shape fits, the values are scrambled)."""
    from impl_torch import attention

    def untransposed(w, latent):
        B, N, T, S = w.shape
        return torch.matmul(latent[:, 0].transpose(1, 2), w.reshape(B, N * T, S).transpose(1, 2)).reshape(B, N, T, -1)

    ran = _spy(monkeypatch)
    monkeypatch.setattr(attention, "absorbed_attend", untransposed)
    config, tensors, x, lat, rot, _ = _step()
    expected, logits = _expected(config, tensors, x, lat, rot, None)
    for path, got in _paths(config, tensors, x, lat, rot, None).items():
        with pytest.raises(AssertionError, match="FAIL"):
            _judge(f"torch {path} (attend untransposed)", got.numpy(), expected, logits, config)
    assert len(ran) == 2, ran


@ATTEND_FORMS
def test_split_keys_gradients_match_sdpas(monkeypatch, columns_from):
    """The split core under autograd (the SDPA path over a given cache, float64): every gradient (the query input,
    both cache parts, every weight) equal to SDPA's over the joined key, an independent kernel (rtol 1e-10: the
    same float64 sums in other orders)."""
    from impl_torch import attention

    monkeypatch.setattr(attention, "ATTEND_COLUMNS_MIN_THREADS", columns_from)
    config, tensors, x, lat, rot, idx = _step()

    def grads():
        t = {k: torch.from_numpy(v.astype(np.float64)).requires_grad_() for k, v in tensors.items()}
        inputs = [torch.from_numpy(a.astype(np.float64)).requires_grad_() for a in (x, lat, rot)]
        out = attention.multi_head_attention(config, t, inputs[0], past_key=inputs[1], past_value=inputs[2],
                                             topk_indices=torch.from_numpy(idx), is_causal=True,
                                             causal_alignment="bottom_right", use_sdpa=True)
        out.square().sum().backward()
        return [a.grad for a in inputs] + [t[k].grad for k in sorted(t)]

    monkeypatch.setattr(attention, "SPLIT_MIN_KEYS", 10**9)
    expected = grads()
    ran = _spy(monkeypatch)
    got = grads()
    assert ran == [9], ran  # the union of both rows' selected keys gathered, then split
    assert len(got) == len(expected) and all(g is not None for g in got)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-10, atol=1e-12)
