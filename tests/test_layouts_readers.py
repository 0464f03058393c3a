"""Every config reader in weights/layouts/ reads or refuses every key its model family defines: none is
dropped in silence.

Each reader is fed the whole config its family writes (transformers' `<X>Config().to_dict()`, every
attribute with its default; for meta-llama and DeepSeek's own files, every field of the ModelArgs that
reads them), then each key in turn is changed (a flipped bool, another number, a value where None was,
each entry of a nested object the same way). A key is read when some change moves what the reader answers
for one of a few blocks, or makes it refuse (a one-line ValueError); a key that moves nothing must be on
IGNORED (or its family's list) with the reason it cannot change the attention. A key that is neither fails
the test, naming the key: a silent drop. Some keys matter only with another one set (a window with
use_sliding_window, num_kv_heads with new_decoder_architecture) or only in the 4.x form that has no
layer_types: each family is also fed those variants, and a key counts as read if any variant shows it.
"""

from __future__ import annotations

import copy
import json
import warnings

import numpy as np
import pytest

from weights.layouts.alibi_models import _bloom_config, _falcon_config, _mpt_config
from weights.layouts.bert import _bert_config
from weights.layouts.deepseek import _deepseek_config
from weights.layouts.deepseek import _hf_config as _hf_deepseek_config
from weights.layouts.gpt2 import _gpt2_config
from weights.layouts.gptj import _gptj_config
from weights.layouts.llama import _llama_config
from weights.layouts.meta import IGNORED as META_IGNORED
from weights.layouts.meta import _meta_config
from weights.layouts.minimax import _hf_config as _hf_minimax_config
from weights.layouts.neox import _neox_config

try:
    import transformers
except ImportError:
    transformers = None

# RoPE and NoPE, sliding and full, Qwen's linear and full, each of Gemma 4's global layers (per_layer_config)
LAYERS = (0, 1, 2, 3, 5, 11, 17, 23, 29)

# Keys no attention block reads, whatever the family: bookkeeping, the embeddings, the MLP and its experts,
# the block norms and residuals, the LM head.
_BOOKKEEPING = ("transformers_version", "architectures", "output_hidden_states", "return_dict", "dtype",
                "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
                "_name_or_path", "output_attentions", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id",
                "tie_word_embeddings", "initializer_range", "init_device", "output_router_logits")
