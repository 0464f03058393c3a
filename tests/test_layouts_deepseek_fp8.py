"""The indexer's scoring precision from DeepSeek's own V3.2 checkpoint (the `deepseek` layout, its ModelArgs
config.json): DeepSeek's Indexer scores in fp8 on every call, whatever `dtype` says, with its scales rounded to a
power of two when `scale_fmt` is set (DeepSeek-V3.2-Exp at 3b99a53: inference/model.py:465-473, :865,
inference/kernel.py:109; docs/porting-modern.md "DeepSeek V3.2"), so the reader sets
config.indexer.scoring_precision "fp8_e4m3" and fp8_scale_format "ue8m0" / "float". transformers' port (hf-deepseek,
or deepseek under a transformers config.json) scores in float32 and leaves both unset; `mha convert
--indexer-scoring` sets or clears them.

A tiny DeepSeek-named block (random weights, float32, written as a checkpoint folder with the ModelArgs JSON)
converted with `mha convert --from deepseek --to canonical`: the written file's config has the two fields and
round-trips; the converted layer (the float64 NumPy reference) attends to the keys the float64 NumPy indexer
selects with precision="fp8_e4m3" and that scale format on the same weights, on a draw (SEED) where the plain,
fp8 and fp8-ue8m0 selections are three sets of keys (asserted), so the reader bugs of READER_MUTANTS (the field
dropped, scale_fmt ignored, fp8 taken for the weights' dtype) each fail. NumPy only, about 0.5 s (reference
marker)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import impl_numpy
from conformance.cli.commands import main as mha
from impl_numpy.indexer import lightning_indexer
from weights import AttentionConfig, layouts, load
from weights.layouts.indexer import with_indexer_scoring

pytestmark = pytest.mark.reference

D, N, QR, C, NOPE, R, V, I, J, K = 16, 4, 5, 6, 4, 4, 3, 4, 8, 3
B, T = 2, 12  # a causal prefill: the late queries keep 3 of up to 12 keys
SEED = 23  # a draw whose plain, fp8 and fp8-ue8m0 selections are three sets of keys (asserted in _selections)
# DeepSeek-V3.2-Exp's ModelArgs JSON (inference/config_671B_v3.2.json's keys, sizes shrunk; max_seq_len <=
# original_seq_len: no YaRN)
ARGS = {"dim": D, "n_heads": N, "q_lora_rank": QR, "kv_lora_rank": C, "qk_nope_head_dim": NOPE, "qk_rope_head_dim": R,
        "v_head_dim": V, "rope_theta": 10000.0, "max_seq_len": 64, "original_seq_len": 4096, "index_n_heads": I,
        "index_head_dim": J, "index_topk": K}
# the same model as transformers' config.json (deepseek_v32)
HF = {"model_type": "deepseek_v32", "hidden_size": D, "num_attention_heads": N, "q_lora_rank": QR,
      "kv_lora_rank": C, "qk_nope_head_dim": NOPE, "qk_rope_head_dim": R, "v_head_dim": V, "num_hidden_layers": 1,
      "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "max_position_embeddings": 64,
      "index_n_heads": I, "index_head_dim": J, "index_topk": K}
SHAPES = {"wq_a": (QR, D), "q_norm": (QR,), "wq_b": (N * (NOPE + R), QR), "wkv_a": (C + R, D), "kv_norm": (C,),
          "wkv_b": (N * (NOPE + V), C), "wo": (D, N * V), "indexer.wq_b": (I * J, QR), "indexer.wk": (J, D),
          "indexer.k_norm": (J,), "indexer.weights_proj": (I, D)}
# hf-deepseek's names of the attention's modules (DeepSeek-V3's inference/convert.py, read backwards)
HF_NAMES = {"wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj", "wkv_a": "kv_a_proj_with_mqa",
            "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
SCORINGS = {"plain": (None, "float"), "fp8_e4m3": ("fp8_e4m3", "float"), "fp8_e4m3:ue8m0": ("fp8_e4m3", "ue8m0")}


def _state() -> dict[str, np.ndarray]:
    """DeepSeek's names of one V3.2 block, random float32 weights (norm scales around 1)."""
    rng = np.random.default_rng(SEED)
    state = {f"layers.0.attn.{key}.weight": (1.0 if "norm" in key else 0.0) + 0.3 * rng.standard_normal(shape)
             for key, shape in SHAPES.items()}
    state["layers.0.attn.indexer.k_norm.bias"] = 0.3 * rng.standard_normal(J)
    return {key: value.astype(np.float32) for key, value in state.items()}


def _folder(tmp_path, config: dict, state=None, name="model0-mp1.safetensors"):
    from safetensors.numpy import save_file

    tmp_path.mkdir(exist_ok=True)
    save_file(_state() if state is None else state, tmp_path / name)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path / name


