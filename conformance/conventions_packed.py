"""Measured conventions of the native packed and sharded attention paths (the
third table of `mha check --conventions`).

Every cell comes from running the API in this process (or, for the sharded
paths, in a group of 2 gloo processes it starts) against the float64 NumPy
reference (impl_numpy) on the same inputs; an API that refuses a call is
"unsupported" with its own error message, measured by trying.

What is measured, per API:
  jax.nn.dot_product_attention  query_seq_lengths / key_value_seq_lengths
      with implementation='xla' (and None and 'cudnn' tried on the same
      call): on B = 2 rows of T = S = 6, lengths (4, 6) and (3, 0), with
      V = I so the output row is the weights row: the keys a valid query
      sees, what a padded query row (i >= its length) gets and what a row
      whose keys are all padding gets, each classified against candidates
      computed here; then whether per-document lengths (B, 2) can express
      a packed row, and the same row through `mask=` against the
      reference's segment_ids.
  torch flex_attention  a document mask: mask_mod doc[q] == doc[kv] from
      segment ids (create_block_mask), with and without & (q >= kv), against
      the reference's segment_ids (and is_causal); then cross-attention in
      which one document of the queries has no key, against the reference's
      three masked_row policies.
  torch context_parallel / DTensor heads  2 gloo processes, a 1-D CPU
      DeviceMesh: context_parallel(mesh, buffers=[q, k, v, positions]) around
      F.scaled_dot_product_attention, and q, k, v as DTensors sharded on the
      head axis (Shard(1)); each with torch's default CPU kernel, then under
      sdpa_kernel(MATH), causal and not, and with a segment-id attn_mask.
      Rank 0 gathers each rank's output rows and the positions its buffers
      hold (a sharded position buffer tells which rows a rank got); the
      rows are compared here with the whole-sequence reference and with a
      rank-local one (each rank's queries against its own keys only).

Shape letters as in impl_numpy: B batch, T query length, S key length,
H head dim, V value head dim.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import socket
import tempfile
import time
import warnings
from typing import Any

import numpy as np

from conformance import conventions_modern

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

KEYS = ("argument", "keys_visible", "empty_row", "packing")
COLUMNS = (("API", "api"), ("what it takes", "argument"), ("keys visible (measured)", "keys_visible"),
           ("row with no visible key", "empty_row"), ("packed documents (segment ids)", "packing"))
SETUP = (f"lengths: T=S={LEN_T}, query_seq_lengths {Q_LENS}, key_value_seq_lengths {KV_LENS}; documents "
         f"{list(DOCS)}; sharded: {WORLD} gloo processes on CPU, (1, {SHARD_N}, {SHARD_T}, {SHARD_H}); "
         "float32 against the float64 reference")
POLICY_LABELS = {"zero": "0", "uniform": "mean of V (uniform)", "nan": "NaN"}


# An API's probe: the modern table's record (name, framework, modules, install, measure).
PackedApi = conventions_modern.ModernApi


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


# -- jax.nn.dot_product_attention --------------------------------------------------------------

def _jax_lengths() -> dict:
    import jax
    import jax.numpy as jnp

    row: dict[str, Any] = {"evidence": {}}
    B_ = len(Q_LENS)
    eye = jnp.eye(LEN_T, dtype=jnp.float32)[None, :, None, :]  # (1, S, N, S): V = I

    def dpa(seed, batch, implementation="xla", **kw):
        q, k = _inputs(batch, LEN_T, LEN_T, LEN_T, seed=seed)  # H = S: the xla path wants V's width == K's
        qj, kj = (jnp.asarray(x[:, :, None, :]) for x in (q, k))  # (B, T, N, H)
        v = jnp.broadcast_to(eye, (batch, LEN_T, 1, LEN_T))
        return np.asarray(jax.nn.dot_product_attention(qj, kj, v, implementation=implementation, **kw))[:, :, 0]

    lengths = {"query_seq_lengths": jnp.asarray(Q_LENS, jnp.int32),
               "key_value_seq_lengths": jnp.asarray(KV_LENS, jnp.int32)}
    w = dpa(LEN_SEED, B_, **lengths)  # (B, T, S)
    others = []
    for implementation in (None, "cudnn"):
        try:
            same = _err(dpa(LEN_SEED, B_, implementation, **lengths), w)
            others.append(f"{implementation!r}: " + ("the same weights" if same == 0.0 else f"differs by {_fmt(same)}"))
        except Exception as err:  # noqa: BLE001 - the refusal is the measured fact
            others.append(f"{implementation!r}: {_short(err)}")
    row["argument"] = (f"query_seq_lengths {Q_LENS}, key_value_seq_lengths {KV_LENS} (B,), implementation='xla' "
                       f"({'; '.join(others)})")
    got = lengths_labels(w)
    row["evidence"].update(got.pop("evidence"))
    row.update(got)
    # packing: one length per row is one prefix; try per-document lengths, then the general mask
    ids = np.asarray(DOCS)
    per_doc = jnp.asarray([np.bincount(ids).tolist()], jnp.int32)  # (1, 3): each document's length
    try:
        packed = dpa(DOC_SEED, 1, query_seq_lengths=per_doc, key_value_seq_lengths=per_doc)
        label, row["evidence"]["packing_lengths"] = documents_label(packed[0], ids, ids, causal=False)
        lengths_part = f"per-document lengths (B, {per_doc.shape[1]}): {label}"
    except Exception as err:  # noqa: BLE001
        lengths_part = f"no: per-document lengths (B, {per_doc.shape[1]}) refused: {_short(err)}"
    same = jnp.asarray((ids[:, None] == ids[None, :])[None, None])  # (1, 1, T, S)
    label, row["evidence"]["packing_mask"] = documents_label(dpa(DOC_SEED, 1, mask=same)[0], ids, ids, causal=False)
    row["packing"] = f"{lengths_part}; mask= (B, 1, T, S) from the ids: {label}"
    return row


# -- torch flex_attention ----------------------------------------------------------------------

def _torch_flex_documents() -> dict:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def run(q, k, v, mask_mod):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            block = create_block_mask(mask_mod, 1, 1, q.shape[1], k.shape[1], device="cpu")
            out = flex_attention(*(torch.tensor(x[:, None]) for x in (q, k, v)), block_mask=block)  # (1, 1, T, V)
        return out[0, 0].numpy()  # (T, V)

    row: dict[str, Any] = {"argument": "block_mask=create_block_mask(mask_mod) with mask_mod doc[q] == doc[kv] "
                                       "(segment ids as a tensor)", "evidence": {}}
    docs = torch.tensor(DOCS)
    q, k = _inputs(1, len(DOCS), len(DOCS), len(DOCS), seed=DOC_SEED)
    v = np.eye(len(DOCS), dtype=np.float32)[None]  # V = I: the output is the weights
    w = run(q, k, v, lambda b, h, i, j: docs[i] == docs[j])
    row["packing"], row["evidence"]["packing"] = documents_label(w, DOCS, DOCS, causal=False)
    w = run(q, k, v, lambda b, h, i, j: (docs[i] == docs[j]) & (i >= j))
    label, row["evidence"]["causal_documents"] = documents_label(w, DOCS, DOCS, causal=True)
    row["keys_visible"] = f"mask_mod & (q >= kv): {label}"
    # a query document with no key (cross-attention): which masked-row policy
    qd, kd = torch.tensor(CROSS_Q_DOCS), torch.tensor(CROSS_K_DOCS)
    T_, S_ = len(CROSS_Q_DOCS), len(CROSS_K_DOCS)
    rng = np.random.default_rng(13)
    qc, kc, vc = (rng.standard_normal(s).astype(np.float32) for s in ((1, T_, 4), (1, S_, 4), (1, S_, 3)))
    out = run(qc, kc, vc, lambda b, h, i, j: qd[i] == kd[j])
    rows = np.flatnonzero(~np.isin(CROSS_Q_DOCS, CROSS_K_DOCS))
    label, row["evidence"]["empty_row"] = policy_label(out, qc, kc, vc, CROSS_Q_DOCS, CROSS_K_DOCS, rows)
    row["empty_row"] = f"query of a document with no key: {label}"
    return row


# -- torch context_parallel and DTensor heads, on a 2-process gloo group ----------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shard_inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(14)
    q, k, v = (rng.standard_normal((1, SHARD_N, SHARD_T, SHARD_H)).astype(np.float32) for _ in range(3))
    return {"q": q, "k": k, "v": v}  # (B, N, T, H) each


# The default CPU kernel without a mask: DTensor finds its sharding by running the kernel's decomposition
# through fake tensors for every placement of q, k, v (125 runs); the first such call took 69-140 s on the
# 2-core VM (profiled 2026-11-25, torch 2.13). Not part of the default run; measure(slow=True) runs them.
SLOW_PROBES = ("cp math=False causal=False", "heads math=False causal=False")
SKIPPED = "skipped (slow: DTensor searches its sharding through the kernel's decomposition; measure(slow=True))"


def _rank_probes(rank: int, world: int, inputs: dict, slow: bool = False) -> dict:
    """This rank's answers: probe name -> {"error"}, {"skipped"} or {"out", "rows"}."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh("cpu", (world,))
    q, k, v = (torch.tensor(inputs[n]) for n in ("q", "k", "v"))
    ids = torch.tensor(SHARD_DOCS)
    doc_mask = (ids[:, None] == ids[None, :])[None, None]  # (1, 1, T, S)
    answers: dict[str, dict] = {}

    def attempt(name, fn):
        if name in SLOW_PROBES and not slow:
            answers[name] = {"skipped": SKIPPED}
            return
        started = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                answers[name] = fn()
        except Exception as err:  # noqa: BLE001 - a refusal is the measured fact
            answers[name] = {"error": _short(err)}
        answers[name]["seconds"] = round(time.perf_counter() - started, 3)

    def cp(math: bool, causal: bool, mask: str | None):
        """mask: None, "whole" (the (T, S) mask as it is) or "buffer" (sharded by its rows with q, k, v)."""
        from torch.distributed.tensor.experimental import context_parallel

        qq, kk, vv, mm = q.clone(), k.clone(), v.clone(), doc_mask.clone()
        pos = torch.arange(SHARD_T, dtype=torch.float32)[None, None, :, None].contiguous()  # (1, 1, T, 1)
        buffers = [qq, kk, vv, pos] + ([mm] if mask == "buffer" else [])
        kernel = sdpa_kernel(SDPBackend.MATH) if math else _nothing()
        with kernel, context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * len(buffers)):
            out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, attn_mask=None if mask is None else mm)
            rows = pos[0, 0, :, 0].long().tolist()  # the positions this rank's shard holds
        out = out.full_tensor() if hasattr(out, "full_tensor") else out
        return {"out": out.detach().numpy(), "rows": rows}

    def heads(math: bool, causal: bool):
        from torch.distributed.tensor import Shard, distribute_tensor

        dq, dk, dv = (distribute_tensor(x, mesh, [Shard(1)]) for x in (q, k, v))
        with sdpa_kernel(SDPBackend.MATH) if math else _nothing():
            out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=causal)
        return {"out": out.full_tensor().detach().numpy(), "rows": list(range(SHARD_T)),
                "placements": str(tuple(out.placements))}

    for math in (False, True):
        for causal in (False, True):
            attempt(f"cp math={math} causal={causal}", lambda m=math, c=causal: cp(m, c, None))
            attempt(f"heads math={math} causal={causal}", lambda m=math, c=causal: heads(m, c))
    for math in (False, True):
        attempt(f"cp math={math} mask=whole", lambda m=math: cp(m, False, "whole"))
    attempt("cp math=True mask=buffer", lambda: cp(True, False, "buffer"))
    return answers


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _rank_main(rank: int, world: int, port: int, inputs: dict, path: str, slow: bool) -> None:
    import logging

    import torch
    import torch.distributed as dist

    logging.getLogger("torch").setLevel(logging.CRITICAL)  # a refused call logs its traceback; the answer says it

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)  # the processes share the host's cores
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        answers = _rank_probes(rank, world, inputs, slow)
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(answers, gathered, dst=0)
        if rank == 0:
            with open(path + ".partial", "wb") as f:
                pickle.dump(gathered, f)
            os.replace(path + ".partial", path)
    finally:
        dist.destroy_process_group()


