"""The Keras layer, in the split_heads style of seed 003 (the TensorFlow tutorial).

Dense `wq`, `wk`, `wv`, `wo` hold the parameters in Keras's own layout:
kernels (D, N*H), (D, K*H), (D, K*V), (N*V, O) and flat biases. The
canonical tensors of the weight format, (D, N, H) and so on, are a reshape
of those, so from_tensors / to_tensors are exact for every dtype.

The norms' scales and biases (QK-norm, the value norm), the sinks, ALiBi's
slopes and the output gate's kernel and bias, where the config has them, are
variables of their canonical shapes (query_norm_scale, value_norm_scale, ...,
sinks, alibi_slopes, gate_kernel, gate_bias); a weightless norm has none.

A latent layer (MLA, config.latent) holds Dense `wq_down` (query.down.*,
with a query_rank), `wq` (query.kernel: from the query's rank, or from the
input), `w_latent` (latent.*: (key_dim, C + R)), `wk` (key.kernel: (C,
K*(H - R))), `wv` (value.kernel: (C, K*V)), `wo`, and the two norms' scales
as variables (query_down_norm_scale, latent_norm_scale). Its cache is
(B, 1, ., C) and (B, 1, ., R).

The layer is a thin wrapper: call() hands its parameters to
attention.multi_head_attention, which runs the spec's stages (or its fused
and chunked paths). The dtype is
the layer's dtype policy (float16, bfloat16, float32 or float64; variables
and every stage's result in that dtype, arithmetic in float32 for 16-bit).
"""

from __future__ import annotations

import os

import numpy as np

import weights
from weights import AttentionConfig
from weights.alibi import bloom_slopes
from weights.contract import cache_widths, check_chunk_size

from . import attention
from . import backend as bk
from ._keras import keras
from .backend import GPU_MISSING, check_dtype, gpus, matmul_precision, placement, to_tensor

ops = keras.ops

DEVICES = ("cpu", "gpu")
PRECISIONS = ("highest", "tf32")


def check_device(device: str | None) -> str | None:
    """None (the backend's own placement: a GPU when there is one), "cpu" or "gpu"."""
    if device is None:
        return None
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}: got {device!r}")
    if device == "gpu" and not gpus():
        raise ValueError(f"device gpu requested but {GPU_MISSING}")
    return device


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}: got {precision!r}")
    return precision


class _Given(keras.initializers.Initializer):
    """A variable's first value given, in its dtype, as a canonical tensor (reshaped to the variable's
    layout): from_tensors builds the layer with the tensors it holds, so no initializer draws values that
    set_tensors would overwrite. On Keras's jax backend each random or constant initializer, and each
    assign of a NumPy array, compiled a small XLA program per shape (about 140 of them in a cold
    `mha check`'s keras-jax column)."""

    def __init__(self, value: np.ndarray):
        self.value = value

    def __call__(self, shape, dtype=None):
        return to_tensor(self.value.reshape(tuple(shape)))  # canonical -> Dense layout, as set_tensors


# The Dense layers' names -> the canonical prefix of their kernel and bias (canonical_variables)
_DENSE_PREFIX = {"wq": "query", "wk": "key", "wv": "value", "wo": "output", "wq_down": "query.down",
                 "w_latent": "latent"}


def _initializer(name: str, num_heads: int):
    """A fresh layer's value of a tensor beyond the Dense ones: the scales 1, ALiBi's slopes BLOOM's rule
    (weights.alibi), the gate's kernel as a Dense kernel (glorot uniform), biases and sinks 0."""
    if name.endswith(".scale"):
        return "ones"
    if name == "alibi.slopes":
        return keras.initializers.Constant(bloom_slopes(num_heads))
    if name.startswith("differential."):  # the lambda vectors: diffllama's N(0, lambda_std_dev 0.1)
        return keras.initializers.RandomNormal(stddev=0.1)
    if name == "gate.kernel" or (name.startswith("indexer.") and name.endswith(".kernel")):
        return "glorot_uniform"
    return "zeros"


