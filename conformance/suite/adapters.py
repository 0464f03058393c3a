"""Live modules as `mha verify` functions (docs/verify-in-ci.md):

    torch_module(factory, layout="torch-mha", call=None, *, accepts=(), self_attention=False, device="cpu", **hints)
    keras_layer(factory, layout="keras-mha", call=None, *, accepts=(), self_attention=False, **hints)
    flax_module(factory, layout="flax-nnx-mha", call=None, *, accepts=(), self_attention=False, **hints)
    mlx_module(factory, layout="canonical", call=None, *, accepts=(), self_attention=False, **hints)

each return fn(config, tensors, inputs, options), the signature of
conformance/suite/verify.py, for `mha verify --impl`, `pytest --mha-impl` or
conformance.suite.pytest_plugin.assert_conforms. Per vector the adapter

1. builds your module: factory(AttentionConfig), in the vector's dtype
   (torch: module.to(dtype); Keras: the global dtype policy while the
   factory runs; Flax and MLX: the loaded parameters carry it, float64
   under jax.enable_x64; MLX's float64 on its CPU device only);
2. loads the vector's canonical tensors through the layout's
   weights.layouts.from_canonical (hints: names, prefix), checking that the
   module's parameters are exactly the layout's keys;
3. calls it: call(module, inputs, options) with inputs as framework tensors
   (query, key, value and every input named in `accepts`), returning the
   output, a tuple whose first element is the output, or a dict with
   "output" and optionally "weights" (B, N, T, S). Default calls, with the
   framework's own argument order: torch module(query, key, value) (first
   element of a tuple), Keras layer(query, value, key=key), Flax and MLX
   module(query, key, value) (impl_mlx.MultiHeadAttention's layout is
   "canonical"; mlx.nn.MultiHeadAttention's is "torch-linears" with
   names={"query": "query_proj", "key": "key_proj", "value": "value_proj",
   "output": "out_proj"});
4. returns the output, the weights when the vector asks and the call gives
   them (else reported "not returned"), and the gradients of
   sum(output * cotangent) by the framework's autodiff: query, key, value
   and every parameter, mapped back to canonical names through the layout's
   to_canonical (Keras: on the backend Keras runs on, tf.GradientTape,
   jax.vjp with the variables' values through keras.StatelessScope, or
   torch.autograd; float64 on jax needs JAX's x64 mode, else unsupported).

What the module is not declared to take makes the vector "unsupported"
(NotImplementedError with the reason), never a silent pass: an input
beyond query, key and value (mask, bias, dropout_mask, positions ...), the
options is_causal and return_cache, training with dropout (which needs the
vector's dropout_mask), a scale other than 1/sqrt(head_dim), and the modern
config fields (rope, qk_norm, logit_softcap, window_left/right, use_sinks),
unless their names are in `accepts` (then the call must honour them); a
config the layout cannot hold (weights.layouts.cannot_express: GQA in
torch-mha ...), or one the factory builds with other shapes. A factory may
raise NotImplementedError itself. `self_attention=True`: the module takes
one input; vectors whose key or value differ from the query are
unsupported, the call gets the same tensor under all three names, and the
input gradient (the sum of the three the vectors hold apart) is reported
"not returned" while every parameter gradient is checked.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np

from weights import AttentionConfig, layouts

QKV = ("query", "key", "value")
# Options a call must be declared to honour (through `accepts`) before a vector that sets them runs.
OPTIONS = ("is_causal", "return_cache")
FROM_HINTS = ("names", "prefix")


class _Plan:
    """What one vector asks of the module, checked against what it was declared to take."""

    def __init__(self, who: str, layout: str, config: dict, inputs: dict, options: dict, accepts, self_attention: bool):
        accepts = set(accepts)
        self.config = cfg = AttentionConfig.from_dict(config)
        refused = [f"input {name}" for name in inputs if name not in QKV and name not in accepts]
        refused += [f"option {name}" for name in OPTIONS if options.get(name) and name not in accepts]
        if options.get("training") and cfg.dropout > 0 and "dropout_mask" not in accepts:
            refused.append(f"training with dropout {cfg.dropout} (its dropout_mask)")
        default_scale = 1.0 / math.sqrt(cfg.head_dim)
        if cfg.scale is not None and not math.isclose(cfg.scale, default_scale, rel_tol=1e-12) and "scale" not in accepts:
            refused.append(f"scale={cfg.scale} (not 1/sqrt(head_dim) = {default_scale:.6g})")
        from weights.config import MODERN_DEFAULTS

        refused += [f"{field}={getattr(cfg, field)!r}" for field, off in MODERN_DEFAULTS.items()
                    if getattr(cfg, field) != off and field not in accepts]
        if refused:
            raise NotImplementedError(f"{who}: the module is not declared to take {', '.join(refused)} "
                                      "(accepts=...)")
        problems = layouts.cannot_express(layout, cfg)
        if problems:
            raise NotImplementedError(f"{who}: layout {layout} cannot express " + "; ".join(problems))
        if self_attention and not all(inputs[n].shape == inputs["query"].shape and np.array_equal(
                inputs[n], inputs["query"], equal_nan=True) for n in ("key", "value")):
            raise NotImplementedError(f"{who}: a self-attention module (self_attention=True): the vector's key and "
                                      "value are not its query")
        self.who, self.layout, self.options, self.self_attention = who, layout, options, self_attention
        self.dtype = inputs["query"].dtype
        self.passed = [name for name in inputs if name in QKV or name in accepts]
        self.cotangent = options.get("cotangent")
        if self.cotangent is not None:
            self.cotangent = np.asarray(self.cotangent).astype(self.dtype)

    def state(self, tensors, hints) -> dict[str, np.ndarray]:
        self.hints = hints
        return layouts.from_canonical(self.layout, self.config, tensors,
                                      **{k: v for k, v in hints.items() if k in FROM_HINTS})

    def check_parameters(self, state: dict, parameters: dict) -> None:
        """parameters: the module's name -> shape. Its names must be the layout's; its shapes those the config gives."""
        missing, unexpected = sorted(set(state) - set(parameters)), sorted(set(parameters) - set(state))
        biases = self.bias_keys()
        if (missing or unexpected) and set(missing) | set(unexpected) <= biases:
            # a module whose biases are fixed (always there, or never) against a config that differs
            raise NotImplementedError(f"{self.who}: the module built for this config has other biases: "
                                      f"{', '.join(unexpected)} beyond the config's" if unexpected else
                                      f"{self.who}: the module built for this config lacks the biases "
                                      f"{', '.join(missing)}")
        if missing or unexpected:
            raise ValueError(f"{self.who}: the module's parameters are not layout {self.layout}'s: layout keys "
                             f"without a parameter: {missing or 'none'}; parameters without a layout key: "
                             f"{unexpected or 'none'} (hints names=, prefix= rename the layout's keys)")
        wrong = [f"{k} {tuple(parameters[k])} (the config gives {state[k].shape})" for k in state
                 if tuple(parameters[k]) != state[k].shape]
        if wrong:
            raise NotImplementedError(f"{self.who}: the module built for this config has other shapes: "
                                      + "; ".join(wrong))

    def bias_keys(self) -> set[str]:
        """The layout's keys that hold biases only, for this config with every bias on."""
        import dataclasses

        full = dataclasses.replace(self.config, use_query_bias=True, use_key_bias=True, use_value_bias=True,
                                   use_output_bias=True)
        try:
            table = layouts.mapping(self.layout, full, **{k: v for k, v in self.hints.items() if k in FROM_HINTS})
        except ValueError:  # the layout has one bias flag and this config mixes them: nothing to name
            return set()
        return {key for key, parts in table.items() if all(part.endswith(".bias") for part in parts)}

    def answer(self, output, weights, grads_qkv: dict | None, grads_params: dict | None, hints) -> dict:
        """NumPy results -> verify's dict: canonical gradient names, what was not returned and why."""
        answer = {"output": output}
        not_returned = {}
        if self.options.get("return_weights"):
            if weights is None:
                not_returned["weights"] = "the call returns no attention weights"
            else:
                answer["weights"] = weights
        if grads_params is not None:
            grads = {}
            if self.self_attention:
                for name in QKV:
                    not_returned[f"grad {name}"] = ("a self-attention module: its one input's gradient is the sum "
                                                    "of the three the vectors hold apart")
            else:
                unused = [name for name in QKV if grads_qkv.get(name) is None]
                if unused:
                    raise ValueError(f"{self.who}: the call does not use the {', '.join(unused)} input (a module "
                                     "of one input takes self_attention=True)")
                grads |= grads_qkv
            grads |= canonical_gradients(self.layout, self.config, grads_params, hints)
            answer["grads"] = grads
        if not_returned:
            answer["not_returned"] = not_returned
        return answer