def run_group(inputs: dict, slow: bool = False) -> list[dict]:
    """Start WORLD spawned processes on one gloo group; every rank's answers."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="mha-conventions-") as tmp:
        path = os.path.join(tmp, "answers.pkl")
        context = mp.start_processes(_rank_main, args=(WORLD, _free_port(), inputs, path, slow), nprocs=WORLD, join=False,
                                     start_method="spawn")
        deadline = time.monotonic() + GROUP_TIMEOUT_S
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:  # only the processes started here
                    process.kill()
                raise TimeoutError(f"the {WORLD}-process gloo group did not finish in {GROUP_TIMEOUT_S} s")
        with open(path, "rb") as f:
            return pickle.load(f)


def assemble(per_rank: list[dict], name: str) -> dict:
    """One probe's outcome over the ranks: the first refusal, or the output
    rows in position order (rows: the positions, each once)."""
    answers = [r[name] for r in per_rank]
    for a in answers:
        for why in ("error", "skipped"):
            if why in a:
                return {why: a[why]}
    if "placements" in answers[0]:  # DTensor: full_tensor() is the whole output on every rank
        return {"out": answers[0]["out"], "rows": answers[0]["rows"], "placements": answers[0]["placements"],
                "per_rank_rows": [a["rows"] for a in answers]}
    rows = [p for a in answers for p in a["rows"]]
    out = np.concatenate([a["out"] for a in answers], axis=2)  # (1, N, T, H) in the ranks' order
    order = np.argsort(rows)
    return {"out": out[:, :, order], "rows": sorted(rows), "per_rank_rows": [a["rows"] for a in answers]}


def _shard_reference(inputs, *, causal=False, segments=False, rows_of_rank=None) -> np.ndarray:
    """(1, N, T, H): the whole-sequence reference; with rows_of_rank, each
    rank's queries against only the keys of its own rows."""
    q, k, v = (inputs[n][0] for n in ("q", "k", "v"))  # (N, T, H): heads as the reference's batch
    ids = np.asarray(SHARD_DOCS) if segments else None
    if rows_of_rank is None:
        out, _ = reference(q, k, v, is_causal=causal, segment_ids=ids, key_segment_ids=ids)
        return out[None]
    out = np.zeros(q.shape, np.float64)
    for rows in rows_of_rank:
        rows = np.asarray(rows)
        mask = None
        if causal:  # the global causal rule among the rank's own rows
            mask = np.broadcast_to(rows[:, None] >= rows[None, :], (q.shape[0], len(rows), len(rows)))
        sub_ids = None if ids is None else ids[rows]
        part, _ = reference(q[:, rows], k[:, rows], v[:, rows], mask=mask, segment_ids=sub_ids, key_segment_ids=sub_ids)
        out[:, rows] = part
    return out[None]


