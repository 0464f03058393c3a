"""How transformers' ALiBi models add the bias (the fourth table of `mha check --conventions`).

One row per model, BLOOM, MPT and Falcon-RW: a tiny randomly initialised model of each, built in this
process (2 blocks, T = 9 tokens: ALiBi's distances reach 8, enough for a misplaced bias to move every
row). Block LAYER is measured: its input and its output projection's output are captured by hooks.
Every cell compares the model's own output with the float64 NumPy reference (impl_numpy) on the block's
weights as the model's layout reads them (weights/layouts/alibi_models.py), with the slopes placed
here from each model's rule (weights.alibi), under the suite's tolerance policy
(conformance/suite/tolerance.py):

  bias vs the scale   the reference with the rule's slopes as they stand (the contract adds the bias
                      after the scale: the model adds it "outside") and times the model's scale
                      (1/sqrt(H), or MPT's softmax_scale: added to q k^T before it, "inside"); which
                      one the model matches, float32 policy. Falcon: its default sdpa path.
  times added         each attention path the model has (BLOOM, MPT: eager; Falcon: sdpa and eager on
                      the same weights) against the reference with the placed slopes once and doubled.
  float64 model       the model built in float64 against the reference: the worst |model - reference|
                      and whether float64's policy holds or only float32's (float32 arithmetic inside).
  decode              the model's own decode step (the last token on the cache its prefix left) against
                      the reference's decode with the cache's keys at positions 0..P-1 and the query at
                      P (bottom-right causal alignment): "yes" where it matches.

tests/test_layouts_alibi.py builds its models and measures its figures with the functions here.
Shape letters as in impl_numpy: T query length, S key length, N heads, H head dim.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import numpy as np

from conformance.native.conventions import modern

T = 9
LAYER = 1  # the block measured: its input is another block's output, not the embedding

_SMALL = dict(num_hidden_layers=2, vocab_size=64)
# variant -> (layout, model_type, config kwargs, path to the blocks, attention attribute, output projection)
MODELS: dict[str, tuple] = {
    "bloom": ("hf-bloom", "bloom", dict(hidden_size=48, n_head=6, **_SMALL), "transformer.h", "self_attention",
              "dense"),  # 6 heads: BLOOM's rule for a head count that is not a power of two
    "mpt": ("hf-mpt", "mpt", dict(d_model=32, n_heads=4, max_seq_len=32, **_SMALL, attn_config=dict(
        clip_qkv=0.6, softmax_scale=0.3, alibi=True)), "transformer.blocks", "attn", "out_proj"),
    # 6 heads of 8 features, positions <= 256: Falcon's bfloat16 bias is exact there (hf-falcon's rule for an H
    # whose sqrt is not a power of two; tests/test_layouts_falcon_rw.py holds the real head counts)
    "falcon-rw": ("hf-falcon", "falcon", dict(hidden_size=48, num_attention_heads=6, alibi=True, multi_query=False,
                                              bias=True, parallel_attn=False, max_position_embeddings=256, **_SMALL),
                  "transformer.h", "self_attention", "dense"),
}

KEYS = ("alibi_placement", "alibi_times_added", "float64_model", "decode_cache_positions")
COLUMNS = (("model", "api"), ("bias vs the scale", "alibi_placement"), ("times the bias is added", "alibi_times_added"),
           ("built in float64: worst error vs the float64 reference", "float64_model"),
           ("decode reads the cache at 0..P-1", "decode_cache_positions"))
SETUP = (f"tiny random models, block {LAYER} of 2, T={T}; float32 against the float64 reference with each rule's "
         "slopes outside the scale (as they stand) or inside (times 1/sqrt(H), MPT's softmax_scale); Falcon's "
         "placement on its default sdpa path")

HF_EXTRA = "pip install -c constraints/cpu.txt '.[hf,torch]'"
INSIDE, OUTSIDE = "inside", "outside"


# -- the tiny models ---------------------------------------------------------------------------------

def build(spec: tuple, *, dtype=None, attn: str | None = None):
    """A tiny model of `spec` (a MODELS value), every parameter random (the inits leave biases 0 and norms
    1), the same for every dtype and attention path; the global torch RNG is left as it was."""
    import torch
    import transformers

    _, model_type, kwargs, *_ = spec
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    attn = attn or ("sdpa" if model_type == "falcon" else "eager")  # Falcon's default; the others have only eager
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn,
                                                              dtype=dtype or torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.normal_(0.0, 0.5 if ("norm" in name or "ln" in name or "bias" in name) else 0.2)
    return model.eval()


def attention_module(model, spec: tuple, layer: int = LAYER):
    """(the block's attention module, its output projection)."""
    _, _, _, path, attribute, out = spec
    blocks = model
    for part in path.split("."):
        blocks = getattr(blocks, part)
    attention = getattr(blocks[layer], attribute)
    return attention, getattr(attention, out)


def capture(model, spec: tuple, *calls: dict, layer: int = LAYER) -> list[dict]:
    """{"x": the block's attention input, "out": its output projection's output} for each call of the model
    (kwargs dicts). The output projection, not the module: BLOOM adds the residual inside its attention."""
    import torch

    attention, out_proj = attention_module(model, spec, layer)
    seen: list[dict] = []
    pre = attention.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append({"x": kwargs.get("hidden_states", args[0] if args else None)
                                             .detach().numpy().copy()}), with_kwargs=True)
    post = out_proj.register_forward_hook(lambda m, args, output: seen[-1].update(out=output.detach().numpy().copy()))
    try:
        with torch.no_grad():
            for kwargs in calls:
                model(**kwargs)
    finally:
        pre.remove()
        post.remove()
    return seen


