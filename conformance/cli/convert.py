"""`mha convert`: weights from one layout to another, through the canonical tensors.

    mha convert --from LAYOUT --to LAYOUT SRC DST [--num-heads N] [--layer I|all]
                [--names NAMES] [--to-names NAMES] [--prefix P] [--to-prefix P]
                [--ignore PATTERN]... [--scale S] [--dropout P] [--masked-row R]
                [--to-config FILE] [--indexer-scoring plain|fp8_e4m3|fp8_e4m3:ue8m0] [--overwrite]

Layouts: weights.layouts.LAYOUTS (`canonical`, `torch-mha`, `torch-linears`,
`torch-fused-qkv`, `torch-per-head`, `keras-split-heads`, `keras-mha`,
`flax-linen-mha`, `flax-nnx-mha`, `hf-bert`, `hf-gpt2`, `hf-llama`, `meta-llama`). File kinds follow the
extension (conformance/cli/files.py): .safetensors, .pt/.pth/.bin (torch, read with
weights_only=True), .weights.h5 (Keras, via h5py), .msgpack (Flax); SRC may
also be a Hugging Face checkpoint folder. `canonical` is the common format
itself, always a .safetensors file written by weights.save (config and
checksums in its header) and read by weights.load.

Options:
  --num-heads N     heads, for layouts that flatten them (torch-*, keras-split-heads;
                    hf-* read it from config.json beside SRC when present).
  hf-llama reads RoPE, windows, QK-norm, softcap, sinks and the scale from the
  config.json beside SRC (required); meta-llama from Meta's params.json beside SRC.
  --layer I         hf-*, meta-llama: the block read (--from) or written (--to); default: the
                    only block of SRC, block 0 when writing.
  --layer all       --from hf-*/meta-llama: every block, one DST file each. DST is
                    then a pattern containing "{layer}" (out/bert-{layer}.safetensors;
                    its extension picks the file kind), or else a folder (created if
                    missing, its parent must exist) that receives
                    layer_00.safetensors, layer_01.safetensors, ... (indices
                    zero-padded to the width of the last one, so names sort). Every
                    block is converted and every destination checked before the first
                    file is written; each file is written atomically.
  --names NAMES     module names of the --from layout, or of the --to layout when
                    --from takes none: "W_q,W_k,W_v,fc" (role order, see
                    weights.layouts.ROLES) or "query=W_q,output=fc".
  --to-names NAMES  module names of the --to layout (when both take names).
  --prefix P        what precedes SRC's keys ("bert.", "attn.", "params/"); detected
                    when left out. --to-prefix: prepended to DST's keys.
  --ignore PATTERN  SRC keys to skip (fnmatch, repeatable): buffers, optimizer state.
  --scale, --dropout, --masked-row
                    behaviour fields no state dict holds, for the canonical config.
  --to-config FILE  --to hf-llama / meta-llama: the destination model's config.json
                    (params.json): Gemma's norms are written as w of its (1 + w), phi3's
                    q, k, v fused into qkv_proj, and the written block is read back
                    under FILE and must mean what the weights do (RoPE, windows, scale...).
                    Between meta-llama and hf-llama the q and k rows are permuted
                    (interleaved <-> half-split RoPE pairs), so the numbers stay the same.
  --indexer-scoring plain|fp8_e4m3|fp8_e4m3:ue8m0
                    the lightning indexer's scoring precision (config.indexer.scoring_precision,
                    fp8_scale_format) of every block read that has an indexer, replacing what the
                    reader set: fp8_e4m3 scores as DeepSeek's own inference code does (Hadamard,
                    e4m3; :ue8m0 its power-of-two scales), plain in the storage dtype as
                    transformers' ports do. `deepseek` with DeepSeek's ModelArgs config reads
                    fp8_e4m3 (:ue8m0 when scale_fmt is set); hf-deepseek reads plain.
  --overwrite       replace existing DST files (otherwise refused).

Errors are ValueError / WeightsFormatError with one line naming the argument
and what was received; the `mha` main turns them into one-line errors, exit 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import weights
from weights import layouts
from weights.format import WeightsFormatError
from weights.layouts import indexer as indexer_layouts

from . import files

HF_LAYOUTS = tuple(layout for layout in layouts.LAYOUTS if layouts.spec(layout).scope)  # hf-*, meta-llama


def _config_file(src: str, layout: str):
    """The config file a layout reads beside SRC: params.json for Meta's checkpoints, else config.json."""
    if layout != "meta-llama":
        return files.read_hf_config(src)
    path = Path(src)
    candidate = (path if path.is_dir() else path.parent) / "params.json"
    if not candidate.is_file():
        return None
    return layouts.load_config_file(str(candidate))


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `convert` on an argparse subparsers object; its handler is `run` (set as `func`)."""
    doc_lines = __doc__.splitlines()
    parser = subparsers.add_parser(
        "convert", help="convert weights between layouts (torch, Keras, Flax, Hugging Face, canonical)",
        description=doc_lines[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="layouts:\n" + "\n".join(f"  {k:<18} {v}" for k, v in layouts.LAYOUTS.items()),
    )
    parser.add_argument("--from", dest="from_layout", required=True, metavar="LAYOUT", help="layout of SRC")
    parser.add_argument("--to", dest="to_layout", required=True, metavar="LAYOUT", help="layout of DST")
    parser.add_argument("src", metavar="SRC", help="file (or Hugging Face checkpoint folder) to read")
    parser.add_argument("dst", metavar="DST", help="file to write (with --layer all: a {layer} pattern or a folder)")
    parser.add_argument("--num-heads", type=int, default=None, metavar="N", help="number of query heads")
    parser.add_argument("--layer", default=None, metavar="I|all", help="hf-* block index, or all")
    parser.add_argument("--names", default=None, metavar="NAMES", help="module names of the layout that takes them")
    parser.add_argument("--to-names", default=None, metavar="NAMES", help="module names of the --to layout")
    parser.add_argument("--prefix", default=None, metavar="P", help="prefix of SRC's keys (detected if absent)")
    parser.add_argument("--to-prefix", default=None, metavar="P", help="prefix for DST's keys")
    parser.add_argument("--ignore", action="append", default=[], metavar="PATTERN", help="SRC keys to skip")
    parser.add_argument("--scale", type=float, default=None, help="logit scale (default 1/sqrt(head_dim))")
    parser.add_argument("--dropout", type=float, default=None, help="attention dropout probability")
    parser.add_argument("--masked-row", default=None, choices=weights.MASKED_ROW_POLICIES,
                        help="what a query row with no allowed key yields")
    parser.add_argument("--to-config", default=None, metavar="FILE",
                        help="--to hf-llama/meta-llama: the destination's config.json (params.json)")
    parser.add_argument("--indexer-scoring", default=None, metavar="PRECISION",
                        help="the indexer's scoring precision: plain, fp8_e4m3 or fp8_e4m3:ue8m0 (DeepSeek's)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing DST files")
    parser.set_defaults(func=run)
    return parser


def _layout_arg(flag: str, value) -> str:
    if value not in layouts.LAYOUTS:
        raise ValueError(f"{flag} must be one of {', '.join(layouts.LAYOUTS)}: got {value!r}")
    return value


def _layer_arg(value) -> int | str | None:
    if value is None or value == "all":
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    raise ValueError(f"--layer must be a block index (0, 1, ...) or 'all': got {value!r}")


def _names(args, src: str, dst: str) -> tuple[str | None, str | None]:
    names, to_names = getattr(args, "names", None), getattr(args, "to_names", None)
    src_named, dst_named = src in layouts.ROLES, dst in layouts.ROLES
    if names is not None and not (src_named or dst_named):
        raise ValueError(f"--names applies to layouts {', '.join(layouts.ROLES)}: got --from {src} --to {dst}")
    if to_names is not None and not dst_named:
        raise ValueError(f"--to-names applies to layouts {', '.join(layouts.ROLES)}: got --to {dst}")
    if src_named:
        return names, to_names
    return None, names if to_names is None else to_names


def _destinations(dst: str, layer_indices: list[int | None], all_layers: bool) -> list[Path]:
    if all_layers:
        if "{layer}" in dst:
            return [Path(dst.replace("{layer}", str(i))) for i in layer_indices]
        folder = Path(dst)
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"DST with --layer all must be a folder or contain {{layer}}: got existing file {dst!r}")
        if not folder.parent.is_dir():
            raise ValueError(f"DST: the folder's parent {str(folder.parent)!r} does not exist")
        width = len(str(max(layer_indices)))
        return [folder / f"layer_{i:0{width}d}.safetensors" for i in layer_indices]
    (layer,) = layer_indices
    if "{layer}" in dst:
        if layer is None:
            raise ValueError(f"DST contains {{layer}} but no --layer was given: got {dst!r}")
        return [Path(dst.replace("{layer}", str(layer)))]
    return [Path(dst)]


def _check_dst_kind(path: Path, dst_layout: str) -> None:
    kind = files.file_kind(path, argument="DST")
    if kind == "hf-dir":
        raise ValueError(f"DST is a folder; name a file (with --layer all: a folder or a {{layer}} pattern): "
                         f"got {str(path)!r}")
    if dst_layout == "canonical" and kind != "safetensors":
        raise ValueError(f"DST: canonical weights are a .safetensors file (weights.save): got {str(path)!r}")


def run(args) -> int:
    src_layout = _layout_arg("--from", getattr(args, "from_layout", None))
    dst_layout = _layout_arg("--to", getattr(args, "to_layout", None))
    layer = _layer_arg(getattr(args, "layer", None))
    src, dst = str(args.src), str(args.dst)
    overwrite = bool(getattr(args, "overwrite", False))
    num_heads = getattr(args, "num_heads", None)
    if num_heads is not None and (not isinstance(num_heads, int) or num_heads < 1):
        raise ValueError(f"--num-heads must be a positive integer: got {num_heads!r}")
    if layer == "all" and src_layout not in HF_LAYOUTS:
        raise ValueError(f"--layer all needs --from {' or '.join(HF_LAYOUTS)}: got --from {src_layout}")
    if layer is not None and src_layout not in HF_LAYOUTS and dst_layout not in HF_LAYOUTS:
        raise ValueError(f"--layer applies to {', '.join(HF_LAYOUTS)}: got --from {src_layout} --to {dst_layout}")
    names, to_names = _names(args, src_layout, dst_layout)
    to_config = getattr(args, "to_config", None)
    if to_config is not None:
        if dst_layout not in HF_LAYOUTS:
            raise ValueError(f"--to-config applies to --to {' or '.join(HF_LAYOUTS)}: got --to {dst_layout}")
        to_config = layouts.load_config_file(str(to_config))
    scoring = getattr(args, "indexer_scoring", None)
    if scoring is not None:  # a bad name is refused before anything is read
        indexer_layouts.parse_indexer_scoring(scoring, "--indexer-scoring")
    if layer != "all" or "{layer}" in dst:  # DST names a file kind: check it before reading anything
        _check_dst_kind(Path(dst.replace("{layer}", "0")), dst_layout)

    # 1. Read SRC into canonical tensors (one item per block with --layer all).
    if src_layout == "canonical":
        if files.file_kind(src, argument="SRC") != "safetensors":
            raise ValueError(f"SRC: canonical weights are a .safetensors file (weights.save): got {src!r}")
        if not Path(src).is_file():
            raise ValueError(f"SRC: no such file: {src!r}")
        config, tensors = weights.load(src)
        hinted = {"scale": args.scale, "dropout": args.dropout, "masked_row": args.masked_row}
        hinted = {k: v for k, v in hinted.items() if v is not None}
        items = [(layer if isinstance(layer, int) else None, config.replace(**hinted) if hinted else config, tensors)]
    else:
        state = files.read_state(src, layout=src_layout, argument="SRC")
        hints = {
            "num_heads": num_heads, "names": names, "prefix": getattr(args, "prefix", None),
            "ignore": list(getattr(args, "ignore", None) or ()) or None, "scale": getattr(args, "scale", None),
            "dropout": getattr(args, "dropout", None), "masked_row": getattr(args, "masked_row", None),
        }
        if src_layout in HF_LAYOUTS:
            hints["hf_config"] = _config_file(src, src_layout)
            if layer == "all":
                indices = layouts.layers(src_layout, state, prefix=hints["prefix"])
                if not indices:
                    raise WeightsFormatError(f"SRC={src}: no {src_layout} blocks found ({layouts.LAYOUTS[src_layout]})")
            else:
                indices = [layer]
        else:
            indices = [None]
        items = []
        for index in indices:
            extra = {"layer": index} if src_layout in HF_LAYOUTS else {}
            try:
                config, tensors = layouts.to_canonical(src_layout, state, **hints, **extra)
            except WeightsFormatError as err:
                guess = layouts.detect_layout(state)
                hint = f" (SRC looks like {guess})" if guess and guess != src_layout else ""
                raise WeightsFormatError(f"SRC={src}: {err}{hint}") from None
            items.append((index if index is not None else (layer if isinstance(layer, int) else None), config, tensors))

    if scoring is not None:  # every block with an indexer (GLM-5's shared layers have none: they take topk_indices)
        if all(config.indexer is None for _, config, _ in items):
            raise ValueError(f"--indexer-scoring applies to a block with an indexer (config.indexer): SRC={src} "
                             f"has none")
        items = [(index, indexer_layouts.with_indexer_scoring(config, scoring, "--indexer-scoring"), tensors)
                 for index, config, tensors in items]

    # 2. Destinations: all checked before anything is written.
    paths = _destinations(dst, [item[0] for item in items], layer == "all")
    for path in paths:
        _check_dst_kind(path, dst_layout)
    existing = [str(p) for p in paths if p.exists()]
    if existing and not overwrite:
        raise ValueError(f"DST exists: {', '.join(existing)}; pass --overwrite to replace")

    # 3. Convert every item in memory, then write.
    outputs = []
    for (index, config, tensors), path in zip(items, paths):
        if dst_layout == "canonical":
            outputs.append((path, config, tensors, None))
        else:
            to_hints = {"names": to_names, "prefix": getattr(args, "to_prefix", None)}
            if dst_layout in HF_LAYOUTS:
                to_hints["layer"] = index if index is not None else 0
                if to_config is not None:
                    to_hints["hf_config"] = to_config
            outputs.append((path, config, None, layouts.from_canonical(dst_layout, config, tensors, **to_hints)))
    if layer == "all" and "{layer}" not in dst:
        Path(dst).mkdir(exist_ok=True)
    for path, config, tensors, state in outputs:
        if state is None:
            metadata = {"converted_from": src_layout}
            weights.save(path, config, tensors, overwrite=overwrite, metadata=metadata)
        else:
            files.write_state(path, state, layout=dst_layout, overwrite=overwrite, argument="DST")
        dtype = weights.dtype_name(next(iter(tensors.values())).dtype) if tensors else \
            weights.dtype_name(next(iter(state.values())).dtype)
        print(f"wrote {path} ({dst_layout}; num_heads={config.num_heads}, head_dim={config.head_dim}, "
              f"query_dim={config.query_dim}, out_dim={config.out_dim}, {dtype})")
    return 0
