"""A layout's state dict (name -> NumPy array) from and to files.

The file kind follows the extension:

    .safetensors          any layout (weights.read_safetensors, the strict reader)
    .pt .pth .bin         torch: torch.load(weights_only=True, map_location="cpu") only.
                          A file that pickles code or any object other than
                          tensors and plain containers is refused with one line;
                          nothing in it is ever run. Nested dicts (and lists)
                          are flattened with "." ({"model": {"attn.w": t}} ->
                          "model.attn.w"); non-tensor leaves (an epoch number)
                          are dropped. Written as one flat dict of tensors.
    .weights.h5 .h5       Keras 3 weights files, read and written with h5py (no
                          Keras import). Keras stores a layer's variables by
                          attribute path and position, `WQ/vars/0`; the reader
                          names position 0 `kernel` and 1 `bias` (the order of
                          Dense and EinsumDense), so `WQ/vars/0` reads as
                          `WQ/kernel`. keras.layers.MultiHeadAttention keeps
                          its sublayers under the attributes query_dense,
                          key_dense, value_dense, output_dense but names its
                          variables query/..., attention_output/...; with
                          layout="keras-mha" those attributes are renamed both
                          ways, so a file and `layer.weights` give the same keys.
                          bfloat16 is stored as Keras does: 2-byte opaque data
                          with the attribute dtype="bfloat16". A written file
                          loads with keras.src.saving.saving_lib.load_weights_only
                          (a layer) or Model.load_weights (prefix "layers/NAME/").
    .msgpack              Flax: flax.serialization.msgpack_restore /
                          msgpack_serialize; nested dicts flattened with "/".
    a directory           a Hugging Face checkpoint folder: model.safetensors,
                          pytorch_model.bin, or their sharded *.index.json.

Frameworks (torch, h5py, flax) are imported only for their own kind; a
missing one is a one-line error saying what to install. Writes are atomic
(weights.atomic.write_bytes_atomic: the old file or the new one, never a
mix) and refuse to replace an existing file unless overwrite=True.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from conformance.io import write_arrays
from weights import WeightsFormatError, read_safetensors
from weights.atomic import write_bytes_atomic

KINDS = {
    "safetensors": (".safetensors",),
    "torch": (".pt", ".pth", ".bin"),
    "keras-h5": (".weights.h5", ".h5"),
    "flax-msgpack": (".msgpack",),
}
INSTALL = {
    "torch": "PyTorch: pip install 'mha-conformance[torch]' (CPU: add -c constraints/cpu.txt)",
    "h5py": "h5py, which Keras installs: pip install 'mha-conformance[tf]'",
    "flax": "Flax: pip install 'mha-conformance[jax]'",
}
# keras.layers.MultiHeadAttention: sublayer attribute (file) -> variable path (layer.weights, the layout).
KERAS_MHA_ATTRIBUTES = {
    "query_dense": "query", "key_dense": "key", "value_dense": "value", "output_dense": "attention_output",
}
KERAS_VARIABLES = ("kernel", "bias")  # Dense / EinsumDense variable order: vars/0, vars/1
HF_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


class FrameworkMissing(ValueError):
    """A file kind whose framework is not installed (one line, says what to install)."""


def _require(module: str, path, argument: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise FrameworkMissing(
            f"{argument}={path}: reading or writing this kind of file needs {INSTALL[module]}"
        ) from None


def file_kind(path: str | os.PathLike, *, argument: str = "path") -> str:
    """The kind of file `path` names, by extension; a directory is "hf-dir"."""
    path = Path(path)
    if path.is_dir():
        return "hf-dir"
    name = path.name.lower()
    for kind, suffixes in KINDS.items():
        if name.endswith(suffixes):
            return kind
    accepted = ", ".join(s for suffixes in KINDS.values() for s in suffixes)
    raise ValueError(f"{argument} must end in one of {accepted} (or be a checkpoint folder): got {str(path)!r}")


# -- reading ---------------------------------------------------------------------------

def read_state(path: str | os.PathLike, *, layout: str | None = None, argument: str = "SRC") -> dict[str, np.ndarray]:
    """The flat state dict stored in `path` (see the module docstring)."""
    kind = file_kind(path, argument=argument)
    path = Path(path)
    if kind != "hf-dir" and not path.is_file():
        raise ValueError(f"{argument}: no such file: {str(path)!r}")
    if kind == "safetensors":
        return read_safetensors(path)[1]
    if kind == "torch":
        return _read_torch(path, argument)
    if kind == "keras-h5":
        return _read_h5(path, layout, argument)
    if kind == "flax-msgpack":
        return _read_msgpack(path, argument)
    return _read_hf_dir(path, argument)


def read_hf_config(path: str | os.PathLike) -> dict[str, Any] | None:
    """The config.json of a Hugging Face checkpoint (in the folder, or beside the file), or None."""
    path = Path(path)
    candidate = (path if path.is_dir() else path.parent) / "config.json"
    if not candidate.is_file():
        return None
    try:
        data = json.loads(candidate.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WeightsFormatError(f"{candidate}: not a readable JSON config: {err}") from None
    if not isinstance(data, dict):
        raise WeightsFormatError(f"{candidate}: config.json must hold a JSON object")
    return data


def torch_to_numpy(tensor) -> np.ndarray:
    """Bit-exact: bfloat16 goes through its 16-bit pattern (NumPy has no bfloat16 of its own)."""
    import torch

    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    return tensor.numpy().copy()


def numpy_to_torch(array: np.ndarray):
    import torch

    array = np.ascontiguousarray(array)
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    blocked = [line for line in lines if "GLOBAL" in line or "global" in line.lower()]
    return (blocked or lines or [type(err).__name__])[0]


def _read_torch(path: Path, argument: str) -> dict[str, np.ndarray]:
    torch = _require("torch", path, argument)
    import pickle

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if "Weights only load failed" in str(err):
            raise WeightsFormatError(
                f"{path}: refused: the file pickles code or objects other than tensors, and it is only ever "
                f"read with torch.load(weights_only=True) ({_first_line(err)})"
            ) from None
        raise WeightsFormatError(f"{path}: not a torch file: {_first_line(err)}") from None
    except Exception as err:  # torch raises RuntimeError, KeyError, EOFError ... on a damaged file
        raise WeightsFormatError(f"{path}: not a torch file: {type(err).__name__}: {_first_line(err)}") from None
    if not isinstance(obj, Mapping):
        raise WeightsFormatError(f"{path}: holds a {type(obj).__name__}, not a state dict")
    flat: dict[str, np.ndarray] = {}
    _flatten(obj, "", ".", flat, lambda v: torch_to_numpy(v) if isinstance(v, torch.Tensor) else None)
    return flat


def _flatten(obj, prefix: str, sep: str, out: dict, leaf) -> None:
    items = obj.items() if isinstance(obj, Mapping) else enumerate(obj)
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, (Mapping, list, tuple)):
            _flatten(value, name + sep, sep, out, leaf)
            continue
        array = leaf(value)
        if array is not None:
            out[name] = array


def _read_h5(path: Path, layout: str | None, argument: str) -> dict[str, np.ndarray]:
    h5py = _require("h5py", path, argument)
    rename = KERAS_MHA_ATTRIBUTES if layout == "keras-mha" else {}
    arrays: dict[str, np.ndarray] = {}
    try:
        handle = h5py.File(path, "r")
    except OSError as err:
        raise WeightsFormatError(f"{path}: not an HDF5 (.weights.h5) file: {_first_line(err)}") from None
    with handle:
        datasets: list[tuple[str, Any]] = []
        handle.visititems(lambda name, obj: datasets.append((name, obj)) if isinstance(obj, h5py.Dataset) else None)
        for name, dataset in datasets:
            parts = name.split("/")
            if len(parts) >= 2 and parts[-2] == "vars" and parts[-1].isdigit():
                index = int(parts[-1])
                groups = parts[:-2]
                if groups and groups[-1] in rename:
                    groups[-1] = rename[groups[-1]]
                variable = KERAS_VARIABLES[index] if index < len(KERAS_VARIABLES) else f"vars/{index}"
                key = "/".join(groups + [variable])
            else:
                key = name
            data = np.asarray(dataset[()])
            dtype_attr = dataset.attrs.get("dtype")
            if isinstance(dtype_attr, bytes):
                dtype_attr = dtype_attr.decode()
            if dtype_attr == "bfloat16":
                data = data.view(ml_dtypes.bfloat16)
            arrays[key] = data
    return arrays


def _read_msgpack(path: Path, argument: str) -> dict[str, np.ndarray]:
    serialization = _require("flax", path, argument).serialization
    try:
        tree = serialization.msgpack_restore(path.read_bytes())
    except Exception as err:  # msgpack raises ValueError and its own ExtraData/FormatError types
        raise WeightsFormatError(f"{path}: not a Flax msgpack file: {_first_line(err)}") from None
    if not isinstance(tree, Mapping):
        raise WeightsFormatError(f"{path}: holds a {type(tree).__name__}, not a dict of parameters")
    flat: dict[str, np.ndarray] = {}
    _flatten(tree, "", "/", flat, lambda v: v if isinstance(v, np.ndarray) else None)
    return flat


def _read_hf_dir(path: Path, argument: str) -> dict[str, np.ndarray]:
    for name in HF_FILES:
        candidate = path / name
        if not candidate.is_file():
            continue
        if not name.endswith(".index.json"):
            return read_state(candidate, argument=argument)
        try:
            index = json.loads(candidate.read_text(encoding="utf-8"))
            shards = sorted(set(index["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise WeightsFormatError(f"{candidate}: not a checkpoint index (needs a weight_map): {err}") from None
        state: dict[str, np.ndarray] = {}
        for shard in shards:
            shard_path = path / shard
            if Path(shard).is_absolute() or ".." in Path(shard).parts:
                raise WeightsFormatError(f"{candidate}: shard {shard!r} lies outside the checkpoint folder")
            state.update(read_state(shard_path, argument=argument))
        return state
    raise ValueError(f"{argument}={str(path)!r} is a folder without {', '.join(HF_FILES)}")


# -- writing ---------------------------------------------------------------------------

def write_state(
    path: str | os.PathLike,
    state: Mapping[str, np.ndarray],
    *,
    layout: str | None = None,
    overwrite: bool = False,
    argument: str = "DST",
) -> None:
    """Write a flat state dict atomically in the kind `path`'s extension names."""
    kind = file_kind(path, argument=argument)
    if kind == "hf-dir":
        raise ValueError(
            f"{argument}={str(path)!r} is a folder; name a file (.safetensors, .pt, .weights.h5, .msgpack)"
        )
    path = Path(path)
    if not overwrite and path.exists():
        raise FileExistsError(f"{path} exists; pass overwrite=True (CLI: --overwrite) to replace it")
    bad = [k for k, v in state.items() if not isinstance(v, np.ndarray)]
    if bad:
        raise ValueError(f"state values must be numpy arrays: {', '.join(bad)} are not")
    if kind == "safetensors":
        write_arrays(path, state, overwrite=overwrite, metadata={"layout": layout} if layout else None)
        return
    if kind == "torch":
        torch = _require("torch", path, argument)
        buffer = io.BytesIO()
        torch.save({k: numpy_to_torch(v) for k, v in state.items()}, buffer)
        data = buffer.getvalue()
    elif kind == "keras-h5":
        data = _h5_bytes(path, state, layout, argument)
    else:
        serialization = _require("flax", path, argument).serialization
        data = serialization.msgpack_serialize(_unflatten(state, "/", argument))
    write_bytes_atomic(path, data, overwrite=overwrite)


