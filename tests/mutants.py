"""A hand-written NumPy port of the contract, and realistic porting bugs in it.

`port(config, tensors, inputs, options, bug=None)` follows `mha verify`'s
interface. With bug=None it must pass every vector (tests/test_mutants.py
checks that, so a caught mutant is caught because of its bug). Each entry of
MUTANTS is one bug people actually make when porting attention.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}


def _tf32(x):
    """Round float32 to TF32's 10 explicit mantissa bits (round to nearest)."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)
    return rounded.view(np.float32)


def port(config, tensors, inputs, options, bug=None):
    index = None
    if config.get("indexer"):  # the lightning indexer's selection, then attention over it (as topk_indices)
        index = _indexer(config, tensors, inputs, bug)
        if bug != "indexer_ignored":
            inputs = {**inputs, "topk_indices": index["selection"]}
    result = _port(config, tensors, inputs, options, bug)
    if index is not None:
        result["selection"] = index["selection"]
        if options.get("return_cache") and options["dtype"] != "float64":
            result["present_index_keys"] = index["present_index_keys"].astype(result["output"].dtype)
        elif options.get("return_cache"):  # verify reads the reason; check judges what is returned
            result["not_returned"] = {"present_index_keys": "the hand indexer port computes in float32"}
    return result


def _indexer(config, tensors, inputs, bug):
    """The selection of tests/indexer_mutants.py's hand port (float32), blocks expanded to their keys that are
    not in the future (as a port scatters a block mask and ANDs the causal mask): (B, T, k) or (B, K, T, k)."""
    import indexer_mutants

    from weights import AttentionConfig

    cfg = AttentionConfig.from_dict(config)
    ix = cfg.indexer
    found = indexer_mutants.port(cfg, tensors, inputs["query"], "causal_after_topk" if bug == "indexer_causal_after_topk"
                                 else None, key=inputs["key"], past_index_keys=inputs.get("past_index_keys"))
    if ix.block_size is None:
        return {"selection": found["topk_indices"], "present_index_keys": found["present_index_keys"]}
    blocks = found["topk_blocks"]  # (B, G, T, kb)
    n, T, bs = found["present_index_keys"].shape[1], blocks.shape[2], ix.block_size
    keys = np.full(blocks.shape[:3] + (blocks.shape[3] * bs,), -1, dtype=np.int64)
    for (b, g, t, slot), block in np.ndenumerate(blocks):
        for i in range(bs):
            j = block * bs + i
            if block >= 0 and j < n and j <= n - T + t:
                keys[b, g, t, slot * bs + i] = j
    return {"selection": keys if ix.per_kv_head else keys[:, 0], "present_index_keys": found["present_index_keys"]}


