"""docs/porting-modern.md's worked DeepSeek V3.2 port, as written: the python block under the
`<!-- porting-modern: deepseek_v32 -->` marker runs in a fresh folder (in this process) (it builds a tiny random model, converts
its block with `mha convert`, runs a causal prefill and decodes token by token, asserting each verdict) and
prints five passing verdicts. The `hf` extra (the `all` env); a few seconds."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- porting-modern: deepseek_v32 -->"


def _script() -> str:
    text = (ROOT / "docs" / "porting-modern.md").read_text(encoding="utf-8")
    found = re.findall(re.escape(MARKER) + r"\n```python\n(.*?)```", text, re.S)
    assert len(found) == 1, "the worked DeepSeek V3.2 port is gone from docs/porting-modern.md"
    return found[0]


@pytest.mark.torch  # torch, tf and jax: the `all` env (the one with the hf extra), as the layout tests
@pytest.mark.tf
@pytest.mark.jax
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None,
                    reason="needs torch and transformers: pip install -c constraints/cpu.txt '.[torch,hf]'")
def test_the_worked_deepseek_v32_port_runs_as_written(tmp_path, monkeypatch, capsys):
    """In this process (torch and transformers already imported by the env's other tests), in tmp_path."""
    monkeypatch.chdir(tmp_path)
    exec(compile(_script(), str(tmp_path / "port.py"), "exec"), {"__name__": "__main__"})
    done = capsys.readouterr()  # .out
    verdicts = [line for line in done.out.splitlines() if re.match(r"(prefill|decode \d+): ", line)]
    assert [v.split(":")[0] for v in verdicts] == ["prefill", "decode 9", "decode 10", "decode 11"], done.out
    assert all(": ok margin" in v for v in verdicts), verdicts
    assert "Indexer(heads=4, head_dim=8, topk=3" in done.out and "interleaved=False" in done.out
