"""hf-llama and meta-llama on real models: a tiny randomly initialised transformers model (eager
attention, float32) is saved with save_pretrained, one attention block is converted with
`mha convert --from hf-llama --to canonical FOLDER W.safetensors --layer L`, and every installed
core backend reproduces that block's own output (captured by a forward hook on the attention
module) for a causal sequence, and for a decode step on a cache built by a previous call with
return_cache. The expected values are the model's own (an independent formulation); the float64
reference on the converted weights is held to the same output, so a conversion error cannot hide
behind a backend that shares it.

Also measured here: which keys a query of each windowed model sees (its own mask, read off its
attention weights), against the window_left the layout derives from `sliding_window`.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conformance.cli import files
from conformance.cli.commands import main as mha
from conformance.suite import backends
from conformance.suite.tolerance import compare, policy_for
from weights import layouts, load

try:
    import torch
    import transformers
except ImportError:  # the hf-llama tests skip; the meta-llama <-> hf-llama ones need NumPy only
    torch = transformers = None
# The real-model tests run every core backend: marked as cross-framework, so `tox -e all` (where the
# hf extra installs transformers) runs them; a framework env without transformers skips them.
needs_transformers = [pytest.mark.torch, pytest.mark.tf, pytest.mark.jax,
                      pytest.mark.skipif(transformers is None, reason="needs torch and transformers (extra hf)")]

T = 9  # tokens: longer than every window below, so the window hides keys
SMALL = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=2,
             intermediate_size=32, vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             max_position_embeddings=64)
# Each model type with the features its family uses turned on and small enough to matter at T tokens.
MODELS = {
    "llama": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 16}),
    "mistral": dict(sliding_window=3),
    "qwen2": dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),  # layer 1 slides
    "qwen3": dict(attention_bias=True),
    "gemma2": dict(sliding_window=3, attn_logit_softcapping=3.0, query_pre_attn_scalar=12),
    "gemma3_text": dict(sliding_window=4, query_pre_attn_scalar=12,
                        layer_types=["sliding_attention", "full_attention"]),
    "olmo2": dict(),
    "gpt_oss": dict(sliding_window=3, num_local_experts=2, num_experts_per_tok=1),
    "phi3": dict(partial_rotary_factor=0.5, sliding_window=5),
}
# The other decoder layouts: model_type -> (layout, config kwargs, path to the blocks, attention attribute)
OTHERS = {
    "gpt_neox": ("hf-gpt-neox", dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                                     intermediate_size=32, vocab_size=64, rope_parameters={
                                         "rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5},
                                     max_position_embeddings=64), "gpt_neox.layers", "attention"),
    "gptj": ("hf-gptj", dict(n_embd=32, n_head=4, n_layer=2, rotary_dim=4, vocab_size=64, n_positions=64),
             "transformer.h", "attn"),
}
LLAMA_FAMILY = ("hf-llama", None, "model.layers", "self_attn")


def _where(model_type: str):
    return OTHERS.get(model_type, LLAMA_FAMILY)


def _model(model_type: str):
    kwargs = OTHERS[model_type][1] if model_type in OTHERS else {**SMALL, **MODELS[model_type]}
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                          dtype=torch.float32)
    with torch.no_grad():  # random norms, sinks and biases too (their inits are ones or zeros)
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.5 if ("norm" in name or "sinks" in name or "bias" in name) else 0.2)
    return model.eval()


def _capture(model, model_type: str) -> dict[int, dict]:
    """Each block's attention input, output (after o_proj) and weights, from the model's own forward."""
    seen: dict[int, dict] = {}
    hooks = []
    _, _, path, attribute = _where(model_type)
    blocks = model
    for part in path.split("."):
        blocks = getattr(blocks, part)
    for index, block in enumerate(blocks):
        def hook(module, args, kwargs, output, index=index):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            seen[index] = {"x": hidden.detach().numpy().copy(), "out": output[0].detach().numpy().copy(),
                           "weights": output[1].detach().numpy().copy()}
        hooks.append(getattr(block, attribute).register_forward_hook(hook, with_kwargs=True))
    ids = torch.arange(3, 3 + T).reshape(1, T)
    with torch.no_grad():
        model(input_ids=ids, position_ids=torch.arange(T).reshape(1, T), output_attentions=True, use_cache=False)
    for hook in hooks:
        hook.remove()
    return seen


@pytest.fixture(scope="module", params=[pytest.param(m, marks=needs_transformers) for m in (*MODELS, *OTHERS)])
def converted(request, tmp_path_factory):
    """(model_type, {layer: (config, tensors, captured)}, state dict, config.json), converted
    through the CLI from the save_pretrained folder."""
    model_type = request.param
    model = _model(model_type)
    folder = tmp_path_factory.mktemp(model_type)
    model.save_pretrained(folder)
    seen = _capture(model, model_type)
    layout = _where(model_type)[0]
    blocks = {}
    for layer in seen:
        target = folder / f"block{layer}.safetensors"
        rc = mha(["convert", "--from", layout, "--to", "canonical", str(folder), str(target),
                  "--layer", str(layer)])
        assert rc == 0, f"mha convert of {model_type} block {layer} returned {rc}"
        config, tensors = load(target)
        blocks[layer] = (config, tensors, seen[layer])
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return model_type, blocks, state, json.loads((folder / "config.json").read_text())


def _check(name, actual, expected, config, *, S, logits, max_position) -> float:
    tol = policy_for(config, dtype="float32", quantity="output", B=1, T=expected.shape[1], S=S,
                     reference=expected, logits=logits, max_position=max_position)
    result = compare(name, actual, expected, tol)
    assert result.ok, result.describe()
    return result.margin


def check_block_reproduced(name: str, config, tensors, x, expected, *, decode=None) -> dict[str, float]:
    """The float64 reference, then every installed core backend, on a full causal call of x (B, L, D)
    against the model's own output, and a decode step of the last token on the cache the prefix returned
    (on the backends named in `decode`; None: every one). -> each check's margin (printed too)."""
    tokens = x.shape[1]
    positions = np.arange(tokens, dtype=np.int64)
    if config.rope is not None and config.rope.mrope_section is not None:  # multimodal RoPE: a text token's
        positions = np.stack([positions] * 3)  # three equal rows (temporal, height, width)
    wide = {k: v.astype(np.float64) for k, v in tensors.items()}
    ref = backends.load("numpy").forward(config, wide, {"query": x.astype(np.float64), "positions": positions},
                                         {"is_causal": True}, trace=True)
    logits = dict(ref["trace"])["logits"]
    check = dict(S=tokens, logits=logits, max_position=tokens)
    margins = {"float64": _check(f"{name} float64 reference", ref["output"], expected, config, **check)}
    for backend_name, backend in _installed():
        full = backend.forward(config, tensors, {"query": x, "positions": positions}, {"is_causal": True})
        margins[backend_name] = _check(f"{name} {backend_name}", full["output"], expected, config, **check)
        if decode is not None and backend_name not in decode:
            continue
        first = backend.forward(config, tensors, {"query": x[:, :-1], "positions": positions[..., :-1]},
                                {"is_causal": True, "return_cache": True})
        step = backend.forward(
            config, tensors, {"query": x[:, -1:], "positions": positions[..., -1:], "past_key": first["present_key"],
                              "past_value": first["present_value"]},
            {"is_causal": True, "causal_alignment": "bottom_right"})
        margins[f"{backend_name} decode"] = _check(f"{name} {backend_name} decode", step["output"], expected[:, -1:],
                                                   config, S=tokens, logits=logits[..., -1:, :], max_position=tokens)
    print(f"{name}: worst margins " + ", ".join(f"{k} {v:.3g}" for k, v in margins.items()))
    return margins


