"""What mlx_lm_ports.py and mlx_lm_stages.py share: the inputs, mlx-lm's model run with its attention
modules' inputs replaced by transformers' (prefill, and decode on mlx-lm's own cache), the float64 reference
and the policy's judgement. Shape letters as in impl_numpy."""

from __future__ import annotations

import contextlib

import numpy as np

B, T, P = 2, 9, 5  # batch rows, tokens, the decode prefix (then T - P steps, one token each)


def token_ids() -> np.ndarray:
    """(B, T) token ids: two different rows."""
    return np.stack([np.arange(3, 3 + T), np.arange(40, 40 - T, -1)]).astype(np.int64)


def _get(root, path: str):
    for part in path.split("."):
        root = getattr(root, part)
    return root


def _mlx_layers(model):
    for path in ("layers", "model.layers", "language_model.model.layers", "model.language_model.layers",
                 "language_model.layers", "transformer.h", "gpt_neox.layers", "model.h"):
        with contextlib.suppress(AttributeError, KeyError):
            return _get(model, path)
    raise ValueError(f"model: no layers found in mlx-lm's {type(model).__name__}")


def _recorder_class():
    import mlx.core as mx
    import mlx.nn as nn

    class Recorder(nn.Module):
        """Stands in the block for one mlx-lm attention module while it runs: replaces its input x by
        `inject` (transformers' captured input, the rows of this call), records what it returns; every
        other attribute is the module's own (what mlx-lm's cache and mask code read of it)."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            object.__setattr__(self, "inject", None)
            object.__setattr__(self, "outputs", [])
            object.__setattr__(self, "gate", None)  # a dict whose "on" is True while the module runs

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                if "inner" not in self:
                    raise
                return getattr(self["inner"], name)

        def __call__(self, *args, **kwargs):
            if self.inject is not None:
                new = mx.array(self.inject)
                if args:
                    args = (new, *args[1:])
                else:
                    key = next(k for k, v in kwargs.items() if isinstance(v, mx.array) and v.ndim == 3)
                    kwargs[key] = new
            if self.gate is not None:
                self.gate["on"] = True
            try:
                out = self["inner"](*args, **kwargs)
            finally:
                if self.gate is not None:
                    self.gate["on"] = False
            first = out[0] if isinstance(out, tuple) else out
            self.outputs.append(np.array(first.astype(mx.float32)))
            return out

    return Recorder


@contextlib.contextmanager
def recording(model, layers: tuple[int, ...], attribute: str):
    """{layer: Recorder} standing in each measured block for its attention module for the duration."""
    Recorder = _recorder_class()
    blocks = _mlx_layers(model)
    recorders = {}
    try:
        for index in layers:
            if attribute not in blocks[index]:
                raise ValueError(f"mlx-lm's block {index} has no {attribute} (its children: "
                                 f"{', '.join(k for k in blocks[index] if not k.startswith('_'))})")
            recorders[index] = Recorder(blocks[index][attribute])
            blocks[index][attribute] = recorders[index]
        yield recorders
    finally:
        for index, recorder in recorders.items():
            blocks[index][attribute] = recorder["inner"]


def run_mlx(model, port, seen: dict[int, dict], *, attribute: str | None = None,
            layers: tuple[int, ...] | None = None) -> dict[int, dict]:
    """{layer: {"prefill": (B, T, D), "decode": (B, T - P, D)}}: mlx-lm's attention outputs on transformers'
    inputs; prefill without a cache (mlx-lm's own causal/window mask), decode with mlx-lm's own cache."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    ids = token_ids()
    attribute = attribute or port.mlx_attribute or port.attribute
    out: dict[int, dict] = {}
    with recording(model, port.layers if layers is None else layers, attribute) as recorders:
        def call(rows: slice, cache=None):
            for index, rec in recorders.items():
                rec.inject = seen[index]["x"][:, rows]
            logits = model(mx.array(ids[:, rows]), cache=cache)
            mx.eval(logits)
            if cache is not None:
                mx.eval([c.state for c in cache])

        call(slice(0, T))
        prefill = {i: r.outputs.pop() for i, r in recorders.items()}
        cache = make_prompt_cache(model)
        call(slice(0, P), cache)
        for r in recorders.values():
            r.outputs.pop()
        for t in range(P, T):
            call(slice(t, t + 1), cache)
        for index, rec in recorders.items():
            out[index] = {"prefill": prefill[index], "decode": np.concatenate(rec.outputs, axis=1)}
    return out


def reference(config, tensors: dict, x: np.ndarray, selection=None) -> dict:
    """The float64 reference's causal call on x (B, T, D): its output, trace and the magnitudes the
    policy takes its allowances from. selection: topk_indices for a layer that attends to another layer's
    selection (GLM-5's shared layers: the previous full layer's)."""
    from conformance.suite import backends
    from impl_numpy.magnitudes import forward_magnitudes

    wide = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
    x64 = np.asarray(x, np.float64)
    positions = np.arange(x.shape[1], dtype=np.int64)
    extra = {} if selection is None else {"topk_indices": np.asarray(selection)}
    ref = backends.load("numpy").forward(config, wide, {"query": x64, "positions": positions, **extra},
                                         {"is_causal": True}, trace=True)
    terms, logit_errors = forward_magnitudes(config, wide, x64, is_causal=True, positions=positions,
                                             logit_errors=True, **extra)
    return {"output": ref["output"], "trace": dict(ref["trace"]), "terms": terms, "logit_errors": logit_errors,
            "tensors": tensors}


def judge(name: str, actual, ref: dict, config, *, rows: slice = slice(None), stage: str = "output",
          expected=None, quantity: str = "output"):
    """conformance.suite.tolerance.compare of `actual` with the reference's `stage` (or `expected`, the same
    shape: transformers' output) on query rows `rows`, float32 policy, allowances from the reference's
    magnitudes (as conformance.suite.compare.case_policy builds them)."""
    from conformance.suite.tolerance import compare, policy_for

    want = ref["trace"][stage] if stage != "output" else ref["output"]
    terms = ref["terms"].get(stage)
    weighted = ref["logit_errors"].get(stage)
    logit_terms = ref["terms"]["logits"]
    if stage in ("output", "merge_heads", "attend"):
        want, terms = want[:, rows] if stage != "attend" else want, terms[:, rows] if stage != "attend" else terms
        weighted = None if weighted is None else (weighted[:, rows] if stage != "attend" else weighted)
    if expected is not None:
        want = expected
    tol = policy_for(config, dtype="float32", quantity=quantity, B=want.shape[0], T=ref["output"].shape[1],
                     S=ref.get("S", ref["output"].shape[1]), reference=want, logits=logit_terms, max_position=T,
                     magnitude=terms, logit_error=weighted)
    return compare(name, np.asarray(actual, np.float64), want, tol)


_KEYED = ("logits", "softcap", "alibi", "mask", "softmax", "dropout")  # (B, N, T, S): a query row and its keys


def _row(stage: str, x, t: int):
    if x is None:
        return None
    x = np.asarray(x)
    if stage in _KEYED:
        return x[:, :, t:t + 1, :t + 1]
    return x[:, t:t + 1] if x.ndim == 3 else x[:, :, t:t + 1]


def row_view(ref: dict, t: int) -> dict:
    """The reference of a decode step: query row t of every traced stage (the new key's row t of the key
    stages; the logits' keys 0..t), of their magnitudes and logit errors, and of the output; S = t + 1."""
    return {"output": ref["output"][:, t:t + 1], "S": t + 1, "tensors": ref["tensors"],
            "trace": {k: _row(k, v, t) for k, v in ref["trace"].items()},
            "terms": {k: _row(k, v, t) for k, v in ref["terms"].items()},
            "logit_errors": {k: _row(k, v, t) for k, v in ref["logit_errors"].items()}}
