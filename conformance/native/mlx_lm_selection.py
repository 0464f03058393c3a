"""mlx-lm's lightning-indexer selection, captured and judged against the spec's (the mlx-lm ports table's
"indexer's selection" column).

mlx-lm's DSA models (deepseek_v32.py, and glm_moe_dsa.py, which is the same Model) run the indexer as a
module, Indexer.__call__, returning the top-k key indices (B, 1, T, k) or None where every key fits the
budget; MiniMax M3 (minimax_m3_vl.py) runs it inside its attention, _block_mask, returning the attention's
boolean mask (B, N, T, S) with only the kept blocks' keys set. `capturing` records both while mlx-lm's model
runs; `judge` compares the prefill call's selection with the float64 reference's (impl_numpy.indexer) under
the tolerance policy's top-k rule (conformance/suite/selection.py: a key swapped across the k-th score
passes only where the two scores are within their allowances; exact ties pass, margin 0).
"""

from __future__ import annotations

import contextlib

import numpy as np

# model type -> (mlx-lm module, class, method): where mlx-lm's selection comes out
HOOKS = {"deepseek_v32": ("mlx_lm.models.deepseek_v32", "Indexer", "__call__"),
         "glm_moe_dsa": ("mlx_lm.models.deepseek_v32", "Indexer", "__call__"),
         "minimax_m3_vl_text": ("mlx_lm.models.minimax_m3_vl", "Attention", "_block_mask")}


@contextlib.contextmanager
def capturing(model_type: str):
    """[(id of the mlx-lm module that selected, its selection as NumPy or None)] in call order, recorded
    while the context is open (the class's method patched, restored on exit). None: mlx-lm ran no top-k
    (every key or block fits the budget)."""
    import importlib

    import mlx.core as mx

    module, cls, method = HOOKS[model_type]
    klass = getattr(importlib.import_module(module), cls)
    original = getattr(klass, method)
    records: list[tuple[int, np.ndarray | None]] = []

    def patched(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if method == "_block_mask" and (not isinstance(out, mx.array) or out is args[1]):
            records.append((id(self), None))  # the mask handed in, unchanged: no block dropped
        else:
            records.append((id(self), None if out is None else np.array(out)))
        return out

    setattr(klass, method, patched)
    try:
        yield records
    finally:
        setattr(klass, method, original)


def selector_ids(model, model_type: str, layers) -> dict[int, int]:
    """{id of the module that selects for block `layer`: layer} of mlx-lm's loaded model."""
    from conformance.native.mlx_lm_harness import _mlx_layers

    blocks = _mlx_layers(model)
    out = {}
    for layer in layers:
        attention = blocks[layer]["self_attn"]
        target = attention.get("indexer") if model_type != "minimax_m3_vl_text" else attention
        if target is not None and (model_type != "minimax_m3_vl_text" or attention.is_sparse_attn):
            out[id(target)] = layer
    return out


def _blocks_of_mask(keep: np.ndarray, block_size: int, width: int, heads_per_group: int) -> np.ndarray:
    """(B, N, T, S) bool kept keys -> (B, K, T, width) kept block indices (ascending, -1 padding): one
    selection per kv group (the group's first query head), a block kept where any of its keys is."""
    keep = keep[:, ::heads_per_group]
    B, K, T, S = keep.shape
    nb = -(-S // block_size)
    padded = np.zeros((B, K, T, nb * block_size), bool)
    padded[..., :S] = keep
    kept = padded.reshape(B, K, T, nb, block_size).any(-1)
    out = -np.ones((B, K, T, width), np.int64)
    for index in np.ndindex(B, K, T):
        ids = np.flatnonzero(kept[index])[:width]
        out[index][:len(ids)] = ids
    return out


def judge(model_type: str, config, tensors: dict, x: np.ndarray, selection: np.ndarray | None, *, name: str):
    """conformance.suite.selection.compare_selection of mlx-lm's prefill selection against the reference's
    on x (B, T, D), or None where mlx-lm made none (every key fits the budget)."""
    from conformance.suite.selection import compare_selection, index_length, score_allowance
    from impl_numpy.indexer import lightning_indexer

    if selection is None:
        return None
    wide = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
    ours = lightning_indexer(config, wide, np.asarray(x, np.float64), positions=np.arange(x.shape[1]),
                             is_causal=True, return_scores=True)
    allowance = score_allowance("float32", ours["index_score_magnitudes"], length=index_length(config, x.shape[1]))
    if model_type == "minimax_m3_vl_text":
        ix = config.indexer
        want = ours["topk_blocks"]
        got = _blocks_of_mask(selection, ix.block_size, want.shape[-1], selection.shape[1] // want.shape[1])
        return compare_selection(name, got, want, ours["index_scores"], allowance)
    want = ours["topk_indices"][:, None]  # (B, 1, T, k): one selection for every head
    return compare_selection(name, selection, want, ours["index_scores"], allowance)
