"""Top-k in the tolerance policy: when two selections of keys (or blocks) agree.

A lightning indexer keeps the k best-scoring keys of each query. Two correct ports compute the index scores
with different roundings, so where two keys' scores are nearer than that rounding, either may land at the
k-th place: a port that keeps the other key of such a near-tie is right. The rule (docs/conformance.md "Top-k
selections" and docs/sparse-attention.md say it in prose):

    s_k      the k-th highest float64 reference score of the query (the lowest score the reference keeps)
    a_j      the score allowance of key j: rtol * m_j, m_j the size of what score j sums
             (impl_numpy.indexer's index_score_magnitudes: the same stages on |q|, |k|, |w|)
    rtol     SAFETY * u * sqrt(L), u the backend's unit round-off, L the score's chain of reductions
             (index_length); 16-bit: at least REFERENCE_FACTOR x the same-dtype reference's own score error
    agree    iff the two selections keep the same number of visible keys, and every key one keeps and the
             other drops has |s_j - s_k| <= a_j + a_k (both within the allowance of the k-th score)

Anything else fails, naming the query (batch, group, query index) and the keys with their scores. The order
of the slots is the contract's (highest score first, ties to the lower key) but is not judged: the attention
takes the selection as a set. A selected key the masks hide counts as padding (-1): transformers' ports fill
a query's spare slots with masked future keys, which the attention's own causal mask hides again; they are
padding in effect, and judged so. A key out of range, selected twice, or a +inf local block dropped fails.

Ties: the contract breaks exact ties by the lower key index. A port that breaks them otherwise (torch.topk's
order among equal values is unspecified; ReLU sets about one score in 2^heads to exactly 0 with independent
heads, so zeros tie often) keeps keys whose scores equal s_k: |s_j - s_k| = 0 <= the allowance, a pass, and
the output is then judged against the reference computed with the port's own selection.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .tolerance import REFERENCE_FACTOR, SAFETY, UNIT_ROUNDOFF


def index_length(config, max_position: int = 0) -> int:
    """L of an index score: the projection of its query source (the query latent's two reductions where the
    query comes from it), the key's projection (key_dim), the key norm's mean (J), the dot product (J), the
    sum over heads (I) and the head weights' projection (query_dim); a gated block pool its gates and pooling;
    RoPE adds theta_max^2 (the rounding of the angle, as the attention's policy: weights/rope.py frequencies,
    largest position)."""
    ix = config.indexer
    J, I = ix.head_dim, ix.heads
    length = config.key_dim + 2 * J + I
    length += (config.query_dim + 2 * config.latent.query_rank) if ix.query_source == "latent" else config.query_dim
    if ix.query_norm is not None:
        length += J
    if ix.head_weights:
        length += config.query_dim
    if ix.block_pool == "gated":  # the k-pool: each gate logit's projection (key_dim), the softmax over the
        # block's slots and the weighted sum of their keys (block_size each), as compressed_index_length's pool
        length += config.key_dim + 2 * ix.block_size
    if ix.rope is not None and max_position:
        from weights.rope import rope_tables

        inv_freq, _ = rope_tables(ix.rope, max_position)
        length += int(math.ceil((max_position * float(np.max(inv_freq))) ** 2))
    return length


def score_allowance(dtype: str, magnitudes, *, length: int, same_precision_error=None) -> np.ndarray:
    """Each score's absolute allowance: SAFETY * u * sqrt(length) * its magnitude; for 16-bit storage with the
    same-dtype reference's error known (per query row, broadcastable), at least REFERENCE_FACTOR times it."""
    rtol = SAFETY * UNIT_ROUNDOFF[dtype] * math.sqrt(max(length, 1))
    m = np.nan_to_num(np.asarray(magnitudes, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    allowance = rtol * m
    if same_precision_error is not None:
        allowance = np.maximum(allowance, REFERENCE_FACTOR * np.asarray(same_precision_error, dtype=np.float64))
    return allowance


@dataclasses.dataclass(frozen=True)
class SelectionComparison:
    ok: bool
    name: str
    margin: float  # worst |s_j - s_k| / (a_j + a_k) over the swapped keys; <= 1 passes (0: same sets)
    swaps: int  # keys kept by one and dropped by the other, over every query (each swap counts one)
    rows: int  # queries (and groups) compared
    problems: tuple[str, ...]  # one line per failing query (the first few)
    failing_rows: int = 0

    def describe(self) -> str:
        head = (f"{self.name}: {'ok' if self.ok else 'FAIL'}: {self.rows} queries, {self.swaps} admissible "
                f"swaps, margin {self.margin:.3g}")
        if self.ok:
            return head
        more = f" (and {self.failing_rows - len(self.problems)} more)" if self.failing_rows > len(self.problems) else ""
        return head + f"; {self.failing_rows} failing: " + "; ".join(self.problems) + more


def compare_selection(name: str, actual, expected, scores, allowance, *, shown: int = 3) -> SelectionComparison:
    """Judge a backend's selection `actual` against the reference's `expected` (both (..., T, k) int, -1
    padding; the same leading axes), with the float64 reference scores (..., T, n) (-inf where masked, +inf
    for a local block) and their allowance (same shape as scores)."""
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    s = np.asarray(scores, dtype=np.float64)
    a = np.broadcast_to(np.asarray(allowance, dtype=np.float64), s.shape)
    if actual.shape[:-1] != expected.shape[:-1] or expected.shape[:-1] != s.shape[:-1]:
        raise ValueError(f"{name}: selections {actual.shape} and {expected.shape} and scores {s.shape} do not "
                         "share their leading axes (..., T)")
    n = s.shape[-1]
    problems: list[str] = []
    failing = swaps = 0
    margin = 0.0
    for row in np.ndindex(*s.shape[:-1]):
        got, want, sc, al = actual[row], expected[row], s[row], a[row]
        where = f"query {list(row)}"
        bad = [int(j) for j in got if j >= n or j < -1]
        if bad:
            failing += 1
            problems.append(f"{where}: keys {bad} out of range [0, {n})")
            margin = math.inf
            continue
        picked = [int(j) for j in got if j >= 0 and sc[j] > -np.inf]  # a masked key is padding in effect
        if len(set(picked)) != len(picked):
            failing += 1
            problems.append(f"{where}: a key selected twice: {sorted(picked)}")
            margin = math.inf
            continue
        ref = {int(j) for j in want if j >= 0}
        mine = set(picked)
        if len(mine) != len(ref):
            failing += 1
            problems.append(f"{where}: {len(mine)} visible keys selected, the reference selects {len(ref)}")
            margin = math.inf
            continue
        added, dropped = sorted(mine - ref), sorted(ref - mine)
        if not added:
            continue
        kth = min(ref, key=lambda j: (sc[j], -j))
        sk, ak = sc[kth], al[kth]
        row_margin = 0.0
        for j in added + dropped:
            gap = abs(sc[j] - sk)
            allowed = al[j] + ak
            row_margin = max(row_margin, math.inf if not np.isfinite(gap) else
                             (gap / allowed if allowed > 0 else (math.inf if gap > 0 else 0.0)))
        swaps += len(added)
        margin = max(margin, row_margin)
        if row_margin > 1.0:
            failing += 1
            if len(problems) < shown:
                problems.append(f"{where}: selected {[(j, float(sc[j])) for j in added]} instead of "
                                f"{[(j, float(sc[j])) for j in dropped]} (key, float64 score); the k-th score "
                                f"{float(sk):.6g} (key {kth}), allowance {float(ak):.3g}, margin {row_margin:.3g}")
    rows = int(np.prod(s.shape[:-1]))
    return SelectionComparison(ok=failing == 0, name=name, margin=margin, swaps=swaps, rows=rows,
                               problems=tuple(problems[:shown]), failing_rows=failing)


def judge_indexer(config, tensors, inputs: dict, result: dict, *, dtype: str = "float32") -> list:
    """Judge one indexer call of a port: `result` holds its "topk_indices" (and, where the port returns them,
    "index_scores", (B, G, T, P+S)); `inputs` the call's query [, key, positions, key_positions,
    past_index_keys, mask, is_causal (default True: bottom-right causal ANDed with the mask; an attention
    call's (call_selection_inputs) is False, its causal mask in its own alignment being in mask)]. The float64
    reference (impl_numpy.indexer) gives the scores, their magnitudes and the selection, in the layer's scoring
    precision (config.indexer.scoring_precision, fp8_scale_format); a 16-bit dtype, or fp8 scoring in a dtype
    other than float64, adds the same-dtype reference's score error. -> [SelectionComparison, and for the scores a
    tolerance.Comparison]: each .ok."""
    from impl_numpy.indexer import block_scores, lightning_indexer

    from .tolerance import Tolerance, compare

    call = {name: inputs[name] for name in ("key", "positions", "key_positions", "past_index_keys", "mask",
                                            "is_causal") if name in inputs}
    # the layer's scoring precision (config.indexer.scoring_precision): the reference scores as the port must
    call |= {"precision": config.indexer.scoring_precision, "fp8_scale_format": config.indexer.fp8_scale_format}
    query = np.asarray(inputs["query"], dtype=np.float64)
    ref = lightning_indexer(config, tensors, query, dtype="float64", return_scores=True, **call)
    s, m = ref["index_scores"], ref["index_score_magnitudes"]
    P = 0 if "past_index_keys" not in call else np.asarray(call["past_index_keys"]).shape[1]
    length = index_length(config, P + query.shape[1])
    same = None
    if dtype in ("float16", "bfloat16") or (dtype != "float64" and call["precision"] is not None):
        # fp8 in a float32 port: an element its dtype's round-off puts across an e4m3 rounding boundary moves by
        # an e4m3 step (2^-3 relative), far above float32's: where the same-dtype reference crosses one, its
        # error says so (a crossing only the port makes is not foreseen: docs/sparse-attention.md)
        low = lightning_indexer(config, tensors, query, dtype=dtype, return_scores=True, **call)["index_scores"]
        finite = np.isfinite(s)
        same = np.abs(np.subtract(low.astype(np.float64), s, where=finite, out=np.zeros(s.shape)))
        same = same.max(axis=-1, keepdims=True)
    allowance = score_allowance(dtype, m, length=length, same_precision_error=same)
    out = []
    if "index_scores" in result:
        got = np.asarray(result["index_scores"], dtype=np.float64)
        finite = np.isfinite(s)
        if not np.array_equal(np.isfinite(got), finite):
            out.append(SelectionComparison(ok=False, name="index_scores", margin=math.inf, swaps=0, rows=0,
                                           problems=("the masked (-inf) scores are not where the reference's are",),
                                           failing_rows=1))
        else:
            floor = np.where(finite, allowance, 0.0)
            tol = Tolerance(rtol=0.0, atol=float(np.finfo(np.float64).tiny), floor=floor,
                            reason=f"{dtype} index scores: 8*u*sqrt(L) x each score's magnitude, L={length}")
            out.append(compare("index_scores", np.where(finite, got, 0.0), np.where(finite, s, 0.0), tol))
    ix = config.indexer
    if ix.block_size is None:
        expected = ref["topk_indices"] if ix.per_kv_head else ref["topk_indices"][:, None]
        actual = np.asarray(result["topk_indices"])
        actual = actual if ix.per_kv_head else actual[:, None]
        out.append(compare_selection("topk_indices", actual, expected, s, allowance))
    elif ix.block_pool == "gated":  # the scores are per pooled block already, and so is their allowance
        n = P + np.shape(call.get("key", query))[1]
        keys = np.asarray(result["topk_indices"])
        keys = keys if ix.per_kv_head else keys[:, None]
        expected = ref["topk_indices"] if ix.per_kv_head else ref["topk_indices"][:, None]
        blocks, open_check = _gated_blocks(ix, keys, expected, s, n)
        if open_check is not None:
            out.append(open_check)
        out.append(compare_selection("topk_blocks", blocks, ref["topk_blocks"], s, np.where(np.isfinite(s), allowance,
                                                                                            0.0)))
    else:
        bs = ref["block_scores"]
        ballow = block_scores(np.where(np.isfinite(s), allowance, -np.inf), ix.block_size)
        out.append(compare_selection("topk_blocks", result["topk_blocks"], ref["topk_blocks"], bs,
                                     np.where(np.isfinite(ballow), ballow, 0.0)))
    return out


def _gated_blocks(ix, keys, expected, scores, n: int):
    """A k-pool selection of keys (B, G, T, k) read back as blocks (B, G, T, min(topk, nb)), the query's open
    block (its own, not a candidate: its reference score -inf) set apart; with open_block its keys must be
    exactly the reference's (they are no choice: every visible key of that block). -> (blocks, the open
    blocks' SelectionComparison or None)."""
    bs, T, nb = ix.block_size, keys.shape[-2], scores.shape[-1]
    own = (np.arange(T) + n - T) // bs
    width = min(ix.topk, nb)
    blocks = np.full((*keys.shape[:-1], width), -1, dtype=np.int64)
    problems, failing = [], 0
    for row in np.ndindex(*keys.shape[:-1]):
        o = own[row[-1]]
        got = keys[row][keys[row] >= 0]
        is_open = o >= nb or not np.isfinite(scores[row][o])
        rest = got[got // bs != o] if is_open else got
        chosen = np.unique(rest // bs)[:width]
        blocks[row][:chosen.size] = chosen
        if ix.open_block and is_open:
            want = expected[row][(expected[row] >= 0) & (expected[row] // bs == o)]
            if set(got[got // bs == o].tolist()) != set(want.tolist()):
                failing += 1
                if len(problems) < 3:
                    problems.append(f"query {list(row)}: open block {o} keys {sorted(got[got // bs == o].tolist())}, "
                                    f"the reference's {sorted(want.tolist())}")
    if not ix.open_block:
        return blocks, None
    rows = int(np.prod(keys.shape[:-1]))
    return blocks, SelectionComparison(ok=failing == 0, name="open block", margin=0.0 if not failing else math.inf,
                                       swaps=0, rows=rows, problems=tuple(problems), failing_rows=failing)


def call_selection_inputs(config, tensors, inputs: dict, options: dict) -> dict:
    """judge_indexer's inputs for one attention call (case inputs, call options): the query, key, positions,
    past_index_keys the call gives, in float64, and the index mask the call's other masks make
    (impl_numpy.attention.index_mask: causal in the call's alignment, the mask, windows, segments, any head)."""
    from impl_numpy.adapter import _kwargs
    from impl_numpy.attention import index_mask, prepare
    from weights.dtypes import is_float

    def f64(x):
        x = np.asarray(x)
        return x.astype(np.float64) if is_float(x.dtype) else x

    import dataclasses

    arrays = {name: f64(x) for name, x in inputs.items() if x is not None}
    # the call without its indexer (whose selection prepare would join to the mask): the other masks alone
    plain = dataclasses.replace(config, indexer=None)
    t64 = {name: np.asarray(t).astype(np.float64) for name, t in tensors.items() if not name.startswith("indexer.")}
    kwargs = _kwargs({n: x for n, x in arrays.items() if n != "past_index_keys"}, options | {"dtype": "float64"})
    call = prepare(plain, t64, arrays["query"], arrays.get("key"), arrays.get("value"), return_weights=False,
                   **kwargs)
    given = {"query": arrays["query"], "key": arrays["key"] if "key" in arrays else arrays["query"]}
    given.update({name: arrays[name] for name in ("positions", "key_positions", "past_index_keys") if name in arrays})
    mask = index_mask(plain, call, kwargs["is_causal"], kwargs["causal_alignment"])
    if mask is not None:
        given["mask"] = np.ascontiguousarray(mask)
    # causal is in that mask, in the call's alignment, as the call's own indexer sees it (run_indexer): the
    # indexer's default (bottom-right causal on top) would hide keys a call that is not causal, or is causal
    # top-left with T != P+S, shows; the 10,000-seed sweep found it (random_981136, docs/conformance.md)
    given["is_causal"] = False
    return given


def blocks_of(selection, block_size: int, width: int) -> np.ndarray:
    """The blocks a selection of keys (..., k) covers, (..., width) ascending, -1 after: a block selection
    expanded to its keys (the attention's topk_indices) read back as blocks, for compare_selection."""
    sel = np.asarray(selection)
    out = np.full((*sel.shape[:-1], width), -1, dtype=np.int64)
    for row in np.ndindex(*sel.shape[:-1]):
        blocks = np.unique(sel[row][sel[row] >= 0] // block_size)[:width]
        out[row][:blocks.size] = blocks
    return out


def judge_call_selection(config, tensors, inputs: dict, options: dict, selection, *, dtype: str):
    """A port's selection from one attention call (config.indexer; the attention's `selection` result, in the
    topk_indices format) judged by judge_indexer against the float64 reference's. -> SelectionComparison."""
    given = call_selection_inputs(config, tensors, inputs, options)
    ix = config.indexer
    result = {"topk_indices": np.asarray(selection)}
    if ix.block_size is not None and ix.block_pool != "gated":  # the expanded keys, read back as blocks (gated:
        # judge_indexer reads them, its query's open block set apart)
        n = np.asarray(given.get("past_index_keys", np.zeros((1, 0)))).shape[1] + np.shape(given["key"])[1]
        width = min(ix.topk, -(-n // ix.block_size))
        keys = result["topk_indices"] if ix.per_kv_head else result["topk_indices"][:, None]
        result["topk_blocks"] = blocks_of(keys, ix.block_size, width)
    tensors64 = {name: np.asarray(t).astype(np.float64) for name, t in tensors.items()}
    verdicts = judge_indexer(config, tensors64, given, result, dtype=dtype)
    failed = [v for v in verdicts if not v.ok]  # a k-pool's open block is judged apart from its top-k blocks
    return failed[0] if failed else verdicts[-1]


def compressed_index_length(config, max_position: int = 0) -> int:
    """L of a DeepSeek V4 csa index score (config.compressed): the query latent's projection (D) and RMS norm (Qr),
    the index query's projection (Qr); the index entry's projection (D), its gate's softmax and pool over the
    slots (m, 2m with overlap) and RMS norm (J); the dot product (J), the sum over index heads (I) and the head
    weights' projection (D); RoPE (on both) adds theta_max^2, as index_length."""
    c = config.compressed
    D, J = config.query_dim, c.index_head_dim
    length = (D + 2 * c.query_rank) + (D + 2 * c.ratio * c.slots + J) + J + c.index_heads + D
    if max_position:
        from weights.rope import rope_tables

        inv_freq, _ = rope_tables(config.rope, max_position)
        length += int(math.ceil((max_position * float(np.max(inv_freq))) ** 2))
    return length


def compressed_index_scores(config, tensors, inputs: dict, *, dtype: str = "float64"):
    """A V4 csa call's index scores as impl_numpy.compressed computes them in `dtype` (float64: the spec's),
    (B, T, E) with -inf where an entry is not visible, its selection (B, T, k) and, in float64, each score's
    magnitude: the same sum on |w|, |q|, |K| (sum_i |w_i| |q_i|.|K_e| / sqrt(J)). inputs: the case's (query,
    positions, past_<name>)."""
    from impl_numpy.compressed import compressed_attention
    from weights import dtype_from_name
    from weights.dtypes import is_float

    dt = dtype_from_name(dtype)

    def cast(a):
        a = np.asarray(a)
        return a.astype(dt) if is_float(a.dtype) else a

    past = {name.removeprefix("past_"): cast(a) for name, a in inputs.items() if name.startswith("past_")} or None
    trace: list = []
    _, selection, present = compressed_attention(
        config, {name: cast(t) for name, t in tensors.items()}, cast(inputs["query"]), inputs["positions"], past,
        return_selection=True, return_cache=True, trace=trace)
    stages = {e.stage: np.asarray(e.value, dtype=np.float64) for e in trace}
    scores = stages["indexer.score"]
    q, w = np.abs(stages["indexer.query"]), np.abs(stages["indexer.weights"])  # (B, I, T, J), (B, T, I)
    keys = np.abs(np.asarray(present["index_entries"], dtype=np.float64))  # (B, E, J): the cache's and this call's
    magnitudes = np.einsum("bitj,bej,bti->bte", q, keys, w) * config.compressed.index_head_dim ** -0.5
    return scores, np.asarray(selection), magnitudes


def judge_compressed_selection(config, tensors, inputs: dict, selection, *, dtype: str = "float32"
                               ) -> SelectionComparison:
    """A port's csa selection (config.compressed kind csa; (B, T, k) entry indices, -1 padding) judged by the top-k
    rule against the float64 reference's (impl_numpy.compressed.select: the top index_topk visible entries, ties
    to the earlier entry): the same entries per query, or entries swapped within the score allowance of the k-th
    score (compare_selection; an invisible entry counts as padding). The allowance: score_allowance with L
    compressed_index_length; 16-bit: at least REFERENCE_FACTOR x the same-dtype reference's own score error per
    query. tensors, inputs: as the port received them (rounded to `dtype`), evaluated in float64."""
    scores, expected, magnitudes = compressed_index_scores(config, tensors, inputs)
    same = None
    if dtype in ("float16", "bfloat16"):
        low = compressed_index_scores(config, tensors, inputs, dtype=dtype)[0]
        finite = np.isfinite(scores)
        same = np.abs(np.subtract(low, scores, where=finite, out=np.zeros(scores.shape)))
        same = same.max(axis=-1, keepdims=True)
    positions = np.asarray(inputs["positions"])
    length = compressed_index_length(config, int(positions.max()) + 1 if positions.size else 0)
    allowance = score_allowance(dtype, magnitudes, length=length, same_precision_error=same)
    return compare_selection("selection", np.asarray(selection), expected, scores, allowance)
