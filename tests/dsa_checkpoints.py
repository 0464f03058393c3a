"""Shared by the DSA checkpoint tests (tests/test_layouts_dsa.py) and the worked port in docs/porting-modern.md:
one call of a block with a lightning indexer on any core backend, and the converter bugs a real port of a
DeepSeek V3.2 / GLM-5 checkpoint makes (each a change to what the reader hands the call).

`sparse_call` composes the two stages the contract defines: the layer's indexer (`lightning_indexer` of the
backend's own mirror) picks the keys, then the attention runs over them through its `topk_indices` input. A
shared layer (GLM-5) runs no indexer: it takes the previous full layer's selection as it is. A layer with
an indexer goes through the wired call (the attention call runs its own indexer and returns its selection);
only the causal-after-top-k mutant, a call the contract cannot be asked to make, composes the two by hand.
"""

from __future__ import annotations

import dataclasses
import importlib

import numpy as np

from conformance.suite import backends

INDEXER_MODULES = {"numpy": "impl_numpy.indexer", "torch": "impl_torch.indexer", "jax": "impl_jax.indexer",
                   "tf": "impl_tf.indexer", "mlx": "impl_mlx.indexer"}


def _array(x):
    return np.asarray(x.numpy() if hasattr(x, "numpy") and not isinstance(x, np.ndarray) else x)


def sparse_call(backend: str, config, tensors, x, positions, *, cache=None, selection=None,
                indexer_causal: bool = True):
    """One causal call of a block on `backend`: x (B, T, D), positions (T,) int; cache: the previous call's
    {"past_key", "past_value", "past_index_keys"} (None: a prefill); selection: a shared layer's topk_indices
    (the previous full layer's, from its own call); neither: a dense layer. indexer_causal False: the causal-after-top-k mutant.

    -> {"output", "cache" (for the next call), "topk_indices" (the keys this call attended to)}."""
    cache = cache or {}
    options = {"is_causal": True, "return_cache": True}
    if cache:
        options["causal_alignment"] = "bottom_right"
    inputs = {"query": x, "positions": positions, **{k: cache[k] for k in ("past_key", "past_value") if k in cache}}
    if config.indexer is not None and indexer_causal:  # the wired call: the layer runs its own indexer
        if "past_index_keys" in cache:
            inputs["past_index_keys"] = cache["past_index_keys"]
        result = backends.load(backend).forward(config, tensors, inputs, options)
        present = {name: _array(result[f"present_{name[5:]}"]) for name in ("past_key", "past_value",
                                                                             "past_index_keys")}
        return {"output": _array(result["output"]), "cache": present, "topk_indices": _array(result["selection"])}
    # The causal-after-top-k mutant (a call the contract cannot be asked to make): the indexer run on its own,
    # then the attention over its selection, the block without its indexer.
    index = {}
    if config.indexer is not None:
        lightning_indexer = importlib.import_module(INDEXER_MODULES[backend]).lightning_indexer
        index = lightning_indexer(config, tensors, x, positions=positions, past_index_keys=cache.get("past_index_keys"),
                                  is_causal=indexer_causal)
        selection = _array(index["topk_indices"])
    if selection is not None:  # None: a dense layer (MiniMax M3's full_attention layers)
        inputs["topk_indices"] = selection
    attention = config.replace(indexer=None)
    plain = {name: t for name, t in tensors.items() if not name.startswith("indexer.")}
    result = backends.load(backend).forward(attention, plain, inputs, options)
    present = {"past_key": _array(result["present_key"]), "past_value": _array(result["present_value"])}
    if "present_index_keys" in index:
        present["past_index_keys"] = _array(index["present_index_keys"])
    return {"output": _array(result["output"]), "cache": present, "topk_indices": selection}


# The bugs a converter makes reading a DSA checkpoint, each as the config it would hand the call (and, for the
# causal mask, the call it would make). Every one fails the reproduction of a real model (test_layouts_dsa.py).
CONVERTER_MUTANTS = {
    "pairing_swapped": "the indexer's RoPE pairing swapped (V3.2 read as GLM-5's interleaved, GLM-5 as half-split)",
    "rope_end_swapped": "RoPE on the last rotary features of the index head (MLA's [nope | rope] order), not the first",
    "relu_dropped": "no ReLU on each index head's score before the weighted sum",
    "weights_unscaled": "head weights without index_n_heads**-0.5 (every index score of a query times sqrt(I))",
    "causal_after_topk": "the causal mask applied after the top-k: future keys take selection slots",
}


def mutate(config, bug: str | None):
    """(the config a converter with `bug` hands the call, indexer_causal)."""
    if bug is None:
        return config, True
    if bug not in CONVERTER_MUTANTS:
        raise ValueError(f"bug must be one of {', '.join(CONVERTER_MUTANTS)}: got {bug!r}")
    if bug == "causal_after_topk":
        return config, False
    ix = config.indexer
    change = {"pairing_swapped": {"rope": dataclasses.replace(ix.rope, interleaved=not ix.rope.interleaved)},
              "rope_end_swapped": {"rope_end": "last"}, "relu_dropped": {"relu": False},
              "weights_unscaled": {"weight_scale": 1.0}}[bug]
    return config.replace(indexer=dataclasses.replace(ix, **change)), True
