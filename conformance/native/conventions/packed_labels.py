"""The packed and sharded table's inputs, its float64 reference and its labels
(pure: the tests feed them fake results); the table is packed.py."""

from __future__ import annotations

from typing import Any

import numpy as np

NONE = "-"
TOL = 1e-4  # float32 API against the float64 reference; a wrong visibility misses by > 1e-2
SEEN = 1e-6  # a weight above this counts as a visible key

LEN_T = 6  # T = S of the jax lengths probe
# The probes and the labels draw the same q, k from these seeds (H = S, V = I: the output row is the weights row)
LEN_SEED, DOC_SEED = 11, 12
Q_LENS, KV_LENS = (4, 6), (3, 0)  # batch 0: queries 4, 5 and keys 3..5 are padding; batch 1: every key is padding
DOCS = (0, 0, 0, 1, 1, 2)  # segment ids of one packed row: three documents
CROSS_Q_DOCS, CROSS_K_DOCS = (0, 0, 1, 1, 2, 2), (0, 0, 1, 1, 1)  # document 2 of the queries has no key
WORLD = 2  # gloo processes of the sharded probes
SHARD_T, SHARD_N, SHARD_H = 8, 2, 4  # their q, k, v: (1, N, T, H)
SHARD_DOCS = (0, 0, 0, 1, 1, 1, 1, 2)
GROUP_TIMEOUT_S = 120  # the whole 2-process start, probes and gather; a hung group is killed after this
POLICY_LABELS = {"zero": "0", "uniform": "mean of V (uniform)", "nan": "NaN"}


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text}"[:200]


def _err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return float("inf")
    both_nan = np.isnan(a) & np.isnan(b)
    if (np.isnan(a) ^ np.isnan(b)).any():
        return float("inf")
    d = np.abs(np.where(both_nan, 0.0, a - b))
    return float(d.max()) if d.size else 0.0


def _fmt(x: float) -> str:
    return f"{x:.1e}"


# -- the reference ---------------------------------------------------------------------------

def reference(q, k, v, *, mask=None, segment_ids=None, key_segment_ids=None, is_causal=False,
              masked_row="zero") -> tuple[np.ndarray, np.ndarray]:
    """impl_numpy's forward with one head and identity projections, float64:
    q (B, T, H), k (B, S, H), v (B, S, V), mask (B, T, S) bool (True =
    attend) -> (output (B, T, V), weights (B, T, S))."""
    from impl_numpy import multi_head_attention
    from weights import AttentionConfig

    H_, V_ = q.shape[-1], v.shape[-1]
    cfg = AttentionConfig(num_heads=1, query_dim=H_, head_dim=H_, value_dim=V_, value_head_dim=V_, out_dim=V_,
                          use_query_bias=False, use_key_bias=False, use_value_bias=False, use_output_bias=False,
                          masked_row=masked_row)
    tensors = {"query.kernel": np.eye(H_).reshape(H_, 1, H_), "key.kernel": np.eye(H_).reshape(H_, 1, H_),
               "value.kernel": np.eye(V_).reshape(V_, 1, V_), "output.kernel": np.eye(V_).reshape(1, V_, V_)}
    mask4 = None if mask is None else np.asarray(mask, bool)[:, None]  # (B, 1, T, S)
    out, w = multi_head_attention(cfg, tensors, *(np.asarray(x, np.float64) for x in (q, k, v)), mask=mask4,
                                  is_causal=is_causal, segment_ids=segment_ids, key_segment_ids=key_segment_ids,
                                  return_weights=True)
    return out, w[:, 0]  # (B, T, V), (B, T, S)


def _inputs(B_: int, T_: int, S_: int, H_: int, seed: int):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B_, T_, H_)).astype(np.float32),  # (B, T, H)
            rng.standard_normal((B_, S_, H_)).astype(np.float32))  # (B, S, H)


def prefix_mask(q_lens, kv_lens, T_: int, S_: int) -> np.ndarray:
    """(B, T, S) bool: query i < q_lens[b] may see key j < kv_lens[b]."""
    i, j = np.arange(T_)[None, :, None], np.arange(S_)[None, None, :]
    return (i < np.asarray(q_lens)[:, None, None]) & (j < np.asarray(kv_lens)[:, None, None])


