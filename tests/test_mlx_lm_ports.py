"""mlx-lm's attention ports judged (conformance/native/mlx_lm_ports.py, the "mlx-lm's ports" table of
`mha check --conventions` and docs/conventions.md).

Each measured test builds one tiny random transformers model (B = 2 rows, T = 9 tokens), loads its
save_pretrained folder with mlx-lm's own loader and runs mlx-lm's attention on transformers' attention
input, prefill and decode on mlx-lm's own cache; the expected values are the float64 reference's on our
converted block and transformers' own output, never mlx-lm's. Held here:

- a port that agrees passes the policy on prefill, decode and the rotation at positions 4096+, and
  transformers' own output passes it too (the judgement can pass);
- a planted porting bug (the rope module's `traditional` flag flipped, the other RoPE pairing) is reported
  as differing, at the RoPE stage, with the other pairing named as what mlx-lm computes; another (the rope
  ignoring the cache offset) passes prefill and is found at the first decode step's RoPE stage;
- two of the findings docs/conventions.md publishes: Mistral's window is not applied (first stage: the
  mask, with the keys each query sees), gpt-oss's YaRN ramp is rounded against `truncate: false` (the
  rotation at positions 4096+ matches truncate=True);
- the lightning indexer's ports (deepseek_v32, glm_moe_dsa, minimax_m3_vl): outputs agree and mlx-lm's own
  top-k keeps the spec's keys (blocks) under the suite's top-k rule; GLM-5's shared layer runs an indexer of
  its own in mlx-lm (found at "indexer selection"); a planted bug, the index RoPE's pairing flipped, fails
  the selection judgement and is named there.

Marked `mlx` (they need mlx, mlx-lm, torch and transformers; skipped with the reason where one is
missing): `tox -e all` runs them where its extras hold mlx-lm. About 16 s on a 2-core VM (3.5 s of it the
indexer rows), most of it the imports of torch, transformers and mlx-lm.
"""

from __future__ import annotations

import importlib.util

import pytest

from conformance.native import mlx_lm_ports as ports

MISSING = [m for m in ("mlx", "mlx_lm", "torch", "transformers") if importlib.util.find_spec(m) is None]


def needs_mlx_lm(test):
    """Marked mlx; skipped with the reason where mlx, mlx-lm, torch or transformers is missing."""
    reason = f"needs {', '.join(MISSING)}: pip install -c constraints/cpu.txt '.[mlx-lm]'"
    return pytest.mark.mlx(pytest.mark.skipif(bool(MISSING), reason=reason)(test))