def _columns_in_shard_order(inputs, key_order) -> np.ndarray:
    """(1, N, T, H): the segment mask's column c applied to the key at
    position key_order[c] (keys reordered by the sharding, the mask not)."""
    q, k, v = (inputs[n][0] for n in ("q", "k", "v"))
    ids = np.asarray(SHARD_DOCS)
    allowed = np.zeros((len(ids), len(ids)), bool)
    allowed[:, np.asarray(key_order)] = ids[:, None] == ids[None, :]
    out, _ = reference(q, k, v, mask=np.broadcast_to(allowed, (q.shape[0], *allowed.shape)))
    return out[None]


def sharded_cells(per_rank: list[dict], inputs: dict) -> dict:
    """The context_parallel and DTensor-heads rows from the ranks' answers."""
    def label(name, causal=False, segments=False):
        outcome = assemble(per_rank, name)
        if "error" in outcome or "skipped" in outcome:
            return sharded_label(outcome, None)
        whole = _shard_reference(inputs, causal=causal, segments=segments)
        if "placements" in outcome:
            return sharded_label(outcome, whole)
        local = _shard_reference(inputs, causal=causal, segments=segments, rows_of_rank=outcome["per_rank_rows"])
        extra = {}
        if segments:
            order = [p for rows in outcome["per_rank_rows"] for p in rows]
            extra["the mask's columns read in the shards' key order " + str(order)] = _columns_in_shard_order(inputs, order)
        return sharded_label(outcome, whole, local, extra)

    cp: dict[str, Any] = {"evidence": {}}
    heads: dict[str, Any] = {"evidence": {}}
    parts = {"cp": [], "heads": []}
    for math in (False, True):
        kernel = "sdpa_kernel(MATH)" if math else "default CPU kernel"
        for causal in (False, True):
            for kind in ("cp", "heads"):
                name = f"{kind} math={math} causal={causal}"
                text, ev = label(name, causal=causal)
                (cp if kind == "cp" else heads)["evidence"][name] = ev
                parts[kind].append(f"{kernel}, {'is_causal' if causal else 'no mask'}: {text}")
    holds = assemble(per_rank, "cp math=True causal=False")
    if "per_rank_rows" in holds:
        cp["evidence"]["positions_per_rank"] = holds["per_rank_rows"]
        parts["cp"].append("positions per rank " + "; ".join(
            f"{r}: {', '.join(map(str, rows))}" for r, rows in enumerate(holds["per_rank_rows"])))
    heads_placed = assemble(per_rank, "heads math=True causal=False")
    if "placements" in heads_placed:
        parts["heads"].append(f"output placements {heads_placed['placements']}")
    cp["argument"] = (f"context_parallel(mesh of {WORLD} gloo ranks, buffers=[q, k, v, positions], "
                      "buffer_seq_dims=2) around F.scaled_dot_product_attention")
    heads["argument"] = f"q, k, v as DTensors Shard(1) (heads) on a {WORLD}-rank gloo mesh, into F.scaled_dot_product_attention"
    cp["keys_visible"] = "; ".join(parts["cp"])
    heads["keys_visible"] = "; ".join(parts["heads"])
    masked = []
    for name, what in (("cp math=False mask=whole", "the whole (T, S) mask, default CPU kernel"),
                       ("cp math=True mask=whole", "the whole mask, sdpa_kernel(MATH)"),
                       ("cp math=True mask=buffer", "the mask sharded by rows with the buffers, sdpa_kernel(MATH)")):
        text, cp["evidence"][name] = label(name, segments=True)
        masked.append(f"{what}: {text}")
    cp["packing"] = "attn_mask from the segment ids: " + "; ".join(masked)
    cp["empty_row"] = NONE
    heads["packing"] = "- (heads split; documents are the caller's mask)"
    return {"cp": cp, "heads": heads}


