"""Decode examples/qwen3's layer 1 one token at a time, the cache written in place.

Each installed backend gets zeroed cache buffers of CAPACITY positions (a
static cache, as Hugging Face's StaticCache and torchtune's KVCache are),
then one call per token with cache_length = the tokens before it: the call
writes its key and value after them and attends to them all, copying no
cache. Every step's output row is held to the model's own (expected.safetensors,
kept by make.py's hook) under the suite's tolerance policy, as `mha run
--expect` holds the whole causal call. After the README's `mha convert`:

    python examples/qwen3/decode_in_place.py /tmp/qwen3-block1.safetensors

Prints one verdict per backend; exits 1 if any step is over its allowance.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

import weights
from conformance.logs import quiet_framework_logging
from conformance.suite.tolerance import compare, policy_for

HERE = Path(__file__).resolve().parent
CAPACITY = 16  # positions the buffers hold; the example decodes 9
DECODE = dict(is_causal=True, causal_alignment="bottom_right", return_cache=True)


def numpy_decoder(config, tensors):
    from impl_numpy import multi_head_attention

    def buffers(shape):
        return np.zeros(shape, np.float32), np.zeros(shape, np.float32)

    def step(x, positions, pk, pv, P):
        out, pk, pv = multi_head_attention(config, tensors, x, positions=positions, past_key=pk, past_value=pv,
                                           cache_length=P, **DECODE)
        return out, pk, pv

    return buffers, step, np.asarray


def torch_decoder(config, tensors):
    import torch

    from impl_torch import multi_head_attention

    t = {name: torch.from_numpy(a) for name, a in tensors.items()}

    def buffers(shape):
        return torch.zeros(shape), torch.zeros(shape)

    def step(x, positions, pk, pv, P):
        with torch.no_grad():  # an in-place cache is for inference
            return multi_head_attention(config, t, torch.from_numpy(x), positions=torch.from_numpy(positions),
                                        past_key=pk, past_value=pv, cache_length=P, **DECODE)

    return buffers, step, lambda a: a.numpy()


def tf_decoder(config, tensors):
    import tensorflow as tf

    from impl_tf import multi_head_attention

    t = {name: tf.constant(a) for name, a in tensors.items()}

    def buffers(shape):  # Keras/TF writes in place into variables
        return tf.Variable(tf.zeros(shape)), tf.Variable(tf.zeros(shape))

    def step(x, positions, pk, pv, P):
        return multi_head_attention(config, t, tf.constant(x), positions=tf.constant(positions), past_key=pk,
                                    past_value=pv, cache_length=P, **DECODE)

    return buffers, step, lambda a: a.numpy()


def jax_decoder(config, tensors):
    import jax
    import jax.numpy as jnp

    from impl_jax import multi_head_attention

    # JAX arrays are immutable: the step returns the written buffers, and donating them to the jitted
    # step lets XLA write in place. cache_length is traced: one program serves every length.
    step_jit = jax.jit(lambda p, x, positions, pk, pv, P: multi_head_attention(
        config, p, x, positions=positions, past_key=pk, past_value=pv, cache_length=P, **DECODE),
        donate_argnums=(3, 4))
    p = {name: jnp.asarray(a) for name, a in tensors.items()}

    def buffers(shape):
        return jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32)

    def step(x, positions, pk, pv, P):
        return step_jit(p, jnp.asarray(x), jnp.asarray(positions), pk, pv, jnp.int32(P))

    return buffers, step, np.asarray


DECODERS = {"numpy": (None, numpy_decoder), "torch": ("torch", torch_decoder), "tf": ("tensorflow", tf_decoder),
            "jax": ("jax", jax_decoder)}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python examples/qwen3/decode_in_place.py BLOCK.safetensors (from the README's mha convert)",
              file=sys.stderr)
        return 2
    config, tensors = weights.load(argv[0])
    inputs, expected = load_file(HERE / "inputs.safetensors"), load_file(HERE / "expected.safetensors")["output"]
    query, positions = inputs["query"], inputs["positions"]
    B, T = query.shape[:2]
    shape = (B, config.num_kv_heads, CAPACITY, config.head_dim)
    failed = False
    for backend, (module, make) in DECODERS.items():
        if module is not None and importlib.util.find_spec(module) is None:
            print(f"{backend:5} not installed")
            continue
        buffers, step, to_numpy = make(config, tensors)
        pk, pv = buffers(shape)
        rows = []
        for i in range(T):
            out, pk, pv = step(query[:, i:i + 1], positions[i:i + 1], pk, pv, i)
            rows.append(to_numpy(out))
        got = np.concatenate(rows, axis=1)
        tol = policy_for(config, dtype="float32", quantity="output", B=B, T=T, S=T, reference=expected)
        verdict = compare(f"{backend:5} decoded {T} tokens in place", got, expected, tol)
        print(verdict.describe())
        failed = failed or not verdict.ok
    return 1 if failed else 0


if __name__ == "__main__":
    restore = quiet_framework_logging()  # TensorFlow's and XLA's C++ start-up lines, filtered as `mha` does
    try:
        code = main(sys.argv[1:])
    finally:
        restore()
    sys.exit(code)