def token_ids():
    import torch

    return torch.arange(3, 3 + T).reshape(1, T)


def decode_calls(model, ids) -> list[dict]:
    """The last token's call on the cache the prefix left (the prefix is run here)."""
    import torch

    with torch.no_grad():
        past = model(input_ids=ids[:, :-1], use_cache=True).past_key_values
    return [{"input_ids": ids[:, -1:], "past_key_values": past, "use_cache": True}]


def hf_config(model) -> dict:
    """The model's config.json as save_pretrained writes it (the fields that differ from the defaults)."""
    return json.loads(model.config.to_json_string(use_diff=True))


def convert(model, spec: tuple, layer: int = LAYER):
    """(AttentionConfig, canonical tensors) of the block, read by the model's layout."""
    from weights import layouts

    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return layouts.to_canonical(spec[0], state, hf_config=hf_config(model), layer=layer)


# -- the reference and the policy ------------------------------------------------------------------

def reference(config, tensors: dict, x: np.ndarray, positions: np.ndarray, **extra):
    """The float64 reference's result, and the logit magnitudes the policy takes z from (|logits| + |bias|
    where ALiBi adds one, as conformance.suite.compare.case_policy does). extra: past_key / past_value
    (then the causal mask is bottom-right aligned)."""
    from conformance.suite import backends

    wide = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
    inputs = {"query": x.astype(np.float64), "positions": positions, **extra}
    options = {"is_causal": True, **({"causal_alignment": "bottom_right"} if extra else {})}
    ref = backends.load("numpy").forward(config, wide, inputs, options, trace=True)
    trace = dict(ref["trace"])
    z = np.abs(trace["logits"])
    if "alibi" in trace:
        z = z + np.abs(trace["alibi"] - trace["logits"])
    return ref, z


def judge(name: str, actual, expected, config, *, S: int, z, dtype: str = "float32"):
    """conformance.suite.tolerance.compare under `dtype`'s policy for this block's output (the Comparison)."""
    from conformance.suite.tolerance import compare, policy_for

    tol = policy_for(config, dtype=dtype, quantity="output", B=1, T=np.shape(expected)[1], S=S, reference=expected,
                     logits=z, max_position=T)
    return compare(name, actual, expected, tol)


def rule_slopes(hf_cfg: dict, num_heads: int) -> np.ndarray:
    """The model's slope rule (weights.alibi, float64), before any scale: BLOOM's; MPT's with its
    alibi_bias_max; Falcon's, BLOOM's rule rounded to bfloat16 (modeling_falcon.build_alibi_tensor's
    .bfloat16(), transformers 5.23)."""
    from weights.alibi import bloom_slopes, mpt_slopes

    model_type = hf_cfg.get("model_type")
    if model_type == "bloom":
        return bloom_slopes(num_heads)
    if model_type == "mpt":
        return mpt_slopes(num_heads, (hf_cfg.get("attn_config") or {}).get("alibi_bias_max", 8))
    if model_type == "falcon":
        import ml_dtypes

        return bloom_slopes(num_heads).astype(ml_dtypes.bfloat16).astype(np.float64)
    raise ValueError(f"hf_config: model_type must be 'bloom', 'mpt' or 'falcon' for an ALiBi rule: got {model_type!r}")


