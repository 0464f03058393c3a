"""Measured: the native APIs that can take a top-k selection (topk_indices, issue 39's sparse attention),
rows of the packed-paths table of `mha check --conventions` (conformance/native/conventions/packed.py).

No native attention API takes topk_indices itself. What each can take, measured here:
  torch flex_attention  a block mask from the indices: mask_mod(b, h, q, kv) = selected[b, q, kv], the
      (B, T, S) bool table impl_torch's selection_mask makes from topk_indices, through create_block_mask;
      the output against impl_numpy's float64 call given the same topk_indices, and the block mask's
      kv_num_blocks (the key blocks flex computes per query block) counted against all of them: the
      unselected blocks are skipped (never computed) only where the selection leaves whole blocks out
  jax.nn.dot_product_attention, keras.ops.dot_product_attention  a dense (B, N|1, T, S) bool mask=
      from the indices: every block computed (a dense mask skips nothing), the output against the same
      reference

Setup: B 1, one head, T 4 queries, S 1024 keys (8 blocks of flex's 128), H 16, k 24 keys per query drawn
from 3 of the 8 blocks (the same 3 for every query: they share one query block), one slot -1 (pads).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

T, S, H, K = 4, 1024, 16, 24
BLOCK = 128  # flex_attention's default block (create_block_mask's BLOCK_SIZE)
KEPT_BLOCKS = (1, 4, 6)
TOL = 1e-4  # float32 API against the float64 reference; a wrong selection misses by > 1e-2


def inputs() -> dict:
    """q (1, T, H), k (1, S, H), v (1, S, H), topk_indices (1, T, K) int64 (-1 in each row's last slot)."""
    rng = np.random.default_rng(39)
    q, k, v = (rng.standard_normal((1, n, H)).astype(np.float32) for n in (T, S, S))
    pool = np.concatenate([np.arange(b * BLOCK, (b + 1) * BLOCK) for b in KEPT_BLOCKS])
    idx = np.stack([np.sort(rng.choice(pool, K - 1, replace=False)) for _ in range(T)])
    idx = np.concatenate([idx, -np.ones((T, 1), np.int64)], axis=1)[None]  # (1, T, K)
    return {"q": q, "k": k, "v": v, "topk": idx}


def selected(topk: np.ndarray) -> np.ndarray:
    """(1, T, S) bool: the keys each query selected (-1 selects nothing)."""
    out = np.zeros((1, T, S + 1), bool)
    np.put_along_axis(out, np.where(topk < 0, S, topk), True, axis=-1)
    return out[..., :S]


def reference(x: dict) -> np.ndarray:
    """impl_numpy's float64 attention core given topk_indices (one head, no projections): (1, T, H)."""
    import weights
    from impl_numpy.attention import multi_head_attention

    config = weights.AttentionConfig(num_heads=1, query_dim=H, head_dim=H, use_query_bias=False,
                                     use_key_bias=False, use_value_bias=False, use_output_bias=False)
    eye = np.eye(H)
    tensors = {"query.kernel": eye.reshape(H, 1, H), "key.kernel": eye.reshape(H, 1, H),
               "value.kernel": eye.reshape(H, 1, H), "output.kernel": eye.reshape(1, H, H)}
    return np.asarray(multi_head_attention(config, tensors, x["q"], x["k"], x["v"], topk_indices=x["topk"],
                                           is_causal=False, dtype="float64"))


def _agree(out, expected) -> str:
    err = float(np.abs(np.asarray(out, np.float64) - expected).max())
    return (f"the selected keys alone: matches the reference (max err {err:.1e})" if err <= TOL
            else f"differs from the reference by {err:.3g}")


def torch_flex() -> dict:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    x = inputs()
    table = torch.from_numpy(selected(x["topk"]))  # (1, T, S)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        block = create_block_mask(lambda b, h, i, j: table[b, i, j], 1, 1, T, S, device="cpu")
        out = flex_attention(*(torch.from_numpy(x[n][:, None]) for n in ("q", "k", "v")), block_mask=block)
    kept = int(block.kv_num_blocks.sum()) + (0 if block.full_kv_num_blocks is None
                                             else int(block.full_kv_num_blocks.sum()))
    total = -(-S // BLOCK)
    row: dict[str, Any] = {"argument": "block_mask=create_block_mask(mask_mod), mask_mod(b, h, q, kv) = "
                                       "selected[b, q, kv] (the bool table of topk_indices)"}
    row["keys_visible"] = _agree(out[:, 0].numpy(), reference(x))
    row["packing"] = (f"selection's blocks: computes {kept} of {total} key blocks of {BLOCK} (kv_num_blocks), "
                      f"skips the {total - kept} with no selected key")
    row["evidence"] = {"kv_num_blocks": kept, "blocks": total, "kept_blocks": list(KEPT_BLOCKS)}
    return row


def jax_dense() -> dict:
    import jax
    import jax.numpy as jnp

    x = inputs()
    mask = jnp.asarray(selected(x["topk"])[:, None])  # (1, 1, T, S)
    out = jax.nn.dot_product_attention(*(jnp.asarray(x[n][:, :, None]) for n in ("q", "k", "v")), mask=mask)
    return {"argument": "mask= (B, 1, T, S) bool from topk_indices", "keys_visible": _agree(out[:, :, 0],
                                                                                             reference(x)),
            "packing": f"selection's blocks: a dense mask, all {S} keys computed (nothing skipped)", "evidence": {}}


def keras_dense() -> dict:
    import keras

    x = inputs()
    mask = selected(x["topk"])[:, None]  # (1, 1, T, S)
    out = keras.ops.dot_product_attention(*(x[n][:, :, None] for n in ("q", "k", "v")), mask=mask)
    return {"argument": f"mask= (B, 1, T, S) bool from topk_indices (keras on {keras.backend.backend()})",
            "keys_visible": _agree(keras.ops.convert_to_numpy(out)[:, :, 0], reference(x)),
            "packing": f"selection's blocks: a dense mask, all {S} keys computed (nothing skipped)", "evidence": {}}
