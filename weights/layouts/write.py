"""Canonical -> state: from_canonical's work, what a layout cannot express, and RoPE's pairing.

What a layout cannot express: from_canonical raises ValueError naming the
field and value; the same rules shape-check to_canonical. Each family
module's docstring lists its layouts' limits.

The decoders (hf-llama, hf-gpt-neox, hf-gptj, meta-llama): their config file
is required (hf_config: config.json, Meta's params.json): RoPE, windows,
softcap, QK-norm and sinks live only there (docs/porting-modern.md says what
each model's fields mean). Each stores RoPE for one pairing (half-split:
hf-llama, hf-gpt-neox; interleaved: hf-gptj, meta-llama); from_canonical
permutes the q and k features of each head of a config in the other
pairing (repair_pairing), so the written block computes the same numbers.
from_canonical with hf_config writes what that config file's model stores
(Gemma's w, phi3's fused qkv_proj, Qwen3-Next's gated q_proj, Gemma 4's k = v
k_proj alone) and checks the block reads back under
it with the same config.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..config import AttentionConfig
from ..format import validate_tensors
from .locate import _expand, _Place
from .read import _per_head_norm, _qkv_rows, to_canonical
from .table import (
    BIAS_FLAG,
    FROM_HINTS,
    HEADS,
    LINEAR,
    Catalogue,
    Layout,
    Row,
    Table,
    _check_hints,
    _check_int,
    _load_hf_config,
    _names_hint,
)

# -- RoPE's pairing ----------------------------------------------------------------------


def _pairing_permutation(head_dim: int, rotary_dim: int, to_interleaved: bool) -> np.ndarray:
    """Feature order that moves RoPE's pairs between the two conventions inside each head.

    new[..., j] = old[..., perm[j]]. Interleaved -> half-split takes the even features of the rotary
    part, then the odd ones (pair (2i, 2i+1) becomes (i, i + R/2), the same frequency i): the
    permutation Hugging Face's convert_llama_weights_to_hf applies to Meta's wq and wk rows. The
    features past rotary_dim stay where they are."""
    half = np.concatenate([np.arange(0, rotary_dim, 2), np.arange(1, rotary_dim, 2),
                           np.arange(rotary_dim, head_dim)])
    return np.argsort(half) if to_interleaved else half


def repair_pairing(config: AttentionConfig, tensors: Mapping[str, np.ndarray], interleaved: bool):
    """(config, tensors) with RoPE in the pairing `interleaved`, computing the same numbers: q and k
    features (kernels, biases, norm tensors) permuted alike inside each head, which leaves every
    q . k unchanged, and the pairs RoPE turns become the other convention's pairs."""
    if config.rope is None or config.rope.interleaved == interleaved:
        return config, dict(tensors)
    perm = _pairing_permutation(config.head_dim, config.rope.rotary_dim, interleaved)
    out = dict(tensors)
    for name in ("query.kernel", "query.bias", "key.kernel", "key.bias", "query.norm.scale", "query.norm.bias",
                 "key.norm.scale", "key.norm.bias"):
        if name in out:
            out[name] = np.array(np.asarray(out[name])[..., perm], order="C", copy=True)  # last axis: H
    rope = dataclasses.replace(config.rope, interleaved=interleaved)
    return config.replace(rope=rope), out


# -- canonical -> state ----------------------------------------------------------------

