"""One handle per mirror (impl_torch, impl_tf, impl_jax, impl_mlx) for tests/test_mirrors_modern.py: how to call
the functional API and the layer, read answers back as NumPy, run each path, decode with the cache, and
what each mirror's error tables and extra cases hold.

The static tables (extra cases, paths, parameter ids) import no framework, so the suite collects where a
framework is missing; load(name) imports one (pytest.importorskip: the test skips) when a test asks for it
through the `mirror` fixture (tests/conftest.py). Each parameter carries its framework's marker, so that
`tox -e torch` (-m torch) runs exactly the torch ones.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from modern_checks import CROSS, DECODE, LLAMA3, PROMPT, TOTAL, YARN, cfg, decode_in_place, modern_bad_calls
from reference_checks import WithOptions, error_of

import impl_numpy
import impl_numpy.adapter as numpy_adapter
import weights
from conformance.suite.cases import Case

MARKS = {"torch": pytest.mark.torch, "tf": pytest.mark.tf, "jax": pytest.mark.jax, "mlx": pytest.mark.mlx}
INSTALL = {"torch": "PyTorch not installed: pip install -c constraints/cpu.txt '.[torch]'",
           "tf": "TensorFlow/Keras not installed: pip install -c constraints/cpu.txt '.[tf]'",
           "jax": "JAX/Flax not installed: pip install -c constraints/cpu.txt '.[jax]'",
           "mlx": "MLX not installed: pip install -c constraints/cpu.txt '.[mlx]' (wheels: Linux x86-64, macOS arm64)"}


def _cases(*cases: Case) -> dict[str, Case]:
    return {case.name: case for case in cases}


# Combinations the named grid does not hold, per mirror (names start with the mirror's so that no case of
# the grid, nor another mirror's, shares their seeds).
EXTRA_CASES = {
    "torch": _cases(
        Case("torch_qk_norm_rms_all", cfg(qk_norm={"type": "rms", "scope": "all"}), **CROSS),
        Case("torch_qk_norm_layer_head_gqa",
             cfg(num_heads=4, num_kv_heads=2, qk_norm={"type": "layer", "eps": 1e-5}), is_causal=True),
        Case("torch_rope_interleaved_partial_linear",
             cfg(head_dim=8, rope={"rotary_dim": 4, "interleaved": True, "scaling": {"type": "linear", "factor": 4.0}}),
             positions="far", is_causal=True),
        Case("torch_window_both_cache", cfg(window_left=2, window_right=0, rope={}), T=2, S=2, P=5, **DECODE),
        Case("torch_window_left_cross_top_left", cfg(window_left=1), **CROSS),
        Case("torch_sinks_cache_mqa_empty_rows",
             cfg(num_heads=4, num_kv_heads=1, use_sinks=True, masked_row="uniform", rope={"interleaved": True}),
             T=2, S=2, P=3, mask="empty_rows", **DECODE),
        Case("torch_softcap_window_segments", cfg(logit_softcap=3.0, window_left=1, rope={}), T=7, S=7,
             positions="packed", is_causal=True),
        Case("torch_window_segments_norm", cfg(window_left=2, window_right=1, qk_norm={"type": "rms"}, rope={}),
             T=7, S=7, positions="packed"),
        Case("torch_softcap_bias_sinks_gqa", cfg(num_heads=4, num_kv_heads=2, logit_softcap=4.0, use_sinks=True),
             bias="random", mask="random", **CROSS),
    ),
    # each rope scaling with each pairing, both norm kinds in both scopes, windows with a cache and T != S,
    # sinks with masks, empty rows, GQA/MQA and a cache, segments with windows
    "tf": _cases(
        Case("tf_qk_norm_rms_all", cfg(qk_norm={"type": "rms", "scope": "all"}), **CROSS),
        Case("tf_qk_norm_layer_head_gqa", cfg(num_heads=4, num_kv_heads=2, qk_norm={"type": "layer", "eps": 1e-5}),
             is_causal=True),
        Case("tf_rope_interleaved_partial_linear",
             cfg(head_dim=8, rope={"rotary_dim": 4, "interleaved": True, "scaling": {"type": "linear", "factor": 4.0}}),
             positions="far", is_causal=True),
        Case("tf_rope_half_partial_llama3_per_batch", cfg(head_dim=8, rope={"rotary_dim": 6, "scaling": LLAMA3}),
             positions="per_batch", **CROSS),
        Case("tf_rope_half_yarn_far", cfg(head_dim=8, rope={"scaling": YARN}), positions="far", is_causal=True),
        Case("tf_window_both_cache", cfg(window_left=2, window_right=0, rope={}), T=2, S=2, P=5, **DECODE),
        Case("tf_window_left_cross_top_left", cfg(window_left=1), **CROSS),
        Case("tf_window_right_causal_long_query", cfg(window_right=1, window_left=1), self_attention=False, T=6,
             S=4, is_causal=True, causal_alignment="bottom_right", mask="empty_rows"),
        Case("tf_sinks_cache_mqa_empty_rows",
             cfg(num_heads=4, num_kv_heads=1, use_sinks=True, masked_row="uniform", rope={"interleaved": True}),
             T=2, S=2, P=3, mask="empty_rows", **DECODE),
        Case("tf_softcap_window_segments", cfg(logit_softcap=3.0, window_left=1, rope={}), T=7, S=7,
             positions="packed", is_causal=True),
        Case("tf_window_segments_norm", cfg(window_left=2, window_right=1, qk_norm={"type": "rms"}, rope={}),
             T=7, S=7, positions="packed"),
        Case("tf_softcap_bias_sinks_gqa", cfg(num_heads=4, num_kv_heads=2, logit_softcap=4.0, use_sinks=True),
             bias="neg_inf", mask="random", **CROSS),
        Case("tf_sinks_dropout_nan_rows", cfg(use_sinks=True, masked_row="nan", dropout=0.25), mask="empty_rows",
             training=True, **CROSS),
    ),
    "jax": _cases(
        Case("jax_qk_norm_rms_all", cfg(qk_norm={"type": "rms", "scope": "all"}), **CROSS),
        Case("jax_qk_norm_layer_head_gqa", cfg(num_heads=4, num_kv_heads=2, qk_norm={"type": "layer", "eps": 1e-5}),
             is_causal=True),
        Case("jax_rope_interleaved_partial_linear",
             cfg(head_dim=8, rope={"rotary_dim": 4, "interleaved": True, "scaling": {"type": "linear", "factor": 4.0}}),
             positions="far", is_causal=True),
        Case("jax_rope_half_partial_llama3_per_batch", cfg(head_dim=8, rope={"rotary_dim": 6, "scaling": LLAMA3}),
             positions="per_batch", **CROSS),
        Case("jax_window_both_cache", cfg(window_left=2, window_right=0, rope={}), T=2, S=2, P=5, **DECODE),
        Case("jax_window_left_cross_top_left", cfg(window_left=1), **CROSS),
        Case("jax_window_long_query_bottom_right", cfg(window_left=1, window_right=1), self_attention=False, T=7,
             S=3, causal_alignment="bottom_right"),
        Case("jax_sinks_cache_mqa_empty_rows",
             cfg(num_heads=4, num_kv_heads=1, use_sinks=True, masked_row="uniform", rope={"interleaved": True}),
             T=2, S=2, P=3, mask="empty_rows", **DECODE),
        Case("jax_softcap_window_segments", cfg(logit_softcap=3.0, window_left=1, rope={}), T=7, S=7,
             positions="packed", is_causal=True),
        Case("jax_window_segments_norm", cfg(window_left=2, window_right=1, qk_norm={"type": "rms"}, rope={}),
             T=7, S=7, positions="packed"),
        Case("jax_softcap_bias_sinks_gqa", cfg(num_heads=4, num_kv_heads=2, logit_softcap=4.0, use_sinks=True),
             bias="random", mask="random", **CROSS),
        Case("jax_dropout_cache_rope_sinks", cfg(dropout=0.25, use_sinks=True, rope={}), training=True, T=3, S=3,
             P=2, mask="padding", **DECODE),
    ),
    # MLX: the combinations its fused kernel's mask folding meets (a window over a cache and T != S, sinks with
    # empty rows, segments with a window, bias with -inf and sinks under GQA) and the norms' scopes
    "mlx": _cases(
        Case("mlx_qk_norm_rms_all", cfg(qk_norm={"type": "rms", "scope": "all"}), **CROSS),
        Case("mlx_qk_norm_layer_head_gqa", cfg(num_heads=4, num_kv_heads=2, qk_norm={"type": "layer", "eps": 1e-5}),
             is_causal=True),
        Case("mlx_rope_interleaved_partial_linear",
             cfg(head_dim=8, rope={"rotary_dim": 4, "interleaved": True, "scaling": {"type": "linear", "factor": 4.0}}),
             positions="far", is_causal=True),
        Case("mlx_window_both_cache", cfg(window_left=2, window_right=0, rope={}), T=2, S=2, P=5, **DECODE),
        Case("mlx_window_long_query_bottom_right", cfg(window_left=1, window_right=1), self_attention=False, T=7,
             S=3, causal_alignment="bottom_right"),
        Case("mlx_sinks_cache_mqa_empty_rows",
             cfg(num_heads=4, num_kv_heads=1, use_sinks=True, masked_row="uniform", rope={"interleaved": True}),
             T=2, S=2, P=3, mask="empty_rows", **DECODE),
        Case("mlx_window_segments_norm", cfg(window_left=2, window_right=1, qk_norm={"type": "rms"}, rope={}),
             T=7, S=7, positions="packed"),
        Case("mlx_bias_sinks_gqa", cfg(num_heads=4, num_kv_heads=2, use_sinks=True), bias="neg_inf", mask="random",
             **CROSS),
        Case("mlx_dropout_cache_rope_sinks", cfg(dropout=0.25, use_sinks=True, rope={}), training=True, T=3, S=3,
             P=2, mask="padding", **DECODE),
    ),
}

# Falcon-RW's rounded ALiBi (alibi_bias_dtype): random slopes, so the bfloat16 product rounds, past a cache
for _framework in EXTRA_CASES:
    EXTRA_CASES[_framework][f"{_framework}_alibi_bf16_cache"] = Case(
        f"{_framework}_alibi_bf16_cache", cfg(num_heads=4, num_kv_heads=2, alibi=True, alibi_bias_dtype="bfloat16"),
        T=3, S=3, P=4, positions="far", mask="padding", **DECODE)


def case_named(framework: str, name: str) -> Case:
    from conformance.suite.cases import CASES

    return CASES.get(name) or EXTRA_CASES[framework][name]


# The paths a case runs on: torch's stages or SDPA; Keras's stages, fused core or chunk_size=2; JAX's
# stages (weights asked for), fused expression or chunk_size=2.
# MLX's stages (weights asked for), fused kernel (mx.fast.scaled_dot_product_attention; float64 and what it
# cannot take run the stages) or chunk_size=2.
PATHS = {"torch": ("stages", "sdpa"), "tf": ("stages", "fused", "chunked"), "jax": ("stages", "fused", "chunked"),
         "mlx": ("stages", "fused", "chunked")}
GPU_PATHS = {"torch": ("stages", "sdpa"), "tf": ("stages", "fused", "chunked"), "jax": ("stages", "fused"),
             "mlx": ("stages", "fused", "chunked")}
TRACE_DTYPES = {"torch": ("float64",), "tf": ("float64",), "jax": ("float64", "float32"), "mlx": ("float64",)}
# (the two indexer cases: the indexer's stages first, in weights.call.INDEXER_STAGES' names and order: DeepSeek
# V3.2's on a latent layer, MiniMax M3's blocks per kv head)
FRONTIER_TRACE_CASES = ["frontier_everything", "latent_mla", "norm_after_rope_chunked", "value_norm",
                        "indexer_dsa_prefill", "indexer_m3_blocks"]
TRACE_CASES = {
    "torch": [*FRONTIER_TRACE_CASES, "modern_everything", "qk_norm_layer_all", "qk_norm_rms_head", "softcap",
              "rope_partial", "rope_yarn",
              "torch_qk_norm_rms_all"],
    "tf": [*FRONTIER_TRACE_CASES, "modern_everything", "qk_norm_layer_all", "qk_norm_rms_head", "softcap",
           "rope_partial", "rope_yarn", "segments_packed", "tf_qk_norm_rms_all", "tf_rope_half_partial_llama3_per_batch",
           "tf_softcap_bias_sinks_gqa"],
    "jax": [*FRONTIER_TRACE_CASES, "modern_everything", "qk_norm_layer_all", "qk_norm_rms_head", "softcap",
            "rope_partial", "rope_yarn", "jax_qk_norm_rms_all", "sinks_masked_rows"],
    "mlx": [*FRONTIER_TRACE_CASES, "modern_everything", "qk_norm_layer_all", "softcap", "rope_yarn",
            "mlx_qk_norm_rms_all", "sinks_masked_rows"],
}
NAMES_CASES = {"torch": ["modern_everything", "decode_cache", "torch_window_both_cache"],
               "tf": ["modern_everything", "decode_cache", "tf_window_both_cache", "tf_qk_norm_layer_head_gqa"],
               "jax": ["modern_everything", "decode_cache", "jax_window_both_cache"],
               "mlx": ["modern_everything", "decode_cache", "mlx_window_both_cache"]}
GPU_CASES = ["modern_everything", "decode_cache", "cache_window_gqa", "segments_packed", "sinks_masked_rows", "softcap",
             "rope_yarn", "qk_norm_layer_all"]  # and each mirror's window_segments_norm


def layer_cases(framework: str) -> list[str]:
    return ["qk_norm_layer_all", "qk_norm_rms_head", "sinks", "modern_everything", f"{framework}_qk_norm_rms_all",
            f"{framework}_qk_norm_layer_head_gqa", "frontier_everything", "latent_mla", "qk_norm_per_head_layer"]


def bad_calls(framework: str) -> dict[str, dict]:
    calls = modern_bad_calls()
    if framework == "torch":  # torch's own table had no dropout_mask_over_new_keys_only row
        del calls["dropout_mask_over_new_keys_only"]
    return calls


# The decode paths (test_decoding_with_the_cache_equals_the_full_causal_call) and the in-place variants.
DECODE_PATHS = {"torch": ("stages", "sdpa"), "tf": ("stages", "fused", "chunked"),
                "jax": ("plain", "stages", "chunked"), "mlx": ("stages", "fused", "chunked")}
# decode_reference(perturb_norms=): Keras's tests move the norm scales and sinks off their initial 1 and 0
PERTURB_NORMS = {"torch": False, "tf": True, "jax": False, "mlx": True}
IN_PLACE_VARIANTS = {
    "torch": ("stages", "sdpa"),
    "tf": ("fused-eager", "stages-eager", "chunked-eager", "fused-tf.function", "fused-captured",
           "stages-tf.function", "chunked-captured"),
    "jax": ("eager", "jit", "traced"),
    "mlx": ("stages", "fused", "chunked"),
}


class TracedOnTheStages(WithOptions):
    """An adapter with fixed options (Keras's chunk_size) whose traced forward (run_case's localisation of
    a failure) goes through the stages, which the chunked path refuses, so that a failure reports its
    stage rather than that refusal."""

    def forward(self, config, tensors, inputs, options, **kwargs):
        if kwargs.get("trace"):
            return self.adapter.forward(config, tensors, inputs, options, **kwargs)
        return super().forward(config, tensors, inputs, options, **kwargs)


def over_mirrors(rows: dict[str, list]) -> list:
    """pytest.param(framework, *values) per framework's rows (pytest.param each), marked with the framework's
    marker, its id "<framework>-<the row's id>"."""
    out = []
    for framework, params in rows.items():
        for p in params:
            ident = f"{framework}-{p.id}" if p.id else framework
            out.append(pytest.param(framework, *p.values, id=ident, marks=(MARKS[framework], *p.marks)))
    return out


def grid(order, values_order, marks=lambda **kw: (), **axes):
    """pytest.params over the product of `axes` (name -> list of values): values in `values_order`, the id
    its values joined by "-" in `order` (the ids each mirror's own file gave)."""
    import itertools

    names = list(axes)
    for combo in itertools.product(*axes.values()):
        row = dict(zip(names, combo))
        yield pytest.param(*(row[n] for n in values_order), id="-".join(str(row[n]) for n in order),
                           marks=marks(**row))


def decode_token_by_token(call, x):
    """The prompt x[:, :PROMPT] in one call, then each token up to TOTAL in its own call over the cache the
    last one returned: (the calls' outputs in order, the last present_key, present_value)."""
    out, pk, pv = call(x[:, :PROMPT], is_causal=True, return_cache=True)
    rows = [out]
    for t in range(PROMPT, TOTAL):
        out, pk, pv = call(x[:, t:t + 1], past_key=pk, past_value=pv, is_causal=True,
                           causal_alignment="bottom_right", return_cache=True)
        rows.append(out)
    return rows, pk, pv


class _Mirror:
    name: str
    module: object  # impl_torch / impl_tf / impl_jax
    adapter: object
    trace_stages = None  # a function config -> the stage names a trace holds, where the mirror has one

    def extra_cases(self):
        return EXTRA_CASES[self.name]

    def case(self, name):
        return case_named(self.name, name)

    def path_case(self, case, path):
        """The case as `path` runs it: weights only on the stages."""
        return case if path == "stages" else dataclasses.replace(case, return_weights=False)

    def path_adapter(self, path):
        return self.adapter

    def optional_input_signature(self):
        import inspect

        return inspect.signature(self.module.multi_head_attention).parameters

    def error_calls(self, config, tensors, query, call):
        """(label, error text of the mirror's call, the reference's text or None: impl_numpy's functional)."""
        layer = self.module.MultiHeadAttention.from_tensors(config, tensors)
        return [("functional", error_of(self.module.multi_head_attention, config, tensors, query, **call), None),
                ("layer", error_of(layer, query, **call), None)]

    def window_mask_calls(self, T, S, left, right, alignment):
        return [("eager", lambda: self.to_numpy(self.module.window_mask(T, S, left, right, alignment)))]

    def segment_mask(self, q_ids, k_ids):
        return self.to_numpy(self.module.segment_mask(q_ids, k_ids))

    def layer_round_trip(self, config, tensors):
        """-> (the layer's to_tensors() after from_tensors, the number of parameters the layer holds)."""
        layer = self.module.MultiHeadAttention.from_tensors(config, tensors)
        return layer.to_tensors(), self.parameter_count(layer)


class TorchMirror(_Mirror):
    name = "torch"

    def __init__(self):
        self.torch = pytest.importorskip("torch", reason=INSTALL["torch"])
        import impl_torch
        import impl_torch.adapter as adapter
        from impl_torch.convert import TORCH_DTYPES, to_numpy, to_torch

        self.module, self.adapter = impl_torch, adapter
        self.to_numpy, self.to_torch, self.dtypes = to_numpy, to_torch, TORCH_DTYPES

    def path_case(self, case, path):
        return dataclasses.replace(case, return_weights=False) if path == "sdpa" else case

    def path_adapter(self, path):
        return WithOptions(self.adapter, use_sdpa=path == "sdpa")

    def gpu_missing(self):
        return None if self.torch.cuda.is_available() else "no CUDA GPU: torch.cuda.is_available() is False"

    def _args(self, value):
        return self.to_torch(value) if isinstance(value, np.ndarray) else value

    def call(self, config, tensors, query, **kw):
        params = {n: self.to_torch(t) for n, t in tensors.items()}
        return self.module.multi_head_attention(config, params, self._args(query),
                                                **{k: self._args(v) for k, v in kw.items()})

    def decode(self, config, tensors, x, path, *, layer=False):
        """PROMPT tokens in one causal call, then one token at a time with the cache (bottom-right causal,
        default positions: P + arange(T)). -> output (B, TOTAL, O), present_key, present_value."""
        torch, use_sdpa = self.torch, path == "sdpa"
        if layer:
            module = self.module.MultiHeadAttention.from_tensors(config, tensors)
            call = lambda q, **kw: module(q, use_sdpa=use_sdpa, **kw)  # noqa: E731
        else:
            params = {n: self.to_torch(t) for n, t in tensors.items()}
            call = lambda q, **kw: self.module.multi_head_attention(config, params, q, use_sdpa=use_sdpa, **kw)  # noqa: E731
        xt = self.to_torch(x)
        with torch.no_grad():
            rows, pk, pv = decode_token_by_token(call, xt)
        return self.to_numpy(torch.cat(rows, dim=1)), self.to_numpy(pk), self.to_numpy(pv)

    def layer_decode_path(self):
        return "stages"

    def in_place_decode(self, config, dtype, tensors, x, variant):
        """A prompt and then one token at a time into one zeroed buffer pair, under torch.no_grad(); every
        step hands back the very tensors it was given."""
        torch, to_numpy, to_torch = self.torch, self.to_numpy, self.to_torch
        params = {n: to_torch(t) for n, t in tensors.items()}

        class Buffer:
            """A torch buffer as decode_in_place holds it: that helper reads its results with np.asarray, and
            a torch tensor's own __array__ has no bfloat16 (to_numpy does)."""

            def __init__(self, tensor):
                self.tensor = tensor

            def __array__(self, dtype=None, copy=None):
                array = to_numpy(self.tensor)
                return array if dtype is None else array.astype(dtype)

        def step(_, part, pk, pv, P):
            with torch.no_grad():
                out, k, v = self.module.multi_head_attention(
                    config, params, to_torch(part), past_key=pk.tensor, past_value=pv.tensor, cache_length=P,
                    is_causal=True, causal_alignment="bottom_right", return_cache=True, use_sdpa=variant == "sdpa")
            # the wrappers stand for the tensors: handed back only where the call returned those very tensors
            return to_numpy(out), pk if k is pk.tensor else Buffer(k), pv if v is pv.tensor else Buffer(v)

        outputs, pk, pv, same = decode_in_place(
            step, tensors, x, lambda shape: Buffer(torch.zeros(shape, dtype=self.dtypes[dtype])))
        assert same, "a step returned a new tensor instead of the buffers it was given"
        return outputs, pk, pv

    def error_calls(self, config, tensors, query, call):
        torch_call = {k: self._args(v) for k, v in call.items()}
        params = {n: self.to_torch(t) for n, t in tensors.items()}
        layer = self.module.MultiHeadAttention.from_tensors(config, tensors)
        return [("functional", error_of(self.module.multi_head_attention, config, params, self.to_torch(query),
                                        **torch_call), None),
                ("layer", error_of(layer, self.to_torch(query), **torch_call), None)]

    def tensor_error_calls(self, config, broken, query):
        return [("functional", error_of(self.module.multi_head_attention, config,
                                        {k: self.to_torch(v) for k, v in broken.items()}, self.to_torch(query)),
                 None)]

    def window_mask_calls(self, T, S, left, right, alignment):
        return [("eager", lambda: self.module.window_mask(T, S, left, right, alignment).numpy())]

    def segment_mask(self, q_ids, k_ids):
        return self.module.segment_mask(self.torch.from_numpy(q_ids), self.torch.from_numpy(k_ids)).numpy()

    def parameter_count(self, layer):
        return sum(p.numel() for p in layer.parameters())

    def layer_output_and_grads(self, case, layer, inputs, d_out):
        """The layer's output on `inputs` and the gradients of <output, d_out> for the inputs and for every
        canonical tensor (the layer's parameters, reshaped to the canonical shapes)."""
        from impl_torch.layer import _layout

        to_torch, to_numpy = self.to_torch, self.to_numpy
        leaves = {k: to_torch(inputs[k]).requires_grad_(True) for k in ("query", "key", "value", "past_key",
                                                                         "past_value") if k in inputs}
        extra = {k: to_torch(inputs[k]) for k in ("mask", "bias", "positions", "key_positions", "segment_ids",
                                                  "key_segment_ids") if k in inputs}
        out = layer(leaves["query"], leaves["key"], leaves["value"], past_key=leaves.get("past_key"),
                    past_value=leaves.get("past_value"), is_causal=case.is_causal,
                    causal_alignment=case.causal_alignment, **extra)
        out.backward(to_torch(d_out).to(out.dtype))
        # an input the layer does not read (a latent layer's value) has no gradient: zeros, as the adapters give
        grads = {k: to_numpy(x.grad) if x.grad is not None else np.zeros(x.shape, inputs[k].dtype)
                 for k, x in leaves.items()}
        for name, (module, param, shape) in _layout(layer.config).items():
            grad = getattr(getattr(layer, module) if module else layer, param).grad
            grads[name] = to_numpy((grad.T if name.endswith(".kernel") else grad).reshape(shape))
        return to_numpy(out), grads


class TfMirror(_Mirror):
    name = "tf"

    def __init__(self):
        os.environ.setdefault("KERAS_BACKEND", "tensorflow")
        self.tf = pytest.importorskip("tensorflow", reason=INSTALL["tf"])
        self.keras = pytest.importorskip("keras", reason=INSTALL["tf"])
        import impl_tf
        from impl_tf import adapter

        self.module, self.adapter = impl_tf, adapter

    def to_numpy(self, x):
        return np.asarray(x)

    def path_adapter(self, path):
        return TracedOnTheStages(self.adapter, chunk_size=2) if path == "chunked" else self.adapter

    def gpu_missing(self):
        if self.tf.config.list_physical_devices("GPU"):
            return None
        return ("no GPU visible to TensorFlow (tf.config.list_physical_devices('GPU') is empty); install "
                "tensorflow[and-cuda] on a CUDA machine to run")

    def call(self, config, tensors, query, **kw):
        return self.module.multi_head_attention(config, tensors, query, **kw)

    def decode(self, config, tensors, x, path, *, layer=False):
        """PROMPT tokens in one causal call, then one token at a time with the cache, each call on `path`
        (stages: with a trace; fused; chunked: chunk_size=2)."""
        tf = self.tf
        extra = {"stages": {"trace": []}, "fused": {}, "chunked": {"chunk_size": 2}}[path]
        if layer:
            module = self.module.MultiHeadAttention.from_tensors(config, tensors)
            call = lambda q, **kw: module(q, **kw, **extra)  # noqa: E731
        else:
            params = {n: tf.constant(t) for n, t in tensors.items()}
            call = lambda q, **kw: self.module.multi_head_attention(config, params, q, **kw, **extra)  # noqa: E731
        rows, pk, pv = decode_token_by_token(call, tf.constant(x))
        return np.asarray(tf.concat(rows, axis=1)), np.asarray(pk), np.asarray(pv)

    def layer_decode_path(self):
        return "fused"

    def in_place_decode(self, config, dtype, tensors, x, variant):
        """One zeroed pair of tf.Variables (cache_length=P) on `variant` = "<path>-<mode>": eagerly, or in a
        tf.function that takes the variables as arguments or captures them (P a Python int: one trace per
        step). In a graph the function cannot hand a tf.Variable back, so the step returns the buffers it was
        given only when the call inside returned those very objects; every step must."""
        tf = self.tf
        path, mode = variant.split("-", 1)
        options = dict(is_causal=True, causal_alignment="bottom_right", return_cache=True,
                       **{"stages": {"trace": []}, "fused": {}, "chunked": {"chunk_size": 2}}[path])

        def call(params, part, pk, pv, P):
            return self.module.multi_head_attention(config, params, part, past_key=pk, past_value=pv,
                                                    cache_length=P, **options)

        def step(tensors, part, pk, pv, P):
            params = {n: tf.constant(t) for n, t in tensors.items()}
            if mode == "eager":
                return call(params, tf.constant(part), pk, pv, P)
            returned = []

            def body(part, *buffers):
                out, k, v = call(params, part, *(buffers or (pk, pv)), P)
                returned.append(k is pk and v is pv)
                return out

            if mode == "tf.function":
                out = tf.function(body, autograph=False)(tf.constant(part), pk, pv)
            else:  # captured: the function closes over the variables
                out = tf.function(lambda part: body(part), autograph=False)(tf.constant(part))
            assert returned, "the tf.function was not traced"
            return (out, pk, pv) if all(returned) else (out, None, None)

        outputs, pk, pv, same = decode_in_place(step, tensors, x, lambda shape: tf.Variable(tf.zeros(shape, dtype)))
        assert same, "a step returned something other than the tf.Variables it was given"
        for name, value in (("output", outputs), ("present_key", pk), ("present_value", pv)):
            assert value.dtype == weights.dtype_from_name(dtype), f"{name}: dtype {value.dtype}, expected {dtype}"
        return outputs, pk, pv

    def tensor_error_calls(self, config, broken, query):
        tf, mha = self.tf, self.module.multi_head_attention
        return [("numpy arrays", error_of(mha, config, broken, query), None),
                ("tf tensors", error_of(mha, config, {k: tf.constant(v) for k, v in broken.items()}, query), None),
                ("layer", error_of(self.module.MultiHeadAttention.from_tensors, config, broken),
                 error_of(impl_numpy.MultiHeadAttention.from_tensors, config, broken))]

    def parameter_count(self, layer):
        return sum(int(np.prod(v.shape)) for v in layer.trainable_variables)

    def layer_output_and_grads(self, case, layer, inputs, d_out):
        """GradientTape on the layer's own variables, Keras layout reshaped to the canonical shapes."""
        tf = self.tf
        leaves = {k: tf.constant(inputs[k]) for k in ("query", "key", "value", "past_key", "past_value")
                  if k in inputs}
        extra = {k: inputs[k] for k in ("mask", "bias", "positions", "key_positions", "segment_ids",
                                        "key_segment_ids") if k in inputs}
        variables = layer.canonical_variables()
        with tf.GradientTape() as tape:
            tape.watch(list(leaves.values()))
            out = layer(leaves["query"], leaves["key"], leaves["value"], past_key=leaves.get("past_key"),
                        past_value=leaves.get("past_value"), is_causal=case.is_causal,
                        causal_alignment=case.causal_alignment, **extra)
        sources = [*leaves.values(), *variables.values()]
        found = tape.gradient(out, sources, output_gradients=tf.constant(d_out))
        shapes = case.config.tensor_shapes()
        # an input the layer does not read (a latent layer's value) has no gradient: zeros, as the adapters give
        grads = {name: (np.zeros(source.shape, source.dtype.as_numpy_dtype) if g is None else np.asarray(g)).reshape(
                 shapes.get(name, tuple(source.shape)))
                 for name, source, g in zip([*leaves, *variables], sources, found, strict=True)}
        return np.asarray(out), grads


class JaxMirror(_Mirror):
    name = "jax"

    def __init__(self):
        self.jax = pytest.importorskip("jax", reason=INSTALL["jax"])
        pytest.importorskip("flax", reason=INSTALL["jax"])
        import jax.numpy as jnp
        from flax import nnx

        import impl_jax
        import impl_jax.adapter as adapter  # (switches x64 on)

        self.jnp, self.nnx, self.module, self.adapter = jnp, nnx, impl_jax, adapter
        self.trace_stages = impl_jax.trace_stages
        self.jit_apply = self.jax.jit(impl_jax.apply, static_argnames=impl_jax.STATIC_ARGNAMES)

    def to_numpy(self, x):
        return np.asarray(x)

    def path_case(self, case, path):
        return dataclasses.replace(case, return_weights=path == "stages")

    def path_adapter(self, path):
        from test_jax import ChunkedAdapter

        return ChunkedAdapter(2) if path == "chunked" else WithOptions(self.adapter)

    def gpu_missing(self):
        return None if self.module.gpu_available() else (
            "no GPU: jax.devices('gpu') fails (a GPU machine needs a CUDA jaxlib: pip install 'jax[cuda12]')")

    def call(self, config, tensors, query, **kw):
        return self.jit_apply(config, tensors, query, **kw)

    def decode(self, config, tensors, x, path, *, layer=False):
        """Through the jitted apply ("plain": the dtype's own path, the fused expression in float32/float64;
        "stages": with the weights, every stage; "chunked": chunk_size=2) or the layer."""
        if layer:
            call = self.module.MultiHeadAttention.from_tensors(config, tensors)
        else:
            extra = {"stages": dict(return_weights=True), "chunked": dict(chunk_size=2), "plain": {}}[path]

            def call(q, **kw):
                result = self.jit_apply(config, tensors, q, **kw, **extra)
                return (result[0], *result[2:]) if path == "stages" else result
        rows, pk, pv = decode_token_by_token(call, x)
        return np.asarray(self.jnp.concatenate(rows, axis=1)), np.asarray(pk), np.asarray(pv)

    def layer_decode_path(self):
        return "plain"

    def in_place_decode(self, config, dtype, tensors, x, variant):
        """apply with cache_length=P and return_cache, eagerly ("eager"), or under jax.jit with the buffers
        donated and P static ("jit") or a traced int32 ("traced": one program for every P). JAX hands back
        new arrays (never the given ones); under jit with the buffers donated, XLA writes them in place and
        the given arrays are deleted (CPU donation works in the installed jax); a traced cache_length
        compiles one program for all P."""
        jnp, mode = self.jnp, variant
        options = dict(is_causal=True, causal_alignment="bottom_right", return_cache=True)

        def call(t, part, pk, pv, P):
            return self.module.apply(config, t, part, past_key=pk, past_value=pv, cache_length=P, **options)

        jitted = self.jax.jit(call, static_argnums=4 if mode == "jit" else (), donate_argnums=(2, 3))
        given = []

        def step(t, part, pk, pv, P):
            given.append((pk, pv))
            if mode == "eager":
                return call(t, part, pk, pv, P)
            return jitted(t, part, pk, pv, P if mode == "jit" else jnp.int32(P))

        outputs, pk, pv, same = decode_in_place(step, tensors, x, lambda shape: jnp.zeros(shape, dtype))
        assert not same  # jax arrays are immutable: each step returns new arrays
        deleted = [pair[0].is_deleted() and pair[1].is_deleted() for pair in given]
        assert deleted == [mode != "eager"] * (1 + TOTAL - PROMPT), f"donated buffers deleted per step: {deleted}"
        if mode == "traced":
            assert jitted._cache_size() == 2, f"{jitted._cache_size()} programs: the prompt's and one for every token"
        return outputs, pk, pv

    def error_calls(self, config, tensors, query, call):
        """apply on NumPy and on jax arrays, the jitted apply, the layer and the adapter."""
        jnp, apply = self.jnp, self.module.apply
        as_jax = {k: (jnp.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in call.items()}
        jax_tensors = {n: jnp.asarray(t) for n, t in tensors.items()}
        found = [("apply", error_of(apply, config, tensors, query, **call), None),
                 ("apply on jax arrays", error_of(apply, config, jax_tensors, jnp.asarray(query), **as_jax), None),
                 ("jitted apply", error_of(self.jit_apply, config, jax_tensors, jnp.asarray(query), **as_jax), None),
                 ("layer", error_of(self.module.MultiHeadAttention.from_tensors(config, tensors), query, **call),
                  None)]
        inputs = {"query": query, **{k: v for k, v in call.items() if isinstance(v, np.ndarray)}}
        options = {k: v for k, v in call.items() if not isinstance(v, np.ndarray)}
        # the adapters read return_cache as a truth value, and take no cache_length (mha verify's options hold
        # no in-place cache: impl_numpy's adapter ignores it)
        if "return_cache" not in options and "cache_length" not in options:
            found.append(("adapter", error_of(self.adapter.forward, config, tensors, inputs, options),
                          error_of(numpy_adapter.forward, config, tensors, inputs, options)))
        return found

    def tensor_error_calls(self, config, broken, query):
        jnp = self.jnp
        return [(label, error_of(fn, *args), None) for label, fn, args in (
            ("apply", self.module.apply, (config, broken, query)),
            ("apply on jax arrays", self.module.apply, (config, {k: jnp.asarray(v) for k, v in broken.items()}, query)),
            ("layer", self.module.MultiHeadAttention.from_tensors, (config, broken)),
            ("adapter", self.adapter.forward, (config, broken, {"query": query}, {})),
        )]

    def window_mask_calls(self, T, S, left, right, alignment):
        calls = [("eager", lambda: np.asarray(self.module.window_mask(T, S, left, right, alignment)))]
        if (T, S, left, right) == (4, 6, 1, 1):  # one compile per alignment suffices
            jitted = self.jax.jit(self.module.window_mask, static_argnums=(0, 1, 2, 3, 4))
            calls.append(("jit", lambda: np.asarray(jitted(T, S, left, right, alignment))))
        return calls

    def segment_mask(self, q_ids, k_ids):
        return np.asarray(self.jax.jit(self.module.segment_mask)(q_ids, k_ids))

    def parameter_count(self, layer):
        nnx = self.nnx
        return sum(int(np.prod(v[...].shape)) for _, v in nnx.to_flat_state(nnx.state(layer, nnx.Param)))

    def layer_output_and_grads(self, case, layer, inputs, d_out):
        """The layer through nnx.jit; nnx.grad gives its parameters' gradients (state path = canonical name)."""
        jnp, nnx = self.jnp, self.nnx
        leaves = {k: jnp.asarray(inputs[k]) for k in ("query", "key", "value", "past_key", "past_value")
                  if k in inputs}
        extra = {k: jnp.asarray(inputs[k]) for k in ("mask", "bias", "positions", "key_positions", "segment_ids",
                                                     "key_segment_ids") if k in inputs}
        d_out = jnp.asarray(d_out)

        def loss(module, leaves):
            out = module(leaves["query"], leaves["key"], leaves["value"], past_key=leaves.get("past_key"),
                         past_value=leaves.get("past_value"), is_causal=case.is_causal,
                         causal_alignment=case.causal_alignment, **extra)
            return jnp.sum(out * d_out), out

        @nnx.jit
        def grads_of(module, leaves):
            return nnx.grad(loss, argnums=(0, 1), has_aux=True)(module, leaves)

        (g_module, g_leaves), out = grads_of(layer, leaves)
        grads = {".".join(map(str, path)): np.asarray(g[...]) for path, g in nnx.to_flat_state(g_module)}
        grads.update({k: np.asarray(g) for k, g in g_leaves.items()})
        return np.asarray(out), grads


class MlxMirror(_Mirror):
    name = "mlx"

    def __init__(self):
        self.mx = pytest.importorskip("mlx.core", reason=INSTALL["mlx"])
        import impl_mlx
        import impl_mlx.adapter as adapter
        from impl_mlx.convert import to_mx, to_numpy

        self.module, self.adapter, self.to_mx, self.to_numpy = impl_mlx, adapter, to_mx, to_numpy
        self.trace_stages = impl_mlx.trace_stages

    PATH_OPTIONS = {"stages": {"trace": []}, "fused": {}, "chunked": {"chunk_size": 2}}

    def path_adapter(self, path):
        return TracedOnTheStages(self.adapter, chunk_size=2) if path == "chunked" else self.adapter

    def gpu_missing(self):
        return None if self.module.gpu_available() else "no GPU: MLX's Metal device is macOS arm64 only"

    def _args(self, value):
        return self.to_mx(value) if isinstance(value, np.ndarray) else value

    def call(self, config, tensors, query, **kw):
        params = {n: self.to_mx(t) for n, t in tensors.items()}
        return self.module.multi_head_attention(config, params, self.to_mx(query),
                                                **{k: self._args(v) for k, v in kw.items()})

    def decode(self, config, tensors, x, path, *, layer=False):
        """PROMPT tokens in one causal call, then one token at a time with the cache, each call on `path`
        (stages: with a trace; fused: the plan's own path; chunked: chunk_size=2)."""
        mx, extra = self.mx, self.PATH_OPTIONS[path]
        if layer:
            module = self.module.MultiHeadAttention.from_tensors(config, tensors)
            call = lambda q, **kw: module(q, **kw, **extra)  # noqa: E731
        else:
            params = {n: self.to_mx(t) for n, t in tensors.items()}
            call = lambda q, **kw: self.module.multi_head_attention(config, params, q, **kw, **extra)  # noqa: E731
        rows, pk, pv = decode_token_by_token(call, self.to_mx(x))
        return self.to_numpy(mx.concatenate(rows, axis=1)), self.to_numpy(pk), self.to_numpy(pv)

    def layer_decode_path(self):
        return "fused"

    def in_place_decode(self, config, dtype, tensors, x, variant):
        """One zeroed pair of mx.arrays (cache_length=P) on `variant` (a path); every step must hand back the
        very arrays it was given (MLX's slice assignment writes the caller's array)."""
        mx, to_mx, to_numpy = self.mx, self.to_mx, self.to_numpy
        params = {n: to_mx(t) for n, t in tensors.items()}

        class Buffer:
            """An mx.array as decode_in_place holds it (np.asarray through to_numpy: bfloat16 included)."""

            def __init__(self, array):
                self.array = array

            def __array__(self, dtype=None, copy=None):
                array = to_numpy(self.array)
                return array if dtype is None else array.astype(dtype)

        def step(_, part, pk, pv, P):
            out, k, v = self.module.multi_head_attention(
                config, params, to_mx(part), past_key=pk.array, past_value=pv.array, cache_length=P, is_causal=True,
                causal_alignment="bottom_right", return_cache=True, **self.PATH_OPTIONS[variant])
            return to_numpy(out), pk if k is pk.array else Buffer(k), pv if v is pv.array else Buffer(v)

        zeros = lambda shape: Buffer(mx.zeros(shape, dtype=to_mx(np.zeros((), dtype)).dtype))  # noqa: E731
        outputs, pk, pv, same = decode_in_place(step, tensors, x, zeros)
        assert same, "a step returned a new array instead of the buffers it was given"
        return outputs, pk, pv

    def error_calls(self, config, tensors, query, call):
        """The functional call on NumPy and on mx arrays, and the layer."""
        as_mx = {k: self._args(v) for k, v in call.items()}
        params = {n: self.to_mx(t) for n, t in tensors.items()}
        layer = self.module.MultiHeadAttention.from_tensors(config, tensors)
        mha = self.module.multi_head_attention
        return [("functional", error_of(mha, config, tensors, query, **call), None),
                ("functional on mx arrays", error_of(mha, config, params, self.to_mx(query), **as_mx), None),
                ("layer", error_of(layer, self.to_mx(query), **as_mx), None)]

    def tensor_error_calls(self, config, broken, query):
        mha = self.module.multi_head_attention
        return [("numpy arrays", error_of(mha, config, broken, query), None),
                ("mx arrays", error_of(mha, config, {k: self.to_mx(v) for k, v in broken.items()}, query), None),
                ("layer", error_of(self.module.MultiHeadAttention.from_tensors, config, broken),
                 error_of(impl_numpy.MultiHeadAttention.from_tensors, config, broken))]

    def parameter_count(self, layer):
        from mlx.utils import tree_flatten

        return sum(int(v.size) for _, v in tree_flatten(layer.parameters()))

    def layer_output_and_grads(self, case, layer, inputs, d_out):
        """mx.grad of <output, d_out> over the layer's own parameters (their flattened names are the canonical
        ones) and the inputs, the parameters swapped in with layer.update as nn.value_and_grad does."""
        from mlx.utils import tree_flatten

        mx, to_mx = self.mx, self.to_mx
        leaves = {k: to_mx(inputs[k]) for k in ("query", "key", "value", "past_key", "past_value") if k in inputs}
        extra = {k: to_mx(inputs[k]) for k in ("mask", "bias", "positions", "key_positions", "segment_ids",
                                               "key_segment_ids") if k in inputs}
        d_out = to_mx(d_out)
        found = {}

        def loss(params, leaves):
            layer.update(params)
            out = layer(leaves["query"], leaves.get("key"), leaves.get("value"), past_key=leaves.get("past_key"),
                        past_value=leaves.get("past_value"), is_causal=case.is_causal,
                        causal_alignment=case.causal_alignment, **extra)
            found["out"] = out
            return (out * d_out).sum()

        params = layer.trainable_parameters()
        g_params, g_leaves = mx.grad(loss, argnums=(0, 1))(params, leaves)
        layer.update(params)
        grads = {name: self.to_numpy(g) for name, g in tree_flatten(g_params)}
        grads.update({k: self.to_numpy(g) for k, g in g_leaves.items()})
        return self.to_numpy(found["out"]), grads


_LOADED: dict[str, _Mirror] = {}


def load(framework: str) -> _Mirror:
    """The mirror's handle (its framework imported once per process); skips the test where it is missing."""
    if framework not in _LOADED:
        _LOADED[framework] = {"torch": TorchMirror, "tf": TfMirror, "jax": JaxMirror, "mlx": MlxMirror}[framework]()
    return _LOADED[framework]