IGNORED = {
    **{key: "bookkeeping of the config class, the tokenizer or the generation loop" for key in _BOOKKEEPING},
    **{key: "sizes of the embeddings (the layer picks one block; a layer past layer_types is refused)"
       for key in ("vocab_size", "type_vocab_size", "num_hidden_layers", "n_layer", "n_layers",
                   "vocab_size_per_layer_input", "hidden_size_per_layer_input")},
    **{key: "the MLP or its experts" for key in (
        "intermediate_size", "intermediate_size_mlp", "n_inner", "ffn_hidden_size", "expansion_ratio", "mlp_bias",
        "hidden_act", "hidden_activation", "activation", "activation_function", "moe_intermediate_size",
        "shared_expert_intermediate_size", "num_experts", "num_experts_per_tok", "num_local_experts", "moe_layers",
        "interleave_moe_layer_step", "router_aux_loss_coef", "router_jitter_noise", "decoder_sparse_step",
        "norm_topk_prob", "mlp_only_layers", "swiglu_alpha", "swiglu_limit", "n_shared_experts", "n_routed_experts",
        "routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace", "enable_moe_block",
        "use_double_wide_mlp", "top_k_experts")},
    **{key: "dropout outside the attention weights (residual, embeddings, hidden states, classifier)" for key in (
        "resid_pdrop", "embd_pdrop", "emb_pdrop", "hidden_dropout", "hidden_dropout_prob", "classifier_dropout")},
    **{key: "the block's own norms and residual wiring, outside the attention" for key in (
        "apply_residual_connection_post_layernorm", "use_parallel_residual", "parallel_attn", "num_ln_in_parallel_attn",
        "norm_type", "embedding_multiplier", "residual_multiplier")},
    **{key: "the LM head or the multiple-token-prediction head" for key in (
        "final_logit_softcapping", "logit_scale", "logits_scaling", "num_nextn_predict_layers", "summary_type",
        "summary_use_proj", "summary_activation", "summary_proj_to_labels", "summary_first_dropout")},
    **{key: "absolute position embeddings or their table's size, added before the blocks" for key in (
        "n_positions", "learned_pos_emb", "embedding_fraction", "max_seq_len")},
    "attention_bias": "the biases are read from the checkpoint's tensors, present or not (the table's rows)",
    "bias": "the biases are read from the checkpoint's tensors, present or not (the table's rows)",
    "no_bias": "the biases are read from the checkpoint's tensors, present or not (the table's rows)",
    "pretraining_tp": "tensor-parallel slicing of the same matmuls (transformers 5 ignores it)",
    "slow_but_exact": "BLOOM's tensor-parallel merge of the same dense layer",
    "model_type": "the layout names the family; these readers read no model_type-dependent field",
    "is_decoder": "causality is the call's option (is_causal), not the config's",
    "add_cross_attention": "a separate cross-attention module, not this block's self-attention",
    "reorder_and_upcast_attn": "GPT-2's float32 upcast of the same logits: a precision choice, the same math",
}
_EPS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")
# family -> {key: why it cannot change that family's attention} beyond IGNORED
FAMILY_IGNORED = {
    "llama": {"rms_norm_eps": "the block norms' eps (Llama has no QK-norm)",
              "max_position_embeddings": "read only by rope rules that need it (yarn, longrope without a factor)"},
    "phi3": {"original_max_position_embeddings": "read by longrope only (tests/test_layouts_llama_frontier.py)"},
    **{family: {key: "the linear-attention (Gated DeltaNet) layers: refused by layer" for key in (
        "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
        "linear_num_value_heads")} for family in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")},
    "mpt": {"attn_config.attn_impl": "which kernel computes the same attention (torch, flash, triton)",
            "attn_config.model_type": "the name of transformers' MptAttentionConfig class"},
    "ministral3": {"rope_parameters.type": "4.x's name of rope_type, which 5.x writes beside it and wins",
                   "rope_parameters.max_position_embeddings": "transformers' yarn reads the factor given, not it"},
    "cohere2": {"head_dim": "Cohere2Config replaces it with hidden_size // num_attention_heads (so does the reader)"},
    "deepseek_v3": {"num_key_value_heads": "MLA: keys and values come from the latent, one per query head",
                    "rms_norm_eps": "q_a_layernorm and kv_a_layernorm keep DeepseekV3RMSNorm's default eps 1e-6",
                    "qk_head_dim": "derived: qk_nope_head_dim + qk_rope_head_dim (read)",
                    "head_dim": "derived: qk_rope_head_dim (read)"},
    **{family: {"num_key_value_heads": "MLA: keys and values come from the latent, one per query head",
                "rms_norm_eps": "q_a_layernorm and kv_a_layernorm keep their RMSNorm's default eps 1e-6",
                "qk_head_dim": "derived: qk_nope_head_dim + qk_rope_head_dim (read)",
                "head_dim": "derived: qk_rope_head_dim (read)",
                "layer_types": "every layer 'indexed_attention'; the modeling file reads it nowhere (which layers "
                               "run their own indexer: indexer_types, read)",
                "mlp_layer_types": "which layers' MLP is a mixture of experts"} for family in ("deepseek_v32",
                                                                                              "glm_moe_dsa")},
    "minimax_m3_vl_text": {"rotary_dim": "transformers reads partial_rotary_factor, not rotary_dim "
                                         "(MiniMaxM3VLRotaryEmbedding, modeling_minimax_m3_vl.py:296-298)",
                           "mlp_layer_types": "which layers' MLP is a mixture of experts",
                           "dense_intermediate_size": "the dense MLP's size", "shared_intermediate_size":
                           "the shared expert's size"},
    "falcon": {"max_position_embeddings": "Falcon's default RoPE reads no length"},
    "gpt_neox": {"max_position_embeddings": "GPT-NeoX's default RoPE reads no length"},
    "bert": {"max_position_embeddings": "absolute position embeddings, added before the blocks"},
}
_NORMS_ONLY = ("llama", "mistral", "qwen2", "gemma2", "gpt_oss", "phi3", "smollm3", "ministral3", "granite",
               "cohere2", "llama4_text", "bloom", "mpt", "falcon", "gpt_neox", "gptj", "bert", "gpt2")
_SHARED = {"max_position_embeddings": "read only by rope rules that need it (yarn, longrope without a factor)"}

# family -> (transformers config class, reader, the variants fed besides the class's defaults)
_WITHOUT_TYPES = {"layer_types": None}
_QWEN_SLIDING = {"layer_types": None, "use_sliding_window": True, "max_window_layers": 2, "sliding_window": 4}
FAMILIES = {
    "llama": ("LlamaConfig", _llama_config, ()),
    "mistral": ("MistralConfig", _llama_config, (_WITHOUT_TYPES,)),
    "qwen2": ("Qwen2Config", _llama_config, (_QWEN_SLIDING,)),
    "qwen3": ("Qwen3Config", _llama_config, (_QWEN_SLIDING,)),
    "gemma2": ("Gemma2Config", _llama_config, (_WITHOUT_TYPES,)),
    "gemma3_text": ("Gemma3TextConfig", _llama_config, (_WITHOUT_TYPES,)),
    "olmo2": ("Olmo2Config", _llama_config, ()),
    "gpt_oss": ("GptOssConfig", _llama_config, (_WITHOUT_TYPES,)),
    "phi3": ("Phi3Config", _llama_config, (_WITHOUT_TYPES,)),
    "llama4_text": ("Llama4TextConfig", _llama_config, ({"layer_types": None, "no_rope_layers": None},)),
    "smollm3": ("SmolLM3Config", _llama_config, ({"layer_types": None, "no_rope_layers": None},
                                                 {"layer_types": None, "use_sliding_window": True,
                                                  "sliding_window": 4})),
    "ministral3": ("Ministral3Config", _llama_config, (_WITHOUT_TYPES,)),
    "granite": ("GraniteConfig", _llama_config, ()),
    "cohere": ("CohereConfig", _llama_config, ({"use_qk_norm": True},)),
    "cohere2": ("Cohere2Config", _llama_config, (_WITHOUT_TYPES,)),
    "qwen3_next": ("Qwen3NextConfig", _llama_config, ()),
    "qwen3_5_text": ("Qwen3_5TextConfig", _llama_config, ()),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", _llama_config, ()),
    "gemma4_text": ("Gemma4TextConfig", _llama_config, ({"attention_k_eq_v": True},)),
    "deepseek_v3": ("DeepseekV3Config", _hf_deepseek_config, ()),
    "deepseek_v32": ("DeepseekV32Config", _hf_deepseek_config, ()),
    "glm_moe_dsa": ("GlmMoeDsaConfig", _hf_deepseek_config, ({"indexer_types": None, "index_topk_pattern": "FS" * 15,
                                                             "num_hidden_layers": 30},
                                                            {"indexer_types": None, "index_topk_freq": 2})),
    # M3's defaults hold no sparse layer: a variant with every one sparse shows the indexer's keys read
    "minimax_m3_vl_text": ("MiniMaxM3VLTextConfig", _hf_minimax_config, ({"layer_types": ["minimax_m3_sparse"] * 60},
                                                                       {"layer_types": None})),
    "bloom": ("BloomConfig", _bloom_config, ()),
    "mpt": ("MptConfig", _mpt_config, ()),
    "falcon": ("FalconConfig", _falcon_config, ({"new_decoder_architecture": True, "num_kv_heads": 71},
                                                {"alibi": True})),
    "gpt_neox": ("GPTNeoXConfig", _neox_config, ()),
    "gptj": ("GPTJConfig", _gptj_config, ()),
    "bert": ("BertConfig", _bert_config, ()),
    "gpt2": ("GPT2Config", _gpt2_config, ()),
}


def _plain(value):
    if isinstance(value, np.ndarray):
        return ["array", value.dtype.str, value.tolist()]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _answers(reader, cfg) -> str:
    out = []
    for layer in LAYERS:
        try:
            out.append(_plain(reader(cfg, layer)))
        except ValueError as error:  # a refusal; anything else is a bug the test should show
            message = str(error)
            assert "\n" not in message, message
            out.append(["refused"])
    return json.dumps(out, sort_keys=True, default=repr)


def _changes(value) -> list:
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1, 2 * value + 3, 1]
    if isinstance(value, float):
        return [1.7 * value + 0.3]
    if value is None:
        return [4, True, 0.5, "other"]
    if isinstance(value, str):
        return ["other"]
    if isinstance(value, list):
        return [list(reversed(value)) if len({repr(v) for v in value}) > 1 else [*value[:1], "other"], []]
    return []


