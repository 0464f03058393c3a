"""examples/deepseek_v3/README.md's commands, as written: layer 1 of the tiny DeepSeek V3 converted from its
save_pretrained folder, held by `mha run --expect` to the model's own output on every installed backend, and
decoded token by token into latent cache buffers written in place; and make.py rebuilding the example.
The commands run in this process (the `mha` entry point's main, the script's main) to spare a Python start
per backend."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from conformance.cli.commands import main as mha

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "deepseek_v3"
FRAMEWORK = {"torch": "torch", "tf": "tensorflow", "jax": "jax"}
INSTALLED = ["numpy"] + [b for b, module in FRAMEWORK.items() if importlib.util.find_spec(module) is not None]


def _commands() -> list[str]:
    text = (EXAMPLE / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    assert len(blocks) == 1, "examples/deepseek_v3/README.md's command block is gone"
    return blocks[0].strip().splitlines()


def _decoder():
    spec = importlib.util.spec_from_file_location("deepseek_decode_in_place", EXAMPLE / "decode_in_place.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_commands_reproduce_the_model(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    convert, loop, decode = (line.replace("/tmp/", f"{tmp_path}/") for line in _commands())
    words = shlex.split(convert)
    assert words[:2] == ["mha", "convert"], convert
    assert mha(words[1:]) == 0
    named, body = re.fullmatch(r"for b in ([\w ]+); do (.*); done", loop).groups()
    assert named.split() == ["numpy", "torch", "tf", "jax"], named
    for backend in INSTALLED:
        capsys.readouterr()
        words = shlex.split(body.replace("$b", backend))
        assert mha(words[1:]) == 0, backend
        verdict = capsys.readouterr().out.strip().splitlines()[-1]
        assert verdict.startswith("output vs examples/deepseek_v3/expected.safetensors: ok margin"), verdict
    words = shlex.split(decode)
    assert words[:2] == ["python", "examples/deepseek_v3/decode_in_place.py"], decode
    capsys.readouterr()
    assert _decoder().main(words[2:]) == 0
    verdicts = capsys.readouterr().out.strip().splitlines()
    for backend in INSTALLED:
        assert any(re.match(rf"{backend} +decoded 9 tokens in place: ok margin", v) for v in verdicts), verdicts


def test_decode_in_place_fails_on_a_wrong_block(tmp_path, capsys):
    """The decode script exits 1 when a row is off: the latent norm's scale read 0.1% high (numpy only)."""
    from weights import load, save

    block = tmp_path / "block.safetensors"
    assert mha(["convert", "--from", "hf-deepseek", "--to", "canonical", str(EXAMPLE / "model"), str(block),
                "--layer", "1"]) == 0
    config, tensors = load(block)
    tensors["latent.norm.scale"] = tensors["latent.norm.scale"] * np.float32(1.001)
    save(tmp_path / "wrong.safetensors", config, tensors)
    decoder = _decoder()
    decoder.DECODERS = {"numpy": decoder.DECODERS["numpy"]}
    capsys.readouterr()
    assert decoder.main([str(tmp_path / "wrong.safetensors")]) == 1
    assert "numpy decoded 9 tokens in place: FAIL" in capsys.readouterr().out


@pytest.mark.torch
@pytest.mark.tf
@pytest.mark.jax
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None,
                    reason="transformers and torch not installed: pip install -c constraints/cpu.txt '.[torch,hf]'")
def test_make_rebuilds_the_example(tmp_path):
    """The shipped numbers are the model's: make.py rebuilds the same weights and the same hooked input and output
    (within float32 round-off: another CPU may order a matmul's sums differently)."""
    done = subprocess.run([sys.executable, str(EXAMPLE / "make.py"), "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    shipped, rebuilt = load_file(EXAMPLE / "model" / "model.safetensors"), load_file(tmp_path / "model" / "model.safetensors")
    assert sorted(shipped) == sorted(rebuilt)
    for name in shipped:
        np.testing.assert_array_equal(rebuilt[name], shipped[name], err_msg=name)
    for file in ("inputs.safetensors", "expected.safetensors"):
        a, b = load_file(EXAMPLE / file), load_file(tmp_path / file)
        assert sorted(a) == sorted(b), file
        for name in a:
            np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=1e-6, err_msg=f"{file} {name}")
