"""Decode examples/deepseek_v3's layer 1 one token at a time, the latent cache written in place.

A latent (MLA) block caches C + R numbers per token, in two buffers every
head shares: past_key (B, 1, CAPACITY, C) the normed latent and past_value
(B, 1, CAPACITY, R) the rotated shared key. Each installed backend gets them
zeroed, then one call per token with cache_length = the tokens before it:
the call writes its latent and rotary key after them and attends to them all
(the absorbed form: docs/spec-frontier.md). Every step's output row is held
to the model's own (expected.safetensors) under the suite's tolerance policy.
After the README's `mha convert`:

    python examples/deepseek_v3/decode_in_place.py /tmp/deepseek-block1.safetensors

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

    def step(x, positions, pk, pv, P):
        return multi_head_attention(config, tensors, x, positions=positions, past_key=pk, past_value=pv,
                                    cache_length=P, **DECODE)

    return (lambda shape: np.zeros(shape, np.float32)), step, np.asarray


def torch_decoder(config, tensors):
    import torch

    from impl_torch import multi_head_attention

    t = {name: torch.from_numpy(a) for name, a in tensors.items()}

    def step(x, positions, pk, pv, P):
        with torch.no_grad():
            return multi_head_attention(config, t, torch.from_numpy(x), positions=torch.from_numpy(positions),
                                        past_key=pk, past_value=pv, cache_length=P, **DECODE)

    return (lambda shape: torch.zeros(shape)), step, lambda a: a.numpy()


def tf_decoder(config, tensors):
    import tensorflow as tf

    from impl_tf import multi_head_attention

    t = {name: tf.constant(a) for name, a in tensors.items()}

    def step(x, positions, pk, pv, P):
        return multi_head_attention(config, t, tf.constant(x), positions=tf.constant(positions), past_key=pk,
                                    past_value=pv, cache_length=P, **DECODE)

    return (lambda shape: tf.Variable(tf.zeros(shape))), step, lambda a: a.numpy()


def jax_decoder(config, tensors):
    import jax
    import jax.numpy as jnp

    from impl_jax import multi_head_attention

    # donated buffers: XLA writes the step's latent and rotary key in place; one program for every length
    step_jit = jax.jit(lambda p, x, positions, pk, pv, P: multi_head_attention(
        config, p, x, positions=positions, past_key=pk, past_value=pv, cache_length=P, **DECODE),
        donate_argnums=(3, 4))
    p = {name: jnp.asarray(a) for name, a in tensors.items()}

    def step(x, positions, pk, pv, P):
        return step_jit(p, jnp.asarray(x), jnp.asarray(positions), pk, pv, jnp.int32(P))

    return (lambda shape: jnp.zeros(shape, jnp.float32)), step, np.asarray


DECODERS = {"numpy": (None, numpy_decoder), "torch": ("torch", torch_decoder), "tf": ("tensorflow", tf_decoder),
            "jax": ("jax", jax_decoder)}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python examples/deepseek_v3/decode_in_place.py BLOCK.safetensors (from the README's "
              "mha convert)", file=sys.stderr)
        return 2
    config, tensors = weights.load(argv[0])
    if config.latent is None:
        print(f"BLOCK must be a latent (MLA) block: got latent=None in {argv[0]}", file=sys.stderr)
        return 2
    inputs, expected = load_file(HERE / "inputs.safetensors"), load_file(HERE / "expected.safetensors")["output"]
    query, positions = inputs["query"], inputs["positions"]
    B, T = query.shape[:2]
    failed = False
    for backend, (module, make) in DECODERS.items():
        if module is not None and importlib.util.find_spec(module) is None:
            print(f"{backend:5} not installed")
            continue
        zeros, step, to_numpy = make(config, tensors)
        pk = zeros((B, 1, CAPACITY, config.latent.kv_rank))  # the normed latent
        pv = zeros((B, 1, CAPACITY, config.latent.rope_dim))  # the rotated shared key
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
    restore = quiet_framework_logging()
    try:
        code = main(sys.argv[1:])
    finally:
        restore()
    sys.exit(code)
