"""The first stage where an mlx-lm attention port leaves the spec (conformance.native.mlx_lm_ports' last column).

mlx-lm's attention modules are hand-written, each its own way, but they share their parts: Linear
projections (q_proj, k_proj, v_proj, o_proj), norms (q_norm, k_norm), a rope module called on the queries
and then the keys, and mx.fast.scaled_dot_product_attention (through mlx_lm.models.base) fed the rotated
queries and keys, the values, the scale, the mask and the sinks. Every child module of the measured
attention is wrapped by a probe that records its input and output, and mx.fast.scaled_dot_product_attention
by one that records its arguments; one prefill call (no cache: mlx-lm's own mask) on transformers' input
then gives, in the spec's stage order:

  query/key/value.project   q_proj / k_proj / v_proj outputs
  query/key.norm            q_norm / k_norm outputs (a per-head norm's (B, T, N, H) as the spec's)
  query/key.rope            the rope module's outputs (the call with N heads the queries', the next the keys')
  logits                    scale * q k^T of what reached the fused attention (the scale and what came in)
  mask                      the keys each query may see under the mask that reached it ("causal", a bool or
                            an additive array)
  merge_heads               o_proj's input (the softmax, sinks and the weighted sum in one)
  output                    o_proj's output

each compared with the reference's trace of the same stage under the policy's stage tolerance (float32,
allowances from the reference's magnitudes, as conformance.suite.compare.localise judges a backend).
Where a stage is not observed (a port that computes the softmax by hand, fused projections), the next
observed one names the difference. Numbers go with every reason: the stage's error and margin, and where
the RoPE stage differs, which rotation mlx-lm's matches (the other pairing, the unscaled frequencies);
where the mask differs, the keys each query sees under each.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np


@contextlib.contextmanager
def probes(attention):
    """{child name: [(input, output), ...]} and the fused attention's calls [{q, k, v, scale, mask, sinks}] while
    `attention`'s children and mx.fast.scaled_dot_product_attention are wrapped."""
    import mlx.core as mx
    import mlx.nn as nn

    records: dict[str, list] = {}
    fused: list[dict] = []
    gate = {"on": False}  # the measured module is running (the fused call of another block is not recorded)

    class Probe(nn.Module):
        def __init__(self, name, inner):
            super().__init__()
            self.inner = inner
            object.__setattr__(self, "probe_name", name)

        def __getattr__(self, key):
            try:
                return super().__getattr__(key)
            except AttributeError:
                if "inner" not in self:
                    raise
                return getattr(self["inner"], key)

        def __call__(self, x, *args, **kwargs):
            out = self["inner"](x, *args, **kwargs)
            if isinstance(out, mx.array):
                records.setdefault(self.probe_name, []).append((np.array(x.astype(mx.float32)),
                                                                np.array(out.astype(mx.float32))))
            return out

    original = mx.fast.scaled_dot_product_attention

    def sdpa(q, k, v, *args, scale=None, mask=None, sinks=None, **kwargs):
        if not gate["on"]:
            return original(q, k, v, *args, scale=scale, mask=mask, sinks=sinks, **kwargs)
        fused.append({"q": np.array(q.astype(mx.float32)), "k": np.array(k.astype(mx.float32)),
                      "v": np.array(v.astype(mx.float32)), "scale": scale,
                      "mask": mask if isinstance(mask, str) or mask is None else np.array(mask),
                      "sinks": None if sinks is None else np.array(sinks.astype(mx.float32))})
        return original(q, k, v, *args, scale=scale, mask=mask, sinks=sinks, **kwargs)

    children = [name for name, value in attention.items() if isinstance(value, nn.Module)]
    for name in children:
        attention[name] = Probe(name, attention[name])
    mx.fast.scaled_dot_product_attention = sdpa
    try:
        yield records, fused, gate
    finally:
        mx.fast.scaled_dot_product_attention = original
        for name in children:
            attention[name] = attention[name]["inner"]


def _as(value: np.ndarray, like: np.ndarray) -> np.ndarray | None:
    """value in the reference stage's shape: as it is, reshaped (B, T, N*H) <-> (B, T, N, H), or with its
    heads and tokens swapped; None where the sizes differ."""
    value = np.asarray(value, np.float64)
    if value.shape == like.shape:
        return value
    if value.size != like.size:
        return None
    if value.ndim == 4 and like.ndim == 4 and value.shape == (like.shape[0], like.shape[2], like.shape[1],
                                                              like.shape[3]):
        return value.transpose(0, 2, 1, 3)
    if like.ndim == 4 and value.ndim == 3:  # (B, T, N*H) -> (B, N, T, H)
        B, N, T, H = like.shape
        return value.reshape(B, T, N, H).transpose(0, 2, 1, 3)
    if like.ndim == 3 and value.ndim == 4 and value.shape[1] == like.shape[1]:  # (B, T, N, H) -> (B, T, N*H)
        return value.reshape(like.shape)
    return None