# -- labels (pure: the tests feed them fake results) -------------------------------------------

def classify(rows: np.ndarray, candidates: dict[str, np.ndarray]) -> tuple[str, dict]:
    """Which candidate `rows` (any shape) matches within TOL; 'other (...)' if none."""
    errs = {name: _err(rows, c) for name, c in candidates.items()}
    best = min(errs, key=errs.get)
    evidence = {f"max_err_if {name}": (e if np.isfinite(e) else str(e)) for name, e in errs.items()}
    if errs[best] > TOL:
        flat = np.asarray(rows, np.float64).ravel()[:4]
        return f"other ({np.round(flat, 3).tolist()}...)", evidence
    return best, evidence


def lengths_labels(w: np.ndarray, q_lens=Q_LENS, kv_lens=KV_LENS) -> dict[str, Any]:
    """w (B, T, S): jax's output with V = I under the lengths. The keys a valid
    query row sees, a padded query row's row, an all-padding row's row."""
    B_, T_, S_ = w.shape
    q_lens, kv_lens = np.asarray(q_lens), np.asarray(kv_lens)
    allowed = prefix_mask(q_lens, kv_lens, T_, S_)
    valid = (np.arange(T_)[None] < q_lens[:, None]) & (kv_lens[:, None] > 0)  # (B, T): rows with keys to see
    padded = (np.arange(T_)[None] >= q_lens[:, None]) & (kv_lens[:, None] > 0)  # (B, T): a padded query row
    empty = (np.arange(T_)[None] < q_lens[:, None]) & (kv_lens[:, None] == 0)  # (B, T): every key is padding
    q, k = _inputs(B_, T_, S_, S_, seed=LEN_SEED)
    _, ref_w = reference(q, k, np.broadcast_to(np.eye(S_), (B_, S_, S_)), mask=allowed)
    _, all_w = reference(q, k, np.broadcast_to(np.eye(S_), (B_, S_, S_)))  # the lengths ignored
    suffix = allowed[:, :, ::-1]  # keys counted from the end: what a left-padded batch would mean
    _, suffix_w = reference(q, k, np.broadcast_to(np.eye(S_), (B_, S_, S_)), mask=suffix)
    seen = np.asarray(w) > SEEN
    visible, ev_visible = classify(seen[valid], {
        "keys j < key_value_seq_lengths[b] (a prefix)": allowed[valid],
        "every key (lengths ignored)": np.ones_like(seen[valid]),
        "keys j >= S - key_value_seq_lengths[b] (a suffix)": suffix[valid]})
    err = _err(np.asarray(w)[valid], ref_w[valid])
    ev_visible["max_err_vs_reference_prefix_mask"] = err
    if visible.startswith("keys j < key"):
        visible += f", for queries i < query_seq_lengths[b] (err {_fmt(err)})"
    out = {"keys_visible": visible, "evidence": {"keys_visible": ev_visible, "weights": np.asarray(w).tolist()}}
    uniform_all = np.full(S_, 1.0 / S_)
    labels = []
    if padded.any():
        rows = np.asarray(w)[padded]
        b_of = np.nonzero(padded)[0]
        prefix_uniform = np.stack([np.where(np.arange(S_) < kv_lens[b], 1.0 / max(kv_lens[b], 1), 0.0)
                                   for b in b_of])
        as_valid = np.stack([_row_as_valid(q, k, b, i, kv_lens[b]) for b, i in zip(*np.nonzero(padded))])
        label, ev = classify(rows, {"0": np.zeros_like(rows), "mean of V (all S keys)": np.broadcast_to(uniform_all, rows.shape),
                                    "mean of its valid keys' V": prefix_uniform,
                                    "attended like a valid row": as_valid,
                                    "NaN": np.full_like(rows, np.nan)})
        labels.append(f"padded query i >= query_seq_lengths[b]: {label}")
        out["evidence"]["padded_query_row"] = ev
    if empty.any():
        rows = np.asarray(w)[empty]
        label, ev = classify(rows, {"0": np.zeros_like(rows),
                                    "mean of V over all S keys (padding included)": np.broadcast_to(uniform_all, rows.shape),
                                    "NaN": np.full_like(rows, np.nan)})
        labels.append(f"key_value_seq_lengths[b] = 0: {label}")
        out["evidence"]["all_keys_padding_row"] = ev
    out["empty_row"] = "; ".join(labels) or NONE
    return out