def canonical_gradients(layout: str, config: AttentionConfig, grads: dict, hints) -> dict[str, np.ndarray]:
    """Parameter gradients in the layout's names and shapes -> canonical ones
    (a layout is transposes, reshapes and concatenations, so gradients map as weights do)."""
    if layout == "canonical":
        return dict(grads)
    from conformance.native import grads_to_canonical

    return grads_to_canonical(layout, grads, num_heads=config.num_heads,
                              **{k: v for k, v in hints.items() if k in FROM_HINTS})


def _split(raw):
    """A call's result -> (output, weights or None)."""
    if isinstance(raw, dict):
        if "output" not in raw:
            raise ValueError(f"the call returned a dict without 'output': keys {sorted(raw)}")
        return raw["output"], raw.get("weights")
    if isinstance(raw, (tuple, list)):
        return raw[0], None
    return raw, None


def _check_hints(hints) -> None:
    unknown = sorted(set(hints) - set(FROM_HINTS))
    if unknown:
        raise ValueError(f"hints must be among {', '.join(FROM_HINTS)}: got {', '.join(unknown)}")


def _call_inputs(plan: _Plan, arrays: dict) -> dict:
    if plan.self_attention:
        return {**{n: arrays["query"] for n in QKV}, **{n: arrays[n] for n in plan.passed if n not in QKV}}
    return {n: arrays[n] for n in plan.passed}