def _selections(config: AttentionConfig, tensors) -> dict[str, np.ndarray]:
    """The float64 NumPy indexer's selection under each scoring precision (the precision= argument, not the
    config's field), sorted per query; asserted to be three different sets of keys."""
    wide = {name: t.astype(np.float64) for name, t in tensors.items()}
    x = np.random.default_rng(SEED).standard_normal((B, T, D))
    plain = with_indexer_scoring(config, "plain")
    out = {name: np.sort(lightning_indexer(plain, wide, x, precision=p, fp8_scale_format=f)["topk_indices"], -1)
           for name, (p, f) in SCORINGS.items()}
    for a, b in (("plain", "fp8_e4m3"), ("plain", "fp8_e4m3:ue8m0"), ("fp8_e4m3", "fp8_e4m3:ue8m0")):
        assert (out[a] != out[b]).any(), f"no near tie tells {a} from {b}: another SEED"
    return out


def _layer_selection(config: AttentionConfig, tensors) -> np.ndarray:
    """The keys the float64 reference layer of `config` attends to (its indexer run by the call)."""
    wide = {name: t.astype(np.float64) for name, t in tensors.items()}
    x = np.random.default_rng(SEED).standard_normal((B, T, D))
    _, selection = impl_numpy.multi_head_attention(config, wide, x, is_causal=True, return_selection=True)
    return np.sort(selection, -1)


# (ModelArgs dtype, scale_fmt, the scoring DeepSeek's code runs): config_671B_v3.2.json's, ModelArgs' defaults, a mix
CASES = [("fp8", "ue8m0", "fp8_e4m3:ue8m0"), ("bf16", None, "fp8_e4m3"), ("bf16", "ue8m0", "fp8_e4m3:ue8m0")]
# the reader bugs a port of DeepSeek's config would make: _deepseek_scoring replaced by these
READER_MUTANTS = {
    "scoring_dropped": lambda cfg: {},  # transformers' plain scoring (the reader before it read the field)
    "scale_fmt_ignored": lambda cfg: {"scoring_precision": "fp8_e4m3", "fp8_scale_format": "float"},
    "dtype_gated": lambda cfg: {"scoring_precision": "fp8_e4m3", "fp8_scale_format": "ue8m0"}
    if cfg.get("dtype") == "fp8" else {},  # fp8 scoring taken for the weights' dtype
}


def _args(dtype, scale_fmt) -> dict:
    return {**ARGS, "dtype": dtype, **({} if scale_fmt is None else {"scale_fmt": scale_fmt})}


@pytest.mark.parametrize("dtype,scale_fmt,want", CASES)
def test_modelargs_set_deepseeks_fp8_scoring(tmp_path, dtype, scale_fmt, want):
    """config_671B_v3.2.json's dtype fp8 + scale_fmt ue8m0 reads fp8_e4m3 with ue8m0 scales; ModelArgs' defaults
    (dtype bf16, scale_fmt null) fp8_e4m3 with float scales (dtype is the Linear weights' storage alone); the
    canonical file's JSON holds the fields and reads back equal; the layer selects the fp8 keys."""
    args = _args(dtype, scale_fmt)
    src = _folder(tmp_path / "ds", args)
    assert mha(["convert", "--from", "deepseek", "--to", "canonical", str(src), str(tmp_path / "c.safetensors"),
                "--layer", "0"]) == 0
    config, tensors = load(tmp_path / "c.safetensors")
    precision, scale_format = SCORINGS[want]
    assert (config.indexer.scoring_precision, config.indexer.fp8_scale_format) == (precision, scale_format)
    written = json.loads(config.to_json())["indexer"]
    assert written["scoring_precision"] == "fp8_e4m3"
    assert written.get("fp8_scale_format", "float") == scale_format  # "float", the default, is not written
    assert AttentionConfig.from_json(config.to_json()) == config
    api_config, api = layouts.to_canonical("deepseek", _state(), hf_config=args, layer=0)
    assert api_config == config and all(np.array_equal(api[k], tensors[k]) for k in api)
    selections = _selections(config, tensors)
    assert np.array_equal(_layer_selection(config, tensors), selections[want])


@pytest.mark.parametrize("mutant", READER_MUTANTS)
def test_reader_mutants_attend_to_other_keys(monkeypatch, mutant):
    """Each reader bug, in place of _deepseek_scoring, makes the converted layer attend to keys DeepSeek's code
    does not select, on at least one of CASES (the check above fails it)."""
    from weights.layouts import deepseek

    monkeypatch.setattr(deepseek, "_deepseek_scoring", READER_MUTANTS[mutant])
    wrong = []
    for dtype, scale_fmt, want in CASES:
        config, tensors = layouts.to_canonical("deepseek", _state(), hf_config=_args(dtype, scale_fmt), layer=0)
        if not np.array_equal(_layer_selection(config, tensors), _selections(config, tensors)[want]):
            wrong.append((dtype, scale_fmt))
    assert wrong, f"{mutant} still selects DeepSeek's keys"
    print(f"{mutant}: other keys for {wrong}")