def _row_as_valid(q, k, b, i, kv_len) -> np.ndarray:
    """The weights row query i of batch b would get if it were not padding."""
    S_ = k.shape[1]
    mask = (np.arange(S_) < kv_len)[None, None, :]  # (1, 1, S)
    _, w = reference(q[b:b + 1, i:i + 1], k[b:b + 1], np.eye(S_)[None], mask=mask)
    return w[0, 0]


def documents_label(w: np.ndarray, q_ids, k_ids, *, causal: bool) -> tuple[str, dict]:
    """w (T, S): an API's output with V = I under a document mask; whether
    documents see each other, against the reference's segment_ids."""
    T_, S_ = w.shape
    q, k = _inputs(1, T_, S_, S_, seed=DOC_SEED)
    v = np.eye(S_)[None]
    _, ref_w = reference(q, k, v, segment_ids=np.asarray(q_ids), key_segment_ids=np.asarray(k_ids), is_causal=causal)
    same = np.asarray(q_ids)[:, None] == np.asarray(k_ids)[None, :]
    tril = np.arange(T_)[:, None] >= np.arange(S_)[None, :]
    seen = np.asarray(w) > SEEN
    label, ev = classify(seen, {
        ("same document, j <= i" if causal else "same document only"): same & tril if causal else same,
        "every key (documents see each other)" if not causal else "j <= i (documents see each other)":
            np.ones_like(seen) if not causal else tril})
    err = _err(w, ref_w[0])
    ev["max_err_vs_reference_segment_ids"] = err
    if label.startswith("same document"):
        label += f" (err {_fmt(err)})"
    return label, ev


def policy_label(out: np.ndarray, q, k, v, q_ids, k_ids, rows) -> tuple[str, dict]:
    """out (T, V) of a cross-attention whose query `rows` see no key: which
    masked_row policy of the reference it matches."""
    candidates = {}
    for policy, label in POLICY_LABELS.items():
        ref, _ = reference(q, k, v, segment_ids=np.asarray(q_ids), key_segment_ids=np.asarray(k_ids), masked_row=policy)
        candidates[label] = ref[0]
    got, ev = classify(np.asarray(out)[rows], {name: c[rows] for name, c in candidates.items()})
    rest = np.setdiff1d(np.arange(out.shape[0]), rows)
    ev["max_err_other_rows"] = _err(np.asarray(out)[rest], candidates[POLICY_LABELS["zero"]][rest])
    return got, ev


def sharded_label(outcome: dict, reference_rows: np.ndarray, local_rows: np.ndarray | None = None,
                  extra: dict[str, np.ndarray] | None = None) -> tuple[str, dict]:
    """outcome: {"error": str} or {"out": (T_rank..., ...) rows gathered over
    the ranks in position order of `rows`}; reference_rows: the
    whole-sequence reference at those rows; local_rows: each rank's queries
    against its own keys only; extra: more named candidates. 'unsupported:
    ...' for a refusal."""
    if "skipped" in outcome:
        return outcome["skipped"], {"skipped": True}
    if "error" in outcome:
        return f"unsupported: {outcome['error']}", {"error": outcome["error"]}
    candidates = {"matches the whole-sequence reference": reference_rows}
    if local_rows is not None:
        candidates["each rank sees only its own keys"] = local_rows
    candidates.update(extra or {})
    label, ev = classify(outcome["out"], candidates)
    err = min(v for v in ev.values() if isinstance(v, float))
    if label.startswith("other"):
        return f"runs, matches no candidate (closest err {_fmt(err)}): wrong output", ev
    return label + f" (err {_fmt(err)})", ev


