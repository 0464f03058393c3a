"""hf-llama's multimodal Qwen decoders: Qwen2-VL, Qwen2.5-VL and Qwen3-VL (their language model's attention).

| model_type              | text decoder as   | rope                                                         |
|-------------------------|-------------------|--------------------------------------------------------------|
| qwen2_vl, qwen2_5_vl    | qwen2 (q/k/v bias)| mrope_section (default 16, 24, 24), contiguous sections      |
| qwen3_vl                | qwen3 (q/k norms) | mrope_section (default 24, 20, 20), interleaved              |

The rows are hf-llama's ([prefix]layers.{L}.self_attn.{q,k,v,o}_proj, q_norm, k_norm; the prefix
model.language_model. in transformers 5.x checkpoints, model. in 4.x ones). config.json keeps the language
model in text_config (5.x) or at the top level (4.x, which wrote rope_scaling {"type": "mrope", ...}; transformers
reads that type as "default"). The sections and the defaults are transformers 5.23's: Qwen2VLRotaryEmbedding and
Qwen2_5_VLRotaryEmbedding read rope_parameters.get("mrope_section", [16, 24, 24]) and split the pairs into
contiguous sections (recomposition_frequencies), Qwen3VLTextRotaryEmbedding reads [24, 20, 20] by default and
always interleaves them (its mrope_interleaved key is not read); default_theta 1e6 (Qwen2-VL, Qwen2.5-VL) and 5e5
(Qwen3-VL). The positions are the caller's, (3, B, T), as the model's get_rope_index builds them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text")
_TEXT_DECODER = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3"}
_DEFAULT_SECTION = {"qwen2_vl": [16, 24, 24], "qwen2_5_vl": [16, 24, 24], "qwen3_vl": [24, 20, 20]}
_DEFAULT_THETA = {"qwen2_vl": 1000000.0, "qwen2_5_vl": 1000000.0, "qwen3_vl": 500000.0}


def layer_facts(cfg: Mapping[str, Any], layer: int | None,
                decoder_facts: Callable[[Mapping[str, Any], int | None], dict[str, Any]]) -> dict[str, Any]:
    """config.json of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL model -> block `layer`'s facts: its text decoder's
    (decoder_facts: hf-llama's reader of qwen2 / qwen3), the rope given its multimodal sections."""
    family = str(cfg.get("model_type")).removesuffix("_text")
    inner = cfg.get("text_config")
    text = {**cfg, **inner} if isinstance(inner, Mapping) else dict(cfg)  # 5.x: text_config; 4.x: the top level
    params = text.get("rope_parameters")
    params = dict(params) if isinstance(params, Mapping) else dict(text.get("rope_scaling") or {})
    section = params.pop("mrope_section", _DEFAULT_SECTION[family])
    params.pop("mrope_interleaved", None)  # Qwen3-VL interleaves whatever it says; Qwen2-VL never
    kind = params.pop("type", None)
    params["rope_type"] = "default" if params.get("rope_type", kind) in (None, "mrope") else params.get("rope_type",
                                                                                                       kind)
    params.setdefault("rope_theta", text.get("rope_theta", _DEFAULT_THETA[family]))
    text = {**text, "model_type": _TEXT_DECODER[family], "rope_parameters": params}
    text.pop("rope_scaling", None)
    facts = decoder_facts(text, layer)
    rope = facts["modern"].get("rope")
    if rope is None:
        raise ValueError(f"hf_config: {family} block {layer} has no rope (its text decoder read none)")
    facts["modern"]["rope"] = {**rope, "mrope_section": list(section), "mrope_interleaved": family == "qwen3_vl"}
    return facts