def test_transformers_port_leaves_it_unset_and_the_option_sets_it(tmp_path):
    """hf-deepseek (transformers' deepseek_v32 scores in float32: modeling_deepseek_v32.py:191-194, :227) and
    deepseek under a transformers config.json read no scoring precision (the plain selection);
    --indexer-scoring fp8_e4m3:ue8m0 on hf-deepseek gives what deepseek's ModelArgs reader gives (config and
    tensors); --indexer-scoring plain clears deepseek's."""
    own = _state()
    hf_state = {}
    for key, value in own.items():
        module = key[len("layers.0.attn."):]
        head, _, rest = module.partition(".")
        renamed = module if head == "indexer" else f"{HF_NAMES[head]}.{rest}"
        hf_state[f"model.layers.0.self_attn.{renamed}"] = value
    for layout, state in (("hf-deepseek", hf_state), ("deepseek", own)):
        config, _ = layouts.to_canonical(layout, state, hf_config=HF, layer=0)
        assert config.indexer is not None and config.indexer.scoring_precision is None, (layout, config.indexer)
    src = _folder(tmp_path / "hf", HF, hf_state, name="model.safetensors")
    assert mha(["convert", "--from", "hf-deepseek", "--to", "canonical", str(src.parent), str(tmp_path / "hf.safetensors"),
                "--layer", "0", "--indexer-scoring", "fp8_e4m3:ue8m0"]) == 0
    hf_config, hf_tensors = load(tmp_path / "hf.safetensors")
    ds_args = {**ARGS, "dtype": "fp8", "scale_fmt": "ue8m0"}
    ds_config, ds_tensors = layouts.to_canonical("deepseek", own, hf_config=ds_args, layer=0)
    assert hf_config == ds_config and all(np.array_equal(hf_tensors[k], ds_tensors[k]) for k in ds_tensors)
    selections = _selections(ds_config, ds_tensors)
    assert np.array_equal(_layer_selection(hf_config, hf_tensors), selections["fp8_e4m3:ue8m0"])
    src = _folder(tmp_path / "ds", ds_args)
    assert mha(["convert", "--from", "deepseek", "--to", "canonical", str(src), str(tmp_path / "plain.safetensors"),
                "--indexer-scoring", "plain"]) == 0
    plain, plain_tensors = load(tmp_path / "plain.safetensors")
    assert plain.indexer.scoring_precision is None and plain == with_indexer_scoring(ds_config, "plain")
    assert np.array_equal(_layer_selection(plain, plain_tensors), selections["plain"])


def test_writing_deepseek_under_its_modelargs_needs_the_fp8_scoring():
    """from_canonical("deepseek", hf_config=ModelArgs) reads the block back: a plain-scoring layer (transformers'
    port) is refused, naming the two precisions and the option; the fp8 one is written."""
    config, tensors = layouts.to_canonical("deepseek", _state(), hf_config=HF, layer=0)  # plain
    args = {**ARGS, "scale_fmt": "ue8m0"}
    with pytest.raises(ValueError, match="the indexer scores as plain, the destination's code as fp8_e4m3:ue8m0 "
                                         r"\(mha convert --indexer-scoring sets it\)") as err:
        layouts.from_canonical("deepseek", config, tensors, hf_config=args, layer=0)
    assert "\n" not in str(err.value)
    state = layouts.from_canonical("deepseek", with_indexer_scoring(config, "fp8_e4m3:ue8m0"), tensors,
                                   hf_config=args, layer=0)
    assert all(np.array_equal(state[k], v) for k, v in _state().items())


@pytest.mark.parametrize("argv,fragment", [
    (["--indexer-scoring", "fp8"], "--indexer-scoring must be one of plain, fp8_e4m3, fp8_e4m3:float, "
                                   "fp8_e4m3:ue8m0: got 'fp8'"),
    (["--indexer-scoring", "fp8_e4m3", "--v3"], "--indexer-scoring applies to a block with an indexer"),
    (["--head-dim", "12"], "indexer.scoring_precision fp8_e4m3 needs indexer.head_dim a power of two <= 128"),
])
def test_bad_values_are_one_line_errors(tmp_path, capsys, argv, fragment):
    """A bad --indexer-scoring, the option on a block without an indexer (DeepSeek V3's ModelArgs), a ModelArgs
    whose index_head_dim the fp8 simulation cannot run: exit 2, one line, no traceback."""
    args, state, extra = dict(ARGS), _state(), [a for a in argv if a not in ("--v3", "--head-dim", "12")]
    if "--v3" in argv:
        args = {k: v for k, v in ARGS.items() if not k.startswith("index_")}
        state = {k: v for k, v in state.items() if ".indexer." not in k}
    if "--head-dim" in argv:
        args["index_head_dim"] = 12
        state["layers.0.attn.indexer.wq_b.weight"] = np.zeros((I * 12, QR), np.float32)
        state["layers.0.attn.indexer.wk.weight"] = np.zeros((12, D), np.float32)
        state["layers.0.attn.indexer.k_norm.weight"] = state["layers.0.attn.indexer.k_norm.bias"] = np.ones(12, np.float32)
    src = _folder(tmp_path / "ds", args, state)
    capsys.readouterr()
    code = mha(["convert", "--from", "deepseek", "--to", "canonical", str(src), str(tmp_path / "c.safetensors"), *extra])
    err = capsys.readouterr().err
    assert code == 2 and fragment in err, (code, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "c.safetensors").exists()