@dataclasses.dataclass
class _GroupCache:
    """One group start serves both sharded rows (a start costs seconds)."""
    rows: dict | None = None
    slow: bool = False
    failed: Exception | None = None  # a group that failed once is not started again in the same run

    def get(self) -> dict:
        if self.failed is not None:
            raise self.failed
        if self.rows is None:
            inputs = shard_inputs()
            try:
                self.rows = sharded_cells(run_group(inputs, self.slow), inputs)
            except Exception as err:
                self.failed = err
                raise
        return self.rows


_GROUP = _GroupCache()


def _torch_context_parallel() -> dict:
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed")
    return dict(_GROUP.get()["cp"])


def _torch_dtensor_heads() -> dict:
    return dict(_GROUP.get()["heads"])


TORCH_EXTRA = "pip install -c constraints/cpu.txt '.[torch]'"
JAX_EXTRA = "pip install -c constraints/cpu.txt '.[jax]'"

APIS: tuple[PackedApi, ...] = (
    PackedApi("jax.nn.dot_product_attention (seq lengths)", "jax", ("jax",), JAX_EXTRA, _jax_lengths),
    PackedApi("torch flex_attention (document mask)", "torch", ("torch",), TORCH_EXTRA, _torch_flex_documents),
    PackedApi("torch context_parallel (experimental, CPU)", "torch", ("torch",), TORCH_EXTRA, _torch_context_parallel),
    PackedApi("torch DTensor heads Shard(1) (CPU)", "torch", ("torch",), TORCH_EXTRA, _torch_dtensor_heads),
)


def measure_row(api: PackedApi) -> dict:
    """One row; never raises: conventions_modern's rule with this table's keys and JSON-safe evidence."""
    return conventions_modern.measure_row(api, KEYS, _json_safe)


def _json_safe(x):
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (float, np.floating)):
        return float(x) if np.isfinite(x) else str(float(x))
    if isinstance(x, (int, np.integer)):
        return int(x)
    return x


def measure(apis: tuple[PackedApi, ...] | None = None, slow: bool = False) -> list[dict]:
    """Every API's row (default APIS); slow: run SLOW_PROBES too."""
    from conformance.backends import quiet_python_loggers

    _GROUP.rows, _GROUP.slow, _GROUP.failed = None, slow, None  # each run measures afresh
    rows = []
    for api in APIS if apis is None else apis:
        rows.append(measure_row(api))
        quiet_python_loggers()
    return rows


def cells(rows: list[dict]) -> list[list[str]]:
    return conventions_modern.cells(rows, COLUMNS)


notes = conventions_modern.notes  # the "not installed" notes, in the same words

def versions() -> dict[str, str]:
    return {}  # torch and jax are in the first table's versions