def _installed():
    out = []
    for backend in backends.CORE:
        try:
            out.append((backend, backends.load(backend)))
        except backends.BackendUnavailable:
            continue
    return out


def test_config_read_from_the_checkpoint(converted):
    """What the layout read from config.json, checked against the model's own attributes."""
    model_type, blocks, *_ = converted
    for layer, (config, _tensors, _seen) in blocks.items():
        spec = MODELS.get(model_type, {})
        assert config.rope is not None, (model_type, layer)
        assert config.rope.interleaved is (model_type == "gptj"), (model_type, layer, config.rope)  # rotate_every_two
        if model_type in ("phi3", "gpt_neox", "gptj"):  # half of each 8-wide head rotates
            assert config.rope.rotary_dim == 4, (model_type, config.rope)
        if model_type.startswith("gemma"):
            assert config.effective_scale == pytest.approx(12 ** -0.5), (model_type, config.scale)
        if model_type == "gemma2":
            assert config.logit_softcap == 3.0, (model_type, config.logit_softcap)
        assert config.use_sinks is (model_type == "gpt_oss"), (model_type, config.use_sinks)
        expect_norm = {"qwen3": "head", "gemma3_text": "head", "olmo2": "all"}.get(model_type)
        got_norm = config.qk_norm.scope if config.qk_norm else None
        assert got_norm == expect_norm, (model_type, config.qk_norm)
        if "sliding_window" not in spec:
            assert config.window_left == -1, (model_type, layer, config.window_left)