def placed(tensors: dict, config, hf_cfg: dict, placement: str) -> dict:
    """The tensors with the rule's slopes as the contract adds them (after the scale) for a model that adds
    the bias outside its scale (the slopes as they stand) or inside (times the scale)."""
    if placement not in (INSIDE, OUTSIDE):
        raise ValueError(f"placement must be {INSIDE!r} or {OUTSIDE!r}: got {placement!r}")
    slopes = rule_slopes(hf_cfg, config.num_heads)
    return dict(tensors, **{"alibi.slopes": slopes * (config.effective_scale if placement == INSIDE else 1.0)})


def placement_results(config, tensors: dict, hf_cfg: dict, full: dict, name: str = "") -> dict:
    """placement -> the Comparison of the model's full causal call with the reference, float32 policy."""
    positions = np.arange(full["x"].shape[1], dtype=np.int64)
    out = {}
    for where in (OUTSIDE, INSIDE):
        ref, z = reference(config, placed(tensors, config, hf_cfg, where), full["x"], positions)
        out[where] = judge(f"{name} bias {where} the scale", full["out"], ref["output"], config, S=len(positions), z=z)
    return out


def bias_count(config, tensors: dict, run: dict, name: str = "") -> dict:
    """{"once": Comparison, "twice": Comparison}: a full causal call against the reference with the
    tensors' slopes and with them doubled (a bias added twice), float32 policy."""
    positions = np.arange(run["x"].shape[1], dtype=np.int64)
    out = {}
    for label, times in (("once", 1.0), ("twice", 2.0)):
        slopes = np.asarray(tensors["alibi.slopes"], np.float64) * times
        ref, z = reference(config, dict(tensors, **{"alibi.slopes": slopes}), run["x"], positions)
        out[label] = judge(f"{name} vs the bias {label}", run["out"], ref["output"], config, S=len(positions), z=z)
    return out


def decode_comparison(config, tensors: dict, full: dict, step: dict, name: str = ""):
    """The model's decode step against the contract's decode: the reference's own cache of the prefix
    (keys at positions 0..P-1), the query at P; float32 policy (the Comparison)."""
    from conformance.suite import backends

    P = full["x"].shape[1] - 1
    positions = np.arange(P + 1, dtype=np.int64)
    wide = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
    first = backends.load("numpy").forward(config, wide, {"query": full["x"][:, :-1].astype(np.float64),
                                                          "positions": positions[:-1]},
                                           {"is_causal": True, "return_cache": True})
    ref, z = reference(config, tensors, step["x"], positions[-1:], past_key=first["present_key"],
                       past_value=first["present_value"])
    return judge(f"{name} decode step vs the contract's", step["out"], ref["output"], config, S=P + 1, z=z)