def _visible(mask, T: int, S: int) -> np.ndarray:
    """(T, S) bool: the keys each query may see under mlx-lm's mask argument (of the first batch row and head)."""
    if mask is None:
        return np.ones((T, S), bool)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"mask: an mlx-lm mask string must be 'causal': got {mask!r}")
        return np.arange(S)[None, :] <= np.arange(T)[:, None] + (S - T)
    m = np.asarray(mask)
    m = m.reshape((-1,) + m.shape[-2:])[0]
    return m.astype(bool) if m.dtype == bool else np.isfinite(m) & (m > -1e4)


def _keys_seen(visible: np.ndarray) -> str:
    counts = visible.sum(-1)
    return "[" + " ".join(str(int(c)) for c in counts) + "]"


def _rope_why(x_in: np.ndarray, got: np.ndarray, config, first: int = 0) -> str:
    """Which rotation mlx-lm's rope output matches: the spec's at positions first.., the other pairing, the
    frequencies without their scaling, theta 10000, positions from 0 (a cache offset ignored); with each
    one's error."""
    import dataclasses

    from impl_numpy.functional import rope, rope_angles
    from weights.rope import rope_tables

    spec = config.rope
    T = x_in.shape[2]

    def rotated(r, start=first):
        positions = np.arange(start, start + T)[None]
        inv_freq, factor = rope_tables(r, int(positions.max()))
        angles = rope_angles(positions, inv_freq, np.dtype(np.float64))
        return rope(np.asarray(x_in, np.float64), angles, r.rotary_dim or x_in.shape[-1], r.interleaved, factor)

    errs = {}
    if first:
        errs[f"positions from 0, not {first} (the cache's offset ignored)"] = float(np.abs(rotated(spec, 0) - got).max())
    candidates = {"the spec's": spec,
                  f"the other pairing ({'half-split' if spec.interleaved else 'interleaved'})":
                      dataclasses.replace(spec, interleaved=not spec.interleaved)}
    if spec.scaling is not None:
        candidates["no frequency scaling"] = dataclasses.replace(spec, scaling=None)
    if spec.theta != 10000.0:
        candidates["theta 10000, unscaled"] = dataclasses.replace(spec, theta=10000.0, scaling=None)
    if spec.rotary_dim not in (None, x_in.shape[-1]):
        candidates["every feature turning"] = dataclasses.replace(spec, rotary_dim=None)
    for label, r in candidates.items():
        with contextlib.suppress(Exception):
            errs[label] = float(np.abs(rotated(r) - got).max())
    best = min(errs, key=errs.get) if errs else None
    listed = ", ".join(f"{k} {v:.1e}" for k, v in errs.items())
    if best is None or best == "the spec's":
        return f"rotation errors against {listed}"
    return f"mlx-lm's rotation is {best} (errors: {listed})"