def _port(config, tensors, inputs, options, bug=None):
    dtype = np.dtype(DTYPES[options["dtype"]])
    ct = np.float64 if dtype == np.float64 else np.float32
    N, K = config["num_heads"], config["num_kv_heads"]
    H, V = config["head_dim"], config["value_head_dim"]
    G = N // K
    t = {k: v.astype(ct) for k, v in tensors.items()}
    shared = _shared_cache(config, inputs, bug)  # kv_shared (issue 42): the cache's tail, the inputs without it
    if shared is not None:
        inputs, shared = shared
    q_in, k_in, v_in = (inputs[n].astype(ct) for n in ("query", "key", "value"))
    if bug == "key_value_swapped":
        k_in, v_in = v_in, k_in
    B, T, _ = q_in.shape
    P = inputs["past_key"].shape[2] if "past_key" in inputs else 0
    S = P + k_in.shape[1]  # every key: the cache's and the new ones

    def mm(a, b):
        if bug == "tf32_matmul_inputs":
            a, b = _tf32(a), _tf32(b)
        return np.matmul(a, b)

    # the positions RoPE, ALiBi, the chunks and the temperature read: the caller's, or counted from the cache's end
    q_pos = np.asarray(inputs.get("positions", P + np.arange(T))).reshape(-1, T)  # (B|1, T)
    new_keys = k_in.shape[1]
    key_positions = np.asarray(inputs.get("key_positions", P + np.arange(new_keys))).reshape(-1, new_keys)
    k_pos = np.concatenate([np.broadcast_to(np.arange(P), (key_positions.shape[0], P)), key_positions],
                           axis=1)  # (B|1, P+S): the cache's keys at 0..P-1
    temperature = config.get("query_temperature")

    def temperature_factor():
        offset = 0 if bug == "temperature_offset_ignored" else temperature["offset"]
        steps = np.floor((q_pos + offset) / temperature["floor"])
        return (1 + temperature["beta"] * np.log(1 + steps))[:, None, :, None]  # (B|1, 1, T, 1)

    clip = config.get("qkv_clip")

    def proj(x, name, heads, width):
        kernel = t[f"{name}.kernel"].reshape(x.shape[-1], heads * width)
        if bug == "transposed_kernel" and kernel.shape[0] == kernel.shape[1]:
            kernel = kernel.T  # a torch Linear weight used without its transpose
        y = mm(x, kernel)
        if f"{name}.bias" in t:
            y = y + t[f"{name}.bias"].reshape(-1)
        if clip and bug != "clip_after_rope":
            y = np.clip(y, -clip, clip)
        if name == "query" and bug == "temperature_before_norm" and temperature:
            y = y * temperature_factor()[:, 0]  # (B|1, T, 1): the norm that follows divides it out again
        norm = config.get("value_norm") if name == "value" else config.get("qk_norm")
        after_rope = norm and norm.get("after_rope") and bug != "norm_before_rope"
        if norm and not after_rope and not (name == "value" and bug == "value_norm_ignored"):
            y = _qk_norm(y, t, name, heads, width, norm, bug)
        y = _knob(y, name, config, bug)  # issue 42's key multiplier and value scale, after the norm
        if bug == "heads_split_wrong_order":
            return y.reshape(x.shape[0], x.shape[1], width, heads).transpose(0, 3, 1, 2)  # (B, heads, L, width)
        return y.reshape(x.shape[0], x.shape[1], heads, width).transpose(0, 2, 1, 3)  # (B, heads, L, width)

    if config.get("latent"):  # multi-head latent attention, written out (its own projections, norms and cache)
        q, k, v, present = _latent(config, t, q_in, k_in, inputs, q_pos, k_pos[:, P:], P, mm, bug)
        if temperature:
            q = q * temperature_factor()
    else:
        q = proj(q_in, "query", N, H)
        k, v = (proj(k_in, "key", K, H), proj(v_in, "value", K, V)) if shared is None else (
            x.astype(ct) for x in shared)  # a kv_shared layer's keys: the cache's, as given
    if config.get("latent"):
        pass
    elif config.get("rope"):
        start = 0 if bug == "rope_positions_no_cache_offset" else P
        positions = inputs.get("positions", start + np.arange(T))
        key_positions = inputs.get("key_positions", start + np.arange(k.shape[2]))
        if bug == "packed_positions_not_restarted" and "segment_ids" in inputs:
            # the caller's restarted positions dropped: the row counted 0..T-1 across its documents
            positions, key_positions = start + np.arange(T), start + np.arange(k.shape[2])
        longest = max(int(np.max(positions)), int(np.max(key_positions)))  # longrope's choice of table
        if bug == "longrope_table_by_length":  # the call's length where its largest position decides
            longest = max(T, k.shape[2]) - 1
        q = _rope(q, positions, config, H, bug, longest)
        k = k if shared is not None else _rope(k, key_positions, config, H, bug, longest)  # shared: turned already
        if bug == "rope_on_value" and V == H:
            v = _rope(v, key_positions, config, H, bug, longest)
    norm = config.get("qk_norm")
    if norm and norm.get("after_rope") and bug != "norm_before_rope":  # the norm of the turned heads
        def flat_norm(x, name, heads):
            B_, _, L, W = x.shape
            y = _qk_norm(x.transpose(0, 2, 1, 3).reshape(B_, L, heads * W), t, name, heads, W, norm, bug)
            return y.reshape(B_, L, heads, W).transpose(0, 2, 1, 3)

        q, k = flat_norm(q, "query", N), flat_norm(k, "key", K)
    if clip and bug == "clip_after_rope":
        q, k, v = (np.clip(x, -clip, clip) for x in (q, k, v))
    if temperature and bug != "temperature_before_norm" and not config.get("latent"):
        q = q * temperature_factor()
    if P and not config.get("latent"):
        k = np.concatenate([inputs["past_key"].astype(ct), k], axis=2)  # (B, K, P+S, H)
        v = np.concatenate([inputs["past_value"].astype(ct), v], axis=2)
    if not config.get("latent"):
        present = (k, v)
    kv_of = (np.arange(N) % K) if bug == "gqa_head_mapping_modulo" else (np.arange(N) // G)
    k, v = k[:, kv_of], v[:, kv_of]  # (B, N, S, H)
    scale = config["scale"] if config["scale"] is not None else 1.0 / np.sqrt(H)
    if bug == "wrong_scale":
        scale = 1.0 / H
    logits = mm(q, k.transpose(0, 1, 3, 2))
    cap = config.get("logit_softcap")
    alibi = _alibi(t, q_pos, k_pos, N, P, T, bug) if config.get("alibi") else None
    if bug == "bias_before_scale" and "bias" in inputs:
        logits = (logits + inputs["bias"].astype(ct).reshape(_rank4(inputs["bias"].shape))) * scale
    elif alibi is not None and bug == "alibi_before_scale":  # Falcon's placement read where the slopes are BLOOM's
        logits = (logits + alibi) * scale
        if cap:
            logits = cap * np.tanh(logits / cap)
    else:
        logits = logits * scale
        if cap and bug != "softcap_after_mask":
            logits = cap * np.tanh(logits / cap)
        if alibi is not None:
            logits = logits + alibi
        if "bias" in inputs:
            logits = logits + inputs["bias"].astype(ct).reshape(_rank4(inputs["bias"].shape))
    allowed = np.ones((B, N, T, S), bool)
    if "mask" in inputs:
        m = inputs["mask"]
        if bug == "inverted_mask":
            m = ~m
        if m.ndim == 3 and bug == "mask_bts_broadcast_as_leading":
            allowed &= np.broadcast_to(m[None], (B, N, T, S)) if B == N else m[:, None]
        else:
            allowed &= m.reshape(_rank4(m.shape))
    if options["is_causal"]:
        offset = 0 if options["causal_alignment"] == "top_left" else S - T
        if bug == "causal_always_bottom_right":
            offset = S - T
        i, j = np.arange(T)[:, None], np.arange(S)[None, :]
        causal = (j < i + offset) if bug == "causal_off_by_one" else (j <= i + offset)
        allowed &= causal
    left, right = config.get("window_left", -1), config.get("window_right", -1)
    if left >= 0 or right >= 0:
        p = np.arange(T)[:, None] + (0 if options["causal_alignment"] == "top_left" else S - T)
        j = np.arange(S)[None, :]
        if left >= 0:
            allowed &= (j > p - left) if bug == "window_off_by_one" else (j >= p - left)
        if right >= 0:
            allowed &= j <= p + right
    chunk = config.get("local_chunk")
    if chunk:
        if bug == "chunks_sliding":  # a sliding window of C positions instead of absolute chunks
            allowed &= (np.abs(q_pos[:, :, None] - k_pos[:, None, :]) < chunk)[:, None]
        else:
            allowed &= (q_pos[:, :, None] // chunk == k_pos[:, None, :] // chunk)[:, None]
    if "segment_ids" in inputs:
        q_ids = np.asarray(inputs["segment_ids"]).reshape(-1, T)
        k_ids = np.asarray(inputs.get("key_segment_ids", inputs["segment_ids"])).reshape(-1, S)
        allowed &= (q_ids[:, :, None] == k_ids[:, None, :])[:, None]
    if "topk_indices" in inputs and bug != "topk_ignored":
        allowed &= _selected(inputs["topk_indices"], N, K, P, S, bug)
    fill = -1e9 if bug == "mask_fill_minus_1e9" else -np.inf
    logits = np.where(allowed, logits, fill)
    if cap and bug == "softcap_after_mask":  # -inf becomes -cap: masked keys get weight
        logits = cap * np.tanh(logits / cap)
    sinks = t["sinks"].reshape(1, N, 1, 1) if config.get("use_sinks") and bug != "sinks_ignored" else None
    axis = -2 if bug == "softmax_wrong_axis" else -1
    if bug == "no_max_subtraction":
        with np.errstate(over="ignore", invalid="ignore"):
            e = np.exp(logits)
            w = e / e.sum(axis, keepdims=True)
    elif sinks is not None:  # one more logit per head in every row, attending to nothing
        top = np.maximum(logits.max(axis, keepdims=True), sinks)
        e = np.exp(logits - top)
        w = e / (e.sum(axis, keepdims=True) + np.exp(sinks - top))
    else:
        top = logits.max(axis, keepdims=True)
        empty = ~np.isfinite(top)
        e = np.exp(logits - np.where(empty, 0, top))
        total = e.sum(axis, keepdims=True)
        w = e / np.where(total == 0, 1, total)
        if config["masked_row"] == "uniform":
            w = np.where(empty, 1.0 / S, w)
        elif config["masked_row"] == "nan":
            w = np.where(empty, np.nan, w)
    weights_out = w
    if options["training"] and "dropout_mask" in inputs:
        rescale = 1.0 if bug == "dropout_no_rescale" else 1.0 / (1.0 - config["dropout"])
        w = np.where(inputs["dropout_mask"], w * rescale, 0.0)
        if bug == "weights_after_dropout":
            weights_out = w
    ctx = mm(w, v)  # (B, N, T, V)
    if config.get("differential"):  # the paper's form: the weights subtracted first, then the pair's value
        ctx = _differential(config["differential"], t, w, v, mm, bug)  # (B, N/2, T, 2V)
    gate = config.get("output_gate")
    if gate:  # sigmoid of the query input's own projection, per feature of each head or per head
        g = mm(q_in, t["gate.kernel"].reshape(q_in.shape[-1], -1)) + (t["gate.bias"].reshape(-1) if "gate.bias" in t
                                                                       else 0)
        g = 1 / (1 + np.exp(-g.reshape(B, T, N, -1).transpose(0, 2, 1, 3)))  # (B, N, T, V|1)
        if bug != "gate_after_output":
            ctx = ctx * g
    ctx = ctx.transpose(0, 2, 1, 3).reshape(B, T, N * V)  # (B, T, N*V)
    out = mm(ctx, t["output.kernel"].reshape(N * V, -1))
    if "output.bias" in t and bug != "missing_output_bias":
        out = out + t["output.bias"]
    if gate and bug == "gate_after_output" and out.shape[-1] == N * V:  # the gate on the projected output
        out = out * g.transpose(0, 2, 1, 3).reshape(B, T, -1)
    result = {"output": out.astype(dtype)}
    if options["return_weights"]:
        result["weights"] = weights_out.astype(dtype)
    if options.get("return_cache"):
        result["present_key"], result["present_value"] = (x.astype(dtype) for x in present)
    return result


def _differential(dif, t, w, v, mm, bug):
    """Differential attention written the paper's way (Ye et al. 2024), not the spec's: head n's weights minus
    lambda times head n + N/2's, (B, N/2, T, S), over the value pair [v_g | v_{g+K/2}] (v here (B, N, S, V),
    already repeated per query head: query head n + N/2 reads kv head g + K/2), then the RMS norm and the
    (1 - lambda_init) scale. lambda = exp(q1 . k1) - exp(q2 . k2) + lambda_init."""
    half = w.shape[1] // 2
    lambda_init = 0.8 - 0.6 * np.exp(-0.3 * 0) if bug == "differential_lambda_init_layer0" else dif["lambda_init"]
    lam = (np.exp(t["differential.lambda_q1"] @ t["differential.lambda_k1"])
           - np.exp(t["differential.lambda_q2"] @ t["differential.lambda_k2"]) + lambda_init)
    pair = np.concatenate([v[:, :half], v[:, half:]], axis=-1)  # (B, N/2, S, 2V)
    ctx = mm(w[:, :half] - lam * w[:, half:], pair)  # (B, N/2, T, 2V)
    ctx = ctx / np.sqrt((ctx * ctx).mean(axis=-1, keepdims=True) + dif["eps"])
    return ctx if bug == "differential_scale_dropped" else ctx * (1 - lambda_init)


def _qk_norm(y, t, name, heads, H, norm, bug):
    """QK-norm of a flat projection (B, L, heads*H): per head over H, or over all of it."""
    B, L, F = y.shape
    per_head = norm["scope"] == "head"
    if bug == "qk_norm_scope_swapped":
        per_head = not per_head
    g = y.reshape(B, L, heads, H) if per_head else y.reshape(B, L, 1, F)
    if norm["type"] == "layer":
        g = g - g.mean(-1, keepdims=True)
    ms = (g * g).mean(-1, keepdims=True)
    if bug == "weightless_qk_norm_as_l2" and not norm["weight"] and name != "value":  # F.normalize: x / |x|
        g = g / np.maximum(np.sqrt((g * g).sum(-1, keepdims=True)), 1e-12)
    elif bug == "norm_eps_outside_sqrt":
        g = g / (np.sqrt(ms) + norm["eps"])
    else:
        g = g / np.sqrt(ms + norm["eps"])
    g = g.reshape(B, L, F)

    def per_feature(x):  # (H,) for every head, or (heads, H): as (F,)
        if x.ndim == 2 and bug == "per_head_norm_weights_averaged" and norm.get("per_head"):
            x = x.mean(axis=0)  # one scale for every head, where each head has its own
        return np.tile(x, heads) if x.ndim == 1 else x.reshape(-1)

    if name == "value" and bug == "value_norm_scale_ignored":
        return g  # normalised, the stored scale never applied
    if f"{name}.norm.scale" in t:  # none for a weightless norm
        g = g * per_feature(t[f"{name}.norm.scale"])
    if f"{name}.norm.bias" in t:
        g = g + per_feature(t[f"{name}.norm.bias"])
    return g


def _rope(x, positions, config, H, bug, longest):
    """Rotary embedding of x (B, heads, L, H) at positions (L,) or (B, L), written out as a port would.
    longest: the call's largest position (longrope's choice of table)."""
    from weights.config import Rope
    from weights.rope import attention_factor, inverse_frequencies

    rope = config["rope"]
    R = H if bug == "partial_rotary_whole_head" else rope["rotary_dim"]
    scaling = rope["scaling"]
    kind = None if scaling is None else scaling["type"]
    if kind == "proportional" and bug == "proportional_as_partial":  # an ordinary partial rotary of the share
        R = 2 * int(scaling["partial_rotary_factor"] * R // 2)
        kind = "plain"
    if scaling is None or kind == "plain" or (bug == "llama3_scaling_ignored" and kind == "llama3"):
        inv_freq = 1.0 / rope["theta"] ** (np.arange(0, R, 2) / R)
    elif kind == "longrope":  # written out: the base frequencies over the short or the long factors
        original = scaling["original_max_position_embeddings"]
        long = longest + 1 >= original if bug == "longrope_long_table_at_original" else longest + 1 > original
        table = "long_factor" if long else "short_factor"
        inv_freq = 1.0 / (np.asarray(scaling[table]) * rope["theta"] ** (np.arange(0, R, 2) / R))
    elif kind == "proportional":  # the first share of the pairs turn, over the whole head; the rest stand still
        turning = int(scaling["partial_rotary_factor"] * R // 2)
        inv_freq = np.where(np.arange(R // 2) < turning, rope["theta"] ** (-np.arange(0, R, 2) / R), 0.0)
        inv_freq = inv_freq / scaling["factor"]
    else:  # the scaled rules from weights.rope (tests/test_rope.py checks them against transformers)
        if kind == "yarn" and bug == "yarn_always_truncated":
            rope = dict(rope, scaling=dict(scaling, truncate=True))
        inv_freq = inverse_frequencies(Rope.from_value(dict(rope, rotary_dim=R)))
    if bug == "rope_freqs_bfloat16":
        inv_freq = inv_freq.astype(ml_dtypes.bfloat16).astype(np.float64)
    factor = 1.0
    if kind == "yarn" and bug != "yarn_attention_factor_ignored":
        factor = attention_factor(Rope.from_value(rope))
    if kind == "longrope":
        factor = scaling["attention_factor"]
        if bug == "longrope_attention_factor_recomputed":  # the paper's rule from factor, the stored value unread
            factor = np.sqrt(1 + np.log(scaling["factor"]) / np.log(scaling["original_max_position_embeddings"]))
    angle = np.asarray(positions, np.float64).reshape(-1, 1, np.shape(positions)[-1], 1) * inv_freq  # (B|1, 1, L, R/2)
    if rope.get("mrope_section"):
        angle = _mrope_angles(positions, inv_freq, rope, bug)
    cos, sin = np.cos(angle) * factor, np.sin(angle) * factor
    interleaved = rope["interleaved"] != (bug == "rope_convention_swapped")
    head = x[..., :R]
    x1, x2 = (head[..., 0::2], head[..., 1::2]) if interleaved else (head[..., : R // 2], head[..., R // 2:])
    y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    turned = np.stack([y1, y2], -1).reshape(head.shape) if interleaved else np.concatenate([y1, y2], -1)
    return np.concatenate([turned, x[..., R:]], -1).astype(x.dtype)


def _mrope_angles(positions, inv_freq, rope, bug):
    """Multimodal RoPE's angles (B|1, 1, L, R/2) as transformers' Qwen2-VL / Qwen3-VL rotary embeddings form
    them, written out: every pair's angle on each of the three axes, (3, B|1, L, R/2), then recomposed: the
    pairs split into the sections, chunk i taking axis i % 3 (Qwen2-VL, Qwen2.5-VL), or axis t overwritten by
    h at pairs 1, 4, ... below 3 h and by w at pairs 2, 5, ... below 3 w (Qwen3-VL, mrope_interleaved)."""
    pos = np.asarray(positions, np.float64)
    pos = np.broadcast_to(pos, (3, *pos.shape)) if pos.ndim == 1 else pos  # the default: a text token's, (3, L)
    freqs = pos.reshape(3, -1, pos.shape[-1], 1) * inv_freq  # (3, B|1, L, R/2)
    if bug == "mrope_section_order_swapped":  # the height and width sections' positions exchanged
        freqs = freqs[[0, 2, 1]]
    section = list(rope["mrope_section"])
    if rope["mrope_interleaved"] and bug != "mrope_not_interleaved":
        chosen = freqs[0].copy()
        for axis in (1, 2):
            chosen[..., axis:3 * section[axis]:3] = freqs[axis][..., axis:3 * section[axis]:3]
    else:
        chunks = np.split(freqs, np.cumsum(section)[:-1], axis=-1)
        chosen = np.concatenate([chunk[i % 3] for i, chunk in enumerate(chunks)], axis=-1)  # (B|1, L, R/2)
    return chosen[:, None]  # (B|1, 1, L, R/2)


def _latent(config, t, q_in, k_in, inputs, q_pos, new_key_pos, P, mm, bug):
    """MLA as transformers' DeepseekV3Attention computes it, written out: -> q (B, N, T, H) after RoPE,
    k (B, K, P+S, H), v (B, K, P+S, V), present (latent (B, 1, P+S, C), rotary key (B, 1, P+S, R))."""
    lat = config["latent"]
    N, K, H, V = config["num_heads"], config["num_kv_heads"], config["head_dim"], config["value_head_dim"]
    C, R, eps = lat["kv_rank"], lat["rope_dim"], lat["eps"]
    B, T, _ = q_in.shape

    def rms(x, scale):  # DeepseekV3RMSNorm: x / sqrt(mean(x^2) + eps) * weight
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * scale

    if lat["query_rank"] is not None:
        down = mm(q_in, t["query.down.kernel"]) + t.get("query.down.bias", 0)
        q = mm(rms(down, t["query.down.norm.scale"]), t["query.kernel"].reshape(lat["query_rank"], -1))
    else:
        q = mm(q_in, t["query.kernel"].reshape(q_in.shape[-1], -1)) + t.get("query.bias", np.zeros(N * H)).reshape(-1)
    q = q.reshape(B, T, N, H).transpose(0, 2, 1, 3)  # (B, N, T, H): [no position | rotary]
    both = mm(k_in, t["latent.kernel"]) + t.get("latent.bias", 0)  # (B, S, C + R)
    if bug == "mla_latent_norm_over_rope_too":  # one norm over the latent and the rotary key together
        scale = np.concatenate([t["latent.norm.scale"], np.ones(R)])
        both = both / np.sqrt((both * both).mean(-1, keepdims=True) + eps) * scale
        latent, rotary = both[..., :C], both[..., C:]
    else:
        latent, rotary = rms(both[..., :C], t["latent.norm.scale"]), both[..., C:]
    rope = {**config, "rope": {**config["rope"], "rotary_dim": R}}
    turned = slice(0, R) if bug == "mla_rope_on_nope_features" else slice(H - R, H)  # DeepSeek: the last R
    head = q[..., turned]
    q = q.copy()
    q[..., turned] = _rope(np.ascontiguousarray(head), q_pos, rope, R, bug, 0)
    rotary = _rope(rotary[:, None], new_key_pos, rope, R, bug, 0)  # (B, 1, S, R): one key for every head
    latent = latent[:, None]  # (B, 1, S, C)
    if P:
        latent = np.concatenate([inputs["past_key"].astype(latent.dtype), latent], axis=2)
        rotary = np.concatenate([inputs["past_value"].astype(rotary.dtype), rotary], axis=2)
    S = latent.shape[2]
    w_k = t["key.kernel"].reshape(C, -1)
    w_v = t["value.kernel"].reshape(C, -1)
    if bug == "mla_absorbed_value_transposed" and P:  # a decode step's torch weight (K*V, C) reshaped, not transposed
        w_v = t["value.kernel"].reshape(C, -1).T.copy().reshape(C, -1)
    k_nope = mm(latent[:, 0], w_k).reshape(B, S, K, H - R).transpose(0, 2, 1, 3)
    v = mm(latent[:, 0], w_v).reshape(B, S, K, V).transpose(0, 2, 1, 3)
    k = np.zeros((B, K, S, H), dtype=k_nope.dtype)
    k[..., : H - R] = k_nope
    if bug == "mla_rotary_key_first_head_only":  # the shared key written into one head, not broadcast
        k[:, :1, :, H - R:] = rotary
    elif bug == "mla_rope_on_nope_features":
        k = np.concatenate([rotary.repeat(K, 1), k_nope], axis=-1)
    else:
        k[..., H - R:] = rotary
    return q, k, v, (latent, rotary)


def _alibi(t, q_pos, k_pos, N, P, T, bug):
    """ALiBi's bias (B|1, N, T, P+S): -slope * |pos_q - pos_k|, as a port writes it."""
    slopes = t["alibi.slopes"]
    if bug == "alibi_power_of_two_rule":  # the slopes recomputed by the rule for a power-of-two head count
        slopes = 2.0 ** (-8.0 * np.arange(1, N + 1) / N)
    if bug == "alibi_slope_typo":  # a hand-typed slope table: 0.26 for the first head's 2^-2
        slopes = slopes * np.where(np.arange(N) == 0, 1.04, 1.0).astype(slopes.dtype)
    if bug == "alibi_query_positions_no_cache_offset":  # the queries counted from 0 while decoding
        q_pos = q_pos - P
    if bug == "alibi_by_index":  # distances by index: the queries the last T of the P + S keys, the positions unread
        S = k_pos.shape[1]
        q_pos, k_pos = (S - T + np.arange(T))[None], np.arange(S)[None]
    distance = np.abs(q_pos[:, :, None] - k_pos[:, None, :])[:, None]  # (B|1, 1, T, S)
    sign = 1.0 if bug == "alibi_sign_flipped" else -1.0
    return sign * slopes.reshape(1, -1, 1, 1) * distance


def _selected(topk_indices, N, K, P, S, bug):
    """The keys each query may see, (B, 1|N, T, S), slot by slot as a port loops over FlashMLA-style indices:
    j < P the cache's key j, P + i the new key i, -1 nothing."""
    idx = np.asarray(topk_indices)
    idx = idx[:, None] if idx.ndim == 3 else idx  # (B, K|1, T, k)
    selected = np.zeros(idx.shape[:3] + (S,), bool)
    for (b, h, t, _), j in np.ndenumerate(idx):
        j = int(j)
        if bug == "topk_new_keys_only" and j >= 0:  # index i read as the new key i, past the cache
            j += P
        if j == -1 and bug == "topk_minus_one_as_last":
            selected[b, h, t, j] = True  # Python's index -1: the last key
        elif 0 <= j < S:
            selected[b, h, t, j] = True
    if idx.shape[1] == 1:
        return selected
    kv_of = np.arange(N) % K if bug == "topk_kv_heads_tiled" else np.arange(N) // (N // K)
    return selected[:, kv_of]  # (B, N, T, S): each query head its kv head's selection


def _rank4(shape):
    return {2: (1, 1) + tuple(shape), 3: (shape[0], 1) + tuple(shape[1:]), 4: tuple(shape)}[len(shape)]


MUTANTS = {
    "wrong_scale": "1/H instead of 1/sqrt(H)",
    "heads_split_wrong_order": "the flat N*H axis split as (H, N) instead of (N, H)",
    "softmax_wrong_axis": "softmax over the query axis",
    "inverted_mask": "mask read as True = masked (torch nn.MultiheadAttention's polarity)",
    "causal_off_by_one": "causal mask j < i: a token cannot see itself",
    "causal_always_bottom_right": "causal alignment ignored: always bottom-right",
    "missing_output_bias": "output projection bias dropped",
    "key_value_swapped": "key and value inputs swapped",
    "transposed_kernel": "square kernels used without their transpose (torch Linear weight)",
    "tf32_matmul_inputs": "float32 matmuls with 10-bit-mantissa inputs, as TF32 does",
    "no_max_subtraction": "softmax without subtracting the row max: overflows on large logits",
    "mask_fill_minus_1e9": "masked logits filled with -1e9 (seed 003): fully masked rows become uniform",
    "gqa_head_mapping_modulo": "GQA: query head n reads key head n % K instead of n // G",
    "bias_before_scale": "additive bias added before scaling",
    "dropout_no_rescale": "dropout without the 1/(1-p) rescale",
    "weights_after_dropout": "returned weights taken after dropout",
    "mask_bts_broadcast_as_leading": "a (B, T, S) mask broadcast as (1, B, T, S) by NumPy rules",
    # the modern features (RoPE, KV cache, window, softcap, sinks, QK-norm)
    "rope_convention_swapped": "RoPE pairs interleaved where the config says half-split, and the reverse",
    "rope_on_value": "RoPE applied to the values too",
    "rope_positions_no_cache_offset": "RoPE's default positions start at 0 while decoding (cache offset forgotten)",
    "rope_freqs_bfloat16": "RoPE frequencies computed in bfloat16",
    "mrope_section_order_swapped": "multimodal RoPE's sections taken in the order t, w, h (the height and width "
                                   "positions exchanged)",
    "mrope_not_interleaved": "Qwen3-VL's interleaved multimodal RoPE sections laid out contiguously, as Qwen2-VL's",
    "llama3_scaling_ignored": "Llama 3's frequency rescaling left out",
    "yarn_attention_factor_ignored": "YaRN's attention factor (on cos and sin) left out",
    "partial_rotary_whole_head": "partial rotary (rotary_dim < H) applied to the whole head",
    "softcap_after_mask": "logit softcap after the mask: -inf becomes -cap, masked keys leak",
    "window_off_by_one": "sliding window j > p - left instead of j >= p - left",
    "sinks_ignored": "attention sinks left out of the softmax",
    "qk_norm_scope_swapped": "QK-norm over the whole projection where per head, and the reverse",
    "norm_eps_outside_sqrt": "QK-norm's eps added outside the square root",
    # packed rows (several documents in one row, segment ids)
    "packed_positions_not_restarted": "a packed row's RoPE positions counted 0..T-1 across its documents, not "
                                      "restarted per document as the caller's positions are",
    # the frontier fields (ALiBi, local chunks, the query temperature, the QKV clip, output gates)
    "alibi_power_of_two_rule": "ALiBi slopes 2^(-8k/N), the power-of-two rule, on any head count (6 heads "
                               "included) instead of the stored slopes",
    "alibi_slope_typo": "the first head's ALiBi slope 4% off (a hand-typed slope table: 0.26 for 2^-2): an "
                        "output 0.7% off at T 256, which only a bar set by the keys that carry weight sees",
    "alibi_sign_flipped": "ALiBi's bias added with the wrong sign (+slope * distance)",
    "alibi_before_scale": "ALiBi added before the scale (Falcon's placement) where the slopes are BLOOM's",
    "alibi_query_positions_no_cache_offset": "ALiBi's query positions counted from 0 while decoding (the cache's "
                                             "offset forgotten)",
    "chunks_sliding": "local chunks read as a sliding window of C positions instead of absolute chunks",
    "temperature_offset_ignored": "the query temperature's offset 1 (Llama 4) read as 0",
    "temperature_before_norm": "the query temperature applied to the projection, before the QK-norm divides it "
                               "out (before RoPE alone it would be the same: a per-position scalar commutes with "
                               "the rotation)",
    "clip_after_rope": "the QKV clip applied after RoPE instead of right after the projection",
    "gate_after_output": "the output gate applied after the output projection instead of before merge_heads",
    "norm_before_rope": "a QK-norm that runs after RoPE applied before it",
    "per_head_norm_weights_averaged": "per-head QK-norm weights (Cohere) averaged into one scale for every head",
    "value_norm_ignored": "the value norm (Gemma 3n / 4) left out",
    "longrope_table_by_length": "LongRoPE's table chosen by the call's length instead of its largest position "
                                "(a decode step far into the context keeps the short table)",
    "proportional_as_partial": "Gemma 4's proportional RoPE read as an ordinary partial rotary of the same share "
                               "(pairs i, i + R/2 of the first features, frequencies over R)",
    # the thresholds and the features of the edge grid (cases.py's _edge_grid)
    "longrope_long_table_at_original": "LongRoPE's long table taken when the largest position + 1 reaches "
                                       "original_max_position_embeddings (>=) instead of exceeding it (>)",
    "longrope_attention_factor_recomputed": "LongRoPE's attention factor computed from factor by the paper's rule, the "
                                            "config's own attention_factor unread",
    "yarn_always_truncated": "YaRN's ramp ends rounded to whole dimensions where the config says truncate false "
                             "(gpt-oss)",
    "weightless_qk_norm_as_l2": "a weightless QK-norm (Llama 4's L2Norm, an RMS norm) done as an L2 norm, x / |x|",
    "value_norm_scale_ignored": "a weighted value norm's scale left out (the weightless form applied)",
    "alibi_by_index": "ALiBi's distances by index (the queries the last T of the P + S keys) instead of the "
                      "caller's positions",
    # latent attention (MLA)
    "mla_rope_on_nope_features": "MLA's RoPE on the first R features of each head (and the rotary key put first) "
                                 "where DeepSeek's heads end with them",
    "mla_rotary_key_first_head_only": "MLA's shared rotary key written into the first head only, not broadcast to "
                                      "every head",
    "mla_latent_norm_over_rope_too": "MLA's latent norm taken over the rotary key's features too",
    "mla_absorbed_value_transposed": "a decode step's value up-projection read from a torch weight (K*V, C) by "
                                     "reshape instead of transpose",
}

# Attention over selected keys (topk_indices), each bug with the grid case it targets (tests/test_topk_selection.py
# runs them on their case: the whole short grid per mutant, as test_mutants does, would add a minute of tox for
# bugs only the topk cases can show)
TOPK_MUTANTS = {
    "topk_ignored": ("the selection ignored: every key the other masks show is attended", "topk_per_kv_head_window"),
    "topk_new_keys_only": ("the selection indexed over the new keys only (the cache offset P forgotten: index i read "
                           "as the new key i)", "topk_shared_cache"),
    "topk_minus_one_as_last": ("a -1 slot read as Python's index -1: the last key selected", "topk_shared_cache"),
    "topk_kv_heads_tiled": ("a per-kv-head selection tiled over the query heads (head n reads kv head n % K) "
                            "instead of each kv head's repeated for its G query heads (n // G)",
                            "topk_per_kv_head_window"),
}


# The lightning indexer in the call (config.indexer), each bug with the grid case it targets (tests/test_indexer_call.py)
INDEXER_MUTANTS = {
    "indexer_ignored": ("the indexer ignored: dense attention over every key the other masks show",
                        "indexer_dsa_prefill"),
    "indexer_causal_after_topk": ("the causal mask applied after the indexer's top-k, not before: future keys take "
                                  "slots, and a query attends to fewer than k keys", "indexer_dsa_prefill"),
}


# The lightning indexer's porting bugs that `mha check` names at the indexer's own stage (its trace, first in the
# call's: compare.localise), each with the grid case it runs on and that stage (tests/test_indexer_call.py): run
# by TracedIndexerMutant, the NumPy reference with that one indexer stage replaced
TRACED_INDEXER_MUTANTS = {
    "indexer_rope_pairing_swapped": ("the indexer's RoPE pairing swapped (interleaved for DeepSeek V3.2's half-split: "
                                     "GLM-5's pairing on a V3.2 checkpoint)", "indexer_dsa_prefill",
                                     "indexer.query.rope"),
    "indexer_relu_dropped": ("the ReLU after each index head's scores dropped", "indexer_dsa_prefill",
                             "indexer.scores"),
    "indexer_best_for_worst": ("the last query's best index key swapped for its worst visible dropped one (a top-k "
                               "that sorts the wrong way for one row)", "indexer_dsa_prefill", "indexer.selection"),
}


class TracedIndexerMutant:
    """impl_numpy's adapter (trace included) with one stage of its indexer replaced by `bug` of
    TRACED_INDEXER_MUTANTS while the port's own call runs (the float64 reference, computed outside it, keeps
    the spec's)."""

    def __init__(self, bug):
        if bug not in TRACED_INDEXER_MUTANTS:
            raise ValueError(f"bug must be one of {', '.join(TRACED_INDEXER_MUTANTS)}: got {bug!r}")
        self.bug = bug

    def devices(self):
        return ["cpu"]

    def _replacement(self, ix):
        if self.bug == "indexer_rope_pairing_swapped":
            rope = ix.index_rope
            return "index_rope", lambda x, angles, rotary_dim, interleaved, *rest: rope(x, angles, rotary_dim,
                                                                                        not interleaved, *rest)
        if self.bug == "indexer_relu_dropped":
            scores = ix.scores
            return "scores", lambda q, k, w, scale, relu, per_kv_head: scores(q, k, w, scale, False, per_kv_head)
        select = ix.select_topk

        def best_for_worst(x, k):
            chosen = select(x, k)  # (B, G, T, k')
            row = x[0, 0, -1]
            visible = [j for j in range(row.shape[-1]) if np.isfinite(row[j]) and j not in chosen[0, 0, -1]]
            if visible:
                chosen[0, 0, -1, 0] = min(visible, key=lambda j: row[j])
            return chosen

        return "select_topk", best_for_worst

    def forward(self, config, tensors, inputs, options, *, device="cpu", precision="highest", trace=False):
        import impl_numpy.adapter
        import impl_numpy.indexer as ix

        name, replacement = self._replacement(ix)
        original = getattr(ix, name)
        setattr(ix, name, replacement)
        try:
            return impl_numpy.adapter.forward(config, tensors, inputs, options, device=device, trace=trace)
        finally:
            setattr(ix, name, original)

    def vjp(self, *args, **kwargs):
        raise NotImplementedError("the traced indexer mutant is judged on its forward pass")


# Differential attention (config.differential), each bug with the grid case it targets (tests/test_mutants.py runs
# them on their case, as the topk ones: the whole short grid per mutant would cost tox for bugs only these cases show)
DIFFERENTIAL_MUTANTS = {
    "differential_lambda_init_layer0": ("lambda_init of layer 0 (0.8 - 0.6 = 0.2) for every layer, in lambda and in "
                                        "the (1 - lambda_init) scale: the layer index not passed on",
                                        "differential_gqa"),
    "differential_scale_dropped": ("the differential norm's (1 - lambda_init) scale dropped", "differential_decode"),
}


# Issue 42's cross-layer KV sharing and small knobs, each bug with the grid case it targets (tests/test_mutants.py
# runs them on their case alone, as the top-k ones)
SHARING_MUTANTS = {
    "kv_shared_appends_own_keys": ("a shared-KV layer that appends the keys it reads to the cache it was given, as a "
                                   "layer with its own projections does (the queries' tokens twice, the queries "
                                   "placed after them)", "kv_shared_decode"),
    "key_multiplier_ignored": ("Falcon-H1's key multiplier left out", "knobs_value_scale_key_multiplier"),
    "value_scale_ignored": ("MiMo-V2's attention_value_scale left out", "knobs_value_scale_key_multiplier"),
}


def _knob(y, name, config, bug):
    """The key multiplier on the key projection, the value scale on the value's (after their norms)."""
    if name == "key" and bug != "key_multiplier_ignored":
        return y * config.get("key_multiplier", 1.0)
    if name == "value" and bug != "value_scale_ignored":
        return y * config.get("value_scale", 1.0)
    return y


def _shared_cache(config, inputs, bug):
    """A kv_shared layer (Gemma 3n): None for any other. Its cache's last T entries are the queries' own keys and
    values (the layer that made them appended them): (inputs with the cache before them as past_key / past_value
    and the query standing in for key and value (their lengths: T), (shared keys, shared values)). The bug
    appends what it reads: the cache whole as past, its tail again as new keys."""
    if not config.get("kv_shared"):
        return None
    T, P = inputs["query"].shape[1], inputs["past_key"].shape[2]
    keep = P if bug == "kv_shared_appends_own_keys" else P - T
    given = {**inputs, "key": inputs["query"], "value": inputs["query"]}
    given.update(past_key=inputs["past_key"][:, :, :keep], past_value=inputs["past_value"][:, :, :keep])
    if not keep:
        del given["past_key"], given["past_value"]
    return given, (inputs["past_key"][:, :, P - T:], inputs["past_value"][:, :, P - T:])


class MutantAdapter:
    """The port as a conformance backend (forward only; no gradients)."""

    def __init__(self, bug=None):
        self.bug = bug

    def devices(self):
        return ["cpu"]

    def forward(self, config, tensors, inputs, options, *, device="cpu", precision="highest", trace=False):
        return port(config.to_dict(), tensors, inputs, options, bug=self.bug)

    def vjp(self, *args, **kwargs):
        raise NotImplementedError("the hand port has no gradients")

    def __call__(self, config, tensors, inputs, options):  # the `mha verify` interface
        return port(config, tensors, inputs, options, bug=self.bug)
