"""DeepSeek V4's attention (config.compressed) in the hf-deepseek and deepseek layouts: read and written back
(weights/layouts/deepseek_v4.py), transformers' names and DeepSeek's own.

A checkpoint is built here from the names and the nn.Linear shapes ((out, in): written out below, not taken from
the layout module), read into the contract and written back: the same keys and the same bytes, for each layer
kind and in both layouts. DeepSeek's own names are held against transformers' own renaming of the released
checkpoint (conversion_mapping.py's deepseek_v4 rules, applied by transformers' rename_source_key), and DeepSeek's
ModelArgs config against the transformers config.json of the same model. The reproduction of a transformers model
loaded with written weights is in tests/test_compressed_v4.py (it shares that file's tiny model).

The NumPy tests are marked `reference` (the numpy env, well under a second in all); the two that read
transformers are unmarked (the `all` env)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conformance.cli import files
from conformance.cli.commands import main as mha
from weights import layouts, load
from weights.format import WeightsFormatError
from weights.layouts.deepseek_v4 import v4_args_config, v4_config

D, N, H, QR, G, R, I, J = 32, 4, 16, 12, 2, 8, 2, 8  # hidden, heads, head_dim, q rank, groups, o rank, index
KINDS = ("sliding", "csa", "hca")
RATIOS = {"sliding": 0, "csa": 4, "hca": 8}
# transformers' config.json of a three-layer model, one layer of each kind
HF = {"model_type": "deepseek_v4", "hidden_size": D, "num_attention_heads": N, "head_dim": H,
      "partial_rotary_factor": 0.5, "q_lora_rank": QR, "o_groups": G, "o_lora_rank": R, "rms_norm_eps": 1e-6,
      "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
      "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, "sliding_window": 6,
      "index_n_heads": I, "index_head_dim": J, "index_topk": 2,
      "rope_parameters": {"main": {"rope_type": "default", "rope_theta": 10000.0},
                          "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 4.0,
                                       "original_max_position_embeddings": 16}}}
# DeepSeek's ModelArgs JSON of the same model (inference/config.json's keys)
ARGS = {"dim": D, "n_heads": N, "head_dim": H, "rope_head_dim": H // 2, "q_lora_rank": QR, "o_groups": G,
        "o_lora_rank": R, "norm_eps": 1e-6, "window_size": 6, "compress_ratios": [0, 4, 8], "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0, "rope_factor": 4.0, "original_seq_len": 16, "index_n_heads": I,
        "index_head_dim": J, "index_topk": 2}


def _shapes(kind: str, deepseek: bool) -> dict[str, tuple[int, ...]]:
    """{key under the layer's attention scope: shape} of one V4 layer: transformers' DeepseekV4Attention module
    names, or DeepSeek's inference/model.py Attention names (the renames of conversion_mapping.py's deepseek_v4
    rules), every nn.Linear weight (out, in)."""
    def name(hf, ds):
        return ds if deepseek else hf

    shapes = {name("q_a_proj.weight", "wq_a.weight"): (QR, D), name("q_a_norm.weight", "q_norm.weight"): (QR,),
              name("q_b_proj.weight", "wq_b.weight"): (N * H, QR), name("kv_proj.weight", "wkv.weight"): (H, D),
              "kv_norm.weight": (H,), name("o_a_proj.weight", "wo_a.weight"): (G * R, N * H // G),
              name("o_b_proj.weight", "wo_b.weight"): (D, G * R), name("sinks", "attn_sink"): (N,)}
    scopes = {"sliding": [], "hca": [("compressor.", H, 1)],
              "csa": [("compressor.", H, 2), (name("compressor.indexer.", "indexer.compressor."), J, 2)]}[kind]
    m = RATIOS[kind]
    for scope, width, c in scopes:
        shapes.update({scope + name("kv_proj.weight", "wkv.weight"): (c * width, D),
                       scope + name("gate_proj.weight", "wgate.weight"): (c * width, D),
                       scope + name("position_bias", "ape"): (m, c * width),
                       scope + name("kv_norm.weight", "norm.weight"): (width,)})
    if kind == "csa":
        shapes[name("compressor.indexer.q_b_proj.weight", "indexer.wq_b.weight")] = (I * J, QR)
        shapes[name("compressor.indexer.scorer.weights_proj.weight", "indexer.weights_proj.weight")] = (I, D)
    return shapes


def _checkpoint(kind: str, deepseek: bool, dtype="float32", seed=0) -> dict[str, np.ndarray]:
    layer = KINDS.index(kind)
    base = f"layers.{layer}.attn." if deepseek else f"model.layers.{layer}.self_attn."
    rng = np.random.default_rng(seed)
    return {base + key: rng.standard_normal(shape).astype(dtype) for key, shape in _shapes(kind, deepseek).items()}


def _same_bytes(a: dict, b: dict) -> list[str]:
    """The keys whose arrays differ in keys, dtype, shape or bytes (the conversion only moves numbers)."""
    return sorted(set(a) ^ set(b)) + [k for k in a if k in b and (
        a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or a[k].tobytes() != b[k].tobytes())]


@pytest.mark.reference
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("kind", KINDS)
def test_hf_deepseek_v4_round_trips_byte_for_byte(kind, dtype):
    """HF -> canonical -> HF (with the config file, read back under it): the same keys, the same bytes."""
    state = _checkpoint(kind, deepseek=False, dtype=dtype)
    layer = KINDS.index(kind)
    config, tensors = layouts.to_canonical("hf-deepseek", state, hf_config=HF, layer=layer)
    assert config.compressed.kind == kind
    back = layouts.from_canonical("hf-deepseek", config, tensors, hf_config=HF, layer=layer, prefix="model.")
    assert not _same_bytes(state, back), _same_bytes(state, back)


@pytest.mark.reference
@pytest.mark.parametrize("kind", KINDS)
def test_deepseek_names_read_and_write_the_same_layer(kind):
    """DeepSeek's own checkpoint of a layer, read with its ModelArgs JSON, is the transformers checkpoint's layer
    (the same config and tensors, the arrays at the renamed keys); deepseek -> canonical -> deepseek and
    hf-deepseek -> deepseek are byte for byte."""
    layer = KINDS.index(kind)
    ds = _checkpoint(kind, deepseek=True)
    hf_keys = list(_shapes(kind, deepseek=False))
    hf = {f"model.layers.{layer}.self_attn.{key}": ds[f"layers.{layer}.attn.{ds_key}"]
          for key, ds_key in zip(hf_keys, _shapes(kind, deepseek=True))}
    config, tensors = layouts.to_canonical("deepseek", ds, hf_config=ARGS, layer=layer)
    hf_config, hf_tensors = layouts.to_canonical("hf-deepseek", hf, hf_config=HF, layer=layer)
    assert config == hf_config, (config, hf_config)
    assert all(np.array_equal(tensors[t], hf_tensors[t]) for t in tensors)
    back = layouts.from_canonical("deepseek", config, tensors, hf_config=ARGS, layer=layer)
    assert not _same_bytes(ds, back), _same_bytes(ds, back)
    across = layouts.from_canonical("deepseek", hf_config, hf_tensors, layer=layer)
    assert not _same_bytes(ds, across), _same_bytes(ds, across)
    # a transformers config.json beside DeepSeek's names reads the same layer
    assert layouts.to_canonical("deepseek", ds, hf_config=HF, layer=layer)[0] == config


@pytest.mark.reference
@pytest.mark.parametrize("layer", [0, 1, 2])
def test_modelargs_and_config_json_give_one_config(layer):
    """The two config readers, written from two sources (DeepSeek's inference/model.py, transformers'
    configuration and modeling files), agree on each kind: the sliding layer on the plain main table, csa and hca
    on the compress table with YaRN (attention factor 1)."""
    ours, theirs = v4_args_config(ARGS, layer), v4_config(HF, layer)
    assert ours == theirs, (ours, theirs)
    assert (ours.rope.scaling is None) == (layer == 0) and ours.window_left == 5
    no_yarn = v4_args_config({**ARGS, "original_seq_len": 0}, 2)  # precompute_freqs_cis: YaRN iff > 0
    assert no_yarn.rope.scaling is None and no_yarn.rope.theta == 160000.0


# Port bugs of the ModelArgs reader: each makes it disagree with transformers' reading of the same model
ARGS_MUTANTS = {
    "window_size_as_window_left": lambda c, a, layer: c.replace(window_left=a["window_size"]),
    "yarn_on_the_sliding_layer": lambda c, a, layer: c if layer else c.replace(rope={
        **c.rope.to_dict(), "scaling": {"type": "yarn", "factor": a["rope_factor"], "attention_factor": 1.0,
                                        "original_max_position_embeddings": a["original_seq_len"]}}),
    "rope_theta_on_compressed_layers": lambda c, a, layer: c if not layer else c.replace(
        rope={**c.rope.to_dict(), "theta": a["rope_theta"]}),
    "hca_overlapping": lambda c, a, layer: c if layer != 2 else c.replace(
        compressed={**c.compressed.to_dict(), "overlap": True}),
}


@pytest.mark.reference
@pytest.mark.parametrize("bug", ARGS_MUTANTS)
def test_a_modelargs_reader_bug_is_caught(bug):
    """Each bug, planted on top of v4_args_config, breaks the agreement the test above holds on some layer."""
    wrong = [layer for layer in range(3)
             if ARGS_MUTANTS[bug](v4_args_config(ARGS, layer), ARGS, layer) != v4_config(HF, layer)]
    assert wrong, f"{bug} not caught"


@pytest.mark.reference
@pytest.mark.parametrize("layout,layer,change,message", [
    ("hf-deepseek", 1, {"compressed": {"kind": "csa", "query_rank": QR, "output_groups": G, "output_rank": R,
                                       "ratio": 4, "overlap": False, "index_heads": I, "index_head_dim": J,
                                       "index_topk": 2}},
     r"hf-deepseek cannot express compressed.overlap=False with kind csa"),
    ("hf-deepseek", 1, {"use_sinks": False}, r"hf-deepseek cannot express use_sinks=False"),
    ("hf-deepseek", 1, {"out_dim": 8}, r"hf-deepseek cannot express out_dim=8 \(needs out_dim == query_dim=32"),
    ("deepseek", 2, {"compressed": {"kind": "hca", "query_rank": QR, "output_groups": G, "output_rank": R,
                                    "ratio": 4}},
     r"deepseek cannot express compressed.ratio=4 with kind hca \(DeepSeek's ModelArgs names"),
])
def test_what_a_v4_layout_cannot_hold_is_refused(layout, layer, change, message):
    from weights import init

    config = v4_config(HF, layer).replace(**change)
    with pytest.raises(ValueError, match=message):
        layouts.from_canonical(layout, config, init(config, seed=0))
    assert layouts.cannot_express(layout, config)


@pytest.mark.reference
def test_the_readers_name_what_is_missing_or_unexpected():
    ds = _checkpoint("csa", deepseek=True)
    with pytest.raises(ValueError, match=r"DeepSeek's V4 ModelArgs config needs index_topk: got none"):
        layouts.to_canonical("deepseek", ds, hf_config={**ARGS, "index_topk": None}, layer=1)
    with pytest.raises(WeightsFormatError, match=r"deepseek: missing layers.1.attn.indexer.compressor.ape; "
                                                  r"unexpected layers.1.attn.wq_b.scale"):
        layouts.to_canonical("deepseek", {**{k: v for k, v in ds.items() if not k.endswith("indexer.compressor.ape")},
                                          "layers.1.attn.wq_b.scale": np.ones(1, np.float32)}, hf_config=ARGS, layer=1)
    # hca read as csa (a config whose compress_ratios says 4): the indexer's keys are missing
    with pytest.raises(WeightsFormatError, match=r"missing layers.2.attn.indexer.compressor.wkv.weight, .*"
                                                  r"layers.2.attn.indexer.wq_b.weight"):
        layouts.to_canonical("deepseek", _checkpoint("hca", deepseek=True),
                             hf_config={**ARGS, "compress_ratios": [0, 4, 4]}, layer=2)


@pytest.mark.reference
def test_a_v4_layer_through_mha_convert(tmp_path):
    """canonical -> deepseek (DeepSeek's names) -> canonical through the CLI, the ModelArgs config.json beside
    the file; -> hf-deepseek with --to-config: transformers' names, read back under that config."""
    from weights import init, save

    config = v4_args_config(ARGS, 1)
    tensors = init(config, seed=3)
    save(tmp_path / "v4.safetensors", config, tensors)
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "config.json").write_text(json.dumps(ARGS))
    (tmp_path / "hf.json").write_text(json.dumps(HF))
    written = tmp_path / "ds" / "model0-mp1.safetensors"
    assert mha(["convert", "--from", "canonical", "--to", "deepseek", str(tmp_path / "v4.safetensors"), str(written),
                "--layer", "1"]) == 0
    assert sorted(files.read_state(written)) == sorted(f"layers.1.attn.{k}" for k in _shapes("csa", deepseek=True))
    assert mha(["convert", "--from", "deepseek", "--to", "canonical", str(written), str(tmp_path / "c.safetensors")]) == 0
    again, read = load(tmp_path / "c.safetensors")
    assert again == config and not _same_bytes(read, tensors)
    assert mha(["convert", "--from", "deepseek", "--to", "hf-deepseek", str(written), str(tmp_path / "hf.safetensors"),
                "--layer", "1", "--to-prefix", "model.", "--to-config", str(tmp_path / "hf.json")]) == 0
    assert sorted(files.read_state(tmp_path / "hf.safetensors")) == sorted(
        f"model.layers.1.self_attn.{k}" for k in _shapes("csa", deepseek=False))


def test_deepseek_names_are_transformers_renaming_of_the_released_checkpoint():
    """transformers' own loader renames each of DeepSeek's keys (conversion_mapping.py's deepseek_v4 rules,
    core_model_loading.rename_source_key) to the hf-deepseek key the layout writes for the same tensor."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers", reason="transformers not installed: pip install '.[hf]'")
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    rules = get_checkpoint_conversion_mapping("deepseek_v4")
    if rules is None:
        pytest.skip(f"transformers {transformers.__version__} has no deepseek_v4 conversion mapping")
    renamings = [r for r in rules if isinstance(r, WeightRenaming)]
    converters = [r for r in rules if isinstance(r, WeightConverter)]
    for layer, kind in enumerate(KINDS):
        config = v4_config(HF, layer)
        ds = layouts.mapping("deepseek", config, layer=layer)
        hf = {canonical: key for key, (canonical,) in layouts.mapping("hf-deepseek", config, layer=layer).items()}
        renamed = {rename_source_key(key, renamings, converters)[0]: canonical for key, (canonical,) in ds.items()}
        assert renamed == {key: canonical for canonical, key in hf.items()}, (kind, renamed)