def first_difference(model, port, seen, layer, config, ref, where) -> tuple[str, str]:
    """(stage, why with numbers) for block `layer` of mlx-lm's `model` against the reference `ref`
    (conformance.native.mlx_lm_harness.reference) on transformers' input. where "prefill": the whole causal
    call without a cache; "decode": the prefix into mlx-lm's cache, then each step, probed, against the
    reference's row of that step (the first step with a stage beyond the policy is named)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from conformance.native import mlx_lm_harness as ports

    attribute = port.mlx_attribute or port.attribute
    attention = ports._mlx_layers(model)[layer][attribute]
    ids, x = ports.token_ids(), seen[layer]["x"]
    if where != "decode":
        with probes(attention) as (records, fused, gate), ports.recording(model, (layer,), attribute) as recorders:
            recorders[layer].inject = x
            object.__setattr__(recorders[layer], "gate", gate)
            mx.eval(model(mx.array(ids)))
        return _first_stage(model, port, seen, layer, config, ref, records, fused, recorders[layer].outputs[-1])
    cache = make_prompt_cache(model)
    with ports.recording(model, (layer,), attribute) as recorders:
        recorders[layer].inject = x[:, :ports.P]
        mx.eval(model(mx.array(ids[:, :ports.P]), cache=cache))
    for t in range(ports.P, ports.T):
        with probes(attention) as (records, fused, gate), ports.recording(model, (layer,), attribute) as recorders:
            recorders[layer].inject = x[:, t:t + 1]
            object.__setattr__(recorders[layer], "gate", gate)
            mx.eval(model(mx.array(ids[:, t:t + 1]), cache=cache))
        stage, why = _first_stage(model, port, seen, layer, config, ports.row_view(ref, t), records, fused,
                                  recorders[layer].outputs[-1], step=True, first=t)
        if stage != "-":
            return f"{stage} (decode step at position {t})", why
    return "-", "every decode step within the policy at every observed stage"


def _first_stage(model, port, seen, layer, config, ref, records, fused, output, *, step: bool = False,
                 first: int = 0):
    """The first observed stage beyond the policy: (stage, why), or ("-", "") for a decode step with none."""
    from conformance.native import mlx_lm_harness as ports

    trace = ref["trace"]
    observed: list[tuple[str, np.ndarray, Any]] = []  # (stage, value, extra)
    for stage, child in (("query.project", "q_proj"), ("key.project", "k_proj"), ("value.project", "v_proj"),
                         ("query.norm", "q_norm"), ("key.norm", "k_norm")):
        if child in records and stage in trace:
            observed.append((stage, records[child][0][1], None))
    rope_calls = records.get("rope", [])
    if rope_calls and config.rope is None:
        moved = [float(np.abs(out - x).max()) for x, out in rope_calls]
        if max(moved) > 0:
            return "query.rope", (f"mlx-lm rotates q and k on a layer without RoPE (NoPE in the model): its rope "
                                  f"moves them by up to {max(moved):.2g}"
                                  + counterfactual(model, port, seen, layer, config, ref))
    if rope_calls and "query.rope" in trace:
        observed.append(("query.rope", rope_calls[0][1], rope_calls[0][0]))
        if len(rope_calls) > 1:
            observed.append(("key.rope", rope_calls[1][1], rope_calls[1][0]))
    if fused and "logits" in trace:
        call = fused[0]
        q, k = np.asarray(call["q"], np.float64), np.asarray(call["k"], np.float64)
        if q.ndim == 4 and k.ndim == 4 and q.shape[1] % k.shape[1] == 0:
            k = np.repeat(k, q.shape[1] // k.shape[1], axis=1)
            scale = 1.0 if call["scale"] is None else float(call["scale"])
            observed.append(("logits", scale * q @ np.swapaxes(k, -1, -2), call))
            observed.append(("mask", None, call))
    if "o_proj" in records:
        observed.append(("merge_heads", records["o_proj"][0][0], None))
        observed.append(("output", records["o_proj"][0][1], None))
    else:
        observed.append(("output", output, None))

    for stage, value, extra in observed:
        want = trace[stage] if stage != "output" else ref["output"]
        if stage == "mask":
            T, S = want.shape[-2:]
            kept = np.asarray(extra["k"]).shape[-2]  # the keys that reached it (a rotating cache keeps a window)
            theirs, ours = _visible(extra["mask"], T, kept), np.isfinite(want.reshape((-1, T, S))[0])
            if theirs.shape != ours.shape and theirs.sum() == ours.sum():
                continue  # the same number of keys, held in the cache's own order
            if not np.array_equal(theirs, ours):
                shown = extra["mask"] if isinstance(extra["mask"], str) else f"an array {np.shape(extra['mask'])}"
                return "mask", (f"keys each query sees {_keys_seen(theirs)} under mlx-lm's mask ({shown}), "
                                f"{_keys_seen(ours)} under the model's (window_left {config.window_left}, "
                                f"local chunk {getattr(config, 'local_chunk', None)})")
            if extra["sinks"] is not None and not config.use_sinks:
                return "softmax", "mlx-lm passes sinks to a model without them"
            continue
        shaped = _as(value, want)
        if shaped is None:
            continue
        c = ports.judge(f"mlx-lm {stage}", shaped, ref, config, stage=stage, expected=None, quantity="stage") \
            if stage != "output" else ports.judge("mlx-lm output", shaped, ref, config)
        if c.ok:
            continue
        after = stage.replace(".rope", ".norm")
        if stage.endswith(".rope") and after in trace and trace[after].shape == want.shape and ports.judge(
                f"mlx-lm {stage} (norm first)", shaped, ref, config, stage=after, quantity="stage").ok:
            continue  # the norm ran before the rotation: the same numbers where the norm commutes with it
        why = f"err {c.max_abs_error:.1e}, margin {c.margin:.3g}"
        if stage in ("query.rope", "key.rope") and config.rope is not None and extra is not None:
            x_in = _as(extra, want)
            if x_in is not None:
                why += "; " + _rope_why(x_in, shaped, config, first)
        if stage == "logits":
            call = extra
            ratio = np.median(np.abs(shaped) / np.maximum(np.abs(want), 1e-30))
            why += f"; scale passed {call['scale']!r}, the spec's {config.effective_scale:.6g} (median ratio {ratio:.4g})"
            why += _normalised(call, trace)
        return stage, why + ("" if step else counterfactual(model, port, seen, layer, config, ref))
    if step:
        return "-", ""
    return "output", "no observed stage leaves the policy" + counterfactual(model, port, seen, layer, config, ref)


def _rms(x) -> np.ndarray:
    return np.sqrt(np.mean(np.square(np.asarray(x, np.float64)), axis=-1))


def _normalised(call: dict, trace: dict) -> str:
    """"; mlx-lm's queries and keys reach the softmax RMS-normalised ..." where every head vector of what
    reached the fused attention has RMS 1 and the spec's (after every stage before the logits) do not."""
    ours = trace.get("query.norm", trace.get("query.rope", trace.get("query.split_heads")))
    theirs_q, theirs_k = _rms(call["q"]), _rms(call["k"])
    near = 0.1  # an RMS norm's output has RMS sqrt(ms / (ms + eps)): within 10% of 1 for eps up to a fifth of ms
    unit = bool(np.abs(theirs_q - 1).max() < near and np.abs(theirs_k - 1).max() < near)
    spec = _rms(ours)
    if not unit or np.abs(spec - 1).max() < near:
        return ""
    low, high = min(theirs_q.min(), theirs_k.min()), max(theirs_q.max(), theirs_k.max())
    if "query.norm" in trace:
        return (f"; mlx-lm's queries and keys reach the softmax with RMS {low:.4f} to {high:.4f} per head, the "
                f"model's normed queries with RMS {spec.min():.4f} to {spec.max():.4f}: the norm's eps is not the "
                "model's (an RMS norm's output has RMS sqrt(ms / (ms + eps)))")
    return (f"; mlx-lm's queries and keys reach the softmax RMS-normalised per head (RMS {low:.3f} to {high:.3f}), "
            f"the model's queries here are not (RMS {spec.min():.2f} to {spec.max():.2f}): a QK-norm the model "
            "does not apply on this layer")