def _leaves(cfg, path=()):
    """(path, value) of every key, descending into objects (rope_parameters, attn_config, per_layer_config)."""
    for key, value in cfg.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, (*path, key))
        else:
            yield (*path, key), value


def _set(cfg, path, value):
    out = copy.deepcopy(cfg)
    place = out
    for key in path[:-1]:
        place = place[key]
    place[path[-1]] = value
    return out


def silent_keys(reader, variants) -> list[str]:
    """The dotted keys that no change moves in any variant."""
    read: set[str] = set()
    seen: set[str] = set()
    for cfg in variants:
        base = _answers(reader, cfg)
        for path, value in _leaves(cfg):
            name = ".".join(map(str, path))
            seen.add(name)
            if name not in read and any(_answers(reader, _set(cfg, path, v)) != base for v in _changes(value)):
                read.add(name)
    return sorted(seen - read)


def _ignored(family: str, key: str) -> bool:
    top = key.split(".")[0]
    extra = FAMILY_IGNORED.get(family, {})
    if family in _NORMS_ONLY and top in _EPS:
        return True
    nested_bookkeeping = any(part in _BOOKKEEPING for part in key.split(".")[1:])  # MPT's attn_config's own
    return top in IGNORED or key in extra or top in extra or top in _SHARED or nested_bookkeeping


