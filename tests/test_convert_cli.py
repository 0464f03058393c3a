"""`mha convert` (conformance.cli.convert.run) on files of every kind, both
directions: round trips are bit-exact, files the frameworks wrote themselves
are read, files we write load back into the frameworks, and bad input gets one
line naming the argument."""

from __future__ import annotations

import argparse
import os
import pickle
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
from assertions import assert_bit_exact

from conformance.cli import convert, files
from weights import DTYPES, AttentionConfig, WeightsFormatError, init, layouts, load, save

NEEDS = {".pt": "torch", ".pth": "torch", ".bin": "torch", ".weights.h5": "h5py", ".msgpack": "flax",
         ".safetensors": None}


def parser():
    top = argparse.ArgumentParser(prog="mha")
    convert.add_parser(top.add_subparsers(dest="command"))
    return top


def mha_convert(*argv) -> int:
    args = parser().parse_args(["convert", *map(str, argv)])
    return args.func(args)


def need(ext):
    module = NEEDS[ext]
    if module:
        pytest.importorskip(module, reason=f"{module} not installed: the {ext} file kind needs it")


def one_line_error(excinfo, *pieces):
    message = str(excinfo.value)
    assert "\n" not in message, f"not one line: {message!r}"
    for piece in pieces:
        assert piece in message, f"{piece!r} not in {message!r}"


MARKS = {".pt": pytest.mark.torch, ".pth": pytest.mark.torch, ".bin": pytest.mark.torch,
         ".weights.h5": pytest.mark.tf, ".msgpack": pytest.mark.jax, ".safetensors": ()}
CASES = [  # (layout, file extension, config)
    ("torch-mha", ".pt", dict(num_heads=2, query_dim=8, head_dim=4)),
    ("torch-mha", ".safetensors", dict(num_heads=2, query_dim=8, head_dim=4, key_dim=3, value_dim=5)),
    ("torch-linears", ".bin", dict(num_heads=4, num_kv_heads=2, query_dim=6, head_dim=2, out_dim=5,
                                   use_query_bias=False)),
    ("torch-fused-qkv", ".safetensors", dict(num_heads=2, query_dim=6, head_dim=3, out_dim=4)),
    ("torch-per-head", ".pth", dict(num_heads=3, query_dim=5, head_dim=2, value_head_dim=3)),
    ("keras-split-heads", ".weights.h5", dict(num_heads=2, query_dim=6, key_dim=5, value_dim=7, head_dim=3)),
    ("keras-mha", ".weights.h5", dict(num_heads=2, query_dim=6, key_dim=5, value_dim=7, head_dim=3,
                                      value_head_dim=2, out_dim=4)),
    ("flax-linen-mha", ".msgpack", dict(num_heads=2, query_dim=6, key_dim=5, value_dim=7, head_dim=3, out_dim=4)),
    ("flax-nnx-mha", ".msgpack", dict(num_heads=4, num_kv_heads=2, query_dim=6, key_dim=5, value_dim=5,
                                      head_dim=3, use_query_bias=False, use_key_bias=False,
                                      use_value_bias=False, use_output_bias=False)),
    ("hf-bert", ".safetensors", dict(num_heads=2, query_dim=8, head_dim=4)),
    ("hf-gpt2", ".bin", dict(num_heads=2, query_dim=8, head_dim=4)),
]
CASES = [pytest.param(*case, marks=MARKS[case[1]], id=f"{case[0]}{case[1]}") for case in CASES]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout,ext,dims", CASES)
def test_round_trip_through_files(tmp_path, layout, ext, dims, dtype):
    need(ext)
    config = AttentionConfig(**dims)
    tensors = init(config, seed=1, dtype=dtype)
    save(tmp_path / "w.safetensors", config, tensors)
    foreign = tmp_path / f"foreign{ext}"
    assert mha_convert("--from", "canonical", "--to", layout, tmp_path / "w.safetensors", foreign) == 0
    state = files.read_state(foreign, layout=layout)
    assert_bit_exact(layouts.from_canonical(layout, config, tensors), state, f"{layout}{ext} file contents")
    assert mha_convert("--from", layout, "--to", "canonical", foreign, tmp_path / "back.safetensors",
                       "--num-heads", config.num_heads) == 0
    back_config, back = load(tmp_path / "back.safetensors")
    assert back_config == config, (back_config, config)
    assert_bit_exact(tensors, back, f"{layout}{ext} canonical -> file -> canonical")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["w.safetensors", foreign.name, "back.safetensors"])


