"""Live Keras objects <-> canonical weights, through weights.layouts.

    from_native(obj, layout=None, **hints) -> (config, tensors)
    to_native(config, tensors, *, into=None, layout=None, **hints) -> keras layer

`obj` is a built keras.layers.MultiHeadAttention (layout keras-mha; its
variables' paths relative to the layer: query/kernel ...), or any built layer
holding Dense sublayers in a layout named by `layout=` (keras-split-heads,
seed 003's WQ/WK/WV/WO), whose state is read as ATTRIBUTE/VARIABLE
("WQ/kernel"): the attribute names, as Keras' .weights.h5 files store them,
not the auto-generated layer names ("dense_1").

to_native builds and fills a keras.layers.MultiHeadAttention in the tensors'
dtype (Keras' call order is layer(query, value, key)), or with `into=` fills
an existing built layer in `layout`. Keras MHA always scales by
1/sqrt(key_dim); other scales, use_gate, sliding_window and attention_axes
other than the sequence axis are refused. Set KERAS_BACKEND before importing.
"""

from __future__ import annotations

import math

import keras
import numpy as np

from weights import AttentionConfig, layouts


def _relative(path: str, owner: str) -> str:
    return path[len(owner) + 1:] if path.startswith(owner + "/") else path.split("/", 1)[-1]


def _mha_variables(layer) -> dict[str, object]:
    return {_relative(v.path, layer.path): v for v in layer.weights}


def _attribute_variables(layer) -> dict[str, object]:
    found = {}
    for attribute, sub in vars(layer).items():
        if isinstance(sub, keras.layers.Layer) and not attribute.startswith("_"):
            for v in sub.weights:
                found[f"{attribute}/{v.name}"] = v
    return found


def _check_mha(layer) -> None:
    if not layer.built:
        raise ValueError("the MultiHeadAttention layer is not built: call it once or build it first")
    refused = []
    if getattr(layer, "_use_gate", False):
        refused.append("use_gate=True")
    if getattr(layer, "_sliding_window", None) is not None:
        refused.append(f"sliding_window={layer._sliding_window}")
    if tuple(getattr(layer, "_attention_axes", None) or (1,)) != (1,):
        refused.append(f"attention_axes={layer._attention_axes}")
    if refused:
        raise ValueError(f"keras MultiHeadAttention with {', '.join(refused)} has no canonical form")


def from_native(obj, layout: str | None = None, **hints):
    if isinstance(obj, keras.layers.MultiHeadAttention) and layout in (None, "keras-mha"):
        _check_mha(obj)
        state = {k: keras.ops.convert_to_numpy(v) for k, v in _mha_variables(obj).items()}
        return layouts.to_canonical("keras-mha", state, **{"dropout": obj._dropout, **hints})
    if not isinstance(obj, keras.layers.Layer):
        raise ValueError(f"obj must be a keras Layer: got {type(obj).__name__}")
    if layout is None:
        raise ValueError(f"layout is needed for a {type(obj).__name__} (one of {', '.join(layouts.LAYOUTS)})")
    if not obj.built:
        raise ValueError(f"the {type(obj).__name__} layer is not built: call it once first")
    state = {k: keras.ops.convert_to_numpy(v) for k, v in _attribute_variables(obj).items()}
    return layouts.to_canonical(layout, state, **hints)


def _assign(variables: dict[str, object], state: dict[str, np.ndarray], what: str) -> None:
    missing = sorted(set(variables) - set(state))
    unexpected = sorted(set(state) - set(variables))
    if missing or unexpected:
        raise ValueError(f"{what}: variables without weights: {missing or 'none'}; weights without variables: "
                         f"{unexpected or 'none'}")
    wrong = [f"{k} {tuple(v.shape)} vs {state[k].shape}" for k, v in variables.items()
             if tuple(v.shape) != state[k].shape]
    if wrong:
        raise ValueError(f"{what}: shapes differ: {'; '.join(wrong)}")
    for key, variable in variables.items():
        variable.assign(state[key].astype(variable.dtype))


def to_native(config: AttentionConfig, tensors, *, into=None, layout: str | None = None, **hints):
    if into is not None:
        if layout is None:
            raise ValueError(f"layout is needed to fill a {type(into).__name__}")
        state = layouts.from_canonical(layout, config, tensors, **hints)
        variables = _mha_variables(into) if layout == "keras-mha" else _attribute_variables(into)
        _assign(variables, state, type(into).__name__)
        return into
    if layout not in (None, "keras-mha"):
        raise ValueError(f"to_native builds keras MultiHeadAttention (keras-mha); pass into= for layout {layout!r}")
    state = layouts.from_canonical("keras-mha", config, tensors, **hints)
    default = 1.0 / math.sqrt(config.head_dim)
    if config.scale is not None and not math.isclose(config.scale, default, rel_tol=1e-12):
        raise ValueError(f"keras MultiHeadAttention always scales by 1/sqrt(key_dim) = {default:.6g}: "
                         f"got scale={config.scale}")
    dtype = np.dtype(next(iter(tensors.values())).dtype).name
    layer = keras.layers.MultiHeadAttention(
        num_heads=config.num_heads, key_dim=config.head_dim, value_dim=config.value_head_dim,
        output_shape=config.out_dim, use_bias=config.use_query_bias, dropout=config.dropout, dtype=dtype,
    )
    layer.build(query_shape=(None, None, config.query_dim), value_shape=(None, None, config.value_dim),
                key_shape=(None, None, config.key_dim))
    _assign(_mha_variables(layer), state, "MultiHeadAttention")
    return layer