# -- PyTorch ------------------------------------------------------------------------------

def _torch_default_call(module, inputs, options):
    return module(inputs["query"], inputs["key"], inputs["value"])


def torch_module(factory, layout: str = "torch-mha", call=None, *, accepts=(), self_attention: bool = False,
                 device: str = "cpu", **hints):
    _check_hints(hints)
    call = call or _torch_default_call

    def verify_fn(config, tensors, inputs, options):
        import torch

        from impl_torch.convert import to_numpy, to_torch, torch_dtype

        plan = _Plan("torch_module", layout, config, inputs, options, accepts, self_attention)
        module = factory(plan.config)
        module.to(device=device, dtype=torch_dtype(plan.dtype.name))
        state = plan.state(tensors, hints)
        parameters = dict(module.named_parameters())
        plan.check_parameters(state, {k: p.shape for k, p in parameters.items()})
        with torch.no_grad():
            for key, value in state.items():
                parameters[key].copy_(to_torch(value, device))
        module.train(bool(options.get("training")))
        arrays = {n: to_torch(v, device) for n, v in inputs.items()}
        for n in QKV:
            arrays[n].requires_grad_(plan.cotangent is not None and not (self_attention and n != "query"))
        with torch.enable_grad():
            output, weights = _split(call(module, _call_inputs(plan, arrays), options))
        grads_qkv = grads_params = None
        if plan.cotangent is not None:
            wrt = [arrays[n] for n in (("query",) if self_attention else QKV)] + list(parameters.values())
            got = torch.autograd.grad(output, wrt, grad_outputs=to_torch(plan.cotangent, device), allow_unused=True)
            got_qkv, got_params = got[:len(wrt) - len(parameters)], got[len(wrt) - len(parameters):]
            grads_qkv = {n: None if g is None else to_numpy(g) for n, g in zip(QKV, got_qkv)}
            grads_params = {k: to_numpy(g) if g is not None else np.zeros(p.shape, plan.dtype)
                            for (k, p), g in zip(parameters.items(), got_params)}
        return plan.answer(to_numpy(output), None if weights is None else to_numpy(weights), grads_qkv,
                           grads_params, hints)

    return verify_fn


# -- Keras ----------------------------------------------------------------------------------

def _keras_default_call(layer, inputs, options):
    return layer(inputs["query"], inputs["value"], key=inputs["key"], training=bool(options.get("training")))


@contextlib.contextmanager
def _keras_dtype_policy(dtype: str):
    import keras

    before = keras.config.dtype_policy()
    keras.config.set_dtype_policy(dtype)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(before)


