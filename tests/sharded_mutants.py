"""Sharding mutants: realistic bugs of a sharded attention, planted in impl_jax.sharded.

Each mutant replaces one small function of impl_jax/sharded.py with the
buggy version a port could plausibly hold; `mha check --sharded`'s grid
(conformance.suite.sharded) must fail it while the unmutated engine passes the
same cases. tests/test_sharded_jax.py runs this file in a subprocess
(JAX's host devices are fixed when JAX starts):

    python tests/sharded_mutants.py [--full] [MUTANT ...]

prints one JSON object: mutant -> {"failed": [...], "run": n}, "clean" for
the engine without a bug. Without --full each mutant meets only the cases
TARGETS names for it (what the test can afford); --full runs every mutant
on every case of the grid under the sharding kind it lives in, float32 at
4 devices (the table in docs/sharding.md; the clean engine's run is then
`mha check --sharded` itself).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from impl_jax import sharded as S  # noqa: E402

_ORIGINAL = {name: getattr(S, name) for name in ("_block_visible", "_add_output_bias", "_kv_head_index", "_merge",
                                                 "_segments_visible")}


def ring_without_causal_offset(config, T, S_, is_causal, alignment, qi, kj):
    """Each received key block masked as if it were the device's own (diagonal)
    block: positions counted from the block's start, the block's offset lost."""
    local_q = jnp.where(qi >= 0, jnp.arange(qi.shape[0]), -1)
    local_k = jnp.where(kj >= 0, jnp.arange(kj.shape[0]), -1)
    return _ORIGINAL["_block_visible"](config, T, S_, is_causal, alignment, local_q, local_k)


def output_bias_every_shard(partial, bias, ct):
    """Each shard adds the output bias to its partial output before the sum: N biases."""
    if bias is not None:
        partial = partial + bias.astype(ct)
    return lax.psum(partial, S.AXIS)


def kv_heads_split_round_robin(shard, devices, K):
    """K < devices, the key/value heads dealt round the shards as if they split: shard i gets head i % K."""
    return shard % K


def merge_nan_on_masked_block(m, l, acc, x, vb, ct):
    """The online merge without the guard for a row that has seen no visible key yet: exp(-inf - -inf) = NaN."""
    B, N, Tb, Sb = x.shape
    K = vb.shape[1]
    m_new = lax.stop_gradient(jnp.maximum(m, x.max(axis=-1, keepdims=True)))
    alpha = jnp.exp(m - m_new)
    e = jnp.exp(x - m_new)
    l = l * alpha + e.sum(axis=-1, keepdims=True)
    ctx = jnp.einsum(S.F.ATTEND, e.reshape(B, K, N // K, Tb, Sb), vb.astype(ct), precision=S.HIGHEST)
    return m_new, l, acc * alpha + ctx.reshape(B, N, Tb, -1)


def merge_uniform_masked_block(m, l, acc, x, vb, ct):
    """A block whose keys a row cannot see merged as uniform weights (its -inf logits taken as 0)."""
    hidden = jnp.all(x == -jnp.inf, axis=-1, keepdims=True)
    return _ORIGINAL["_merge"](m, l, acc, jnp.where(hidden, jnp.asarray(0, ct), x), vb, ct)


def segment_ids_ignored(qseg, kseg):
    """The packing ignored by the ring: every key of the row visible across documents."""
    return jnp.ones((max(qseg.shape[0], kseg.shape[0]), 1, qseg.shape[1], kseg.shape[1]), bool)


MUTANTS = {
    "ring_without_causal_offset": ("_block_visible", ring_without_causal_offset),
    "output_bias_every_shard": ("_add_output_bias", output_bias_every_shard),
    "kv_heads_split_though_k_lt_n": ("_kv_head_index", kv_heads_split_round_robin),
    "merge_nan_on_masked_block": ("_merge", merge_nan_on_masked_block),
    "merge_uniform_masked_block": ("_merge", merge_uniform_masked_block),
    "segment_ids_ignored": ("_segments_visible", segment_ids_ignored),
}

# The (case, kind) a mutant must fail in the quick run (4 devices, float32, forward and gradients).
TARGETS = {
    "ring_without_causal_offset": [("sh_causal_top_left", "sequence")],
    "output_bias_every_shard": [("sh_self", "heads")],
    "kv_heads_split_though_k_lt_n": [("sh_gqa_k2", "heads")],
    "merge_nan_on_masked_block": [("sh_causal_top_left", "sequence")],
    "merge_uniform_masked_block": [("sh_causal_self", "sequence")],
    "segment_ids_ignored": [("sh_segments_causal", "sequence")],
}


def plant(name: str | None) -> None:
    """Put the mutant's function in place (None: every original back)."""
    for fn_name, fn in _ORIGINAL.items():
        setattr(S, fn_name, fn)
    S._jitted.cache_clear()
    import jax

    jax.clear_caches()  # the programs traced with another version of the functions
    if name is not None:
        fn_name, fn = MUTANTS[name]
        setattr(S, fn_name, fn)


def run(name: str | None, pairs, devices: int = 4) -> dict:
    from conformance.suite import sharded

    plant(name)
    failed = []
    for case_name, kind in pairs:
        r = sharded.run_case(sharded.SHARDED_CASES[case_name], "jax", S, kind, devices, "float32")
        if r.status != "pass":
            failed.append(f"{case_name}/{kind}: {r.status} (margin {r.margin:.3g}{'; ' + r.message if r.message else ''})")
    plant(None)
    return {"failed": failed, "run": len(pairs)}


def main(argv: list[str]) -> None:
    full = "--full" in argv
    names = [a for a in argv if not a.startswith("--")] or list(MUTANTS)
    from conformance.suite.sharded import SHARDED_CASES

    out = {}
    for name in names:
        kinds = sorted({kind for _, kind in TARGETS[name]})
        out[name] = run(name, [(c, k) for c in SHARDED_CASES for k in kinds] if full else TARGETS[name])
    if not full:  # with --full, the clean engine's run is `mha check --sharded` itself
        out["clean"] = run(None, sorted({pair for n in names for pair in TARGETS[n]}))
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