@pytest.mark.torch
def test_layout_to_layout_and_names(tmp_path):
    pytest.importorskip("torch", reason="torch not installed: the .pt file kind needs it")
    config = AttentionConfig(num_heads=2, query_dim=8, head_dim=4)
    tensors = init(config, seed=2)
    files.write_state(tmp_path / "seed000.pt", layouts.from_canonical("torch-fused-qkv", config, tensors,
                                                                       names="qkv_proj,out_proj"))
    assert mha_convert("--from", "torch-fused-qkv", "--to", "torch-linears", tmp_path / "seed000.pt",
                       tmp_path / "lin.pt", "--num-heads", 2, "--to-names", "query=Wq,key=Wk,value=Wv,output=Wo") == 0
    state = files.read_state(tmp_path / "lin.pt")
    assert set(state) == {f"W{r}.{p}" for r in "qkvo" for p in ("weight", "bias")}
    assert mha_convert("--from", "torch-linears", "--to", "torch-per-head", tmp_path / "lin.pt",
                       tmp_path / "heads.pt", "--num-heads", 2, "--names", "Wq,Wk,Wv,Wo",
                       "--to-names", "heads=h,query=q,key=k,value=v,output=o") == 0
    assert "h.1.q.weight" in files.read_state(tmp_path / "heads.pt")
    _, back = layouts.to_canonical("torch-per-head", files.read_state(tmp_path / "heads.pt"),
                                   names="h,q,k,v,o")
    assert_bit_exact(tensors, back, "fused -> linears -> per-head")


def test_hf_checkpoint_folder_every_layer(tmp_path, capsys):
    config = AttentionConfig(num_heads=2, query_dim=8, head_dim=4)
    layers = [init(config, seed=10 + i, dtype="float32") for i in range(11)]
    checkpoint = tmp_path / "bert-tiny"
    checkpoint.mkdir()
    state = {"bert.embeddings.word_embeddings.weight": np.zeros((5, 8), np.float32)}
    for i, tensors in enumerate(layers):
        state.update(layouts.from_canonical("hf-bert", config, tensors, layer=i, prefix="bert."))
    half = len(state) // 2
    names = list(state)
    files.write_state(checkpoint / "model-00001-of-00002.safetensors", {k: state[k] for k in names[:half]})
    files.write_state(checkpoint / "model-00002-of-00002.safetensors", {k: state[k] for k in names[half:]})
    index = {"weight_map": {k: f"model-0000{1 + (n >= half)}-of-00002.safetensors" for n, k in enumerate(names)}}
    (checkpoint / "model.safetensors.index.json").write_text(__import__("json").dumps(index))
    (checkpoint / "config.json").write_text('{"model_type": "bert", "num_attention_heads": 2, "hidden_size": 8, '
                                            '"attention_probs_dropout_prob": 0.1}')
    out = tmp_path / "layers"
    assert mha_convert("--from", "hf-bert", "--to", "canonical", checkpoint, out, "--layer", "all") == 0
    written = sorted(p.name for p in out.iterdir())
    assert written == [f"layer_{i:02d}.safetensors" for i in range(11)], written
    for i, tensors in enumerate(layers):
        got_config, got = load(out / f"layer_{i:02d}.safetensors")
        assert got_config == config.replace(dropout=0.1)
        assert_bit_exact(tensors, got, f"layer {i}")
    assert capsys.readouterr().out.count("wrote ") == 11
    # a {layer} pattern, into another layout
    assert mha_convert("--from", "hf-bert", "--to", "keras-split-heads", checkpoint,
                       tmp_path / "k{layer}.safetensors", "--layer", "all") == 0
    assert (tmp_path / "k10.safetensors").is_file()
    # one layer, and HF -> HF (layer 3 of one checkpoint becomes layer 3 of a GPT-2-shaped one)
    assert mha_convert("--from", "hf-bert", "--to", "hf-gpt2", checkpoint, tmp_path / "g.safetensors",
                       "--layer", "3", "--to-prefix", "transformer.") == 0
    assert "transformer.h.3.attn.c_attn.weight" in files.read_state(tmp_path / "g.safetensors")


