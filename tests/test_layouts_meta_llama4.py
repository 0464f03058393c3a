"""meta-llama on Llama 4 as Meta ships it: params.json with Scout's and Maverick's attention fields (NoPE
layers, QK-norm, local chunks, the NoPE layers' query temperature, Scout's rope scaling: factor 16 with
low_freq_factor = high_freq_factor = 1, a step) and Meta's fused wqkv.

Two formulations of Meta's attention are checked against the converted block:
- `meta_llama4_attention` below: this project's own NumPy float64 formulation, written from reading
  llama-models' models/llama4/model.py (Attention.forward, TransformerBlock's NoPE rule,
  apply_scaling, create_chunked_attention_mask); not Meta's code. It runs everywhere.
- Meta's own code (llama-models' llama_models/llama4/model.py, run on CPU): where the package and
  fairscale are installed (`pip install --no-deps llama-models==0.3.0 fairscale==0.4.13`, with pydantic),
  a tiny Transformer is built with Meta's ModelArgs and run through Transformer.forward (its masks, its
  freqs_cis), each block's attention captured by a forward hook. Its Attention allocates its cache with
  .cuda(); on a machine without CUDA the test makes Tensor.cuda a no-op for that construction only.
Positions up to T - 1 = 11 with chunks of 4, a NoPE layer every 2nd and floor_scale 4 put every field in
play at 12 tokens; head_dim 16 with rope_theta 500000 puts three of the eight pairs past Meta's fixed
original length 8192 (divided by 16 in Scout's reading) and one inside Llama 3's band (where a
factor 8 / high 4 reading blends it).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from test_layouts_modern import check_block_reproduced

from conformance.cli import files
from conformance.cli.commands import main as mha
from weights import layouts, load

T = 12
D, N, K = 64, 4, 2
H = D // N
# The attention fields of Scout's and Maverick's params.json (llama-models' models/llama4/args.py names) at
# test sizes; the rest of each file (moe_args, vision_args, ffn sizes, vocab) as published, sizes shrunk.
COMMON = {"dim": D, "n_layers": 2, "n_heads": N, "n_kv_heads": K, "vocab_size": 16, "multiple_of": 16,
          "ffn_dim_multiplier": 1.2, "ffn_exp": 4.0, "norm_eps": 1e-2, "rope_theta": 500000.0,
          "nope_layer_interval": 2, "attention_chunk_size": 4, "attn_temperature_tuning": True, "floor_scale": 4.0,
          "attn_scale": 0.5, "max_seq_len": 32, "max_batch_size": 1}
SCOUT = {**COMMON, "use_scaled_rope": True, "use_qk_norm": True,
         "moe_args": {"num_experts": 2, "capacity_factor": 1.0, "auto_scale_F": True, "top_k": 1,
                      "interleave_moe_layer_step": 1}}
MAVERICK = {**COMMON, "use_scaled_rope": False, "use_qk_norm": False,
            "moe_args": {"num_experts": 2, "capacity_factor": 1.0, "auto_scale_F": True, "top_k": 1,
                         "interleave_moe_layer_step": 2}}
MODELS = {"scout": SCOUT, "maverick": MAVERICK}


def _frequencies(params) -> np.ndarray:
    """Meta's precompute_freqs_cis / apply_scaling, restated: low_freq_factor 1, original length 8192, and
    (llama4/args.py) factor 16, high_freq_factor 1 unless params.json gives them."""
    base = params["rope_theta"] ** (-np.arange(0, H, 2, dtype=np.float64) / H)
    if not params.get("use_scaled_rope"):
        return base
    factor = params.get("rope_scaling_factor") or 16.0
    high = params.get("rope_high_freq_factor") or 1.0
    out = []
    for f in base:
        wavelength = 2 * math.pi / f
        if wavelength < 8192 / high:
            out.append(f)
        elif wavelength > 8192:
            out.append(f / factor)
        else:
            smooth = (8192 / wavelength - 1) / (high - 1)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


def meta_llama4_attention(state, layer: int, x: np.ndarray, params) -> np.ndarray:
    """Meta's Llama 4 Attention.forward of block `layer` on a prefill from position 0, in float64."""
    w = lambda name: state[f"layers.{layer}.attention.{name}.weight"].astype(np.float64)  # noqa: E731
    if f"layers.{layer}.attention.wqkv.weight" in state:
        wq, wk, wv = np.split(w("wqkv"), [N * H, (N + K) * H])
    else:
        wq, wk, wv = w("wq"), w("wk"), w("wv")
    x = x.astype(np.float64)
    tokens = x.shape[1]
    q = (x @ wq.T).reshape(1, tokens, N, H)
    k = (x @ wk.T).reshape(1, tokens, K, H)
    v = (x @ wv.T).reshape(1, tokens, K, H)
    t = np.arange(tokens)
    nope = params.get("nope_layer_interval") and (layer + 1) % params["nope_layer_interval"] == 0
    if not nope:
        cis = np.exp(1j * np.outer(t, _frequencies(params)))[None, :, None, :]  # (1, T, 1, H/2)

        def rotate(a):
            c = (a[..., 0::2] + 1j * a[..., 1::2]) * cis
            return np.stack([c.real, c.imag], axis=-1).reshape(a.shape)

        q, k = rotate(q), rotate(k)
        if params.get("use_qk_norm"):
            eps = params["norm_eps"]
            q = q / np.sqrt((q * q).mean(-1, keepdims=True) + eps)
            k = k / np.sqrt((k * k).mean(-1, keepdims=True) + eps)
    elif params.get("attn_temperature_tuning"):
        scales = np.log(np.floor((t + 1.0) / params["floor_scale"]) + 1.0) * params["attn_scale"] + 1.0
        q = q * scales[None, :, None, None]
    k, v = np.repeat(k, N // K, axis=2), np.repeat(v, N // K, axis=2)
    scores = np.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(H)
    allowed = t[None, :] <= t[:, None]
    if not nope and params.get("attention_chunk_size"):
        chunk = params["attention_chunk_size"]
        allowed = allowed & (t[None, :] // chunk == t[:, None] // chunk)
    scores = np.where(allowed, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", p, v).reshape(1, tokens, N * H) @ w("wo").T


def _state(fused: bool, seed: int = 7) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    state = {}
    for layer in range(2):
        p = f"layers.{layer}.attention."
        q, k, v = (rng.standard_normal((rows, D)).astype(np.float32) / 4 for rows in (N * H, K * H, K * H))
        if fused:  # Meta's Llama 4 checkpoints: wqkv = [wq; wk; wv] (Attention.load_hook splits it)
            state[p + "wqkv.weight"] = np.concatenate([q, k, v])
        else:
            state[p + "wq.weight"], state[p + "wk.weight"], state[p + "wv.weight"] = q, k, v
        state[p + "wo.weight"] = rng.standard_normal((D, N * H)).astype(np.float32) / 4
    return state


def _convert(tmp_path, state, params, layer):
    """mha convert --from meta-llama --to canonical, params.json beside the checkpoint."""
    files.write_state(tmp_path / "consolidated.00.safetensors", state, layout="meta-llama", overwrite=True)
    (tmp_path / "params.json").write_text(json.dumps(params))
    target = tmp_path / f"block{layer}.safetensors"
    assert mha(["convert", "--from", "meta-llama", "--to", "canonical", str(tmp_path / "consolidated.00.safetensors"),
                str(target), "--layer", str(layer)]) == 0
    return load(target)


def test_params_json_reads_every_llama4_field():
    """Scout: rope layer 0 (Scout's step scaling, QK-norm after RoPE, chunks), NoPE layer 1 (temperature);
    Maverick: the same without the scaling and the norm."""
    state = _state(fused=True)
    scout0, _ = layouts.to_canonical("meta-llama", state, hf_config=SCOUT, layer=0)
    scaling = scout0.rope.scaling
    assert (scaling.type, scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor,
            scaling.original_max_position_embeddings) == ("llama3", 16.0, 1.0, 1.0, 8192), scaling
    assert scout0.rope.interleaved and scout0.local_chunk == 4 and scout0.query_temperature is None, scout0
    assert scout0.qk_norm.after_rope and not scout0.qk_norm.weight and scout0.qk_norm.eps == 1e-2, scout0.qk_norm
    scout1, _ = layouts.to_canonical("meta-llama", state, hf_config=SCOUT, layer=1)
    assert scout1.rope is None and scout1.qk_norm is None and scout1.local_chunk is None, scout1
    assert scout1.query_temperature.to_dict() == {"beta": 0.5, "floor": 4.0, "offset": 1, "position": "cache_index"}
    maverick0, _ = layouts.to_canonical("meta-llama", state, hf_config=MAVERICK, layer=0)
    assert maverick0.rope.scaling is None and maverick0.qk_norm is None and maverick0.local_chunk == 4, maverick0
    # a params.json nested under "model" (as transformers' converter allows) reads the same
    assert layouts.to_canonical("meta-llama", state, hf_config={"model": SCOUT}, layer=0)[0] == scout0


@pytest.mark.parametrize("model", MODELS)
def test_numpy_reference_computes_meta_llama4(model, tmp_path):
    """The converted blocks (fused wqkv for Scout, separate wq/wk/wv for Maverick) against this project's
    formulation of Meta's attention: the float64 reference and every installed core backend."""
    params = MODELS[model]
    state = _state(fused=model == "scout")
    x = np.random.default_rng(3).standard_normal((1, T, D)).astype(np.float32)
    for layer in (0, 1):
        config, tensors = _convert(tmp_path, state, params, layer)
        check_block_reproduced(f"meta-llama {model}[{layer}]", config, tensors, x,
                        meta_llama4_attention(state, layer, x, params).astype(np.float32))


def test_a_field_read_wrongly_is_caught():
    """The formulation is not blind to what the reader used to drop: Scout read as Llama 3.1's scaling
    (factor 8, high 4), without the QK-norm, the chunks or the temperature moves the output."""
    state = _state(fused=True)
    x = np.random.default_rng(3).standard_normal((1, T, D))
    right = meta_llama4_attention(state, 0, x, SCOUT)
    for wrong in ({"rope_scaling_factor": 8.0, "rope_high_freq_factor": 4.0}, {"use_qk_norm": False},
                  {"attention_chunk_size": None}):
        moved = np.abs(meta_llama4_attention(state, 0, x, {**SCOUT, **wrong}) - right).max() / np.abs(right).max()
        assert moved > 1e-4, (wrong, moved)
    moved = np.abs(meta_llama4_attention(state, 1, x, {**SCOUT, "attn_temperature_tuning": False})
                   - meta_llama4_attention(state, 1, x, SCOUT)).max()
    assert moved > 1e-3, moved


def test_unknown_and_contradicting_keys_are_refused():
    state = _state(fused=True)
    with pytest.raises(ValueError, match=r"does not read params.json's rope_type, sliding_window \(read:"):
        layouts.to_canonical("meta-llama", state, hf_config={**SCOUT, "sliding_window": 4, "rope_type": "x"}, layer=0)
    with pytest.raises(ValueError, match="head_dim must be dim // n_heads = 16"):
        layouts.to_canonical("meta-llama", state, hf_config={**SCOUT, "head_dim": 8}, layer=0)


# -- Meta's own code, where llama-models is installed ------------------------------------------------------

def _meta_code():
    torch = pytest.importorskip("torch")
    pytest.importorskip("fairscale", reason="Meta's reference needs fairscale: pip install fairscale==0.4.13")
    pytest.importorskip("llama_models.llama4.model", reason="Meta's reference code is not installed: "
                        "pip install --no-deps llama-models==0.3.0 fairscale==0.4.13 (and pydantic)")
    return torch


def _run_meta(torch, params):
    """Meta's Transformer (llama_models.llama4) on a tiny config, float32 on CPU: each block's attention
    input and output from its own forward (Transformer.forward builds the masks and freqs_cis)."""
    import os

    import fairscale.nn.model_parallel.initialize as fs_init
    import torch.distributed as dist
    from llama_models.llama4 import model as meta
    from llama_models.llama4.args import ModelArgs
    from llama_models.llama4.datatypes import TransformerInput

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("gloo", rank=0, world_size=1)
    if not fs_init.model_parallel_is_initialized():
        fs_init.initialize_model_parallel(1)
    args = ModelArgs(**{k: v for k, v in params.items() if k != "moe_args"})  # dense blocks: attention alone matters
    cuda = torch.Tensor.cuda
    try:
        if not torch.cuda.is_available():
            torch.Tensor.cuda = lambda self, *a, **k: self  # Attention.__init__ puts its cache on .cuda()
        torch.manual_seed(0)
        model = meta.Transformer(args)
    finally:
        torch.Tensor.cuda = cuda
    with torch.no_grad():  # ColumnParallelLinear's init_method is the identity on an empty tensor: fill them all
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.5 if "norm" in name else 0.25)
    seen, hooks = {}, []
    for index, block in enumerate(model.layers):
        def hook(module, inputs, output, index=index):
            seen[index] = (inputs[0].detach().numpy().copy(), output.detach().numpy().copy())
        hooks.append(block.attention.register_forward_hook(hook))
    model.forward(TransformerInput(tokens=torch.arange(1, T + 1).reshape(1, T) % args.vocab_size, tokens_position=0))
    for hook in hooks:
        hook.remove()
    state = {k: v.detach().numpy() for k, v in model.state_dict().items() if ".attention.w" in k}
    return state, seen


@pytest.mark.torch
@pytest.mark.tf
@pytest.mark.jax
@pytest.mark.parametrize("model", MODELS)
def test_converted_block_reproduces_metas_own_code(model, tmp_path):
    """Meta's own Llama 4 prefill, each block converted through `mha convert --from meta-llama` (Scout's as
    the fused wqkv Meta ships): the float64 reference and every installed backend reproduce it; this
    project's formulation agrees with it too."""
    torch = _meta_code()
    params = MODELS[model]
    state, seen = _run_meta(torch, params)
    if model == "scout":
        for layer in (0, 1):
            p = f"layers.{layer}.attention."
            state[p + "wqkv.weight"] = np.concatenate([state.pop(p + w) for w in ("wq.weight", "wk.weight",
                                                                                   "wv.weight")])
    for layer, (x, expected) in seen.items():
        config, tensors = _convert(tmp_path, state, params, layer)
        check_block_reproduced(f"Meta's llama4 {model}[{layer}]", config, tensors, x, expected)
        mine = meta_llama4_attention(state, layer, x, params)
        scale = np.abs(expected).max()
        # Meta's code runs in float32: sums of D = 64 and S <= 12 terms, a softmax and wo, each ~1e-7
        # relative; 1e-5 of the largest output is 100x that, and 1000x below what a misread field moves
        assert np.abs(mine - expected).max() <= 1e-5 * scale, (model, layer, np.abs(mine - expected).max(), scale)


def test_meta_llama_and_hf_llama_read_scout_alike():
    """The same Scout-like blocks read from Meta's params.json and from transformers' llama4_text config.json
    (rope_parameters llama3 with factor 16, low and high 1: Scout's published config) are the same config."""
    hf = {"model_type": "llama4_text", "hidden_size": D, "num_attention_heads": N, "num_key_value_heads": K,
          "head_dim": H, "rms_norm_eps": 1e-2, "no_rope_layers": [1, 0], "attention_chunk_size": 4,
          "use_qk_norm": True, "attn_temperature_tuning": True, "floor_scale": 4, "attn_scale": 0.5,
          "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}}
    meta_state = _state(fused=False)
    hf_state = {k.replace("attention.w", "self_attn.").replace(".weight", "_proj.weight"): v  # wq -> q_proj ...
                for k, v in meta_state.items()}
    for layer in (0, 1):
        from_meta, _ = layouts.to_canonical("meta-llama", meta_state, hf_config=SCOUT, layer=layer)
        from_hf, _ = layouts.to_canonical("hf-llama", hf_state, hf_config=hf, layer=layer)
        assert from_meta == from_hf, (layer, from_meta, from_hf)