@pytest.mark.reference
def test_hub_form_moves_the_rope_fields_to_the_top_level():
    """NumPy only: the config.json rewrite the measured ports use (what transformers 4.x wrote)."""
    saved = {"model_type": "gpt_neox", "rope_parameters": {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0,
                                                           "partial_rotary_factor": 0.5},
             "layer_types": ["sliding_attention", "full_attention"], "per_layer_config": {"1": {"head_dim": 32}}}
    hub = ports.hub_form(saved)
    assert hub["rope_theta"] == 1000.0 and hub["partial_rotary_factor"] == 0.5, hub
    assert hub["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5, "type": "yarn"}
    assert (hub["rotary_pct"], hub["rotary_emb_base"]) == (0.5, 1000.0), hub
    assert hub["sliding_window_pattern"] == 2 and hub["global_head_dim"] == 32, hub
    assert saved.get("rope_theta") is None, "hub_form must not change its argument"


@pytest.mark.reference
def test_a_missing_package_is_a_row_saying_so(monkeypatch):
    """Without mlx-lm (here: a module that does not exist) every row says "not installed" with the install
    line, and the table renders; nothing is built."""
    from conformance.native import conventions as conv

    monkeypatch.setattr(ports, "MODULES", ("mlx_lm_ghost_module",))
    data = conv.measure(apis=(), mlx_lm_ports=("qwen3", "gpt2"))
    for row in data["mlx_lm_rows"]:
        assert row["status"] == "not installed" and ports.MLX_EXTRA in row["reason"], row
    text = conv.to_markdown(data)
    assert "| mlx-lm qwen3 | not installed |" in text and "| mlx-lm gpt2 | not installed |" in text, text
    assert ports.MLX_EXTRA in text, text


def _flip_rope_pairing(model):
    """The planted bug: every measured block's rope rotates the other pairing (nn.RoPE's traditional)."""
    for layer in ports._mlx_layers(model):
        rope = layer["self_attn"]["rope"]
        rope.traditional = not rope.traditional


@needs_mlx_lm
def test_a_faithful_port_agrees():
    name = "qwen3"
    row = ports.measure_port(name)
    ev = row["evidence"]
    assert row["verdict"].startswith("agrees"), row
    for field in ("prefill", "decode", "vs_transformers", "transformers", "far"):
        for layer, c in ev[field].items():
            assert c["ok"] and c["margin"] <= 1, f"{name} block {layer} {field}: {c}"
    assert row["first_stage"] == "-", row


@needs_mlx_lm
def test_planted_rope_flip_is_found_at_the_rope_stage():
    row = ports.measure_port("qwen3", mutate=_flip_rope_pairing)
    assert row["verdict"].startswith("differs"), row
    worst = max(c["margin"] for c in row["evidence"]["prefill"].values())
    assert worst > 1, f"the flipped pairing passed the policy: margin {worst}"
    for layer in ("0", "1"):
        stage = row["evidence"][f"stage[{layer}]"]
        assert stage["where"] == "prefill" and stage["stage"] == "query.rope", stage
        assert "the other pairing (interleaved)" in stage["why"], stage


def _rope_without_offset(model):
    """The planted decode bug: every block's rope ignores the cache offset (each decode step rotated as
    position 0), a port's classic slip; prefill, whose offset is 0, is untouched."""
    import mlx.nn as nn

    class FromZero(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def __call__(self, x, offset=0, **kwargs):
            return self.inner(x)

    for layer in ports._mlx_layers(model):
        layer["self_attn"]["rope"] = FromZero(layer["self_attn"]["rope"])


@needs_mlx_lm
def test_planted_decode_offset_bug_is_found_at_its_step():
    row = ports.measure_port("qwen3", mutate=_rope_without_offset)
    ev = row["evidence"]
    assert all(c["ok"] for c in ev["prefill"].values()), ev["prefill"]
    assert not all(c["ok"] for c in ev["decode"].values()), f"the offset bug passed decode: {ev['decode']}"
    for layer in ("0", "1"):
        stage = ev[f"stage[{layer}]"]
        assert stage["where"] == "decode", stage
        assert stage["stage"] == f"query.rope (decode step at position {ports.P})", stage
        assert "is positions from 0, not 5 (the cache's offset ignored)" in stage["why"], stage


@needs_mlx_lm
def test_mistral_window_is_not_applied():
    """docs/conventions.md: mlx-lm runs Mistral through its Llama port, which slides only on layers that
    layer_types names: config.json's sliding_window alone is not applied."""
    row = ports.measure_port("mistral")
    assert row["verdict"].startswith("differs"), row
    stage = row["evidence"]["stage[0]"]
    assert stage["stage"] == "mask", stage
    assert "[1 2 3 4 5 6 7 8 9] under mlx-lm's mask" in stage["why"] and "[1 2 3 3 3 3 3 3 3] under the model's" \
        in stage["why"], stage


@needs_mlx_lm
def test_gpt_oss_yarn_ramp_is_rounded():
    """docs/conventions.md: gpt-oss's config says truncate: false; mlx-lm's YarnRoPE rounds the ramp's ends
    always. Within the output's allowance at T = 9, not at positions 4096+."""
    row = ports.measure_port("gpt_oss")
    assert all(c["ok"] for c in row["evidence"]["prefill"].values()), row["evidence"]["prefill"]
    assert all(not c["ok"] for c in row["evidence"]["far"].values()), row["evidence"]["far"]
    stage = row["evidence"]["stage[0]"]
    assert stage["stage"] == "query.rope, key.rope" and "truncate=True" in stage["why"], stage


@needs_mlx_lm
def test_the_table_in_mha_check_conventions():
    """The ports' table rides in `mha check --conventions` (survey.measure, render.to_markdown), a row per
    port with every column; a port that cannot be measured is a row saying why, never a crash."""
    from conformance.native import conventions as conv

    data = conv.measure(apis=(), mlx_lm_ports=("qwen3",))
    (row,) = data["mlx_lm_rows"]
    assert row["status"] == "measured" and all(key in row for key in ports.KEYS), row
    text = conv.to_markdown(data)
    assert "mlx-lm's ports judged" in text and "| mlx-lm qwen3 | agrees" in text, text
    assert "mlx-lm" in data["versions"], data["versions"]
    from rich.console import Console

    console = Console(record=True, width=400)
    conv.render_terminal(data, console=console)
    shown = console.export_text()
    assert "mlx-lm's ports judged" in shown and "mlx-lm qwen3" in shown, shown


# -- the lightning indexer's ports: deepseek_v32, glm_moe_dsa, minimax_m3_vl --------------------------

@needs_mlx_lm
@pytest.mark.parametrize("name", ["deepseek_v32", "glm_moe_dsa", "minimax_m3_vl"])
def test_indexer_ports_agree_and_select_the_spec_keys(name):
    """docs/conventions.md: mlx-lm's DSA and MiniMax M3 ports reproduce the spec's sparse attention at
    T = 9 (3 keys, or 2 blocks of 2, kept: late queries drop keys), prefill and decode, and their indexers
    keep the keys (blocks) the float64 reference keeps, every query judged by the top-k policy."""
    row = ports.measure_port(name)
    ev = row["evidence"]
    assert row["verdict"].startswith("agrees"), row
    for field in ("prefill", "decode", "vs_transformers", "transformers"):
        for layer, c in ev[field].items():
            assert c["ok"] and c["margin"] <= 1, f"{name} block {layer} {field}: {c}"
    selections = {layer: c for layer, c in ev["selection"].items() if isinstance(c, dict)}
    assert selections and all(c["ok"] and c["rows"] >= 2 * ports.T for c in selections.values()), ev["selection"]


@needs_mlx_lm
def test_glm5_shared_layer_runs_an_indexer_of_its_own():
    """docs/conventions.md: GLM-5's shared layers (index_topk_pattern S) take the previous full layer's
    selection in transformers and the spec; mlx-lm's glm_moe_dsa builds an indexer in every layer, its
    weights missing from the checkpoint, and block 1 attends to other keys. Block 0 agrees."""
    row = ports.measure_port("glm_moe_dsa shared")
    ev = row["evidence"]
    assert row["verdict"].startswith("differs") and "Missing 5 parameters" in ev["hub"]["note"], row
    assert ev["prefill"]["0"]["ok"] and not ev["prefill"]["1"]["ok"], ev["prefill"]
    assert ev["decode"]["0"]["ok"] and ev["vs_transformers"]["0"]["ok"], ev
    # block 0 holds an exact tie at the k-th score (ReLU zeros): a swap is admissible (margin 0), and the
    # output is then judged on mlx-lm's own selection; without that rule the swapped query fails
    assert ev["selection"]["0"]["ok"] and ev["selection"]["0"]["margin"] == 0, ev["selection"]
    assert ev["transformers"]["1"]["ok"], "the spec's shared layer must reproduce transformers'"
    assert ev["stage[1]"]["stage"] == "indexer selection", ev["stage[1]"]


def _flip_indexer_pairing(model):
    """The planted indexer bug: the index heads' RoPE rotates the other pairing (V3.2's half-split read as
    GLM-5's interleaved); the attention's own RoPE is untouched."""
    for layer in ports._mlx_layers(model):
        attention = layer["self_attn"]
        rope = attention["indexer"]["rope"] if "indexer" in attention else attention.get("index_rope")
        if rope is not None:
            rope.traditional = not rope.traditional


@needs_mlx_lm
@pytest.mark.parametrize("name", ["deepseek_v32", "minimax_m3_vl"])
def test_planted_indexer_pairing_flip_is_found_at_the_selection(name):
    row = ports.measure_port(name, mutate=_flip_indexer_pairing)
    ev = row["evidence"]
    assert row["verdict"].startswith("differs"), row
    failed = [layer for layer, c in ev["selection"].items() if isinstance(c, dict) and not c["ok"]]
    assert failed, f"the flipped indexer pairing kept the spec's keys: {ev['selection']}"
    for layer in failed:
        assert ev[f"stage[{layer}]"]["stage"] == "indexer selection", ev[f"stage[{layer}]"]