def float64_model(spec: tuple, placement: str | None = None, name: str = "") -> dict:
    """The model built in float64, its full causal call against the reference on its block: {"worst":
    max |model - reference|, "float64": Comparison under float64's policy, "float32": under float32's}.
    placement: the slopes placed by the rule (INSIDE / OUTSIDE); None: as the layout reads them."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build(spec, dtype=torch.float64)
        (full,) = capture(model, spec, {"input_ids": token_ids(), "use_cache": False})
        config, tensors = convert(model, spec)
    if placement is not None:
        tensors = placed(tensors, config, hf_config(model), placement)
    ref, z = reference(config, tensors, full["x"], np.arange(T, dtype=np.int64))
    return {"worst": float(np.abs(full["out"] - ref["output"]).max()),
            **{dtype: judge(f"{name} float64 model, {dtype} policy", full["out"], ref["output"], config, S=T, z=z,
                            dtype=dtype) for dtype in ("float64", "float32")}}


# -- one row ----------------------------------------------------------------------------------------

def _ev(result) -> dict:
    return {"ok": bool(result.ok), "margin": float(result.margin), "max_abs_error": float(result.max_abs_error)}


def _err(result) -> str:
    return f"(err {result.max_abs_error:.1e})"


def _count_label(results: dict) -> str:
    matched = [n for n, label in (("1", "once"), ("2", "twice")) if results[label].ok]
    if not matched:
        return f"neither 1 nor 2 (margins {results['once'].margin:.3g}, {results['twice'].margin:.3g})"
    return f"{' and '.join(matched)} {_err(results['once' if matched[0] == '1' else 'twice'])}"


def measure_model(variant: str) -> dict:
    """One row's cells and evidence for MODELS[variant]."""
    spec = MODELS[variant]
    with warnings.catch_warnings():  # transformers' notes on the configs' unusual sizes
        warnings.simplefilter("ignore")
        model = build(spec)
        ids = token_ids()
        (full,) = capture(model, spec, {"input_ids": ids, "use_cache": False})
        (step,) = capture(model, spec, *decode_calls(model, ids))
        config, tensors = convert(model, spec)
        paths = {model.config._attn_implementation: full}
        if spec[1] == "falcon":  # the eager path on the same weights
            eager = build(spec, attn="eager")
            eager.load_state_dict(model.state_dict())
            (paths["eager"],) = capture(eager, spec, {"input_ids": ids, "use_cache": False})
    cfg = hf_config(model)
    row: dict[str, Any] = {"evidence": {}}

    where = placement_results(config, tensors, cfg, full, variant)
    row["evidence"]["placement"] = {k: _ev(v) for k, v in where.items()}
    matched = [k for k, v in where.items() if v.ok]
    if len(matched) == 1:
        row["alibi_placement"] = f"{matched[0]} {_err(where[matched[0]])}"
        tensors = placed(tensors, config, cfg, matched[0])
    else:  # the rest is measured on the slopes as the layout reads them
        row["alibi_placement"] = (("both" if matched else "neither") + " (margins " +
                                  ", ".join(f"{k} {v.margin:.3g}" for k, v in where.items()) + ")")

    counts = []
    for path, run in paths.items():
        results = bias_count(config, tensors, run, f"{variant} {path}")
        row["evidence"][f"times_added[{path}]"] = {k: _ev(v) for k, v in results.items()}
        counts.append(f"{path}: {_count_label(results)}")
    row["alibi_times_added"] = "; ".join(counts)

    wide = float64_model(spec, matched[0] if len(matched) == 1 else None, variant)
    row["evidence"]["float64_model"] = {"worst": wide["worst"], "float64": _ev(wide["float64"]),
                                        "float32": _ev(wide["float32"])}
    label = ("within float64's policy" if wide["float64"].ok else
             "within float32's policy only" if wide["float32"].ok else "neither policy")
    row["float64_model"] = f"{label} (err {wide['worst']:.1e})"

    decode = decode_comparison(config, tensors, full, step, variant)
    row["evidence"]["decode"] = _ev(decode)
    row["decode_cache_positions"] = f"{'yes' if decode.ok else 'no'} {_err(decode)}"
    return row


APIS: tuple[modern.ModernApi, ...] = (
    modern.ModernApi("transformers BLOOM (BloomForCausalLM)", "transformers", ("torch", "transformers"), HF_EXTRA,
                     lambda: measure_model("bloom")),
    modern.ModernApi("transformers MPT (MptForCausalLM)", "transformers", ("torch", "transformers"), HF_EXTRA,
                     lambda: measure_model("mpt")),
    modern.ModernApi("transformers Falcon-RW (FalconForCausalLM, alibi=True)", "transformers",
                     ("torch", "transformers"), HF_EXTRA, lambda: measure_model("falcon-rw")),
)


def measure(apis: tuple[modern.ModernApi, ...] | None = None) -> list[dict]:
    """Every model's row (default APIS); never raises (modern.measure_row's rule with this table's keys)."""
    from conformance.logs import quiet_python_loggers
    from conformance.native.conventions.packed import _json_safe

    rows = []
    for api in APIS if apis is None else apis:
        rows.append(modern.measure_row(api, KEYS, _json_safe))
        quiet_python_loggers()
    return rows


def cells(rows: list[dict]) -> list[list[str]]:
    return modern.cells(rows, COLUMNS)


notes = modern.notes  # the "not installed" notes, in the same words
