"""The measurement harness of the conventions table: the shapes, the NumPy
reference with identity projections, the Runner/Api wrappers and what is
measured of each API (mask polarity, the fully masked row, causal alignment).
The package docstring (conformance/native/conventions/__init__.py) says what
each measurement means."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

B, T, S, N, H = 2, 4, 5, 2, 4
D = N * H
CAUSAL_SHAPES = ((2, 4), (4, 2))  # (T, S) pairs for the causal test
EMPTY_ROW = (0, 1)  # (b, t): the query row whose keys are all masked
TOL = 1e-4  # float32 API vs float64 reference; a wrong convention misses by > 1e-2
MATMUL_SHAPE = (256, 1024, 256)  # (M, K, N) of the precision probe
FLOAT32_REL_ERR_MAX = 1e-5  # above this a float32 matmul was computed with fewer mantissa bits

POLICY_LABELS = {"zero": "0", "uniform": "mean of V (uniform)", "nan": "NaN"}
# A fully masked row can also come out as if it had no mask at all: attention over every key. No
# masked_row policy asks for that, but the cuDNN kernels answer it (measured on an H200: docs/gpu.md).
ROW_LABELS = {**POLICY_LABELS, "ignored": "every key (the row's mask ignored)"}
NOT_INSTALLED = "not installed"


class NotExpressible(Exception):
    """The API has no way to express what the measurement asks for."""


# -- inputs and the reference ----------------------------------------------------

def _inputs(T_: int, S_: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T_, D)).astype(np.float32)  # (B, T, D)
    k = rng.standard_normal((B, S_, D)).astype(np.float32)  # (B, S, D)
    v = rng.standard_normal((B, S_, D)).astype(np.float32)  # (B, S, D)
    return q, k, v


def full_pattern(T_: int = T, S_: int = S) -> np.ndarray:
    """(B, T, S) bool; every row holds both values, so neither the mask nor its
    complement empties a row (S >= 3)."""
    b, t, s = np.ogrid[:B, :T_, :S_]
    return (b + 2 * t + s) % 3 != 0


def key_pattern(S_: int = S) -> np.ndarray:
    """(B, S) bool, both values in every batch."""
    b, s = np.ogrid[:B, :S_]
    return (b + s) % 3 != 0


def _identity_tensors(dtype=np.float64) -> dict[str, np.ndarray]:
    eye = np.eye(D, dtype=dtype)
    return {
        "query.kernel": eye.reshape(D, N, H), "key.kernel": eye.reshape(D, N, H),
        "value.kernel": eye.reshape(D, N, H), "output.kernel": eye.reshape(N, H, D),
    }


def _config(masked_row: str = "zero"):
    from weights import AttentionConfig

    return AttentionConfig(num_heads=N, query_dim=D, head_dim=H, use_query_bias=False, use_key_bias=False,
                           use_value_bias=False, use_output_bias=False, masked_row=masked_row)


def reference(q, k, v, *, allowed=None, is_causal=False, alignment="top_left", masked_row="zero", dtype=np.float64):
    """impl_numpy's forward with identity projections: (output (B, T, D), weights (B, N, T, S))."""
    from impl_numpy import multi_head_attention

    mask4 = None if allowed is None else np.asarray(allowed, dtype=bool)[:, None]  # (B, 1, T, S)
    cast = [np.asarray(x, dtype=dtype) for x in (q, k, v)]
    return multi_head_attention(_config(masked_row), _identity_tensors(dtype), *cast, mask=mask4, is_causal=is_causal,
                                causal_alignment=alignment, return_weights=True)


def _max_err(a, b) -> float:
    """Max abs difference; NaN anywhere (in either) counts as infinitely far."""
    d = np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))
    if d.size == 0:
        return 0.0
    return float("inf") if np.isnan(d).any() else float(d.max())


def _num(x: float) -> float | str:
    """JSON-safe number: non-finite values become strings."""
    x = float(x)
    return x if np.isfinite(x) else str(x)


def _short(err: BaseException) -> str:
    """The exception's type and first sentence."""
    text = f"{type(err).__name__}: {err}".strip().splitlines()[0]
    text = text.split(". ")[0].rstrip(".")
    return text if len(text) <= 160 else text[:157] + "..."


# -- the APIs ----------------------------------------------------------------------

@dataclasses.dataclass
class Runner:
    """A native API wrapped to take (B, T, D) float32 q, k, v and native masks.

    run(q, k, v, masks, causal) -> (output (B, T, D), weights (B, N, T, S) or None).
    masks maps an argument name of `mask_args` to a native bool mask: (B, T, S)
    for kind "full", (B, S) for kind "key". The first argument is the one the
    fully-masked-row test uses.
    """

    run: Callable[..., tuple[np.ndarray, np.ndarray | None]]
    mask_args: dict[str, str]
    returns_weights: bool
    self_attention_only: bool = False  # q, k, v must be one tensor (so T == S)
    extra: Callable[[], dict] | None = None  # API-specific extra measurements (notes, evidence)
    tolerance: float = TOL  # a half-precision kernel's rows are judged with its own (conventions_kernels.py)