def test_window_is_the_models_own_mask(converted):
    """Measured: the number of keys each query row of the model's own attention weights gives
    weight to equals min(i, window_left) + 1 under the converted config (the whole prefix when
    the block has no window)."""
    model_type, blocks, *_ = converted
    for layer, (config, _tensors, seen) in blocks.items():
        weights = seen["weights"][0]  # (N, T, T)
        visible = (weights > 0).sum(-1)  # (N, T)
        left = config.window_left if config.window_left >= 0 else T
        expected = np.minimum(np.arange(T), left) + 1
        assert (visible == expected).all(), (
            f"{model_type} block {layer}: keys seen per row {visible[0].tolist()}, "
            f"window_left={config.window_left} gives {expected.tolist()}")
    windowed = [layer for layer, block in blocks.items() if block[0].window_left >= 0]
    assert bool(windowed) == ("sliding_window" in MODELS.get(model_type, {})), (model_type, windowed)


def test_backends_reproduce_the_block(converted):
    """Full causal call and one decode step on a cache, every installed core backend, against the
    model's own output; the float64 reference first."""
    model_type, blocks, *_ = converted
    for layer, (config, tensors, seen) in blocks.items():
        check_block_reproduced(f"{model_type}[{layer}]", config, tensors, seen["x"], seen["out"])


def test_round_trip_is_bit_exact(converted):
    """canonical -> the model's layout (with its config.json) -> canonical gives the same bits; the
    written tensors equal the checkpoint's own (Gemma's 1 + w: to one rounding of the addition)."""
    model_type, blocks, state, hf_config = converted
    layout, _, path, _ = _where(model_type)
    prefix = path.rsplit(".", 1)[0] + "."  # what precedes the layout's scope in the checkpoint
    for layer, (config, tensors, _seen) in blocks.items():
        written = layouts.from_canonical(layout, config, tensors, hf_config=hf_config, layer=layer, prefix=prefix)
        for key, value in written.items():
            if model_type == "gemma3_text" and "_norm." in key:
                np.testing.assert_allclose(value, state[key], rtol=0, atol=np.spacing(np.float32(2)),
                                           err_msg=key)
            else:
                assert value.dtype == state[key].dtype and np.array_equal(value, state[key]), key
        again_config, again = layouts.to_canonical(layout, written, hf_config=hf_config, layer=layer)
        assert again_config == config, (again_config, config)
        for name in tensors:
            assert np.array_equal(again[name], tensors[name]), (model_type, layer, name)


# -- meta-llama <-> hf-llama: the q/k row permutation ----------------------------------------

META = {"dim": 24, "n_heads": 4, "n_kv_heads": 2, "rope_theta": 500000.0, "multiple_of": 16, "norm_eps": 1e-5}
HF_OF_META = {"model_type": "llama", "hidden_size": 24, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 6, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
              "num_hidden_layers": 2, "rms_norm_eps": 1e-5, "attention_bias": False}


