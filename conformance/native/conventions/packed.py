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

import warnings
from typing import Any

import numpy as np

from conformance.native.conventions import modern, selection
from conformance.native.conventions.packed_labels import (
    CROSS_K_DOCS,
    CROSS_Q_DOCS,
    DOC_SEED,
    DOCS,
    KV_LENS,
    LEN_SEED,
    LEN_T,
    Q_LENS,
    SHARD_H,
    SHARD_N,
    SHARD_T,
    WORLD,
    _err,
    _fmt,
    _inputs,
    _short,
    documents_label,
    lengths_labels,
    policy_label,
)
from conformance.native.conventions.packed_sharded import _GROUP, _torch_context_parallel, _torch_dtensor_heads

KEYS = ("argument", "keys_visible", "empty_row", "packing")
COLUMNS = (("API", "api"), ("what it takes", "argument"), ("keys visible (measured)", "keys_visible"),
           ("row with no visible key", "empty_row"),
           ("packed documents (segment ids); a top-k selection's key blocks", "packing"))
SETUP = (f"lengths: T=S={LEN_T}, query_seq_lengths {Q_LENS}, key_value_seq_lengths {KV_LENS}; documents "
         f"{list(DOCS)}; sharded: {WORLD} gloo processes on CPU, (1, {SHARD_N}, {SHARD_T}, {SHARD_H}); "
         "float32 against the float64 reference")


# An API's probe: the modern table's record (name, framework, modules, install, measure).
PackedApi = modern.ModernApi



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


TORCH_EXTRA = "pip install -c constraints/cpu.txt '.[torch]'"
JAX_EXTRA = "pip install -c constraints/cpu.txt '.[jax]'"
TF_EXTRA = "pip install -c constraints/cpu.txt '.[tf]'"

APIS: tuple[PackedApi, ...] = (
    PackedApi("jax.nn.dot_product_attention (seq lengths)", "jax", ("jax",), JAX_EXTRA, _jax_lengths),
    PackedApi("torch flex_attention (document mask)", "torch", ("torch",), TORCH_EXTRA, _torch_flex_documents),
    PackedApi("torch context_parallel (experimental, CPU)", "torch", ("torch",), TORCH_EXTRA, _torch_context_parallel),
    PackedApi("torch DTensor heads Shard(1) (CPU)", "torch", ("torch",), TORCH_EXTRA, _torch_dtensor_heads),
    # a top-k selection (topk_indices): conventions/selection.py says what each row measures
    PackedApi("torch flex_attention (top-k block mask)", "torch", ("torch",), TORCH_EXTRA, selection.torch_flex),
    PackedApi("jax.nn.dot_product_attention (top-k mask)", "jax", ("jax",), JAX_EXTRA, selection.jax_dense),
    PackedApi("keras.ops.dot_product_attention (top-k mask)", "keras", ("keras",), TF_EXTRA, selection.keras_dense),
)


def measure_row(api: PackedApi) -> dict:
    """One row; never raises: conventions_modern's rule with this table's keys and JSON-safe evidence."""
    return modern.measure_row(api, KEYS, _json_safe)


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
    from conformance.logs import quiet_python_loggers

    _GROUP.rows, _GROUP.slow, _GROUP.failed = None, slow, None  # each run measures afresh
    rows = []
    for api in APIS if apis is None else apis:
        rows.append(measure_row(api))
        quiet_python_loggers()
    return rows


def cells(rows: list[dict]) -> list[list[str]]:
    return modern.cells(rows, COLUMNS)


notes = modern.notes  # the "not installed" notes, in the same words

def versions() -> dict[str, str]:
    return {}  # torch and jax are in the first table's versions