def test_layer_all_writes_nothing_when_a_layer_is_bad(tmp_path):
    config = AttentionConfig(num_heads=2, query_dim=8, head_dim=4)
    state = {}
    for i in range(3):
        state.update(layouts.from_canonical("hf-gpt2", config, init(config, seed=i), layer=i))
    state["h.2.attn.c_proj.bias"] = state["h.2.attn.c_proj.bias"][:5]
    files.write_state(tmp_path / "gpt2.safetensors", state)
    with pytest.raises(WeightsFormatError) as info:
        mha_convert("--from", "hf-gpt2", "--to", "canonical", tmp_path / "gpt2.safetensors",
                    tmp_path / "out{layer}.safetensors", "--layer", "all", "--num-heads", 2)
    one_line_error(info, "SRC=", "h.2.attn.c_proj.bias has shape (5,), expected (8,)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2.safetensors"]


def test_overwrite(tmp_path):
    config = AttentionConfig(num_heads=2, query_dim=4, head_dim=2)
    save(tmp_path / "w.safetensors", config, init(config, seed=0))
    (tmp_path / "out.safetensors").write_bytes(b"old")
    with pytest.raises(ValueError) as info:
        mha_convert("--from", "canonical", "--to", "keras-mha", tmp_path / "w.safetensors",
                    tmp_path / "out.safetensors")
    one_line_error(info, "DST exists", "--overwrite")
    assert (tmp_path / "out.safetensors").read_bytes() == b"old"
    assert mha_convert("--from", "canonical", "--to", "keras-mha", tmp_path / "w.safetensors",
                       tmp_path / "out.safetensors", "--overwrite") == 0
    assert "query/kernel" in files.read_state(tmp_path / "out.safetensors")


@pytest.mark.parametrize("argv,pieces", [
    (["--from", "torch", "--to", "canonical", "SRC.pt", "DST.safetensors"], ["--from must be one of", "'torch'"]),
    (["--from", "canonical", "--to", "keras", "SRC.safetensors", "DST.pt"], ["--to must be one of", "'keras'"]),
    (["--from", "torch-mha", "--to", "canonical", "SRC.pt", "DST.safetensors", "--layer", "all"],
     ["--layer all needs --from hf-bert or hf-gpt2", "torch-mha"]),
    (["--from", "hf-bert", "--to", "canonical", "SRC.pt", "DST.safetensors", "--layer", "x"],
     ["--layer must be", "'x'"]),
    (["--from", "torch-mha", "--to", "canonical", "SRC.pt", "DST.safetensors", "--layer", "1"],
     ["--layer applies to"]),
    (["--from", "keras-mha", "--to", "canonical", "SRC.pt", "DST.safetensors", "--names", "a,b"],
     ["--names applies to"]),
    (["--from", "torch-mha", "--to", "canonical", "SRC.txt", "DST.safetensors"], ["SRC must end in", "SRC.txt"]),
    (["--from", "canonical", "--to", "canonical", "SRC.safetensors", "DST.pt"],
     ["DST: canonical weights are a .safetensors file"]),
    (["--from", "canonical", "--to", "torch-mha", "missing.safetensors", "DST.pt"], ["SRC: no such file"]),
    (["--from", "torch-mha", "--to", "canonical", "SRC.pt", "DST.safetensors", "--num-heads", "0"],
     ["--num-heads must be a positive integer"]),
    (["--from", "canonical", "--to", "torch-mha", "SRC.safetensors", "DST.pt", "--to-config", "c.json"],
     ["--to-config applies to --to hf-bert or hf-gpt2 or hf-llama", "torch-mha"]),
])
def test_argument_errors(tmp_path, argv, pieces):
    argv = [str(tmp_path / a) if a.startswith(("SRC", "DST", "missing")) else a for a in argv]
    with pytest.raises(ValueError) as info:
        mha_convert(*argv)
    one_line_error(info, *pieces)


def test_content_errors(tmp_path):
    config = AttentionConfig(num_heads=2, query_dim=8, head_dim=4)
    files.write_state(tmp_path / "mha.safetensors", layouts.from_canonical("torch-mha", config, init(config, seed=0)))
    with pytest.raises(WeightsFormatError) as info:
        mha_convert("--from", "torch-mha", "--to", "canonical", tmp_path / "mha.safetensors",
                    tmp_path / "o.safetensors")
    one_line_error(info, "num_heads is not stored", "--num-heads")
    with pytest.raises(WeightsFormatError) as info:
        mha_convert("--from", "torch-linears", "--to", "canonical", tmp_path / "mha.safetensors",
                    tmp_path / "o.safetensors", "--num-heads", "2")
    one_line_error(info, "missing W_query.weight", "unexpected in_proj_bias", "(SRC looks like torch-mha)")
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 4)
    with pytest.raises(WeightsFormatError) as info:
        mha_convert("--from", "torch-mha", "--to", "canonical", tmp_path / "bad.safetensors",
                    tmp_path / "o.safetensors")
    one_line_error(info, "bad.safetensors", "not a safetensors file")
    assert not (tmp_path / "o.safetensors").exists()