def cannot_express(catalogue: Catalogue, layout: str, config: AttentionConfig, /, *,
                   table: Table | None = None) -> list[str]:
    """weights.layouts.cannot_express over `catalogue`'s layouts."""
    lay = catalogue.get(layout)
    table = table or _pick_table(lay, config)
    problems = []
    extras = {extra.canonical for extra in lay.extras}
    if not (lay.extras or lay.pairing):
        pass  # the plain layouts predate the modern tensors; they write the projections they hold
    elif config.qk_norm is not None and "query.norm.scale" not in extras:
        problems.append(f"qk_norm={config.qk_norm.to_dict()} ({lay.id} holds no QK-norm tensors)")
    elif config.qk_norm is not None and config.qk_norm.type != "rms" and not (
            config.qk_norm.per_head and "query.norm.bias" in lay.derived):  # hf-llama: Cohere's per-head LayerNorm
        problems.append(f"qk_norm.type={config.qk_norm.type!r} ({lay.id} stores RMS-norm scales only, no norm bias)")
    if (lay.extras or lay.pairing) and config.use_sinks and "sinks" not in extras:
        problems.append(f"use_sinks=True ({lay.id} holds no sinks tensor)")
    shapes = config.tensor_shapes()
    held = {part for row in table.rows for part in row.parts}
    if (lay.extras or lay.pairing) and config.output_gate is not None and "gate.kernel" not in held:
        problems.append(f"output_gate={config.output_gate.to_dict()} ({lay.id}'s table "
                        f"'{table.note}' holds no gate)")
    for row in table.rows:
        absent = [part for part in row.parts if part not in shapes]
        if not row.is_bias and absent:
            problems.append(f"no {', '.join(absent)} ({row.key} holds {' + '.join(row.parts)}: {table.note})")
    for tie in table.ties:
        value = getattr(config, tie.field)
        target = math.prod(getattr(config, f) for f in tie.equals.split("*"))
        if value != target:
            shown = f"{tie.equals} = {target}" if "*" in tie.equals else f"{tie.equals}={target}"
            problems.append(f"{tie.field}={value} (needs {tie.field} == {shown}: {tie.why})")
    flags = {name: getattr(config, flag) for name, flag in BIAS_FLAG.items()}
    if lay.bias == "required":
        problems += [f"{BIAS_FLAG[n]}=False ({lay.bias_why})" for n, on in flags.items() if not on]
    elif lay.bias == "all" and len(set(flags.values())) > 1:
        off = [BIAS_FLAG[n] for n, on in flags.items() if not on]
        problems.append(f"{', '.join(f'{f}=False' for f in off)} with other biases on ({lay.bias_why})")
    for row in table.rows:
        has = {p: flags[p] if p in flags else p in shapes for p in row.parts}  # gate.bias: output_gate.bias
        if row.is_bias and len(row.parts) > 1 and len(set(has.values())) > 1:
            shown = ", ".join(f"{BIAS_FLAG.get(p, p)}={has[p]}" for p in row.parts)
            problems.append(f"{shown} ({row.key} holds the {' and '.join(p.split('.')[0] for p in row.parts)} "
                            "biases together)")
    if config.differential is not None and "differential.lambda_q1" not in held | extras:
        problems.append(f"differential={config.differential.to_dict()} ({lay.id} holds no differential.lambda_* "
                        "tensors; hf-llama does, for diffllama)")
    if config.indexer is not None and not any(part.startswith("indexer.") for part in held | extras):
        problems.append(f"indexer ({lay.id} holds no indexer.* tensors; weights.layouts.indexer converts "
                        "transformers' Indexer modules, and a weights file holds them)")
    return problems


def _pick_table(layout: Layout, config: AttentionConfig) -> Table:
    for table in layout.tables:  # a table made for the config (its `when` accepts it) before a general one
        if table.when is not None and table.when(config):
            return table
    for table in layout.tables:
        if table.when is None:
            return table
    raise AssertionError(f"{layout.id}: no table accepts the config")  # the last table has no `when`


def from_canonical(catalogue: Catalogue, layout: str, config: AttentionConfig, tensors: Mapping[str, np.ndarray], /,
                   **hints: Any) -> dict[str, np.ndarray]:
    """weights.layouts.from_canonical over `catalogue`'s layouts."""
    lay = catalogue.get(layout)
    _check_hints("from_canonical", lay, hints, FROM_HINTS)
    hints = {k: v for k, v in hints.items() if v is not None}
    if not isinstance(config, AttentionConfig):
        raise ValueError(f"config must be an AttentionConfig: got {type(config).__name__}")
    validate_tensors(config, tensors, source="canonical tensors")
    prefix = hints.get("prefix") or ""
    if not isinstance(prefix, str):
        raise ValueError(f"prefix must be a string: got {prefix!r}")
    layer = _check_int("layer", hints["layer"]) if hints.get("layer") is not None else (0 if lay.scope else None)
    hf_config = _load_hf_config(hints.get("hf_config"))
    hf = lay.hf(hf_config, layer) if hf_config is not None else {}
    if lay.pairing:  # config.json may name the model's own pairing (hf-llama: llama4, cohere)
        config, tensors = repair_pairing(config, tensors, hf.get("pairing", lay.pairing) == "interleaved")
    table = lay.tables[hf["table"]] if "table" in hf else _pick_table(lay, config)
    problems = cannot_express(catalogue, lay.id, config, table=table)
    problems += [f"{target} != {source} ({table.note})" for target, source in table.shared
                 if target in tensors and not np.array_equal(tensors[target], tensors[source])]
    if problems:
        raise ValueError(f"{lay.id} cannot express " + "; ".join(problems))
    roles = _names_hint(catalogue, lay, hints.get("names")) or lay.roles[0]
    place = _Place(table, roles, prefix, layer)
    state: dict[str, np.ndarray] = {}
    for key, row, head in _expand(lay, place, config.num_heads):
        if not all(part in tensors for part in row.parts):
            continue  # a bias the config does not have
        state[key] = _scatter(row, head, [tensors[p] for p in row.parts])
    if lay.qkv_per_head:
        state = _qkv_rows(state, [place.base(lay) + key for key in lay.qkv_per_head], config.num_heads,
                          to_blocks=False, kv_heads=config.num_kv_heads)
    for extra in lay.extras:
        if extra.canonical in tensors:
            value = np.asarray(tensors[extra.canonical])
            value = value if _per_head_norm(config, extra.canonical) else value.reshape(-1)
            if hf.get("norm_offset") and ".norm." in extra.canonical:
                value = value - value.dtype.type(hf["norm_offset"])  # Gemma stores w of its (1 + w)
            key = (hf.get("extra_keys") or {}).get(extra.canonical, extra.key)  # a model's own name (llama_knobs)
            state[place.base(lay) + key] = np.array(value, order="C", copy=True)
    derived = [name for name in lay.derived if name in tensors]
    if derived and hf_config is None:
        raise ValueError(f"hf_config: {lay.id} stores no {', '.join(derived)} (config.json's rule gives them): "
                         "pass the destination's config.json: got None")
    if hf_config is not None:  # the file must mean, under its config file, what config says
        read, read_tensors = to_canonical(catalogue, lay.id, state, hf_config=hf_config, layer=layer, prefix=prefix)
        differ = _behaviour_differences(config, read)
        differ += [f"{name}={np.asarray(tensors[name]).tolist()} (config file gives "
                   f"{read_tensors[name].tolist()})" for name in derived
                   if name in read_tensors and not np.array_equal(read_tensors[name], tensors[name])]
        if differ:
            raise ValueError(f"hf_config disagrees with config for {lay.id} block {layer}: " + "; ".join(differ))
    return state