def keras_layer(factory, layout: str = "keras-mha", call=None, *, accepts=(), self_attention: bool = False, **hints):
    _check_hints(hints)
    call = call or _keras_default_call

    def verify_fn(config, tensors, inputs, options):
        import keras

        from impl_tf import native

        plan = _Plan("keras_layer", layout, config, inputs, options, accepts, self_attention)
        with _keras_dtype_policy(plan.dtype.name):
            layer = factory(plan.config)
        from impl_tf.backend import X64_MESSAGE, to_tensor  # NumPy bfloat16 on torch too

        backend = keras.backend.backend()
        if backend == "jax" and plan.dtype.name == "float64":
            import jax

            if not jax.config.jax_enable_x64:
                raise NotImplementedError(f"float64: {X64_MESSAGE}")
        arrays = {n: to_tensor(v) for n, v in inputs.items()}
        if not layer.built:  # Keras builds a layer on its first call
            call(layer, _call_inputs(plan, arrays), options)
        variables = native._mha_variables(layer) if layout == "keras-mha" else native._attribute_variables(layer)
        state = plan.state(tensors, hints)
        plan.check_parameters(state, {k: tuple(v.shape) for k, v in variables.items()})
        for key, value in state.items():
            variables[key].assign(to_tensor(value.astype(variables[key].dtype)))
        if plan.cotangent is None:
            output, weights = _split(call(layer, _call_inputs(plan, arrays), options))
            return plan.answer(keras.ops.convert_to_numpy(output), _numpy_or_none(weights), None, None, hints)
        watched_names = ("query",) if self_attention else QKV
        names = list(variables)

        def run(watched):
            return _split(call(layer, _call_inputs(plan, {**arrays, **dict(zip(watched_names, watched))}), options))

        output, weights, got = _KERAS_GRADIENTS[backend](run, [arrays[n] for n in watched_names],
                                                         [variables[k] for k in names], plan.cotangent)
        got_qkv, got_params = got[:len(watched_names)], got[len(watched_names):]
        grads_qkv = {n: None if g is None else _numpy_or_none(g) for n, g in zip(QKV, got_qkv)}
        grads_params = {k: _numpy_or_none(g) if g is not None else np.zeros(tuple(variables[k].shape), plan.dtype)
                        for k, g in zip(names, got_params)}
        return plan.answer(keras.ops.convert_to_numpy(output), _numpy_or_none(weights), grads_qkv, grads_params,
                           hints)

    return verify_fn


def _numpy_or_none(x):
    if x is None:
        return None
    import keras

    return keras.ops.convert_to_numpy(x)


# The gradients of sum(output * cotangent) by each Keras backend's own autodiff: run(watched) -> (output,
# weights); -> (output, weights, [d watched..., d variable...]) (None: not read).

def _keras_tensorflow_gradients(run, watched, variables, cotangent):
    import tensorflow as tf

    with tf.GradientTape() as tape:
        tape.watch(watched)
        output, weights = run(watched)
    got = tape.gradient(output, watched + [v.value for v in variables],
                        output_gradients=tf.cast(tf.convert_to_tensor(cotangent), output.dtype))
    return output, weights, got


def _keras_torch_gradients(run, watched, variables, cotangent):
    import keras
    import torch

    from impl_tf.backend import to_tensor

    watched = [w.detach().requires_grad_(True) for w in watched]
    output, weights = run(watched)
    got = torch.autograd.grad(output, watched + [v.value for v in variables],
                              grad_outputs=keras.ops.cast(to_tensor(cotangent), output.dtype), allow_unused=True)
    return output, weights, list(got)


def _keras_jax_gradients(run, watched, variables, cotangent):
    """jax.vjp over the inputs and the variables' values, read through keras.StatelessScope (how Keras's
    stateless_call runs a layer on values it is given)."""
    import jax
    import keras

    def pure(watched_now, values):
        with keras.StatelessScope(state_mapping=list(zip(variables, values))):
            output, weights = run(watched_now)
        return output, weights

    output, pullback, weights = jax.vjp(pure, watched, [v.value for v in variables], has_aux=True)
    d_watched, d_values = pullback(jax.numpy.asarray(np.asarray(cotangent, np.float32)
                                                     if cotangent.dtype.name == "bfloat16" else cotangent,
                                                     output.dtype))
    return output, weights, [*d_watched, *d_values]


_KERAS_GRADIENTS = {"tensorflow": _keras_tensorflow_gradients, "torch": _keras_torch_gradients,
                    "jax": _keras_jax_gradients}


# -- Flax NNX -------------------------------------------------------------------------------

def _flax_default_call(module, inputs, options):
    return module(inputs["query"], inputs["key"], inputs["value"])