def test_decoder_layouts_need_their_config_file(tmp_path):
    """hf-llama without config.json beside SRC is refused by name (RoPE, windows and norms live only
    there); a --to-config under which the written block would mean something else is refused by field."""
    config = AttentionConfig(num_heads=2, num_kv_heads=1, query_dim=8, head_dim=4, rope={"theta": 10000.0},
                             window_left=3)
    tensors = init(config, seed=1)
    folder = tmp_path / "llama"
    folder.mkdir()
    files.write_state(folder / "model.safetensors", layouts.from_canonical("hf-llama", config, tensors,
                                                                           prefix="model."))
    with pytest.raises(ValueError) as info:
        mha_convert("--from", "hf-llama", "--to", "canonical", folder, tmp_path / "o.safetensors")
    one_line_error(info, "hf_config: hf-llama reads RoPE", "beside SRC")
    (folder / "config.json").write_text('{"model_type": "mistral", "hidden_size": 8, "num_attention_heads": 2, '
                                        '"num_key_value_heads": 1, "sliding_window": 4}')
    mha_convert("--from", "hf-llama", "--to", "canonical", folder, tmp_path / "o.safetensors")
    assert load(tmp_path / "o.safetensors")[0] == config  # sliding_window 4: window_left 3
    (tmp_path / "llama.json").write_text('{"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2, '
                                         '"num_key_value_heads": 1}')
    with pytest.raises(ValueError) as info:
        mha_convert("--from", "canonical", "--to", "hf-llama", tmp_path / "o.safetensors",
                    tmp_path / "back.safetensors", "--to-config", tmp_path / "llama.json")
    one_line_error(info, "hf_config disagrees with config", "window_left=3 (config file gives -1)")
    assert not (tmp_path / "back.safetensors").exists()


# -- torch files: weights_only, never code ---------------------------------------------------