def _behaviour_differences(want: AttentionConfig, got: AttentionConfig) -> list[str]:
    out = []
    for field, value in want.to_dict().items():
        if field in ("dropout", "masked_row", "scale"):
            continue
        if got.to_dict()[field] != value:
            out.append(f"{field}={value!r} (config file gives {got.to_dict()[field]!r})")
    if not math.isclose(want.effective_scale, got.effective_scale, rel_tol=1e-12):
        out.append(f"scale={want.effective_scale!r} (config file gives {got.effective_scale!r})")
    return out


def _scatter(row: Row, head: int | None, arrays: list[np.ndarray]) -> np.ndarray:
    """Canonical tensors -> one foreign array: flatten, concatenate, transpose
    (or take one head's slice)."""
    if row.form == HEADS:
        return np.array(arrays[0], order="C", copy=True)
    name = row.parts[0]
    if head is not None:
        flat = arrays[0][:, head, :] if name.endswith(".kernel") else arrays[0][head]  # (in, width) / (width,)
    elif row.head_major:  # (in, heads, width) each -> (in, heads, sum(widths)) -> (in, heads*sum(widths))
        joined = np.concatenate(arrays, axis=-1)
        flat = joined.reshape(*joined.shape[:-2], -1)
    else:
        flats = []
        for part, array in zip(row.parts, arrays):
            if part == "output.kernel":
                flats.append(array.reshape(-1, array.shape[-1]))  # (N*V, O)
            elif part.endswith(".kernel"):
                flats.append(array.reshape(array.shape[0], -1))  # (in, heads*width)
            else:
                flats.append(array.reshape(-1))  # (heads*width,)
        flat = flats[0] if len(flats) == 1 else np.concatenate(flats, axis=-1)
    if row.form == LINEAR and flat.ndim == 2:
        flat = flat.T  # (out, in)
    return np.array(flat, order="C", copy=True)


def mapping(catalogue: Catalogue, layout: str, config: AttentionConfig, /, **hints: Any) -> dict[str, tuple[str, ...]]:
    """weights.layouts.mapping over `catalogue`'s layouts."""
    state = from_canonical(catalogue, layout, config, _zeros(config), **hints)
    lay = catalogue.get(layout)
    hints = {k: v for k, v in hints.items() if v is not None}
    roles = _names_hint(catalogue, lay, hints.get("names")) or lay.roles[0]
    layer = hints.get("layer", 0 if lay.scope else None)
    place = _Place(_pick_table(lay, config), roles, hints.get("prefix", ""), layer)
    return {key: row.parts for key, row, _ in _expand(lay, place, config.num_heads) if key in state}


def _zeros(config: AttentionConfig, dtype="float32") -> dict[str, np.ndarray]:
    return {name: np.zeros(shape, dtype=dtype) for name, shape in config.tensor_shapes().items()}
