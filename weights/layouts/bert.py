"""The hf-bert layout: a BERT-family checkpoint's self-attention, and its config.json reader.

| layout            | foreign key (defaults; {role} names overridable)  | canonical                  | form   |
|-------------------|---------------------------------------------------|----------------------------|--------|
| hf-bert           | [P]encoder.layer.{L}.attention.self.query.weight  | query (key, value alike)   | linear |
|                   | [P]encoder.layer.{L}.attention.output.dense.weight| output                     | linear |

What it cannot express: every dimension is hidden_size = num_heads*head_dim,
no GQA, all four biases present.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .table import _HIDDEN_TIES, LINEAR, Layout, R, Table


def _bert_config(cfg: Mapping[str, Any], layer: int | None = None) -> dict[str, Any]:
    position = cfg.get("position_embedding_type", "absolute")
    if position != "absolute":
        raise ValueError(
            f"hf_config: position_embedding_type={position!r} adds relative-position terms to the logits, "
            "which the canonical config cannot express; only 'absolute' converts"
        )
    return {"num_heads": cfg.get("num_attention_heads"), "hidden": cfg.get("hidden_size"),
            "dropout": cfg.get("attention_probs_dropout_prob"), "scale": None, "scale_by_layer": False}


FAMILY = (
    Layout(
        "hf-bert", "a BERT-family checkpoint's self-attention: [prefix]encoder.layer.{L}.attention."
        "self.{query,key,value} and output.dense nn.Linears; hints layer, num_heads or hf_config",
        sep=".", bias="required", bias_why="BERT's Linear layers always have biases",
        scope="encoder.layer.{layer}.attention.", select=True, hf=_bert_config,
        tables=(Table((
            R("self.query.weight", "query.kernel", LINEAR), R("self.query.bias", "query.bias", LINEAR),
            R("self.key.weight", "key.kernel", LINEAR), R("self.key.bias", "key.bias", LINEAR),
            R("self.value.weight", "value.kernel", LINEAR), R("self.value.bias", "value.bias", LINEAR),
            R("output.dense.weight", "output.kernel", LINEAR), R("output.dense.bias", "output.bias", LINEAR),
        ), ties=_HIDDEN_TIES),),
    ),
)