@dataclasses.dataclass
class Api:
    name: str
    framework: str  # the framework key of versions / matmul precision
    modules: tuple[str, ...]  # importable modules it needs; missing -> "not installed"
    install: str  # the extra that installs it
    build: Callable[[], Runner]



def _split(x: np.ndarray) -> np.ndarray:
    Bx, L, _ = x.shape
    return x.reshape(Bx, L, N, H)  # (B, L, N, H)


def _merge(x: np.ndarray) -> np.ndarray:
    Bx, L = x.shape[:2]
    return x.reshape(Bx, L, N * H)  # (B, L, D)



# -- the measurements ------------------------------------------------------------------

def _polarity(runner: Runner, arg: str, kind: str, q, k, v) -> tuple[str, dict]:
    if kind == "full":
        pattern = full_pattern(q.shape[1], k.shape[1])  # (B, T, S)
        as_allowed = lambda m: m  # noqa: E731
    else:
        pattern = key_pattern(k.shape[1])  # (B, S)
        as_allowed = lambda m: np.broadcast_to(m[:, None, :], (B, q.shape[1], k.shape[1]))  # noqa: E731
    out, _ = runner.run(q, k, v, masks={arg: pattern}, want_weights=False)
    errs = {
        "attend": _max_err(out, reference(q, k, v, allowed=as_allowed(pattern))[0]),
        "masked": _max_err(out, reference(q, k, v, allowed=as_allowed(~pattern))[0]),
        "ignored": _max_err(out, reference(q, k, v)[0]),
    }
    return _pick(errs, runner.tolerance), {f"max_err_if_true_{name}": _num(e) for name, e in errs.items()}


def _pick(errs: dict[str, float], tol: float = TOL) -> str:
    """The one candidate within tol; "other" if none, "ambiguous: a / b" if several."""
    hits = [name for name, err in errs.items() if err <= tol]
    if not hits:
        return "other"
    return hits[0] if len(hits) == 1 else "ambiguous: " + " / ".join(hits)


def _classify_row(row: np.ndarray, candidates: dict[str, np.ndarray], tol: float = TOL) -> tuple[str, float | str]:
    """row vs the reference's masked_row policies: (label, max error of the match)."""
    row = np.asarray(row, dtype=np.float64)
    if np.isnan(row).all():
        return POLICY_LABELS["nan"], 0.0
    if np.isnan(row).any():
        return f"partly NaN ({int(np.isnan(row).sum())} of {row.size})", "nan"
    errs = {policy: _max_err(row, ref) for policy, ref in candidates.items() if policy != "nan"}
    best = min(errs, key=errs.get)
    if errs[best] <= tol:
        return ROW_LABELS[best], _num(errs[best])
    values = " ".join(f"{x:.3g}" for x in row.reshape(-1)[:4])
    return f"other ({values} ...)", _num(errs[best])


def _classify_weights(row: np.ndarray, S_: int, tol: float = TOL) -> tuple[str, float | str]:
    row = np.asarray(row, dtype=np.float64)  # (N, S)
    if np.isnan(row).all():
        return "NaN", 0.0
    if np.isnan(row).any():
        return f"partly NaN ({int(np.isnan(row).sum())} of {row.size})", "nan"
    for label, target in (("0", 0.0), ("uniform (1/S)", 1.0 / S_)):
        err = _max_err(row, np.full_like(row, target))
        if err <= tol:
            return label, _num(err)
    return "other (" + " ".join(f"{x:.3g}" for x in row.reshape(-1)[:4]) + " ...)", "n/a"


def _fully_masked(runner: Runner, arg: str, kind: str, polarity: str, q, k, v) -> dict:
    b0, t0 = EMPTY_ROW
    T_, S_ = q.shape[1], k.shape[1]
    if kind == "full":
        allowed = full_pattern(T_, S_)
        allowed[b0, t0, :] = False
        empty = np.zeros((B, T_), bool)
        empty[b0, t0] = True
        native = allowed
        allowed_full = allowed
    else:
        allowed = key_pattern(S_)
        allowed[b0, :] = False  # every key of batch b0 is padding: all its rows are empty
        empty = np.zeros((B, T_), bool)
        empty[b0, :] = True
        native = allowed
        allowed_full = np.broadcast_to(allowed[:, None, :], (B, T_, S_))
    if polarity == "masked":
        native = ~native
    out, w = runner.run(q, k, v, masks={arg: native})
    refs = {p: reference(q, k, v, allowed=allowed_full, masked_row=p) for p in POLICY_LABELS}
    candidates = {p: r[0][b0, t0] for p, r in refs.items()}
    candidates["ignored"] = reference(q, k, v)[0][b0, t0]  # the same row with no mask anywhere
    label, err = _classify_row(out[b0, t0], candidates, runner.tolerance)
    result = {"output": label, "evidence": {"row_max_err": err,
                                            "other_rows_max_err": _num(_max_err(out[~empty], refs["zero"][0][~empty]))}}
    if w is None or not runner.returns_weights:
        result["weights"] = "n/a: returns no weights"
    else:
        wlabel, werr = _classify_weights(w[b0, :, t0], S_, runner.tolerance)
        result["weights"] = wlabel
        result["evidence"]["weights_row_max_err"] = werr
        keep = ~empty[:, None, :].repeat(N, axis=1)  # (B, N, T)
        result["evidence"]["other_weights_max_err"] = _num(_max_err(w[keep], refs["zero"][1][keep]))
    return result