def _unflatten(state: Mapping[str, np.ndarray], sep: str, argument: str) -> dict:
    tree: dict = {}
    for key, value in state.items():
        *groups, leaf = key.split(sep)
        node = tree
        for group in groups:
            node = node.setdefault(group, {})
            if not isinstance(node, dict):
                raise ValueError(f"{argument}: key {key!r} nests under another tensor's name")
        if leaf in node:
            raise ValueError(f"{argument}: key {key!r} is both a tensor and a group")
        node[leaf] = np.ascontiguousarray(value)
    return tree


def _h5_bytes(path: Path, state: Mapping[str, np.ndarray], layout: str | None, argument: str) -> bytes:
    h5py = _require("h5py", path, argument)
    rename = {v: k for k, v in KERAS_MHA_ATTRIBUTES.items()} if layout == "keras-mha" else {}
    not_keras = [k for k in state if "/" not in k or k.rsplit("/", 1)[1] not in KERAS_VARIABLES]
    if not_keras:
        raise ValueError(
            f"{argument}: a .weights.h5 file stores Keras variables GROUP/kernel and GROUP/bias by position; "
            f"cannot store {', '.join(not_keras)} (write this layout to .safetensors, .pt or .msgpack)"
        )
    buffer = io.BytesIO()
    with h5py.File(buffer, "w") as handle:
        for key, value in state.items():
            groups, variable = key.rsplit("/", 1)
            groups = groups.split("/")
            groups[-1] = rename.get(groups[-1], groups[-1])
            vars_group = handle.require_group("/".join(groups) + "/vars")
            index = str(KERAS_VARIABLES.index(variable))
            value = np.ascontiguousarray(value)
            if value.dtype == ml_dtypes.bfloat16:
                dataset = vars_group.create_dataset(index, data=value.view(np.dtype("V2")))
                dataset.attrs["dtype"] = "bfloat16"
            else:
                vars_group.create_dataset(index, data=value)
    return buffer.getvalue()
