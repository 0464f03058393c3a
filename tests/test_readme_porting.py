"""The README's "Porting a modern checkpoint" commands, as written: examples/qwen3's block 1 converted from its
save_pretrained folder and held by `mha run --expect` to the model's own output on every installed backend;
`--expect` failing on wrong numbers; and examples/qwen3/make.py rebuilding the example from transformers."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "qwen3"
MHA = [sys.executable, "-m", "conformance"]
FRAMEWORK = {"torch": "torch", "tf": "tensorflow", "jax": "jax"}
INSTALLED = ["numpy"] + [b for b, module in FRAMEWORK.items() if importlib.util.find_spec(module) is not None]


def _readme_block() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "--from hf-llama" in b]
    assert len(blocks) == 1, "the README's porting block is gone"
    return blocks[0].strip().splitlines()


def _mha(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([*MHA, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_readme_porting_commands_reproduce_the_model_on_every_installed_backend(tmp_path):
    convert, loop, decode = _readme_block()
    convert = convert.replace("/tmp/", f"{tmp_path}/")
    words = shlex.split(convert)
    assert words[:2] == ["mha", "convert"], convert
    done = _mha(words[1:])
    assert done.returncode == 0, done.stderr
    # The loop runs `mha run ... --backend $b` for each backend the README names; here those installed.
    named, body = re.fullmatch(r"for b in ([\w ]+); do (.*); done", loop).groups()
    assert named.split() == ["numpy", "torch", "tf", "jax"], named
    for backend in INSTALLED:
        words = shlex.split(body.replace("$b", backend).replace("/tmp/", f"{tmp_path}/"))
        done = _mha(words[1:])
        assert done.returncode == 0, (backend, done.stdout, done.stderr)
        verdict = done.stdout.strip().splitlines()[-1]
        assert verdict.startswith("output vs examples/qwen3/expected.safetensors: ok margin"), verdict
    # Then token by token, the cache written in place into buffers, on every installed backend.
    words = shlex.split(decode.replace("/tmp/", f"{tmp_path}/"))
    assert words[:2] == ["python", "examples/qwen3/decode_in_place.py"], decode
    done = subprocess.run([sys.executable, *words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout, done.stderr)
    verdicts = done.stdout.strip().splitlines()
    for backend in INSTALLED:
        assert any(re.match(rf"{backend} +decoded 9 tokens in place: ok margin", v) for v in verdicts), verdicts


# reference: what it asserts is NumPy's (its FAIL line and the exit status): the numpy env runs it; in `tox -e all`
# the script would decode again on every framework (6.4 CPU s) with nothing more asserted.
@pytest.mark.reference
def test_decode_in_place_fails_on_a_wrong_block(tmp_path):
    """examples/qwen3/decode_in_place.py exits 1 when a step's row is off: here the block's output kernel is
    scaled by 1.001 (every output 0.1% off: about a hundred times the float32 allowance)."""
    from weights import load, save

    config, tensors = load(_block(tmp_path))
    tensors["output.kernel"] = tensors["output.kernel"] * np.float32(1.001)
    save(tmp_path / "wrong.safetensors", config, tensors)
    done = subprocess.run([sys.executable, str(EXAMPLE / "decode_in_place.py"), str(tmp_path / "wrong.safetensors")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    assert "numpy decoded 9 tokens in place: FAIL" in done.stdout, done.stdout


def _block(tmp_path) -> Path:
    out = tmp_path / "block1.safetensors"
    done = _mha(["convert", "--from", "hf-llama", "--to", "canonical", str(EXAMPLE / "model"), str(out), "--layer", "1"])
    assert done.returncode == 0, done.stderr
    return out


@pytest.mark.reference  # `mha run --backend numpy`: the numpy env runs it, not `tox -e all` again
def test_expect_fails_on_numbers_off_by_more_than_the_policy(tmp_path):
    block = _block(tmp_path)
    wrong = load_file(EXAMPLE / "expected.safetensors")
    wrong["output"] = wrong["output"].copy()
    wrong["output"][0, 5, 3] += 1e-3  # a thousand times the float32 allowance's order, one element
    save_file(wrong, str(tmp_path / "wrong.safetensors"))
    done = _mha(["run", "--backend", "numpy", "--weights", str(block), "--inputs", str(EXAMPLE / "inputs.safetensors"),
                 "--causal", "--expect", str(tmp_path / "wrong.safetensors"), "--out", str(tmp_path / "o.safetensors")])
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    assert "FAIL" in done.stdout and "worst at [0, 5, 3]" in done.stdout, done.stdout


@pytest.mark.reference  # `mha run --backend numpy`: the numpy env runs it, not `tox -e all` again
def test_expect_names_what_it_cannot_compare(tmp_path):
    block = _block(tmp_path)
    save_file({"present_key": np.zeros((1, 2, 9, 8), np.float32)}, str(tmp_path / "cache.safetensors"))
    done = _mha(["run", "--backend", "numpy", "--weights", str(block), "--inputs", str(EXAMPLE / "inputs.safetensors"),
                 "--causal", "--expect", str(tmp_path / "cache.safetensors"), "--out", str(tmp_path / "o.safetensors")])
    assert done.returncode == 2, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--expect" in lines[0] and "present_key" in lines[0] and "--return-cache" in lines[0], lines
    assert not (tmp_path / "o.safetensors").exists(), "checked before the run: nothing written"
    done = _mha(["run", "--backend", "numpy", "--weights", str(block), "--inputs", str(EXAMPLE / "inputs.safetensors"),
                 "--causal", "--expect", str(ROOT / "README.md"), "--out", str(tmp_path / "o.safetensors")])
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "--expect" in lines[0] and "README.md" in lines[0], lines
    assert not (tmp_path / "o.safetensors").exists()


# Marked with every framework, so that it runs in tox's `all` env, where transformers is installed.
@pytest.mark.torch
@pytest.mark.tf
@pytest.mark.jax
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None,
                    reason="transformers and torch not installed: pip install -c constraints/cpu.txt '.[torch,hf]'")
def test_make_rebuilds_the_example(tmp_path):
    """The shipped numbers are the model's: make.py rebuilds the same weights (torch's seeded generator) and the
    same hooked input and output (within float32 round-off: another CPU may order a matmul's sums differently)."""
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
