"""transformers' batched, left-padded generation reproduced token by token: a tiny randomly initialised
Llama 4 text model (layer 0: RoPE, chunks of 4, the weightless norm after RoPE; layer 1: NoPE with the
query temperature) and a tiny BLOOM (ALiBi), batch 2 with the second row left-padded by 2, greedy
`generate`. Each block's attention input and output (after its output projection) are captured at every
forward pass generate makes (the prompt, then one token at a time); each block, converted with its
layout (hf-llama, hf-bloom), is run the same way on every installed core backend: the prompt, then each
token on the cache the previous call returned, the cached keys at their positions (past_key_positions:
transformers' position_ids, attention_mask.cumsum(-1) - 1), the pads masked. The float64 reference on the
converted weights is held to the model's output first.

What makes a left-padded row need past_key_positions (checked against transformers 5.23's sources):
- Llama 4's chunks are (index - left_padding) // C (masking_utils.py:107, chunked_overlay, with
  left_padding counted at masking_utils.py:1440), while its RoPE reads position_ids; both are the real
  token's position, index - pads, for every key, the cached ones included;
- its NoPE layers' temperature counts the cache index, arange(T) + the past length, pads included
  (modeling_llama4.py:360-361): query_temperature.position "cache_index", which hf-llama's reader sets;
- BLOOM's ALiBi is slope * (cumsum(attention_mask) - 1) * mask over the keys (modeling_bloom.py:87),
  the same within each row as -slope * |pos_q - pos_k| for every key a query sees (a per-row constant).
A pad's own query row (every key masked) is the model's arbitrary value: it is left out (zeroed on both
sides); the pads' positions are generate's (0, generation/utils.py:906-908), masked as keys.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_layouts_llama_frontier import MODELS as LLAMA_MODELS
from test_layouts_llama_frontier import SMALL as LLAMA_SMALL
from test_layouts_modern import _installed

from conformance.native.conventions import alibi_models as am
from conformance.suite import backends
from conformance.suite.tolerance import compare, policy_for
from weights import layouts

try:
    import torch
    import transformers
except ImportError:
    torch = transformers = None
needs_transformers = [pytest.mark.torch, pytest.mark.tf, pytest.mark.jax,
                      pytest.mark.skipif(transformers is None, reason="needs torch and transformers (extra hf)")]

PADS = 2  # the second row's left padding
PROMPT = 6  # the first row's prompt; the second's is PROMPT - PADS tokens after its pads
NEW = 3  # tokens generated: the prompt's forward pass, then NEW - 1 passes of one token
CHUNK = 4  # Llama 4's attention_chunk_size (LLAMA_MODELS["llama4_text"])


def _llama4():
    config = transformers.AutoConfig.for_model("llama4_text", **{**LLAMA_SMALL, **LLAMA_MODELS["llama4_text"]})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                              dtype=torch.float32)
        with torch.no_grad():  # random norms too (their inits are ones)
            for name, param in model.named_parameters():
                param.normal_(0.0, 0.5 if "norm" in name else 0.2)
    return model.eval()


# model -> (build, layout, the blocks, attention attribute, output projection)
SPECS = {
    "llama4_text": (_llama4, "hf-llama", "model.layers", "self_attn", "o_proj"),
    "bloom": (lambda: am.build(am.MODELS["bloom"]), "hf-bloom", "transformer.h", "self_attention", "dense"),
}


def _blocks(model, path):
    blocks = model
    for part in path.split("."):
        blocks = getattr(blocks, part)
    return blocks


def _generate(model, name):
    """Greedy generation of NEW tokens for the left-padded batch, each block's (input, output projection)
    captured at every forward pass: {layer: [{"x", "out"}, ...]}, and the attention mask of the last pass."""
    _, _, path, attribute, out_name = SPECS[name]
    ids = torch.tensor([list(range(3, 3 + PROMPT)), [0] * PADS + list(range(20, 20 + PROMPT - PADS))])
    mask = torch.tensor([[1] * PROMPT, [0] * PADS + [1] * (PROMPT - PADS)])
    seen: dict[int, list] = {}
    hooks = []
    for layer, block in enumerate(_blocks(model, path)):
        attention = getattr(block, attribute)
        seen[layer] = []
        hooks.append(attention.register_forward_pre_hook(
            lambda m, args, kwargs, layer=layer: seen[layer].append(
                {"x": kwargs.get("hidden_states", args[0] if args else None).detach().numpy().copy()}),
            with_kwargs=True))
        hooks.append(getattr(attention, out_name).register_forward_hook(
            lambda m, args, output, layer=layer: seen[layer][-1].update(out=output.detach().numpy().copy())))
    try:
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    finally:
        for hook in hooks:
            hook.remove()
    assert all(len(calls) == NEW for calls in seen.values()), {k: len(v) for k, v in seen.items()}
    return seen


def _converted(model, name, layer):
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    hf_config = json.loads(model.config.to_json_string(use_diff=True))
    return layouts.to_canonical(SPECS[name][1], state, hf_config=hf_config, layer=layer)


_BUILT: dict[str, tuple] = {}


@pytest.fixture(scope="module", params=[pytest.param(m, marks=needs_transformers) for m in SPECS])
def generated(request):
    """(model name, {layer: (config, tensors)}, {layer: captured passes})."""
    name = request.param
    if name not in _BUILT:
        model = SPECS[name][0]()
        seen = _generate(model, name)
        _BUILT[name] = (name, {layer: _converted(model, name, layer) for layer in seen}, seen)
    return _BUILT[name]


def _steps():
    """Each forward pass generate made: (the keys' valid mask (B, P+T), positions (B, P+T)) over the cache
    and its tokens; generate's position_ids: cumsum(mask) - 1, the pads at 0."""
    valid = np.array([[1] * PROMPT, [0] * PADS + [1] * (PROMPT - PADS)])
    out = []
    for step in range(NEW):
        if step:
            valid = np.concatenate([valid, np.ones((2, 1), int)], axis=1)
        positions = np.where(valid == 1, valid.cumsum(-1) - 1, 0).astype(np.int64)
        out.append((valid.astype(bool), positions))
    return out


def _decode(forward, config, tensors, passes):
    """The prompt, then one token at a time on the returned cache, through forward(config, tensors, inputs,
    options) -> (the outputs of every pass, each (B, T, O), and the float64 reference's logit magnitudes where
    forward is the reference)."""
    outputs, past = [], None
    for (valid, positions), seen in zip(_steps(), passes, strict=True):
        x = seen["x"]
        T = x.shape[1]
        P = valid.shape[1] - T
        inputs = {"query": x, "positions": positions[:, P:], "key_positions": positions[:, P:],
                  "mask": valid[:, None, None, :]}  # (B, 1, 1, P+T): the pads hidden as keys
        options = {"is_causal": True, "return_cache": True}
        if P:
            inputs.update(past_key=past[0], past_value=past[1], past_key_positions=positions[:, :P])
            options["causal_alignment"] = "bottom_right"
        result = forward(config, tensors, inputs, options)
        past = (result["present_key"], result["present_value"])
        outputs.append(result)
    return outputs


def _real_rows(out, step):
    """The pass's output with the pads' own query rows (every key masked: arbitrary) zeroed."""
    out = np.array(out, np.float64)
    if step == 0:
        out[1, :PADS] = 0
    return out


def test_left_padded_generation_is_reproduced_token_by_token(generated):
    """Every block, every forward pass of generate: the float64 reference on the converted block, then every
    installed core backend (float32, the model's dtype, judged by the float32 policy with the reference's
    logit magnitudes), against the model's own output."""
    name, blocks, seen = generated
    reference = backends.load("numpy")
    margins = {}
    for layer, (config, tensors) in blocks.items():
        if name == "llama4_text":  # what the layout read: the chunked RoPE layer and the NoPE temperature layer
            assert (config.local_chunk, config.rope is None) == ((CHUNK, False) if layer == 0 else (None, True))
            assert layer == 0 or config.query_temperature.position == "cache_index", config.query_temperature
        else:
            assert config.alibi, config
        wide = {k: v.astype(np.float64) for k, v in tensors.items()}
        passes = [{"x": p["x"].astype(np.float64), "out": p["out"]} for p in seen[layer]]

        def traced(config, tensors, inputs, options):
            return reference.forward(config, tensors, inputs, options, trace=True)

        ref = _decode(traced, config, wide, passes)
        z = []  # the logit magnitudes the policy takes (ALiBi's bias included), per pass
        for result in ref:
            trace = dict(result["trace"])
            z.append(np.abs(trace["logits"]) + (np.abs(trace["alibi"] - trace["logits"]) if "alibi" in trace else 0))
        runs = {"float64 reference": ref}
        for backend_name, backend in _installed():
            runs[backend_name] = _decode(backend.forward, config, tensors, seen[layer])
        for run_name, results in runs.items():
            worst = 0.0
            for step, (result, p) in enumerate(zip(results, passes, strict=True)):
                expected = _real_rows(p["out"], step)
                tol = policy_for(config, dtype="float32", quantity="output", B=2, T=expected.shape[1],
                                 S=PROMPT + step, reference=expected, logits=z[step], max_position=PROMPT + NEW)
                comparison = compare(f"{name}[{layer}] {run_name} pass {step}",
                                     _real_rows(result["output"], step), expected, tol)
                assert comparison.ok, comparison.describe()
                worst = max(worst, comparison.margin)
            margins[f"{layer} {run_name}"] = worst
    print(f"{name}: worst margins " + ", ".join(f"{k} {v:.3g}" for k, v in margins.items()))


def _padded_row_error(config, tensors, passes, forward) -> float:
    """The float64 reference's worst difference to the model on the padded row's real outputs, every pass,
    relative to the largest output."""
    results = _decode(forward, config, {k: v.astype(np.float64) for k, v in tensors.items()}, passes)
    worst = max(float(np.abs(_real_rows(r["output"], s) - _real_rows(p["out"], s))[1].max())
                for s, (r, p) in enumerate(zip(results, passes, strict=True)))
    return worst / max(float(np.abs(p["out"]).max()) for p in passes)


def test_the_contract_without_them_does_not_reproduce_it(generated):
    """The two readings the contract could not avoid before, each moving the padded row's outputs by more
    than 1e-3 of their largest (the reproduction above stays within 0.02 of the float32 policy's allowance):
    the cache's keys at 0..P-1 (past_key_positions left out: Llama 4's chunked layer, BLOOM's ALiBi), and
    Llama 4's temperature from the positions instead of the cache index. So the test above can fail."""
    name, blocks, seen = generated
    reference = backends.load("numpy")
    passes = {layer: [{"x": p["x"].astype(np.float64), "out": p["out"]} for p in calls] for layer, calls in seen.items()}

    def forgetful(config, tensors, inputs, options):
        inputs = {k: v for k, v in inputs.items() if k != "past_key_positions"}
        return reference.forward(config, tensors, inputs, options)

    config, tensors = blocks[0]
    errors = {"cache at 0..P-1": _padded_row_error(config, tensors, passes[0], forgetful)}
    if name == "llama4_text":
        config, tensors = blocks[1]
        by_positions = config.replace(query_temperature={**config.query_temperature.to_dict(), "position": "positions"})
        errors["temperature from the positions"] = _padded_row_error(by_positions, tensors, passes[1],
                                                                     reference.forward)
    print(f"{name}: relative error of each bug on the padded row: "
          + ", ".join(f"{k} {v:.3g}" for k, v in errors.items()))
    assert all(v > 1e-3 for v in errors.values()), errors