@pytest.mark.skipif(transformers is None, reason="needs transformers (extra hf) for its config classes")
@pytest.mark.parametrize("family", FAMILIES)
def test_every_key_of_the_family_is_read_or_refused(family):
    name, reader, variants = FAMILIES[family]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = getattr(transformers, name)().to_dict()
    # a variant's None removes that key (the 4.x form without layer_types)
    fed = [base] + [{k: v for k, v in {**base, **variant}.items() if variant.get(k, 0) is not None}
                    for variant in variants]
    dropped = [key for key in silent_keys(reader, fed) if not _ignored(family, key)]
    assert not dropped, f"{family}: {reader.__name__} drops {dropped} in silence: read them, refuse them, or " \
                        "list them as not attention with the reason"


# -- the families without a transformers config class: every field of the ModelArgs that reads the file -----

# llama-models' ModelArgs (models/llama3/args.py and models/llama4/args.py), with Scout's values where Llama 4
# sets them, a NoPE interval of 2 so that block 1 is a NoPE one
META_PARAMS = {"dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "vocab_size": 16,
               "multiple_of": 16, "ffn_dim_multiplier": 1.2, "ffn_exp": 4.0, "norm_eps": 1e-5,
               "attention_chunk_size": 8192, "rope_theta": 500000.0, "use_scaled_rope": True,
               "rope_scaling_factor": 16.0, "rope_high_freq_factor": 1.0, "nope_layer_interval": 2,
               "use_qk_norm": True, "attn_temperature_tuning": True, "floor_scale": 8192.0, "attn_scale": 0.1,
               "vision_args": {"dim": 8}, "moe_args": {"num_experts": 2}, "quantization_args": None,
               "lora_args": None, "max_batch_size": 32, "max_seq_len": 2048, "vision_chunk_size": -1,
               "vision_max_num_chunks": 4, "vision_num_cross_attention_layers": -1}
