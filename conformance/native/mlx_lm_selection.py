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


# -- a tie swapped: the output judged on mlx-lm's own selection -----------------------------------------

def _as_keys(model_type: str, selection, rows: tuple[int, int], groups: int) -> np.ndarray:
    """One call's selection as kept key indices (B, G, rows, w), -1 padding: DSA's indices as they are (G 1),
    M3's kept-key mask per kv group; None (no top-k run: every key fits) as every key up to the call's last."""
    start, stop = rows
    if selection is None:
        keys = np.arange(stop)
        return np.broadcast_to(keys, (1, 1, stop - start, stop)).copy()
    if model_type != "minimax_m3_vl_text":
        return np.asarray(selection, np.int64)
    keep = np.asarray(selection)[:, ::selection.shape[1] // groups]
    out = -np.ones(keep.shape, np.int64)
    for index in np.ndindex(*keep.shape[:-1]):
        ids = np.flatnonzero(keep[index])
        out[index][:len(ids)] = ids
    return out


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    """Calls' selections joined along the query rows, padded with -1 to the widest; batch and group axes
    broadcast (a None call's (1, 1, ...))."""
    B = max(p.shape[0] for p in parts)
    G = max(p.shape[1] for p in parts)
    width = max(p.shape[-1] for p in parts)
    out = []
    for p in parts:
        p = np.broadcast_to(p, (B, G) + p.shape[2:])
        pad = -np.ones((B, G, p.shape[2], width), np.int64)
        pad[..., :p.shape[-1]] = p
        out.append(pad)
    return np.concatenate(out, axis=2)


def own_references(model_type: str, config, tensors: dict, x: np.ndarray, calls: list, *, T: int, P: int) -> dict:
    """The float64 reference of the block on mlx-lm's own selections (the policy's rule where the selections
    agree only up to admissible swaps): calls, the selecting module's records in order (the prefill call,
    the P-token prefix, then one per decode step). -> {"prefill": reference on the prefill call's selection,
    "decode": on the prefix's and each step's, "prefill_keys": (B, G, T, w) the prefill call's kept keys}."""
    from conformance.native.mlx_lm_harness import reference

    groups = config.num_kv_heads if model_type == "minimax_m3_vl_text" else 1
    plain = config.replace(indexer=None)
    weights = {k: v for k, v in tensors.items() if not k.startswith("indexer.")}
    prefill = _as_keys(model_type, calls[0], (0, T), groups)
    decode = _joined([_as_keys(model_type, calls[1], (0, P), groups)] +
                     [_as_keys(model_type, c, (t, t + 1), groups) for t, c in zip(range(P, T), calls[2:])])
    B = x.shape[0]
    prefill = _joined([prefill]) if prefill.shape[0] == B else np.broadcast_to(prefill, (B,) + prefill.shape[1:])

    def squeeze(s):
        return s[:, 0] if s.shape[1] == 1 else s
    return {"prefill": reference(plain, weights, x, squeeze(prefill)),
            "decode": reference(plain, weights, x, squeeze(np.broadcast_to(decode, (B,) + decode.shape[1:]))),
            "prefill_keys": prefill}


def swapped_queries(keys: np.ndarray, spec_keys: np.ndarray) -> np.ndarray:
    """(B, T) bool: the queries whose kept visible key set differs between mlx-lm's (B, G, T, w) and the
    spec's (B, G, T, k) (keys past the query's own position are padding in effect)."""
    B, G, T = spec_keys.shape[:3]
    out = np.zeros((B, T), bool)
    for b, g, t in np.ndindex(B, G, T):
        mine = {int(j) for j in keys[b, min(g, keys.shape[1] - 1), t] if 0 <= j <= t}
        theirs = {int(j) for j in spec_keys[b, g, t] if 0 <= j <= t}
        out[b, t] |= mine != theirs
    return out
