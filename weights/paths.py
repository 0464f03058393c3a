"""The options that run each path of a mirror, for its conformance adapter (`mha check`'s columns).

An adapter names its paths (PATHS: "stages", its fast path FAST_PATH, maybe "chunked", "in_place") and
answers path_options(path, config, inputs, options) with the call options that run that path: None where
the path does not exist for the call, NotImplementedError (with the mirror's plan's reason) where it exists
but cannot take the call. What every mirror does alike is written here once: the stages run when the
weights are asked for, the chunked path when chunk_size is given, an in-place cache on buffers the adapter
makes from the call's cache. Adapter-only option keys: "in_place" (make the buffers, pass cache_length)
and "forward_only" (why no gradient is judged on the path).
"""

from __future__ import annotations

import numpy as np

# chunk_size of the chunked paths in conformance runs: blocks of 2 keys and 2 queries, so that every case
# with S_total > 2 crosses blocks (the online softmax's rescaling) and causal cases skip hidden ones.
CHUNK = 2
# A long call's blocks: about this many per axis (at least CHUNK rows), so that T 2048 runs 8 x 8 blocks of 256
# instead of a million blocks of 2; a call of up to 23 positions keeps blocks of 2.
BLOCKS_PER_AXIS = 8
# An in-place cache's buffers hold this many positions past P + S, never part of a result.
SPARE = 1
IN_PLACE_FORWARD_ONLY = "an in-place cache is inference only"


def common_path_options(path: str, inputs: dict, options: dict, *, paths, forward_only: str | None = None,
                        in_place_forward_only: str = IN_PLACE_FORWARD_ONLY) -> dict | None:
    """The options of the paths every mirror runs alike (stages, chunked, in_place); the adapter answers for
    its fast path itself. forward_only: why the chunked path judges no gradient (None: it does)."""
    if path not in paths:
        raise ValueError(f"path must be one of {', '.join(paths)}: got {path!r}")
    if path == "stages":
        return options | {"return_weights": True}  # asking for the weights runs the stages (each mirror's plan)
    if path == "chunked":
        return options | {"return_weights": False, "chunk_size": chunk_size(inputs)} | (
            {"forward_only": forward_only} if forward_only else {})
    if path == "in_place":
        if inputs.get("past_key") is None:
            return None
        return options | {"return_weights": False, "return_cache": True, "in_place": True,
                          "forward_only": in_place_forward_only}
    raise ValueError(f"path {path!r} is the adapter's own (its fast path): common_path_options has no answer")


def chunk_size(inputs: dict) -> int:
    """The chunked path's block size for a call: CHUNK, or longest // BLOCKS_PER_AXIS for a long one (the longest
    of the queries and every key, the cache's included)."""
    past = inputs.get("past_key")
    longest = max(np.shape(inputs["query"])[1], new_keys(inputs) + (0 if past is None else np.shape(past)[2]))
    return max(CHUNK, longest // BLOCKS_PER_AXIS)


def new_keys(inputs: dict, config=None) -> int:
    """S: the new keys of a call (the query's length when no key is passed; 0 for a kv_shared config's, which
    appends nothing: issue 42)."""
    if getattr(config, "kv_shared", False):
        return 0
    return np.shape(inputs["query"] if inputs.get("key") is None else inputs["key"])[1]


def index_buffer(inputs: dict, capacity: int, dtype) -> np.ndarray:
    """The indexer's cache (past_index_keys (B, P, J), or none with P = 0) copied into the first P positions of
    a zeroed (B, capacity, J) buffer of `dtype`, beside in_place_buffers' (config.indexer's in-place cache)."""
    past = inputs.get("past_index_keys")
    B = np.shape(inputs["query"])[0]
    if past is None:
        raise ValueError("past_index_keys is missing: an in-place cache with config.indexer needs it")
    past = np.asarray(past)
    buffer = np.zeros((B, capacity, past.shape[2]), dtype)
    buffer[:, :past.shape[1]] = past
    return buffer


def in_place_buffers(inputs: dict, dtype) -> tuple[np.ndarray, np.ndarray, int]:
    """The call's cache copied into the first P positions of zeroed NumPy buffers of capacity P + S + SPARE,
    in `dtype` (the storage dtype, as the contract asks of buffers written in place): (past_key, past_value,
    P). Each adapter hands them to its framework as that framework's writeable buffers."""
    buffers = []
    for name in ("past_key", "past_value"):
        past = np.asarray(inputs[name])
        buffer = np.zeros((*past.shape[:2], past.shape[2] + new_keys(inputs) + SPARE, past.shape[3]), dtype)
        buffer[:, :, :past.shape[2]] = past  # (B, K, C, H|V)
        buffers.append(buffer)
    return buffers[0], buffers[1], np.shape(inputs["past_key"])[2]