def _meta_state(seed: int = 5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    D, N, K, H = 24, 4, 2, 6
    state = {}
    for layer in range(2):
        p = f"layers.{layer}."
        state[p + "attention.wq.weight"] = (rng.standard_normal((N * H, D)) / 4).astype(np.float32)
        state[p + "attention.wk.weight"] = (rng.standard_normal((K * H, D)) / 4).astype(np.float32)
        state[p + "attention.wv.weight"] = (rng.standard_normal((K * H, D)) / 4).astype(np.float32)
        state[p + "attention.wo.weight"] = (rng.standard_normal((D, N * H)) / 4).astype(np.float32)
        state[p + "attention_norm.weight"] = np.ones(D, np.float32)  # another module's: ignored
    return state


def meta_attention(state, layer: int, x: np.ndarray, params=META) -> np.ndarray:
    """Meta's llama/model.py Attention in NumPy float64, written from its definition: the rotation
    multiplies consecutive feature pairs, viewed as complex numbers, by exp(i t theta^(-2j/H))
    (precompute_freqs_cis, apply_rotary_emb), kv heads repeated n_heads // n_kv_heads times each
    (repeat_kv), causal softmax of q k^T / sqrt(H)."""
    D, N, K = params["dim"], params["n_heads"], params["n_kv_heads"]
    H = D // N
    w = lambda name: state[f"layers.{layer}.attention.{name}.weight"].astype(np.float64)  # noqa: E731
    x = x.astype(np.float64)
    T = x.shape[1]
    q = (x @ w("wq").T).reshape(1, T, N, H)
    k = (x @ w("wk").T).reshape(1, T, K, H)
    v = (x @ w("wv").T).reshape(1, T, K, H)
    freqs = 1.0 / params["rope_theta"] ** (np.arange(0, H, 2)[: H // 2] / H)
    cis = np.exp(1j * np.outer(np.arange(T), freqs))[None, :, None, :]  # (1, T, 1, H/2)

    def rotate(a):
        c = (a[..., 0::2] + 1j * a[..., 1::2]) * cis
        return np.stack([c.real, c.imag], axis=-1).reshape(a.shape)

    q, k = rotate(q), rotate(k)
    k, v = np.repeat(k, N // K, axis=2), np.repeat(v, N // K, axis=2)
    scores = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
    scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bnts,bsnh->btnh", p, v).reshape(1, T, N * H)
    return out @ w("wo").T


def hf_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_llama_weights_to_hf.py's permute, written from its definition: each head's rows
    viewed (H/2, 2), transposed to (2, H/2): even rows first, then odd."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def _agree(name, backend, config, tensors, x, expected) -> float:
    positions = np.arange(x.shape[1], dtype=np.int64)
    out = backend.forward(config, tensors, {"query": x, "positions": positions}, {"is_causal": True})["output"]
    T = x.shape[1]
    tol = policy_for(config, dtype=str(x.dtype), quantity="output", B=1, T=T, S=T, reference=expected,
                     max_position=T)
    result = compare(name, out, expected, tol)
    assert result.ok, result.describe()
    return result.margin


def test_meta_llama_reads_meta_attention():
    """meta-llama -> canonical (interleaved RoPE): every installed core backend computes Meta's attention."""
    state = _meta_state()
    x = np.random.default_rng(1).standard_normal((1, T, 24)).astype(np.float32)
    for layer in (0, 1):
        config, tensors = layouts.to_canonical("meta-llama", state, hf_config=META, layer=layer)
        assert config.rope.interleaved is True and config.rope.theta == 500000.0, config.rope
        assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 6), config
        expected = meta_attention(state, layer, x)
        for name, backend in _installed():
            _agree(f"meta-llama[{layer}] {name}", backend, config, tensors, x, expected)


def test_meta_to_hf_and_back_through_the_cli(tmp_path):
    """mha convert meta-llama -> hf-llama permutes wq and wk rows exactly as Hugging Face's converter
    does; the converted block computes Meta's numbers on every installed backend (half-split RoPE
    now); and hf-llama -> meta-llama gives back Meta's tensors bit for bit."""
    state = _meta_state()
    meta_dir, hf_dir = tmp_path / "meta", tmp_path / "hf"
    meta_dir.mkdir()
    hf_dir.mkdir()
    files.write_state(meta_dir / "consolidated.safetensors", state, layout="meta-llama")
    (meta_dir / "params.json").write_text(json.dumps(META))
    (hf_dir / "config.json").write_text(json.dumps(HF_OF_META))
    x = np.random.default_rng(2).standard_normal((1, T, 24)).astype(np.float32)
    layer = 1
    assert mha(["convert", "--from", "meta-llama", "--to", "hf-llama", str(meta_dir / "consolidated.safetensors"),
                str(hf_dir / "model.safetensors"), "--layer", str(layer), "--to-prefix", "model.",
                "--to-config", str(hf_dir / "config.json")]) == 0
    hf_state = files.read_state(hf_dir / "model.safetensors")
    p = f"model.layers.{layer}.self_attn."
    np.testing.assert_array_equal(hf_state[p + "q_proj.weight"], hf_permute(state[f"layers.{layer}.attention.wq.weight"], 4))
    np.testing.assert_array_equal(hf_state[p + "k_proj.weight"], hf_permute(state[f"layers.{layer}.attention.wk.weight"], 2))
    np.testing.assert_array_equal(hf_state[p + "v_proj.weight"], state[f"layers.{layer}.attention.wv.weight"])

    assert mha(["convert", "--from", "hf-llama", "--to", "canonical", str(hf_dir), str(tmp_path / "c.safetensors"),
                "--layer", str(layer)]) == 0
    config, tensors = load(tmp_path / "c.safetensors")
    assert config.rope.interleaved is False, config.rope
    expected = meta_attention(state, layer, x)
    for name, backend in _installed():
        _agree(f"meta -> hf-llama {name}", backend, config, tensors, x, expected)

    assert mha(["convert", "--from", "hf-llama", "--to", "meta-llama", str(hf_dir), str(tmp_path / "back.safetensors"),
                "--layer", str(layer), "--to-config", str(meta_dir / "params.json")]) == 0
    back = files.read_state(tmp_path / "back.safetensors")
    for key, value in back.items():
        assert value.dtype == state[key].dtype and np.array_equal(value, state[key]), key


@pytest.mark.skipif(transformers is None, reason="needs torch and transformers (extra hf)")
def test_meta_converted_runs_in_transformers():  # unmarked, as tests/test_rope.py: tox -e all runs it
    """The hf-llama state converted from Meta's, loaded into transformers' LlamaAttention, computes
    Meta's attention: the permutation is the one Hugging Face's model expects."""
    state = _meta_state()
    config, tensors = layouts.to_canonical("meta-llama", state, hf_config=META, layer=0)
    hf_state = layouts.from_canonical("hf-llama", config, tensors, hf_config=HF_OF_META, layer=0, prefix="model.")
    cfg = transformers.LlamaConfig(**{k: v for k, v in HF_OF_META.items() if k != "model_type"},
                                   intermediate_size=16, vocab_size=8)
    model = transformers.LlamaForCausalLM(cfg).eval()
    missing = model.load_state_dict({k: torch.from_numpy(v) for k, v in hf_state.items()}, strict=False)
    assert not missing.unexpected_keys, missing.unexpected_keys
    x = np.random.default_rng(3).standard_normal((1, T, 24)).astype(np.float32)
    xt = torch.from_numpy(x)
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(xt, torch.arange(T).reshape(1, T))
        causal = torch.full((T, T), float("-inf")).triu(1).reshape(1, 1, T, T)
        out, _ = model.model.layers[0].self_attn(hidden_states=xt, position_embeddings=(cos, sin),
                                                 attention_mask=causal)
    expected = meta_attention(state, 0, x)
    config_hf, _ = layouts.to_canonical("hf-llama", hf_state, hf_config=HF_OF_META, layer=0)
    tol = policy_for(config_hf, dtype="float32", quantity="output", B=1, T=T, S=T, reference=expected, max_position=T)
    result = compare("transformers LlamaAttention on the converted Meta block", out.numpy(), expected, tol)
    assert result.ok, result.describe()