def flax_module(factory, layout: str = "flax-nnx-mha", call=None, *, accepts=(), self_attention: bool = False,
                **hints):
    _check_hints(hints)
    call = call or _flax_default_call

    def verify_fn(config, tensors, inputs, options):
        import jax
        import jax.numpy as jnp
        from flax import nnx

        plan = _Plan("flax_module", layout, config, inputs, options, accepts, self_attention)
        x64 = jax.enable_x64() if plan.dtype == np.float64 else contextlib.nullcontext()
        with x64:
            module = factory(plan.config)
            parameters = {"/".join(map(str, path)): v for path, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}
            state = plan.state(tensors, hints)
            plan.check_parameters(state, {k: tuple(v.get_value().shape) for k, v in parameters.items()})
            for key, value in state.items():
                parameters[key].set_value(jnp.asarray(value))
            module.train() if options.get("training") else module.eval()
            graphdef, params, rest = nnx.split(module, nnx.Param, ...)
            others = {n: jnp.asarray(v) for n, v in inputs.items() if n not in QKV}

            def run(p, q, k, v):
                m = nnx.merge(graphdef, p, rest)
                return _split(call(m, _call_inputs(plan, {"query": q, "key": k, "value": v, **others}), options))

            def forward_backward(p, q, k, v, cotangent):
                output, pullback, weights = jax.vjp(run, p, q, k, v, has_aux=True)
                return output, weights, pullback(cotangent)

            qkv = [jnp.asarray(inputs[n]) for n in QKV]
            grads_qkv = grads_params = None
            # One compiled program per vector (op by op JAX compiles each primitive anew: seconds per vector),
            # except float16 on CPU, where XLA refuses the float16 dot with float32 accumulation that jit emits.
            compiled = (lambda f: f) if plan.dtype == np.float16 and jax.default_backend() == "cpu" else jax.jit
            if plan.cotangent is None:
                output, weights = compiled(run)(params, *qkv)
            else:
                output, weights, (g_params, *g_qkv) = compiled(forward_backward)(params, *qkv,
                                                                                 jnp.asarray(plan.cotangent))
                grads_qkv = dict(zip(QKV, (np.asarray(g) for g in g_qkv)))
                grads_params = {"/".join(map(str, path)): np.asarray(v.get_value())
                                for path, v in nnx.to_flat_state(g_params)}
            return plan.answer(np.asarray(output), None if weights is None else np.asarray(weights), grads_qkv,
                               grads_params, hints)

    return verify_fn


# -- MLX ------------------------------------------------------------------------------------

def _mlx_default_call(module, inputs, options):
    return module(inputs["query"], inputs["key"], inputs["value"])


def mlx_module(factory, layout: str = "canonical", call=None, *, accepts=(), self_attention: bool = False, **hints):
    """An mlx.nn.Module (impl_mlx.MultiHeadAttention, mlx.nn.MultiHeadAttention, yours): its parameters are
    its flattened names (mlx.utils.tree_flatten), loaded with module.update; gradients by mx.vjp."""
    _check_hints(hints)
    call = call or _mlx_default_call

    def verify_fn(config, tensors, inputs, options):
        import mlx.core as mx
        from mlx.utils import tree_flatten, tree_unflatten

        from impl_mlx.convert import to_mx, to_numpy

        plan = _Plan("mlx_module", layout, config, inputs, options, accepts, self_attention)
        module = factory(plan.config)
        state = plan.state(tensors, hints)
        parameters = dict(tree_flatten(module.parameters()))
        plan.check_parameters(state, {k: tuple(v.shape) for k, v in parameters.items()})
        names = list(state)
        module.update(tree_unflatten([(k, to_mx(state[k])) for k in names]))
        module.train(bool(options.get("training")))
        arrays = {n: to_mx(v) for n, v in inputs.items()}

        def run(q, k, v, *params):
            module.update(tree_unflatten(list(zip(names, params))))
            return _split(call(module, _call_inputs(plan, {**arrays, "query": q, "key": k, "value": v}), options))

        qkv = [arrays[n] for n in QKV]
        params = [to_mx(state[k]) for k in names]
        output, weights = run(*qkv, *params)
        grads_qkv = grads_params = None
        if plan.cotangent is not None:
            _, got = mx.vjp(lambda *primals: [run(*primals)[0]], qkv + params, [to_mx(plan.cotangent)])
            grads_qkv = {n: to_numpy(g) for n, g in zip(QKV, got[:3])}
            grads_params = {k: to_numpy(g) for k, g in zip(names, got[3:])}
        return plan.answer(to_numpy(output), None if weights is None else to_numpy(weights), grads_qkv, grads_params,
                           hints)

    return verify_fn