# DeepSeek-V3's inference/model.py ModelArgs, every field (values of its config_671B.json, sizes shrunk)
DEEPSEEK_ARGS = {"max_batch_size": 8, "max_seq_len": 16384, "dtype": "bf16", "vocab_size": 16, "dim": 64,
                 "inter_dim": 32, "moe_inter_dim": 16, "n_layers": 4, "n_dense_layers": 1, "n_heads": 4,
                 "n_routed_experts": 4, "n_shared_experts": 1, "n_activated_experts": 2, "n_expert_groups": 1,
                 "n_limited_groups": 1, "score_func": "sigmoid", "route_scale": 2.5, "q_lora_rank": 24,
                 "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
                 "original_seq_len": 4096, "rope_theta": 10000.0, "rope_factor": 40.0, "beta_fast": 32,
                 "beta_slow": 1, "mscale": 1.0}
DEEPSEEK_IGNORED = {
    **{key: "the MLP, its experts and their routing" for key in (
        "inter_dim", "moe_inter_dim", "n_dense_layers", "n_routed_experts", "n_shared_experts",
        "n_activated_experts", "n_expert_groups", "n_limited_groups", "score_func", "route_scale")},
    "max_batch_size": "the size of the preallocated cache", "vocab_size": "the embeddings",
    "n_layers": "the number of blocks",
    "dtype": "how the checkpoint's Linear weights are stored (fp8 or bf16: DeepSeek-V3.2-Exp inference/model.py:865); "
             "V3.2's indexer scores in fp8 either way (model.py:465-473)",
}
# scale_fmt is read (V3.2: the indexer's fp8_scale_format, ue8m0 when set); V3's ModelArgs has none
# DeepSeek-V3.2-Exp's ModelArgs adds these (inference/model.py:89-91, config_671B_v3.2.json)
DEEPSEEK_V32_ARGS = {**DEEPSEEK_ARGS, "scale_fmt": "ue8m0", "index_n_heads": 4, "index_head_dim": 8, "index_topk": 16}


def test_meta_params_json_every_key_read_or_refused():
    """meta-llama: every ModelArgs field is read (a change moves a block or is refused) or on meta.IGNORED; a
    key ModelArgs does not have is refused by name."""
    dropped = [key for key in silent_keys(_meta_config, [META_PARAMS]) if key.split(".")[0] not in META_IGNORED]
    assert not dropped, f"meta-llama drops {dropped} in silence"
    with pytest.raises(ValueError, match="does not read params.json's use_sliding_window"):
        _meta_config({**META_PARAMS, "use_sliding_window": True}, 0)


def test_deepseek_model_args_every_key_read():
    # V3.2 with scale_fmt null too (ModelArgs' default): DeepSeek's act_quant rounds the scales for any scale_fmt
    # string, so from "ue8m0" only null moves the reading
    variants = [DEEPSEEK_ARGS, DEEPSEEK_V32_ARGS, {**DEEPSEEK_V32_ARGS, "scale_fmt": None}]
    dropped = [key for key in silent_keys(_deepseek_config, variants)
               if key not in DEEPSEEK_IGNORED]
    assert not dropped, f"deepseek drops {dropped} in silence"


@pytest.mark.skipif(transformers is None, reason="needs transformers (extra hf) for its config classes")
def test_the_audit_sees_a_dropped_key():
    """The audit is not blind: a reader that loses sliding_window (Mistral's window), or Gemma 4's
    zero-padded per_layer_config key of layer 5 (what hf-llama did until this audit: "05" != str(5)), is
    named."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mistral = transformers.MistralConfig(sliding_window=4).to_dict()
        gemma4 = transformers.Gemma4TextConfig().to_dict()
    losing = lambda cfg, layer: _llama_config({k: v for k, v in cfg.items() if k != "sliding_window"}, layer)  # noqa: E731
    assert "sliding_window" in silent_keys(losing, [mistral])
    assert "sliding_window" not in silent_keys(_llama_config, [mistral])
    assert "05" in gemma4["per_layer_config"], gemma4["per_layer_config"]  # transformers 5.23 pads the keys
    unpadded = lambda cfg, layer: _llama_config(  # noqa: E731
        {**cfg, "per_layer_config": {k: v for k, v in cfg["per_layer_config"].items() if k != "05"}}, layer)
    assert "per_layer_config.05.head_dim" in silent_keys(unpadded, [gemma4])
    assert "per_layer_config.05.head_dim" not in silent_keys(_llama_config, [gemma4])

