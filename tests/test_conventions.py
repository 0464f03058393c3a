"""The measured conventions table (conformance/native/conventions/).

Two kinds of test. The harness tests run the measurement on fake NumPy "APIs"
with known, deliberately foreign conventions, so a measurement that always
answered "attend" / "top_left" would fail them. The framework tests read the
facts that the frameworks document from one real measure() run; each skips,
naming the extra to install, when its framework is missing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from conformance.native import conventions as conv
from conformance.native.conventions import alibi_models as ca
from conformance.native.conventions import keras_backends as ckb
from conformance.native.conventions import modern as cm
from conformance.native.conventions import packed as cp
from conformance.native.conventions import precision

os.environ.setdefault("KERAS_BACKEND", "tensorflow")  # before anything imports keras

TORCH = "torch not installed: pip install -c constraints/cpu.txt '.[torch]'"
TF = "keras/tensorflow not installed: pip install -c constraints/cpu.txt '.[tf]'"
JAX = "jax/flax not installed: pip install -c constraints/cpu.txt '.[jax]'"
ONNX = "onnx/onnxruntime not installed: pip install -c constraints/cpu.txt '.[onnx]'"
HF = "torch/transformers not installed: pip install -c constraints/cpu.txt '.[hf,torch]'"

ROOT = Path(__file__).resolve().parents[1]
UNIFORM = conv.POLICY_LABELS["uniform"]
KNOWN_ROW_LABELS = set(conv.POLICY_LABELS.values())


@pytest.fixture(scope="module")
def data():
    # every table but mlx-lm's ports (about 25 s of model building: tests/test_mlx_lm_ports.py renders that one)
    # and Keras on its three backends (tests/test_conventions_keras_backends.py)
    return conv.measure(mlx_lm_ports=(), keras_backends=())


def _row(data, api: str) -> dict:
    rows = {r["api"]: r for r in data["rows"]}
    assert api in rows, f"no row {api!r}; rows: {sorted(rows)}"
    row = rows[api]
    assert row["status"] == "measured", f"{api}: {row['status']}: {row.get('reason')}"
    return row


def _expect(row: dict, key: str, expected) -> None:
    got = row.get(key)
    assert got == expected, f"{row['api']}: {key} measured {got!r}, expected {expected!r}; evidence {row['evidence']}"


# -- the harness, on fake APIs with known conventions ----------------------------------

def _fake(name: str, run, *, weights: bool = True, build=None) -> conv.Api:
    runner = conv.Runner(run, {"m": "full"}, returns_weights=weights)
    return conv.Api(name, "numpy", ("numpy",), "(fake)", build or (lambda: runner))


def _inverted(q, k, v, masks=None, causal=False, want_weights=True):
    """True = masked, NaN rows, bottom-right causal: every convention foreign to the reference."""
    allowed = None if not masks else ~masks["m"]
    return conv.reference(q, k, v, allowed=allowed, is_causal=causal, alignment="bottom_right", masked_row="nan",
                          dtype=np.float32)


def _ignores_everything(q, k, v, masks=None, causal=False, want_weights=True):
    return conv.reference(q, k, v, dtype=np.float32)


def _odd_empty_rows(q, k, v, masks=None, causal=False, want_weights=True):
    """True = attend, but a row without keys gets 0.5 everywhere (no policy of the reference)."""
    allowed = None if not masks else masks["m"]
    out, w = conv.reference(q, k, v, allowed=allowed, is_causal=causal, dtype=np.float32)
    if allowed is not None:
        out[~allowed.any(-1)] = 0.5  # (B, T) rows with no key
    return out, w


def _empty_rows_see_every_key(q, k, v, masks=None, causal=False, want_weights=True):
    """True = attend, but a row whose keys are all masked attends to every key (the cuDNN kernels' answer)."""
    allowed = None if not masks else masks["m"].copy()
    if allowed is not None:
        allowed[~allowed.any(-1)] = True  # (B, T) rows with no key: unmasked
    return conv.reference(q, k, v, allowed=allowed, is_causal=causal, dtype=np.float32)


def test_harness_names_a_fully_masked_row_that_ignores_its_mask():
    row = conv.measure_api(_fake("cudnn-like", _empty_rows_see_every_key))
    _expect(row, "mask_true_means", "attend")
    _expect(row, "fully_masked_row", "every key (the row's mask ignored)")


def test_harness_detects_foreign_conventions():
    row = conv.measure_api(_fake("inverted", _inverted))
    for key, expected in (("mask_true_means", "masked"), ("fully_masked_row", "NaN"), ("fully_masked_weights", "NaN"),
                          ("causal_T2_S4", "bottom_right"), ("causal_T4_S2", "bottom_right")):
        _expect(row, key, expected)
    err = row["evidence"]["polarity[m]"]["max_err_if_true_masked"]
    assert err <= conv.TOL, f"polarity match error {err} above tolerance {conv.TOL}"


def test_harness_detects_ignored_mask_and_causal():
    row = conv.measure_api(_fake("ignores", _ignores_everything))
    _expect(row, "mask_true_means", "ignored")
    assert row["fully_masked_row"].startswith("n/a"), row["fully_masked_row"]
    _expect(row, "causal_T2_S4", "not causal")
    _expect(row, "causal_T4_S2", "not causal")


def test_harness_reports_values_no_policy_explains():
    row = conv.measure_api(_fake("odd", _odd_empty_rows, weights=False))
    assert row["fully_masked_row"].startswith("other (0.5"), row["fully_masked_row"]
    _expect(row, "mask_true_means", "attend")
    _expect(row, "causal_T4_S2", "top_left")


def test_missing_framework_and_inexpressible_api_are_rows_not_crashes():
    def refuse():
        raise conv.NotExpressible("this runtime has no Attention op")

    apis = (conv.Api("ghost", "ghost", ("mha_no_such_module",), "pip install ghost", lambda: None),
            _fake("refuses", None, build=refuse))
    data = conv.measure(apis=apis)
    ghost, refuses = data["rows"]
    assert ghost["status"] == conv.NOT_INSTALLED and "pip install ghost" in ghost["reason"], ghost
    assert refuses["status"] == "n/a" and "no Attention op" in refuses["reason"], refuses
    text = conv.to_markdown(data)
    assert "| ghost | not installed |" in text, text
    assert "pip install ghost" in text and "no Attention op" in text, text


def test_precision_label_separates_float32_from_tf32():
    a, b, exact = precision._precision_inputs()
    f32 = precision._precision_label(a @ b, exact)
    tf32 = lambda x: (x.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)  # keep 10 mantissa bits  # noqa: E731
    reduced = precision._precision_label(tf32(a).astype(np.float64) @ tf32(b).astype(np.float64), exact)
    assert f32["label"] == "float32" and f32["rel_err"] < 1e-6, f32
    assert reduced["label"] == "TF32/bf16-like (reduced)" and 1e-4 < reduced["rel_err"] < 1e-2, reduced


def test_disagreements_name_the_api_and_both_values():
    row = {"api": "torch F.scaled_dot_product_attention", "status": "measured", "fully_masked_row": "NaN",
           "mask_true_means": "attend", "causal_T2_S4": "top_left", "causal_T4_S2": "top_left"}
    lines = conv.disagreements({"rows": [row]})
    assert lines == ["torch F.scaled_dot_product_attention: fully_masked_row expected '0', measured 'NaN'"], lines


def test_expectations_are_project_data_for_known_apis_and_keys():
    """The expectations ship in the package (a user's clone has no notes
    beside it): every API they name is a row of the table, every key one the
    measurement fills, and each entry says where it comes from."""
    import importlib.resources

    text = (importlib.resources.files("conformance.native.conventions") / conv.EXPECTED_FILE).read_text(encoding="utf-8")
    raw = json.loads(text)["apis"]
    table = conv.expected()
    names = ({api.name for api in conv.APIS} | {api.name for api in cm.APIS} | {api.name for api in cp.APIS}
             | {api.name for api in ca.APIS} | set(ckb.API_NAMES))
    assert set(table) == set(raw) and set(table) <= names, sorted(set(table) - names)
    for api, entry in raw.items():
        assert entry["expect"] and set(entry["expect"]) <= set(conv.EXPECTED_KEYS), (api, entry)
        assert len(entry["source"]) > 20, f"{api}: no source for its expectations"
    keys = {key for _, key in conv.COLUMNS} | {"causal_T2_S4_past_cache"} | set(cm.KEYS) | set(cp.KEYS) | set(ca.KEYS)
    assert set(conv.EXPECTED_KEYS) <= keys, set(conv.EXPECTED_KEYS) - keys
    assert "shared/" not in text and "shared/" not in conv.EXPECTED_SOURCE


def test_malformed_expectations_are_one_line_errors():
    with pytest.raises(ValueError, match=r"names unknown keys \['mask_polarity'\]"):
        conv.parse_expected(json.dumps({"apis": {"x": {"expect": {"mask_polarity": "attend"}, "source": "s"}}}))
    with pytest.raises(ValueError, match="malformed: KeyError"):
        conv.parse_expected(json.dumps({"api": {}}))
    with pytest.raises(ValueError, match="malformed: JSONDecodeError"):
        conv.parse_expected("{")


def test_what_the_user_sees_points_nowhere_outside_the_package():
    row = {"api": "torch F.scaled_dot_product_attention", "status": "measured", "fully_masked_row": "NaN",
           "mask_true_means": "attend", "fully_masked_weights": "n/a", "causal_T2_S4": "top_left",
           "causal_T4_S2": "top_left", "float32_matmul": {}, "evidence": {}, "notes": []}
    data = {"rows": [row], "versions": {"numpy": np.__version__}, "seconds": 0.1, "tolerance": conv.TOL,
            "matmul_shape": list(conv.MATMUL_SHAPE), "shapes": {"B": 2, "T": 4, "S": 5, "N": 2, "H": 4}}
    from rich.console import Console

    console = Console(record=True, width=300)
    conv.render_terminal(data, console=console)
    for text in (conv.to_markdown(data), console.export_text()):
        assert "shared/" not in text, text
        assert "fully_masked_row expected '0', measured 'NaN'" in text, text
        assert "conformance/native/conventions/expected.json" in text, text


def test_module_help_prints_help_without_measuring():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "conformance.native.conventions", "--help"], capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode == 0 and proc.stderr == "", proc
    assert proc.stdout.startswith("usage: python -m conformance.native.conventions") and "--markdown" in proc.stdout, proc.stdout
    assert "Native attention APIs" not in proc.stdout, "--help ran the measurement"
    bad = subprocess.run([sys.executable, "-m", "conformance.native.conventions", "--tabular"], capture_output=True, text=True,
                         cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "unrecognized arguments: --tabular" in bad.stderr, bad


# -- one real run -------------------------------------------------------------------------

def test_numpy_reference_policies(data):
    for policy, weights in (("zero", "0"), ("uniform", "uniform (1/S)"), ("nan", "NaN")):
        row = _row(data, f"numpy reference (masked_row={policy})")
        _expect(row, "mask_true_means", "attend")
        _expect(row, "fully_masked_row", conv.POLICY_LABELS[policy])
        _expect(row, "fully_masked_weights", weights)
        _expect(row, "causal_T2_S4", "top_left")
        _expect(row, "causal_T4_S2", "top_left")
        m = row["float32_matmul"]["cpu"]
        assert m["label"] == "float32" and m["rel_err"] < conv.FLOAT32_REL_ERR_MAX, m


@pytest.mark.torch
def test_torch(data):
    pytest.importorskip("torch", reason=TORCH)
    for api in ("torch nn.MultiheadAttention", "torch nn.MultiheadAttention (fast path)"):
        row = _row(data, api)
        _expect(row, "mask_true_means_by_argument", {"attn_mask": "masked", "key_padding_mask": "masked"})
        _expect(row, "fully_masked_row", "NaN")
    _expect(_row(data, "torch nn.MultiheadAttention"), "fully_masked_weights", "NaN")
    calls = _row(data, "torch nn.MultiheadAttention (fast path)")["evidence"]["fast_path_calls"]
    assert calls > 0, f"the fast-path row never reached torch._native_multi_head_attention ({calls} calls)"
    sdpa = _row(data, "torch F.scaled_dot_product_attention")
    _expect(sdpa, "mask_true_means", "attend")
    _expect(sdpa, "causal_T2_S4", "top_left")
    _expect(sdpa, "causal_T4_S2", "top_left")
    assert sdpa["fully_masked_row"] in KNOWN_ROW_LABELS, sdpa["fully_masked_row"]


@pytest.mark.tf
def test_keras(data):
    pytest.importorskip("tensorflow", reason=TF)
    pytest.importorskip("keras", reason=TF)
    for api in ("keras MultiHeadAttention (fused)", "keras MultiHeadAttention (return_attention_scores=True)"):
        row = _row(data, api)
        _expect(row, "mask_true_means", "attend")
        _expect(row, "causal_T2_S4", "top_left")
        _expect(row, "causal_T4_S2", "top_left")
        assert row["fully_masked_row"] in KNOWN_ROW_LABELS, row["fully_masked_row"]


@pytest.mark.jax
def test_flax_and_jax(data):
    pytest.importorskip("jax", reason=JAX)
    pytest.importorskip("flax", reason=JAX)
    for api in ("flax.linen.MultiHeadDotProductAttention", "flax.nnx.MultiHeadAttention", "jax.nn.dot_product_attention"):
        row = _row(data, api)
        _expect(row, "mask_true_means", "attend")
        _expect(row, "fully_masked_row", UNIFORM)
    for api in ("flax.linen.MultiHeadDotProductAttention", "flax.nnx.MultiHeadAttention"):
        _expect(_row(data, api), "fully_masked_weights", "uniform (1/S)")
    for api in ("flax.nnx.MultiHeadAttention", "jax.nn.dot_product_attention"):
        _expect(_row(data, api), "causal_T2_S4", "top_left")
        _expect(_row(data, api), "causal_T4_S2", "top_left")
    linen = _row(data, "flax.linen.MultiHeadDotProductAttention")
    assert linen["causal_T2_S4"].startswith("n/a"), linen["causal_T2_S4"]


def test_onnx(data):
    pytest.importorskip("onnx", reason=ONNX)
    spec = _row(data, "onnx.reference Attention (opset 23)")
    _expect(spec, "mask_true_means", "attend")
    _expect(spec, "causal_T2_S4", "top_left")  # no cache: offset 0
    _expect(spec, "causal_T2_S4_past_cache", "bottom_right")  # the cache shifts the diagonal
    pytest.importorskip("onnxruntime", reason=ONNX)
    rows = {r["api"]: r for r in data["rows"]}
    ort = rows["onnxruntime Attention (opset 23, CPU)"]
    if ort["status"] != "measured":  # a runtime without opset-23 Attention is a row saying why
        assert ort["status"] == "n/a" and ort["reason"], ort
        return
    _expect(ort, "mask_true_means", "attend")


def test_every_row_is_json_and_has_every_column(data):
    json.dumps(data, allow_nan=False)
    assert [r["api"] for r in data["rows"]] == [api.name for api in conv.APIS]
    for row in data["rows"]:
        if row["status"] != "measured":
            continue
        missing = [key for _, key in conv.COLUMNS if key not in row]
        assert not missing, f"{row['api']}: missing {missing}"
        for device, m in row["float32_matmul"].items():
            assert m["label"] in ("float32", "TF32/bf16-like (reduced)") and isinstance(m["rel_err"], float), (row["api"], device, m)


def test_markdown_and_terminal_show_every_api(data):
    from rich.console import Console

    text = conv.to_markdown(data)
    table = [line for line in text.splitlines() if line.startswith("| ")]
    every = (*conv.APIS, *cm.APIS, *cp.APIS, *ca.APIS)
    assert len(table) == 4 + len(every), table  # four headers + one line per API
    for api in every:
        assert any(line.startswith(f"| {api.name} |") for line in table), f"{api.name} missing from\n{text}"
    assert f"with {conv.EXPECTED_SOURCE}" in text, text
    console = Console(record=True, width=400)
    conv.render_terminal(data, console=console)
    shown = console.export_text()
    for api in every:
        assert api.name in shown, f"{api.name} missing from the terminal tables"


# -- the modern arguments (conformance/native/conventions/modern.py) ------------------------------

def _rotate(x, interleaved: bool, sign: float = 1.0):
    """RoPE written out pair by pair (independent of impl_numpy): pair p turns by position * 10000^(-2p/H)."""
    H = x.shape[-1]
    out = np.array(x, dtype=np.float64)
    for pos in range(x.shape[-2]):
        for p in range(H // 2):
            a, b = (2 * p, 2 * p + 1) if interleaved else (p, p + H // 2)
            theta = pos * cm.ROPE_THETA ** (-2 * p / H)
            c, s = np.cos(theta), sign * np.sin(theta)
            x1, x2 = x[..., pos, a], x[..., pos, b]
            out[..., pos, a], out[..., pos, b] = x1 * c - x2 * s, x2 * c + x1 * s
    return out


def test_rope_pairing_label_tells_the_pairings_apart():
    x = cm.rope_inputs()
    half, _ = cm.pairing_label(_rotate(x, False), x)
    inter, _ = cm.pairing_label(_rotate(x, True), x)
    wrong, _ = cm.pairing_label(_rotate(x, True, sign=-1.0), x)  # turned the other way: neither
    assert half.startswith("half-split (i, i+H/2)") and inter.startswith("interleaved (2i, 2i+1)"), (half, inter)
    assert wrong.startswith("neither"), wrong


def test_window_label_counts_the_visible_keys_and_checks_every_row():
    i, j = np.ogrid[:cm.WINDOW_T, :cm.WINDOW_T]
    band = (np.abs(i - j) < 3).astype(float)  # keras's sliding_window=3 rule, written here
    label, ev = cm.window_label(band, lambda a, b: abs(a - b) < 3)
    assert label == "keys i-2..i+2 (5)" and ev["every_row_follows_rule"], (label, ev)
    band[0, 5] = 1.0  # one row off the rule
    label, _ = cm.window_label(band, lambda a, b: abs(a - b) < 3)
    assert label.endswith("(rows differ: see evidence)"), label


def test_softcap_label_tells_the_orders_apart():
    def soft(x):
        e = np.exp(np.asarray(x, dtype=np.float64) - 3.0)
        return e / e.sum()

    c, b = cm.SOFTCAP, cm.SOFTCAP_BIAS
    cap_then_bias = soft([c * np.tanh(2 / c), c * np.tanh(2 / c) + b, -np.inf])
    bias_then_cap = soft([c * np.tanh(2 / c), c * np.tanh(3 / c), -np.inf])
    after_mask = soft([c * np.tanh(2 / c), c * np.tanh(2 / c) + b, -c])  # tanh(-inf) = -1: the key comes back
    assert cm.softcap_label(cap_then_bias)[0] == "before bias and mask"
    assert cm.softcap_label(bias_then_cap)[0] == "after bias, before mask"
    assert cm.softcap_label(after_mask)[0].startswith("neither"), "a masked key with weight > 0 matches no order"


def _modern(data, api: str) -> dict:
    rows = {r["api"]: r for r in data["modern_rows"]}
    assert api in rows, f"no modern row {api!r}; rows: {sorted(rows)}"
    row = rows[api]
    if row["status"] == "not installed":
        pytest.skip(row["reason"])
    assert row["status"] == "measured", f"{api}: {row['status']}: {row.get('reason')}"
    return row


def test_modern_rows_are_json_and_have_every_column(data):
    json.dumps(data["modern_rows"], allow_nan=False)
    assert [r["api"] for r in data["modern_rows"]] == [api.name for api in cm.APIS]
    for row in data["modern_rows"]:
        if row["status"] == "measured":
            assert all(isinstance(row.get(key), str) and row[key] for key in cm.KEYS), row


def test_modern_torch_flex(data):
    pytest.importorskip("torch", reason=TORCH)
    row = _modern(data, "torch flex_attention")
    assert row["softcap_order"] == "score_mod, then block_mask: before bias and mask", row
    assert row["sinks"].startswith("return_aux lse: out * sigmoid(lse - sink)") and row["evidence"]["sinks_max_err"] < 1e-5


def test_modern_windows_in_keys_visible(data):
    pytest.importorskip("jax", reason=JAX)
    assert _modern(data, "jax.nn.dot_product_attention")["window"] == "local_window_size=(2, 1): keys i-2..i+1 (4)"
    pytest.importorskip("keras", reason=TF)
    assert _modern(data, "keras MultiHeadAttention")["window"] == (
        "sliding_window=3: keys i-2..i+2 (5); with use_causal_mask: keys i-2..i+0 (3)")


def test_modern_flax_qk_norm_scope(data):
    pytest.importorskip("flax", reason=JAX)
    row = _modern(data, "flax.nnx.MultiHeadAttention")
    assert row["qk_norm"].startswith("normalize_qk: LayerNorm per head (H), eps 1e-06, no bias"), row["evidence"]


def test_modern_onnx(data):
    pytest.importorskip("onnx", reason=ONNX)
    ref = _modern(data, "onnx.reference (Attention, RotaryEmbedding)")
    assert ref["window"] == "left/right_window_size=(2, 1): keys i-2..i+1 (4)" and ref["softcap_order"] == (
        "before bias and mask"), ref
    assert ref["rope_pairing"].startswith("RotaryEmbedding interleaved=0: half-split") and (
        "interleaved=1: interleaved (2i, 2i+1)" in ref["rope_pairing"]), ref
    pytest.importorskip("onnxruntime", reason=ONNX)
    ort = _modern(data, "onnxruntime (Attention, RotaryEmbedding; CPU)")
    assert ort["softcap_order"] == "before bias and mask", ort
    # onnxruntime 1.30 does not know the opset-25 window attributes; a later release that runs them must match ONNX
    assert ort["window"] in ("n/a: opset 25 left_window_size: InvalidGraph: Unrecognized attribute: left_window_size "
                             "for operator Attention", ref["window"]), ort


def test_modern_rope_pairing_of_the_rope_libraries(data):
    expected = {"transformers (Llama rotary)": "apply_rotary_pos_emb (Llama): half-split (i, i+H/2)",
                "keras-hub": "RotaryEmbedding: half-split (i, i+H/2)",
                "torchtune": "RotaryPositionalEmbeddings: interleaved (2i, 2i+1)"}
    measured = {}
    for api, want in expected.items():
        row = {r["api"]: r for r in data["modern_rows"]}[api]
        if row["status"] == "not installed":
            continue
        assert row["status"] == "measured" and row["rope_pairing"].startswith(want + " (err "), row
        measured[api] = row["rope_pairing"]
    if not measured:
        pytest.skip("none of transformers, keras-hub, torchtune installed")


# -- transformers' ALiBi models (conformance/native/conventions/alibi_models.py) --------------------------

@pytest.mark.torch
@pytest.mark.tf
@pytest.mark.jax
def test_alibi_models_are_measured_and_match_the_expectations(data):
    """One row per model, every cell measured ("<label> (err ...)"), each label the one expected.json
    records from transformers' source: BLOOM and MPT outside the scale, Falcon inside; Falcon's eager
    path adds the bias twice, its sdpa path once; BLOOM and MPT compute in float32 inside a float64
    model; every decode step reads the cache at positions 0..P-1."""
    import re

    pytest.importorskip("torch", reason=HF)
    pytest.importorskip("transformers", reason=HF)
    rows = data["alibi_rows"]
    json.dumps(rows, allow_nan=False)
    assert [r["api"] for r in rows] == [api.name for api in ca.APIS]
    table = conv.expected()
    for row in rows:
        assert row["status"] == "measured", f"{row['api']}: {row['status']}: {row.get('reason')}"
        for key in ca.KEYS:
            assert re.search(r" \(err \d\.\de[-+]\d\d\)", row[key]), (row["api"], key, row[key])
            label = re.sub(r" \(err [^)]*\)", "", row[key])
            assert label == table[row["api"]][key], f"{row['api']}: {key} measured {row[key]!r}; {row['evidence']}"
    assert not [line for line in conv.disagreements(data) if line.startswith("transformers ")], conv.disagreements(data)


def test_alibi_models_without_transformers_are_not_installed_rows(monkeypatch):
    """transformers missing: each model is a "not installed" row naming the install line, in every
    rendering; nothing raises."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "transformers" else find_spec(name, *a, **k))
    data = conv.measure(apis=(), alibi_apis=ca.APIS)
    assert [r["api"] for r in data["alibi_rows"]] == [api.name for api in ca.APIS]
    for row in data["alibi_rows"]:
        assert row["status"] == conv.NOT_INSTALLED and "transformers" in row["reason"], row
        assert ca.HF_EXTRA in row["reason"], row
    text = conv.to_markdown(data)
    from rich.console import Console

    console = Console(record=True, width=300)
    conv.render_terminal(data, console=console)
    for api in ca.APIS:
        assert f"| {api.name} | not installed |" in text, text
    shown = console.export_text()
    assert all(api.name in shown for api in ca.APIS) and "not installed" in shown, shown
    assert ca.HF_EXTRA in text and ca.HF_EXTRA in shown, (text, shown)