@keras.saving.register_keras_serializable(package="impl_tf")
class MultiHeadAttention(keras.layers.Layer):
    """Multi-head attention on the contract's weights (weights.AttentionConfig).

    layer(query, key=None, value=None, mask=None, bias=None, is_causal=False,
    causal_alignment="top_left", training=None, dropout_mask=None, seed=None,
    positions=None, key_positions=None, past_key=None, past_value=None,
    segment_ids=None, key_segment_ids=None, return_weights=False,
    return_cache=False, chunk_size=None) -> output (B, T, O)[, weights (B, N,
    T, P+S)][, present_key (B, K, P+S, H), present_value (B, K, P+S, V)].
    The modern inputs as attention.multi_head_attention takes them: rope
    positions, the cache (decoding: causal_alignment="bottom_right"), packed
    segment ids. chunk_size: the chunked path (exact, never holds a (T, S)
    array; not with return_weights); None: the layer's.

    config: an AttentionConfig (or its dict, as get_config stores it).
    device: None (the backend's placement), "cpu" or "gpu".
    precision: "highest" (TF32 off during the call) or "tf32".

    It runs on Keras's tensorflow, jax and torch backends (the one keras was
    imported on); the chunked path (chunk_size) and the in-place cache
    (cache_length) on TensorFlow alone (NotImplementedError elsewhere, with
    the reason); float64 on jax needs JAX's x64 mode.
    seed: if given, training without dropout_mask or a call seed draws its
      keep-mask from a keras.random.SeedGenerator(seed) (what model.fit
      needs); if None, such a call is refused as the contract says.
    chunk_size: the calls' default chunk_size (None: the plain path), so a
      model that calls the layer on long sequences runs the chunked path.
    dtype: the dtype policy, "float32" by default.

    `mask` follows the contract (bool, True = may attend, (T, S), (B, T, S),
    (B, 1, T, S) or (B, N, T, S)). When it is omitted and the inputs carry
    Keras padding masks (Embedding(mask_zero=True) attaches (B, L) masks),
    they become the mask, as in keras.layers.MultiHeadAttention: query
    position t and key position s may meet iff both are unpadded. The output
    carries the query's Keras mask on.
    """

    def __init__(self, config, *, device: str | None = None, precision: str = "highest", seed: int | None = None,
                 chunk_size: int | None = None, _given: dict[str, np.ndarray] | None = None, **kwargs):
        # _given (from_tensors): every canonical tensor, validated and in the layer's dtype: the variables'
        # first values (_Given), instead of initializers'.
        # The stages cast for themselves (16-bit stored, float32 arithmetic),
        # and a float mask must reach the checks with its own dtype.
        kwargs.setdefault("autocast", False)
        super().__init__(**kwargs)
        if isinstance(config, dict):
            config = AttentionConfig.from_dict(config)
        if not isinstance(config, AttentionConfig):
            raise ValueError(f"config must be an AttentionConfig or its dict: got {type(config).__name__}")
        policy = self.dtype_policy
        if policy.variable_dtype != policy.compute_dtype:
            raise ValueError(
                "dtype must be one policy for variables and arithmetic (float16, bfloat16, float32 or float64; "
                f"the layer casts 16-bit to float32 itself): got {policy.name}"
            )
        check_dtype(weights.dtype_from_name(policy.variable_dtype, argument="dtype").name)
        self.config = config
        self.device = check_device(device)
        self.precision = check_precision(precision)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
            raise ValueError(f"seed must be an integer: got {seed!r}")
        self.seed = None if seed is None else int(seed)
        self.chunk_size = None if chunk_size is None else check_chunk_size(chunk_size)
        c = config
        N, K, H, V = c.num_heads, c.num_kv_heads, c.head_dim, c.value_head_dim
        L = c.latent
        with placement(self.device):
            def dense(units, bias, name):
                given = {} if _given is None else {
                    "kernel_initializer": _Given(_given[f"{_DENSE_PREFIX[name]}.kernel"]),
                    **({"bias_initializer": _Given(_given[f"{_DENSE_PREFIX[name]}.bias"])} if bias else {})}
                return keras.layers.Dense(units, use_bias=bias, dtype=self.dtype_policy, name=name, **given)
            if L is None:
                self.wq = dense(N * H, c.use_query_bias, "wq")
                self.wq.build((None, c.query_dim))
                if not c.kv_shared:  # issue 42: a kv_shared layer has no key or value projection
                    self.wk = dense(K * H, c.use_key_bias, "wk")
                    self.wv = dense(K * V, c.use_value_bias, "wv")
                    self.wk.build((None, c.key_dim))
                    self.wv.build((None, c.value_dim))
            else:  # latent attention (MLA): the query's and the latent's down-projections, the up-projections
                if L.query_rank is not None:
                    self.wq_down = dense(L.query_rank, c.use_query_bias, "wq_down")  # query.down.*
                    self.wq_down.build((None, c.query_dim))
                self.wq = dense(N * H, c.use_query_bias and L.query_rank is None, "wq")
                self.wq.build((None, c.query_dim if L.query_rank is None else L.query_rank))
                self.w_latent = dense(L.kv_rank + L.rope_dim, c.use_key_bias, "w_latent")  # latent.*
                self.w_latent.build((None, c.key_dim))
                self.wk = dense(K * (H - L.rope_dim), False, "wk")  # key.kernel (C, K, H - R)
                self.wv = dense(K * V, False, "wv")  # value.kernel (C, K, V)
                self.wk.build((None, L.kv_rank))
                self.wv.build((None, L.kv_rank))
            self.wo = dense(c.out_dim, c.use_output_bias, "wo")
            self.wo.build((None, N * V))
            # The norms' scales and biases (QK-norm, the value norm, a latent layer's two RMS norms), sinks,
            # ALiBi and the gate: variables of the canonical shapes (scale 1, bias 0, sink logits 0, BLOOM's
            # slopes, the gate's kernel drawn as a Dense kernel is).
            self.extra_variables = {}
            for name, shape in c.tensor_shapes().items():
                if (".norm." in name or name in ("sinks", "alibi.slopes", "gate.kernel", "gate.bias")
                        or name.startswith("indexer.")  # the indexer's (no gradient reaches them from the output)
                        or name.startswith("differential.")):  # differential attention's lambda vectors
                    first = _initializer(name, N) if _given is None else _Given(_given[name])
                    self.extra_variables[name] = self.add_weight(shape=shape, initializer=first,
                                                                 name=name.replace(".", "_"))
            self.seed_generator = None if seed is None else keras.random.SeedGenerator(self.seed)
        self.supports_masking = True
        self.built = True

    # -- the canonical tensors ------------------------------------------------
    def canonical_variables(self) -> dict[str, keras.Variable]:
        """Canonical tensor name -> the Dense variable holding it (Keras layout)."""
        found = {}
        layers = [("query", self.wq), ("output", self.wo)]
        layers += [(prefix, getattr(self, name)) for prefix, name in (("query.down", "wq_down"),
                                                                      ("latent", "w_latent"), ("key", "wk"),
                                                                      ("value", "wv")) if hasattr(self, name)]
        for prefix, dense in layers:
            found[f"{prefix}.kernel"] = dense.kernel
            if dense.use_bias:
                found[f"{prefix}.bias"] = dense.bias
        found.update(self.extra_variables)
        return {name: found[name] for name in self.config.tensor_shapes()}

    def parameters(self) -> dict:
        """The canonical tensors as (differentiable) reshapes of the variables."""
        shapes = self.config.tensor_shapes()
        # (D, N*H) -> (D, N, H), (N*H,) -> (N, H), (N*V, O) -> (N, V, O), ...: tensor_shapes()
        return {name: bk.reshape(v, shapes[name]) for name, v in self.canonical_variables().items()}

    def set_tensors(self, tensors: dict[str, np.ndarray]) -> None:
        """Assign canonical tensors (validated first), cast to the layer's dtype."""
        weights.validate_tensors(self.config, tensors)
        dtype = weights.dtype_from_name(self.dtype_policy.variable_dtype)
        for name, variable in self.canonical_variables().items():
            # canonical -> Dense layout: (D, N, H) -> (D, N*H), (N, H) -> (N*H,), (N, V, O) -> (N*V, O)
            variable.assign(to_tensor(np.asarray(tensors[name]).astype(dtype).reshape(tuple(variable.shape))))

    def to_tensors(self) -> dict[str, np.ndarray]:
        """The canonical tensors as NumPy arrays in the layer's dtype (bfloat16:
        ml_dtypes.bfloat16)."""
        shapes = self.config.tensor_shapes()
        return {
            name: np.array(ops.convert_to_numpy(v)).reshape(shapes[name])  # Dense layout -> tensor_shapes()
            for name, v in self.canonical_variables().items()
        }

    @classmethod
    def from_tensors(cls, config: AttentionConfig, tensors: dict[str, np.ndarray], *, dtype: str | None = None,
                     **kwargs) -> MultiHeadAttention:
        """A layer holding these canonical tensors, in their dtype unless dtype says otherwise."""
        stored = weights.validate_tensors(config, tensors)
        dtype = stored if dtype is None else weights.dtype_from_name(dtype)
        given = {name: np.asarray(tensors[name]).astype(dtype) for name in config.tensor_shapes()}
        return cls(config, dtype=dtype.name, _given=given, **kwargs)  # the variables start as the tensors

    @classmethod
    def from_file(cls, path: str | os.PathLike, **kwargs) -> MultiHeadAttention:
        """A layer from a weight file (weights.load: strict, checksummed)."""
        return cls.from_tensors(*weights.load(path), **kwargs)

    # -- seed 003's helper ------------------------------------------------------
    def split_heads(self, x, batch_size, num_heads: int | None = None):
        """(B, L, heads*width) -> (B, heads, L, width); heads defaults to N, so
        a projected query gives (B, N, T, H). Pass num_kv_heads for keys/values."""
        heads = self.config.num_heads if num_heads is None else num_heads
        x = ops.reshape(x, (batch_size, -1, heads, x.shape[-1] // heads))  # (B, L, heads, width)
        return ops.transpose(x, (0, 2, 1, 3))  # (B, heads, L, width)

    # -- calling ------------------------------------------------------------------
    @staticmethod
    def mask_from_keras_masks(query, key=None, value=None):
        """Keras padding masks, (B, T) on the query and (B, S) on key/value,
        as a contract mask (B, T|1, S|1); None if no input carries one."""
        key = query if key is None else key
        value = key if value is None else value
        get = lambda x: getattr(x, "_keras_mask", None)  # noqa: E731  (where Keras keeps it)
        q_mask = get(query)
        kv_masks = [get(x) for x in ([key] if value is key else [key, value]) if get(x) is not None]
        allowed = None if q_mask is None else ops.cast(q_mask, "bool")[:, :, None]  # (B, T, 1)
        for kv in kv_masks:
            kv = ops.cast(kv, "bool")[:, None, :]  # (B, 1, S)
            allowed = kv if allowed is None else ops.logical_and(allowed, kv)
        return allowed

    def compute_mask(self, inputs, previous_mask=None):
        """The output (B, T, O) keeps the query's Keras padding mask, if any."""
        return getattr(inputs, "_keras_mask", None)

    def __call__(self, query, key=None, value=None, **kwargs):
        if kwargs.get("mask") is None:
            kwargs["mask"] = self.mask_from_keras_masks(query, key, value)
        return super().__call__(query, key, value, **kwargs)

    def _generated_keep_mask(self, query, key, training, dropout_mask, seed, past_key=None, cache_length=None):
        if not (training and dropout_mask is None and seed is None and self.config.dropout > 0):
            return dropout_mask
        if self.seed_generator is None:
            return None  # the contract's error follows
        source = query if key is None else key
        P = (0 if past_key is None else bk.shape(past_key)[2]) if cache_length is None else cache_length
        S_total = bk.shape(source)[1] + P
        shape = (bk.shape(query)[0], self.config.num_heads, bk.shape(query)[1], S_total)
        return keras.random.uniform(shape, seed=self.seed_generator) >= self.config.dropout

    def call(self, query, key=None, value=None, mask=None, bias=None, is_causal=False, causal_alignment="top_left",
             training=None, dropout_mask=None, seed=None, positions=None, key_positions=None, past_key=None,
             past_value=None, segment_ids=None, key_segment_ids=None, return_weights=False, return_cache=False,
             chunk_size=None, cache_length=None, past_key_positions=None, topk_indices=None, past_index_keys=None,
             return_selection=False):
        training = bool(training)
        try:
            with placement(self.device), matmul_precision(self.precision):
                dropout_mask = self._generated_keep_mask(query, key, training, dropout_mask, seed, past_key,
                                                         cache_length)
                return attention.multi_head_attention(
                    self.config, self.parameters(), query, key, value, mask=mask, bias=bias, is_causal=is_causal,
                    causal_alignment=causal_alignment, training=training, dropout_mask=dropout_mask, seed=seed,
                    positions=positions, key_positions=key_positions, past_key=past_key, past_value=past_value,
                    segment_ids=segment_ids, key_segment_ids=key_segment_ids, return_weights=return_weights,
                    return_cache=return_cache, chunk_size=self.chunk_size if chunk_size is None else chunk_size,
                    cache_length=cache_length, past_key_positions=past_key_positions, topk_indices=topk_indices,
                    past_index_keys=past_index_keys, return_selection=return_selection,
                )
        except ValueError as err:
            # Keras rewrites the message of an error raised in call() (adding
            # the arguments) unless it is marked as already annotated; the
            # contract's words must reach the caller unchanged.
            err._keras_call_info_injected = True
            raise

    def trace(self, query, key=None, value=None, **options) -> tuple:
        """(result, [TraceEntry(stage, tensor), ...]): the call with every stage
        recorded (impl_numpy.STAGES' names). Runs eagerly, outside Keras's __call__."""
        entries: list = []
        options["training"] = bool(options.get("training"))
        with placement(self.device), matmul_precision(self.precision):
            result = attention.multi_head_attention(
                self.config, self.parameters(), query, key, value, trace=entries, **options
            )
        return result, entries

    def compute_output_spec(self, query, key=None, value=None, return_weights=False, return_cache=False,
                            past_key=None, cache_length=None, return_selection=False, **_options):
        c = self.config
        B, T = query.shape[0], query.shape[1]
        S = (query if key is None else key).shape[1]
        C = S  # the present cache's length: P + S, or an in-place cache's buffers, whole
        if past_key is not None:
            P = past_key.shape[2] if cache_length is None else cache_length
            S = None if S is None or P is None else S + P
            C = past_key.shape[2] if cache_length is not None else S
        dtype = self.dtype_policy.compute_dtype
        parts = [keras.KerasTensor((B, T, c.out_dim), dtype=dtype)]
        if return_weights:
            parts.append(keras.KerasTensor((B, c.num_heads, T, S), dtype=dtype))
        if return_selection:  # the indexer's selection: (B, T, k') or (B, K, T, k'), int64
            ix = c.indexer
            width = None if S is None else min(ix.topk * (ix.block_size or 1), S)
            lead = (B, c.num_kv_heads) if ix.per_kv_head else (B,)
            parts.append(keras.KerasTensor((*lead, T, width), dtype="int64"))
        if return_cache:  # (B, K, ., H) and (B, K, ., V); a latent layer's (B, 1, ., C) and (B, 1, ., R)
            parts += [keras.KerasTensor((B, heads, C, width), dtype=dtype) for heads, width, _ in cache_widths(c)]
            if c.indexer is not None:  # present_index_keys (B, ., J)
                parts.append(keras.KerasTensor((B, C, c.indexer.cache_width), dtype=dtype))
        return parts[0] if len(parts) == 1 else tuple(parts)

    # -- serialisation ---------------------------------------------------------------
    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "config": self.config.to_dict(),
            "device": self.device,
            "precision": self.precision,
            "seed": self.seed,
            "chunk_size": self.chunk_size,
        }