def _causal_label(out, q, k, v, tol: float = TOL) -> tuple[str, dict]:
    from impl_numpy.masks import causal_mask

    T_, S_ = q.shape[1], k.shape[1]
    errs = {}
    for alignment in ("top_left", "bottom_right"):
        # rows this alignment leaves without a key (bottom_right when T > S) are the
        # fully-masked-row question, measured separately: compare the others
        rows = causal_mask(T_, S_, alignment).any(-1)  # (T,)
        ref = reference(q, k, v, is_causal=True, alignment=alignment)[0]
        errs[alignment] = _max_err(out[:, rows], ref[:, rows])
    errs["not causal"] = _max_err(out, reference(q, k, v)[0])
    return _pick(errs, tol), {f"max_err_if_{a.replace(' ', '_')}": _num(e) for a, e in errs.items()}


def _causal(runner: Runner, T_: int, S_: int) -> tuple[str, dict]:
    if runner.self_attention_only and T_ != S_:
        return "n/a: self-attention only (T == S)", {}
    q, k, v = _inputs(T_, S_, seed=7)
    try:
        out, _ = runner.run(q, k, v, causal=True, want_weights=False)
    except NotExpressible as why:
        return f"n/a: {why}", {}
    except Exception as err:  # noqa: BLE001 - the API refusing is the measured fact
        return f"n/a: {_short(err)}", {}
    return _causal_label(out, q, k, v, runner.tolerance)


def measure_api(api: Api) -> dict:
    """One row of the table. Never raises: a missing framework is "not installed",
    an API that cannot run at all is "n/a", anything else that fails is recorded
    in the row. float32_matmul is filled in by measure()."""
    row: dict[str, Any] = {"api": api.name, "framework": api.framework, "evidence": {}, "notes": []}
    missing = [m for m in api.modules if importlib.util.find_spec(m) is None]
    if missing:
        row.update(status=NOT_INSTALLED, reason=f"{', '.join(missing)} not installed ({api.install})")
        return row
    started = time.perf_counter()
    try:
        runner = api.build()
    except NotExpressible as why:
        row.update(status="n/a", reason=str(why))
        return row
    except Exception as err:  # noqa: BLE001
        row.update(status="error", reason=_short(err))
        return row
    row["status"] = "measured"
    if api.framework == "keras":
        row["framework"] = f"keras ({sys.modules['keras'].backend.backend()})"
    T_, S_ = (T, T) if runner.self_attention_only else (T, S)
    q, k, v = _inputs(T_, S_, seed=0)
    if runner.self_attention_only:
        k = v = q
    polarities = {}
    for arg, kind in runner.mask_args.items():
        try:
            polarities[arg], row["evidence"][f"polarity[{arg}]"] = _polarity(runner, arg, kind, q, k, v)
        except Exception as err:  # noqa: BLE001
            polarities[arg] = f"error: {_short(err)}"
    values = set(polarities.values())
    row["mask_true_means"] = values.pop() if len(values) == 1 else "; ".join(f"{a}: {p}" for a, p in polarities.items())
    row["mask_true_means_by_argument"] = polarities
    first, kind = next(iter(runner.mask_args.items()))
    if polarities[first] in ("attend", "masked"):
        for arg, kind in runner.mask_args.items():
            try:
                fm = _fully_masked(runner, arg, kind, polarities[arg], q, k, v)
            except Exception as err:  # noqa: BLE001
                fm = {"output": f"error: {_short(err)}", "weights": "n/a", "evidence": {}}
            if arg == first:
                row["fully_masked_row"], row["fully_masked_weights"] = fm["output"], fm["weights"]
                row["evidence"][f"fully_masked[{arg}]"] = fm["evidence"]
            else:
                row["evidence"][f"fully_masked[{arg}]"] = {"output": fm["output"], **fm["evidence"]}
                row["notes"].append(f"{arg} masking every key of a batch: output {fm['output']}")
    else:
        row["fully_masked_row"] = row["fully_masked_weights"] = f"n/a: polarity of {first} is {polarities[first]}"
    for T_c, S_c in CAUSAL_SHAPES:
        key = f"causal_T{T_c}_S{S_c}"
        row[key], row["evidence"][key] = _causal(runner, T_c, S_c)
    if runner.extra is not None:
        try:
            extra = runner.extra()
        except Exception as err:  # noqa: BLE001
            extra = {"notes": [f"extra measurement failed: {_short(err)}"]}
        row["notes"] += extra.pop("notes", [])
        row["evidence"].update(extra.pop("evidence", {}))
        row.update(extra)
    row["float32_matmul"] = {}
    row["seconds"] = round(time.perf_counter() - started, 3)
    return row


