"""The TensorFlow runner of `mha bench`: impl_tf's paths (eager,
tf.function, XLA, chunked, an in-place cache in tf.Variables) beside
keras.layers.MultiHeadAttention, TensorFlow's allocator's peak memory.
"""

from __future__ import annotations

import os

import numpy as np

from conformance.bench.frameworks.runner import (
    DECODE_OPTIONS,
    Path_,
    Runner,
    cache_read_path,
    decode_buffers,
    decode_cache,
    float32_only,
    window_chunk,
)
from conformance.bench.measure import rss_memory
from conformance.bench.shapes import TF_CHUNK_SIZE, TF_CHUNK_SIZE_SMALL_BATCH, framework_chunk


def tf_runner(device: str, quick: bool, dtype: str = "float32") -> Runner:
    float32_only("tf", dtype)
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from impl_tf._keras import keras, tf
    from impl_tf.attention import multi_head_attention

    gpus = tf.config.list_physical_devices("GPU")
    if device == "gpu" and not gpus:
        raise RuntimeError("TensorFlow sees no GPU (tf.config.list_physical_devices('GPU') is empty)")
    tf.config.experimental.enable_tensor_float_32_execution(False)
    dev = "/GPU:0" if device == "gpu" else "/CPU:0"

    def done(f):
        def call():
            with tf.device(dev):
                y = f()
            if device == "gpu":
                y = tf.nest.map_structure(lambda a: a.numpy(), y)  # waits for the device
            return y
        return call

    def paths(shape, config, tensors_np, x_np):
        c = shape.causal
        if shape.family:
            return family_paths(shape, config, tensors_np, x_np)
        with tf.device(dev):
            t = {k: tf.constant(v) for k, v in tensors_np.items()}
            x = tf.constant(x_np)
            layer = keras.layers.MultiHeadAttention(num_heads=shape.N, key_dim=shape.H)
            layer(x[:1, :2], x[:1, :2])  # build

        def ours(inp, tt):
            return multi_head_attention(config, tt, inp, is_causal=c)

        def native(inp):
            return layer(inp, inp, use_causal_mask=c)

        out = []
        ours_xla = tf.function(ours, jit_compile=True, reduce_retracing=False)
        native_xla = tf.function(native, jit_compile=True)
        if not shape.sweep and not shape.long:
            out.append(Path_("ours.eager", "ours", "eager", "forward", done(lambda: ours(x, t)), ts_arrays=5, compare=True))
            ours_graph = tf.function(ours)
            out.append(Path_("ours.graph", "ours", "compiled", "forward", done(lambda: ours_graph(x, t)), ts_arrays=4,
                             note="tf.function", compare=True))
        if not shape.long:
            out.append(Path_("ours.xla", "ours", "compiled", "forward", done(lambda: ours_xla(x, t)), ts_arrays=2,
                             note="tf.function(jit_compile=True)", compare=True))
        if c or shape.long:
            # The chunked path (never a (T, S) array; causal key blocks skipped); its key-block step is
            # compiled by XLA in both modes. Chunk sizes: see TF_CHUNK_SIZE.
            chunk = framework_chunk(shape, TF_CHUNK_SIZE, TF_CHUNK_SIZE_SMALL_BATCH)

            def ours_chunked(inp, tt):
                return multi_head_attention(config, tt, inp, is_causal=c, chunk_size=chunk)

            ours_chunked_graph = tf.function(ours_chunked)
            if not shape.sweep:
                out.append(Path_("ours.chunked.eager", "ours", "eager", "forward", done(lambda: ours_chunked(x, t)),
                                 note=f"chunk_size={chunk}", compare=True))
            out.append(Path_("ours.chunked.graph", "ours", "compiled", "forward", done(lambda: ours_chunked_graph(x, t)),
                             note=f"chunk_size={chunk}, tf.function", compare=True))
        if not shape.sweep:
            out.append(Path_("native.keras_mha.eager", "native", "eager", "forward", done(lambda: native(x)), ts_arrays=5))
            native_graph = tf.function(native)
            out.append(Path_("native.keras_mha.graph", "native", "compiled", "forward", done(lambda: native_graph(x)),
                             ts_arrays=4, note="tf.function"))
        out.append(Path_("native.keras_mha.xla", "native", "compiled", "forward", done(lambda: native_xla(x)),
                         ts_arrays=2, note="tf.function(jit_compile=True)"))
        if not shape.sweep and not shape.long:
            g = tf.constant(np.random.default_rng(1).standard_normal(x_np.shape).astype(np.float32))

            @tf.function(jit_compile=True)
            def ours_grad(inp, tt):
                with tf.GradientTape() as tape:
                    tape.watch([inp, tt])
                    y = ours(inp, tt)
                grads = tape.gradient(y, [inp, tt], output_gradients=g)
                return y, grads  # returned, or tf.function prunes the backward pass away

            @tf.function(jit_compile=True)
            def native_grad(inp):
                with tf.GradientTape() as tape:
                    tape.watch(inp)
                    y = native(inp)
                grads = tape.gradient(y, [inp, *layer.trainable_variables], output_gradients=g)
                return y, grads

            out.append(Path_("ours.xla", "ours", "compiled", "forward+backward", done(lambda: ours_grad(x, t)),
                             ts_arrays=5, note="GradientTape in tf.function(jit_compile=True)"))
            out.append(Path_("native.keras_mha.xla", "native", "compiled", "forward+backward",
                             done(lambda: native_grad(x)), ts_arrays=5, note="GradientTape in tf.function(jit_compile=True)"))
        return out

    def family_paths(shape, config, tensors_np, x_np):
        """window: the chunked path under tf.function (its key-block step XLA-compiled); decode: the
        default path, eager and under tf.function, and the cache read."""
        with tf.device(dev):
            t = {k: tf.constant(v) for k, v in tensors_np.items()}
            x = tf.constant(x_np)
        if shape.family == "window":
            chunk = window_chunk(shape, quick, TF_CHUNK_SIZE, TF_CHUNK_SIZE_SMALL_BATCH)
            graph = tf.function(lambda inp, tt: multi_head_attention(config, tt, inp, is_causal=True, chunk_size=chunk))
            return [Path_("ours.chunked.graph", "ours", "compiled", "forward", done(lambda: graph(x, t)),
                          note=f"chunk_size={chunk}, window_left={shape.window_left}, tf.function", compare=True)]
        with tf.device(dev):
            pk, pv = (tf.constant(a) for a in decode_cache(shape))

        def step(inp, tt, k, v):
            return multi_head_attention(config, tt, inp, past_key=k, past_value=v, **DECODE_OPTIONS)

        graph = tf.function(step)
        with tf.device(dev):
            bk, bv = (tf.Variable(a) for a in decode_buffers(shape))
        # The in-place step returns its output alone: the variables are written where they lie, and a read
        # of them handed out of the graph would make the next write copy the buffer whole.
        in_place = tf.function(lambda inp, tt: multi_head_attention(
            config, tt, inp, past_key=bk, past_value=bv, cache_length=shape.P,
            **{**DECODE_OPTIONS, "return_cache": False}))
        return [Path_("ours.eager", "ours", "eager", "forward", done(lambda: step(x, t, pk, pv)), note="return_cache",
                      compare=True),
                Path_("ours.in_place.graph", "ours", "compiled", "forward", done(lambda: in_place(x, t)),
                      note="cache_length (variables written in place), tf.function", compare=True),
                Path_("ours.graph", "ours", "compiled", "forward", done(lambda: graph(x, t, pk, pv)),
                      note="return_cache, tf.function", compare=True),
                cache_read_path(shape, "eager", done(lambda: (tf.reduce_sum(pk), tf.reduce_sum(pv))), "tf.reduce_sum")]

    def matmul(n):
        with tf.device(dev):
            a = tf.random.normal((n, n))
        return done(lambda: tf.linalg.matmul(a, a))

    def memory(call):
        # TF's allocator's own counters, CPU included: with oneDNN on, the CPU allocator pools
        # large blocks (a BFC allocator), so the process RSS does not grow after the first call.
        name = "GPU:0" if device == "gpu" else "CPU:0"
        try:
            tf.config.experimental.reset_memory_stats(name)
            base = tf.config.experimental.get_memory_info(name)["current"]
        except (ValueError, RuntimeError):
            return rss_memory(call)
        out = call()
        peak = tf.config.experimental.get_memory_info(name)["peak"] - base
        return peak, f"tf.config.experimental.get_memory_info({name!r}) peak growth", out

    from impl_tf import attention, chunked

    info = {"version": tf.__version__, "keras": keras.__version__, "device": dev, "tf32": False,
            "keras_mha_kernel": "keras einsum path (Keras flash attention is not used on the TensorFlow backend)",
            "ours_kernels": f"fused attention core compiled by XLA from {attention.XLA_MIN_SCORES} score elements, "
                            f"chunked key-block step from {chunked.XLA_MIN_BLOCK} (eager paths too)"}
    return Runner(info, matmul, paths, lambda y: np.asarray(y), memory)