def _variants(config) -> dict[str, Any]:
    """The block's config with one feature undone each: what a port that leaves it out computes."""
    import dataclasses

    out = {}
    if config.window_left is not None and config.window_left >= 0:
        out["without its window"] = dataclasses.replace(config, window_left=-1)
    if getattr(config, "local_chunk", None):
        out["without its chunks"] = dataclasses.replace(config, local_chunk=None)
    if config.logit_softcap:
        out["without its softcap"] = dataclasses.replace(config, logit_softcap=None)
    if getattr(config, "query_temperature", None) is not None:
        out["without its query temperature"] = dataclasses.replace(config, query_temperature=None)
    if config.rope is not None:
        out["with the other RoPE pairing"] = dataclasses.replace(
            config, rope=dataclasses.replace(config.rope, interleaved=not config.rope.interleaved))
        if config.rope.scaling is not None:
            out["without its RoPE scaling"] = dataclasses.replace(
                config, rope=dataclasses.replace(config.rope, scaling=None))
    return out


def counterfactual(model, port, seen, layer, config, ref) -> str:
    """"; mlx-lm's output matches the spec <without its window> (err ...)" where one undone feature
    explains mlx-lm's whole output; "" where none does."""
    import warnings

    from conformance.native import mlx_lm_harness as ports

    got = ports.run_mlx(model, port, {layer: seen[layer]}, layers=(layer,))[layer]["prefill"]
    tensors = ref["tensors"]
    found = []
    for label, variant in _variants(config).items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                alt = ports.reference(variant, tensors, seen[layer]["x"])
        except Exception:  # noqa: BLE001 (a variant the contract refuses explains nothing)
            continue
        c = ports.judge(f"mlx-lm vs the spec {label}", got, alt, variant)
        if c.ok:
            found.append(f"{label} (err {c.max_abs_error:.1e}, margin {c.margin:.3g})")
    return "; mlx-lm's output is the spec's " + " and ".join(found) if found else ""