class _Plant:
    """Unpickling this creates a marker file: the proof that code ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.torch
@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")  # the raw pickle below
def test_torch_file_with_code_is_refused(tmp_path):
    torch = pytest.importorskip("torch", reason="torch not installed: the .pt file kind needs it")
    marker = tmp_path / "MARKER"
    evil = tmp_path / "evil.pt"
    torch.save({"in_proj_weight": torch.zeros(6, 2), "payload": _Plant(str(marker))}, evil)
    assert not marker.exists()
    with pytest.raises(WeightsFormatError) as info:
        mha_convert("--from", "torch-mha", "--to", "canonical", evil, tmp_path / "o.safetensors", "--num-heads", 1)
    one_line_error(info, str(evil), "refused", "weights_only=True")
    assert not marker.exists(), "reading the file ran its pickled code"
    # a plain pickle of a function reference, and a whole pickled module, are refused the same way
    (tmp_path / "raw.pt").write_bytes(pickle.dumps({"w": _Plant(str(marker))}))
    with pytest.raises(WeightsFormatError) as info:
        files.read_state(tmp_path / "raw.pt")
    assert "\n" not in str(info.value) and not marker.exists()
    torch.save(torch.nn.Linear(2, 2), tmp_path / "module.pt")
    with pytest.raises(WeightsFormatError) as info:
        files.read_state(tmp_path / "module.pt")
    one_line_error(info, "refused")
    # control: the payload is live, so the checks above could have failed
    pickle.loads((tmp_path / "raw.pt").read_bytes())
    assert marker.exists(), "the payload did not plant its marker: the test proves nothing"


@pytest.mark.torch
def test_torch_checkpoint_nested_and_native(tmp_path):
    torch = pytest.importorskip("torch", reason="torch not installed: the .pt file kind needs it")
    from impl_torch.native import from_native

    module = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    torch.save({"epoch": 3, "model": {"attn": module.state_dict()}, "note": "x"}, tmp_path / "ckpt.pt")
    assert set(files.read_state(tmp_path / "ckpt.pt")) == {f"model.attn.{k}" for k in module.state_dict()}
    assert mha_convert("--from", "torch-mha", "--to", "canonical", tmp_path / "ckpt.pt", tmp_path / "c.safetensors",
                       "--num-heads", 2) == 0
    config, tensors = load(tmp_path / "c.safetensors")
    native_config, native = from_native(module)
    assert config == native_config
    assert_bit_exact(native, tensors, "nested torch checkpoint")


# -- Keras and Flax files written by the frameworks themselves ----------------------------------

@pytest.mark.tf
def test_keras_weights_files_both_ways(tmp_path):
    pytest.importorskip("tensorflow", reason="TensorFlow not installed: pip install 'mha-conformance[tf]'")
    keras = pytest.importorskip("keras", reason="Keras not installed: pip install 'mha-conformance[tf]'")
    from keras.src.saving import saving_lib

    from impl_tf.native import from_native

    keras.utils.set_random_seed(0)
    inputs = keras.Input((3, 6))
    layer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, bias_initializer="random_normal")
    model = keras.Model(inputs, layer(inputs, inputs))
    model.save_weights(tmp_path / "model.weights.h5")  # keys under layers/multi_head_attention/
    assert mha_convert("--from", "keras-mha", "--to", "canonical", tmp_path / "model.weights.h5",
                       tmp_path / "c.safetensors") == 0
    config, tensors = load(tmp_path / "c.safetensors")
    native_config, native = from_native(layer)
    assert config == native_config
    assert_bit_exact(native, tensors, "Model.save_weights file")
    # and ours loads into a fresh layer with Keras' own loader
    assert mha_convert("--from", "canonical", "--to", "keras-mha", tmp_path / "c.safetensors",
                       tmp_path / "ours.weights.h5") == 0
    fresh = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    fresh.build((None, None, 6), (None, None, 6))
    saving_lib.load_weights_only(fresh, tmp_path / "ours.weights.h5")
    assert_bit_exact(native, from_native(fresh)[1], "our .weights.h5 loaded by Keras")
    # a layout that is not Keras variables cannot go to .weights.h5
    with pytest.raises(ValueError) as info:
        mha_convert("--from", "canonical", "--to", "torch-linears", tmp_path / "c.safetensors",
                    tmp_path / "t.weights.h5")
    one_line_error(info, "DST", "W_query.weight")


@pytest.mark.jax
def test_flax_msgpack_written_by_flax(tmp_path):
    jax = pytest.importorskip("jax", reason="JAX not installed: pip install 'mha-conformance[jax]'")
    pytest.importorskip("flax", reason="Flax not installed: pip install 'mha-conformance[jax]'")
    from flax import linen, serialization

    from impl_jax.native import from_native

    module = linen.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)
    variables = module.init(jax.random.key(0), np.ones((1, 3, 5), np.float32))
    (tmp_path / "linen.msgpack").write_bytes(serialization.to_bytes(variables))  # {"params": {...}}
    assert mha_convert("--from", "flax-linen-mha", "--to", "canonical", tmp_path / "linen.msgpack",
                       tmp_path / "c.safetensors") == 0
    config, tensors = load(tmp_path / "c.safetensors")
    assert_bit_exact(from_native((module, variables))[1], tensors, "flax.serialization.to_bytes file")
    (tmp_path / "junk.msgpack").write_bytes(b"\xc1\xc1")
    with pytest.raises(WeightsFormatError) as info:
        files.read_state(tmp_path / "junk.msgpack")
    one_line_error(info, "junk.msgpack", "not a Flax msgpack file")


@pytest.mark.parametrize("ext,module,words", [(".pt", "torch", "needs PyTorch"), (".weights.h5", "h5py", "needs h5py"),
                                              (".msgpack", "flax", "needs Flax")])
def test_missing_framework_says_what_to_install(tmp_path, monkeypatch, ext, module, words):
    monkeypatch.setitem(sys.modules, module, None)  # import now fails as if it were not installed
    (tmp_path / f"w{ext}").write_bytes(b"\0" * 16)
    with pytest.raises(ValueError) as info:
        mha_convert("--from", "torch-mha", "--to", "canonical", tmp_path / f"w{ext}", tmp_path / "o.safetensors")
    one_line_error(info, "SRC=", words, "pip install")
