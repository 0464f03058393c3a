"""The contract's config and file format."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import configs

import weights
from weights import AttentionConfig, WeightsFormatError

pytestmark = pytest.mark.reference  # NumPy only, no framework looked for: the numpy env runs it, `all` does not again


@given(config=configs(dropout=True, modern=True))
def test_config_json_round_trip(config):
    again = AttentionConfig.from_json(config.to_json())
    assert again == config
    # every size resolves; the optional fields (scale, and the modern ones: null = off) may stay None
    nullable = {"scale", "rope", "logit_softcap", "qk_norm", "local_chunk", "query_temperature", "qkv_clip",
                "output_gate", "value_norm", "latent", "alibi_bias_dtype", "indexer"}
    nullable |= {"differential"}
    nullable |= {"compressed"}  # issue 41: DeepSeek V4's layer, null = off
    assert all(v is not None for k, v in config.to_dict().items() if k not in nullable), config.to_dict()


def test_config_defaults_resolve():
    c = AttentionConfig(num_heads=4, query_dim=16, head_dim=8)
    assert (c.key_dim, c.value_dim, c.value_head_dim, c.out_dim, c.num_kv_heads) == (16, 16, 8, 16, 4)
    assert c.effective_scale == pytest.approx(8**-0.5)
    assert AttentionConfig(num_heads=4, query_dim=16, head_dim=8, key_dim=5).value_dim == 5


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(num_heads=0), "num_heads must be a positive integer: got 0"),
        (dict(num_heads=True), "num_heads must be a positive integer: got True"),
        (dict(head_dim=2.5), "head_dim must be a positive integer: got 2.5"),
        (dict(num_kv_heads=3), "num_kv_heads must divide num_heads: got num_kv_heads=3, num_heads=4"),
        (dict(masked_row="ignore"), "masked_row must be one of zero, uniform, nan: got 'ignore'"),
        (dict(dropout=1.0), "dropout must be a number in [0, 1): got 1.0"),
        (dict(scale=float("nan")), "scale must be a finite number or null: got nan"),
        (dict(use_query_bias=1), "use_query_bias must be true or false: got 1"),
    ],
)
def test_config_errors_name_field_and_value(fields, message):
    base = dict(num_heads=4, query_dim=8, head_dim=2)
    with pytest.raises(ValueError) as info:
        AttentionConfig(**{**base, **fields})
    assert str(info.value) == message


def test_config_from_dict_rejects_unknown_and_missing():
    with pytest.raises(ValueError, match="unknown fields: 'heads'"):
        AttentionConfig.from_dict({"heads": 2, "num_heads": 2, "query_dim": 4, "head_dim": 2})
    with pytest.raises(ValueError, match="missing required fields: head_dim"):
        AttentionConfig.from_dict({"num_heads": 2, "query_dim": 4})
    with pytest.raises(ValueError, match="not valid JSON"):
        AttentionConfig.from_json("{nope")


@pytest.mark.parametrize("dtype", list(weights.DTYPES))
@given(config=configs(modern=True))
def test_save_load_bit_exact(tmp_path_factory, dtype, config):
    path = tmp_path_factory.mktemp("w") / "w.safetensors"
    tensors = weights.init(config, seed=4, dtype=dtype)
    weights.save(path, config, tensors, metadata={"note": "test"})
    loaded_config, loaded = weights.load(path)
    assert loaded_config == config
    assert list(loaded) == list(config.tensor_shapes())
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype, (name, loaded[name].dtype, t.dtype)
        assert loaded[name].tobytes() == t.tobytes(), f"{name} differs after the round trip"


def test_file_metadata_follows_the_contract(tmp_path):
    config = AttentionConfig(num_heads=2, query_dim=4, head_dim=2, use_key_bias=False)
    tensors = weights.init(config, seed=0)
    weights.save(tmp_path / "w.safetensors", config, tensors)
    metadata, arrays = weights.read_safetensors(tmp_path / "w.safetensors")
    assert metadata["format"] == "mha-weights" and metadata["format_version"] == "1"
    stored = json.loads(metadata["config"])
    # a plain layer's file holds no modern field (a reader that predates them reads it unchanged)
    from weights.config import MODERN_DEFAULTS
    assert stored == {k: v for k, v in config.to_dict().items() if k not in MODERN_DEFAULTS}
    import hashlib
    sums = json.loads(metadata["sha256"])
    assert sums == {n: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest() for n, a in tensors.items()}
    assert "key.bias" not in arrays


def test_save_is_deterministic_and_refuses_to_overwrite(tmp_path):
    config = AttentionConfig(num_heads=2, query_dim=4, head_dim=2)
    tensors = weights.init(config, seed=0)
    weights.save(tmp_path / "a", config, tensors)
    weights.save(tmp_path / "b", config, tensors)
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()
    before = (tmp_path / "a").read_bytes()
    with pytest.raises(FileExistsError, match="exists; pass overwrite=True"):
        weights.save(tmp_path / "a", config, weights.init(config, seed=1))
    assert (tmp_path / "a").read_bytes() == before
    weights.save(tmp_path / "a", config, weights.init(config, seed=1), overwrite=True)
    assert (tmp_path / "a").read_bytes() != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"], "no temporary files left behind"


def test_validate_lists_every_problem():
    config = AttentionConfig(num_heads=2, query_dim=4, head_dim=2)
    tensors = weights.init(config, seed=0)
    del tensors["key.bias"]
    tensors["query.kernel"] = tensors["query.kernel"][:3]
    tensors["value.bias"] = tensors["value.bias"].astype(np.float64)
    tensors["extra"] = np.zeros(2, np.float32)
    with pytest.raises(WeightsFormatError) as info:
        weights.validate_tensors(config, tensors)
    message = str(info.value)
    for part in ("missing tensors: key.bias", "unexpected tensors: extra",
                 "query.kernel has shape (3, 2, 2), expected (4, 2, 2)", "tensors must share one dtype"):
        assert part in message, f"{part!r} not in {message!r}"
    assert "\n" not in message


def test_load_reports_checksum_mismatch_and_config_problems(tmp_path):
    config = AttentionConfig(num_heads=2, query_dim=4, head_dim=2)
    tensors = weights.init(config, seed=0)
    path = tmp_path / "w.safetensors"
    weights.save(path, config, tensors)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # last byte of the last tensor
    path.write_bytes(bytes(data))
    with pytest.raises(WeightsFormatError, match=r"sha256 mismatch for [a-z]+\.(kernel|bias) "):
        weights.load(path)
    for changes, expected in [
        ({"config": config.replace(num_heads=3, num_kv_heads=3).to_json()}, "query.kernel has shape (4, 2, 2), expected (4, 3, 2)"),
        ({"config": '{"num_heads": 2}'}, "bad config: config is missing required fields: head_dim, query_dim"),
        ({"format_version": "2"}, "format_version is '2'; this reader knows '1'"),
        ({"sha256": "[]"}, "sha256 metadata is not a JSON object"),
    ]:
        (tmp_path / "c.safetensors").write_bytes(rewrite_metadata(weights.to_bytes(config, tensors), changes))
        with pytest.raises(WeightsFormatError) as info:
            weights.load(tmp_path / "c.safetensors")
        assert expected in str(info.value) and "c.safetensors" in str(info.value), str(info.value)


def rewrite_metadata(raw: bytes, changes: dict) -> bytes:
    import struct

    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["__metadata__"].update(changes)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + raw[8 + n :]


def test_load_refuses_other_formats(tmp_path):
    from safetensors.numpy import save_file

    save_file({"a": np.zeros(2, np.float32)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(WeightsFormatError, match=r"plain\.safetensors: format is None, expected 'mha-weights'"):
        weights.load(tmp_path / "plain.safetensors")
    with pytest.raises(WeightsFormatError, match="no such file"):
        weights.load(tmp_path / "missing.safetensors")


def test_init_is_seeded_and_bounded():
    config = AttentionConfig(num_heads=3, query_dim=9, head_dim=4)
    a, b = weights.init(config, seed=1), weights.init(config, seed=1)
    assert all(np.array_equal(a[n], b[n]) for n in a)
    assert not np.array_equal(a["query.kernel"], weights.init(config, seed=2)["query.kernel"])
    assert np.abs(a["query.kernel"]).max() <= 1 / 3 and np.abs(a["output.kernel"]).max() <= 1 / np.sqrt(12)
    assert np.abs(a["query.bias"]).min() > 0, "biases are nonzero so a dropped bias is visible"


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "float64"])
def test_dtype_names(name):
    assert weights.dtype_name(weights.dtype_from_name(name)) == name
    with pytest.raises(ValueError, match="dtype must be one of float16, bfloat16, float32, float64: got 'int8'"):
        weights.dtype_from_name("int8")


@given(st.sampled_from(["float16", "bfloat16", "float32", "float64"]))
def test_compute_dtype(name):
    expected = "float32" if name in ("float16", "bfloat16") else name
    assert weights.compute_dtype(weights.dtype_from_name(name)).name == expected
