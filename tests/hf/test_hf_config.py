"""HF config.json <-> our ModelConfig (hf/config.py), per family (hf/families.py)."""

import dataclasses
import json

import pytest
from hf_reference import FIXTURES, MOE_FAMILIES

from shardtrain import config
from shardtrain.config import ConfigError
from shardtrain.hf.config import hf_config, model_config
from shardtrain.hf.io import HfDir, read_config


def test_config_json_in_both_rope_forms():
    new = json.loads((FIXTURES / "llama" / "config.json").read_text())  # transformers 5: rope_parameters
    old = {k: v for k, v in new.items() if k != "rope_parameters"}  # published Llama 3.1 files
    old.update(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    m = model_config(new)
    assert m == model_config(old)
    assert m.rope_theta == 500000.0 and m.rope_scaling == config.RopeScalingConfig(
        type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)
    assert model_config(hf_config(m)) == m


def test_published_config_files_map_to_our_fields():
    """config.json of published models (the fields that matter, as on the Hub in 2025)."""
    llama31_8b = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
                  "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
                  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                  "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256, "hidden_act": "silu",
                  "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
                  "eos_token_id": [128001, 128008, 128009]}
    m = model_config(llama31_8b)
    assert (m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff) == (4096, 32, 8, None, 14336)
    assert m.rope_scaling.factor == 8.0 and m.rope_theta == 500000.0
    qwen25_7b = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584, "intermediate_size": 18944,
                 "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
                 "rope_theta": 1000000.0, "sliding_window": 131072, "use_sliding_window": False,
                 "tie_word_embeddings": False, "vocab_size": 152064, "hidden_act": "silu", "rope_scaling": None}
    m = model_config(qwen25_7b)
    assert m.qkv_bias and not m.qk_norm and m.rope_scaling is None and m.head_dim is None
    qwen3_8b = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "intermediate_size": 12288, "head_dim": 128,
                "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-6,
                "rope_theta": 1000000, "tie_word_embeddings": False, "vocab_size": 151936, "attention_bias": False}
    assert model_config(qwen3_8b).qk_norm
    mistral = {"architectures": ["MistralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
               "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
               "rope_theta": 1000000.0, "sliding_window": None, "vocab_size": 32768, "head_dim": 128}
    assert model_config(mistral).head_dim is None  # 128 = 4096 / 32
    mixtral_8x7b = {"architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
                    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                    "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                    "router_aux_loss_coef": 0.02, "sliding_window": None, "vocab_size": 32000}
    m = model_config(mixtral_8x7b)
    e = m.moe
    assert (e.n_experts, e.experts_per_token, m.d_ff, e.norm_topk_prob, e.n_shared_experts) == (8, 2, 14336, True, 0)
    qwen15_moe = {"architectures": ["Qwen2MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 5632,
                  "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "num_experts": 60,
                  "num_experts_per_tok": 4, "norm_topk_prob": False, "decoder_sparse_step": 1,
                  "mlp_only_layers": [], "num_attention_heads": 16, "num_hidden_layers": 24,
                  "num_key_value_heads": 16, "rope_theta": 1e6, "vocab_size": 151936}
    m = model_config(qwen15_moe)
    e = m.moe
    assert (e.n_experts, m.d_ff, e.shared_expert_d_ff, e.shared_expert_gate, e.norm_topk_prob, m.qkv_bias) == (
        60, 1408, 5632, True, False, True)
    qwen3_30b_a3b = {**qwen3_8b, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128,
                     "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
                     "decoder_sparse_step": 1, "mlp_only_layers": []}
    m = model_config(qwen3_30b_a3b)
    e = m.moe
    assert (e.n_experts, e.experts_per_token, m.d_ff, m.qk_norm, e.n_shared_experts) == (128, 8, 768, True, 0)
    with pytest.raises(ConfigError, match="dense layers between MoE layers are not supported"):
        model_config({**qwen3_30b_a3b, "mlp_only_layers": [0]})
    mistral_v01 = model_config({**mistral, "sliding_window": 4096})
    assert mistral_v01.sliding_window == 4096 and model_config(hf_config(mistral_v01)) == mistral_v01
    assert model_config(qwen25_7b).sliding_window is None  # use_sliding_window false
    qwen_windowed = model_config({**qwen25_7b, "use_sliding_window": True, "max_window_layers": 0})
    assert qwen_windowed.sliding_window == 131072 and model_config(hf_config(qwen_windowed)) == qwen_windowed
    with pytest.raises(ConfigError, match="20 of 28 layers use sliding_window=131072 and the others full"):
        model_config({**qwen25_7b, "use_sliding_window": True, "max_window_layers": 8})
    qwen_long = model_config({**qwen25_7b, "rope_scaling": {  # Qwen2.5's long-context setting
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}})
    assert (qwen_long.rope_scaling.type, qwen_long.rope_scaling.factor) == ("yarn", 4.0)
    assert model_config(hf_config(qwen_long)) == qwen_long
    with pytest.raises(ConfigError, match="rope type 'longrope' is not supported"):
        model_config({**qwen25_7b, "rope_scaling": {"type": "longrope", "factor": 4.0}})


def test_each_moe_family_comes_back_as_its_own_config_json():
    for family in MOE_FAMILIES:  # each MoE config comes back as its own family's config.json
        m = HfDir(FIXTURES / family).model
        assert model_config(hf_config(m)) == m
        assert hf_config(m)["architectures"] == read_config(FIXTURES / family)["architectures"]


def test_a_model_config_no_family_holds_is_refused_not_exported_without_a_feature():
    m = model_config(read_config(FIXTURES / "qwen3"))
    both = dataclasses.replace(m, qkv_bias=True)  # Qwen3's qk-norm and Qwen2's biases: no family has both
    with pytest.raises(ConfigError, match="no Hugging Face family: .*Qwen3ForCausalLM cannot hold qkv_bias=True"):
        hf_config(both)
    assert hf_config(dataclasses.replace(m, qk_norm=False, qkv_bias=True))["architectures"] == ["Qwen2ForCausalLM"]
    llama = read_config(FIXTURES / "llama")
    windowed = dataclasses.replace(model_config(llama), sliding_window=8)
    with pytest.raises(ConfigError, match="imported from a LlamaForCausalLM, which cannot hold this model config's "
                                          "sliding_window=8"):
        hf_config(windowed, base=llama)
    assert hf_config(windowed)["architectures"] == ["MistralForCausalLM"]
    mixtral = model_config(read_config(FIXTURES / "mixtral"))
    with pytest.raises(ConfigError, match="MixtralForCausalLM cannot hold norm_topk_prob=False"):
        hf_config(dataclasses.replace(mixtral, moe=dataclasses.replace(mixtral.moe, norm_topk_prob=False)))


OLMO2_7B = {"architectures": ["Olmo2ForCausalLM"], "hidden_size": 4096, "intermediate_size": 11008,
            "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-6,
            "rope_theta": 500000, "tie_word_embeddings": False, "vocab_size": 100352, "hidden_act": "silu",
            "attention_bias": False}
"""OLMo-2-1124-7B's config.json (the fields that matter)."""


def test_olmo2_config_file_maps_to_our_fields_and_back():
    m = model_config(OLMO2_7B)
    assert (m.norm_position, m.qk_norm, m.qk_norm_scope, m.layer_pattern) == ("post", True, "projection", ())
    assert model_config(hf_config(m)) == m
    with pytest.raises(ConfigError, match="imported from a Olmo2ForCausalLM, which cannot hold .*norm_position='pre'"):
        hf_config(dataclasses.replace(m, norm_position="pre", qk_norm_scope="head", qk_norm=False, qkv_bias=True),
                  base=OLMO2_7B)
    with pytest.raises(ConfigError, match="hidden_act='gelu' is not supported"):
        model_config({**OLMO2_7B, "hidden_act": "gelu"})


OLMO3_7B = {"architectures": ["Olmo3ForCausalLM"], "hidden_size": 4096, "intermediate_size": 11008,
            "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-6,
            "rope_theta": 500000.0, "sliding_window": 4096, "vocab_size": 100278, "hidden_act": "silu",
            "max_position_embeddings": 65536, "layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 8,
            "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32, "beta_slow": 1,
                             "attention_factor": 1.20794415416798, "original_max_position_embeddings": 8192}}
"""OLMo-3-7B-Think's config.json (the fields that matter)."""


def test_olmo3_config_file_maps_to_our_fields_and_back():
    """OLMo 2's norms with layer_types (three local layers, one global) and yarn on the global layers only;
    without per-layer-type rope_parameters transformers gives the local layers its default base 5e5,
    whatever rope_theta says."""
    m = model_config(OLMO3_7B)
    assert (m.name, m.norm_position, m.qk_norm_scope, m.layer_pattern, m.sliding_window) == (
        "olmo3", "post", "projection", ("local", "local", "local", "global"), 4096)
    assert (m.rope_scaling.type, m.rope_scaling.attention_factor, m.rope_local_theta) == ("yarn", 1.20794415416798, 5e5)
    fresh = hf_config(m)  # no imported config.json: rope_parameters per layer type, no Gemma keys
    assert fresh["architectures"] == ["Olmo3ForCausalLM"] and "query_pre_attn_scalar" not in fresh
    assert fresh["rope_parameters"]["sliding_attention"] == {"rope_type": "default", "rope_theta": 500000.0}
    assert model_config(fresh) == m
    assert model_config({**OLMO3_7B, "rope_theta": 1e4}).rope_local_theta == 5e5
    with pytest.raises(ConfigError, match="layer_types .* not supported"):
        model_config({**OLMO3_7B, "num_hidden_layers": 8})


LLAMA4_SCOUT = {"architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", "hidden_size": 5120,
                "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_attention_heads": 40,
                "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 48, "num_local_experts": 16,
                "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "attention_chunk_size": 8192,
                "use_qk_norm": True, "no_rope_layers": [], "attn_temperature_tuning": True, "floor_scale": 8192,
                "attn_scale": 0.1, "rope_theta": 500000.0, "vocab_size": 202048, "rms_norm_eps": 1e-5,
                "hidden_act": "silu", "tie_word_embeddings": False, "rope_scaling": {
                    "rope_type": "llama3", "factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                    "original_max_position_embeddings": 8192}}
"""Llama-4-Scout-17B-16E's text_config (the fields that matter)."""


def test_llama4_config_file_maps_to_our_fields_and_back():
    """Scout: every 4th layer NoPE (global, with the temperature), the others rotary in chunks of 8192
    with the qk L2 norm; every layer MoE (16 experts, top 1, sigmoid-scaled inputs, a shared expert);
    Maverick's interleaving (interleave_moe_layer_step 2) leaves every other layer dense. The vision
    model is refused in one line."""
    m = model_config(LLAMA4_SCOUT)
    assert (m.name, m.layer_pattern, m.attention_chunk, m.global_nope, m.attn_temperature, m.qk_l2_norm) == (
        "llama4_text", ("local",) * 3 + ("global",), 8192, True, 0.1, True)
    assert (m.moe.n_experts, m.moe.experts_per_token, m.moe.router, m.moe.n_shared_experts, m.moe.dense_layers,
            m.d_ff) == (16, 1, "sigmoid_input", 1, (), 8192)
    assert model_config(hf_config(m)) == m and hf_config(m)["architectures"] == ["Llama4ForCausalLM"]
    maverick = model_config({**LLAMA4_SCOUT, "interleave_moe_layer_step": 2, "num_local_experts": 128})
    assert maverick.moe.dense_layers == tuple(range(0, 48, 2)) and maverick.moe.dense_d_ff == 16384
    assert len(maverick.mlp_runs) == 48 and model_config(hf_config(maverick)) == maverick
    with pytest.raises(ConfigError, match="Llama4ForConditionalGeneration .Llama 4 with its vision tower. is not "):
        model_config({**LLAMA4_SCOUT, "architectures": ["Llama4ForConditionalGeneration"]})
    with pytest.raises(ConfigError, match="only chunked rotary layers and full NoPE layers are supported"):
        model_config({**LLAMA4_SCOUT, "attention_chunk_size": None})


def test_gemma_config_files_map_to_our_fields_and_back():
    """Published config.json files (the fields that matter): Gemma-2-9B and Gemma-3-1B (26 layers:
    four groups of five local + one global, then two local layers), Gemma 3 in its older form
    (rope_local_base_freq, sliding_window_pattern) and transformers 5's."""
    gemma2_9b = {"architectures": ["Gemma2ForCausalLM"], "hidden_size": 3584, "intermediate_size": 14336,
                 "num_attention_heads": 16, "num_hidden_layers": 42, "num_key_value_heads": 8, "head_dim": 256,
                 "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
                 "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": 256000,
                 "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh"}
    m = model_config(gemma2_9b)
    assert (m.layer_pattern, m.sliding_window, m.attn_softcap, m.final_softcap, m.query_pre_attn_scalar) == (
        ("local", "global"), 4096, 50.0, 30.0, 256)
    assert (m.norm_position, m.norm_scale, m.activation, m.scale_embeddings, m.tie_embeddings, m.head_dim) == (
        "pre_post", "one_plus_weight", "gelu_tanh", True, True, 256)
    assert model_config(hf_config(m)) == m and hf_config(m)["architectures"] == ["Gemma2ForCausalLM"]
    gemma3_1b = {"architectures": ["Gemma3ForCausalLM"], "hidden_size": 1152, "intermediate_size": 6912,
                 "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "head_dim": 256,
                 "query_pre_attn_scalar": 256, "sliding_window": 512, "sliding_window_pattern": 6,
                 "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": None,
                 "final_logit_softcapping": None, "attn_logit_softcapping": None, "vocab_size": 262144,
                 "hidden_activation": "gelu_pytorch_tanh"}
    m = model_config(gemma3_1b)
    assert m.layer_pattern == ("local",) * 5 + ("global",) and m.qk_norm and m.qk_norm_scope == "head"
    assert (m.rope_theta, m.rope_local_theta, m.rope_scaling, m.attn_softcap) == (1e6, 1e4, None, None)
    new_form = hf_config(m)
    assert new_form["rope_parameters"]["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert new_form["layer_types"][24:] == ["sliding_attention"] * 2 and model_config(new_form) == m
    scaled = model_config({**gemma3_1b, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert scaled.rope_scaling == config.RopeScalingConfig(type="linear", factor=8.0)
    assert model_config(hf_config(scaled)) == scaled
    for bad, message in [({"hidden_activation": "gelu"}, "hidden_activation='gelu' is not supported"),
                         ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True is not supported"),
                         ({"query_pre_attn_scalar": 24.5}, "query_pre_attn_scalar=24.5 is not supported"),
                         ({"layer_types": ["chunked_attention"] * 26},
                          "layer_types .'chunked_attention'. not supported"),
                         ({"rope_parameters": {"sliding_attention": {"rope_type": "yarn"}, "full_attention": {}}},
                          "rope type 'yarn' of the sliding_attention layers is not supported")]:
        with pytest.raises(ConfigError, match=message):
            model_config({**gemma3_1b, **bad})


DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "intermediate_size": 18432,
               "moe_intermediate_size": 2048, "num_attention_heads": 128, "num_key_value_heads": 128,
               "num_hidden_layers": 61, "first_k_dense_replace": 3, "n_routed_experts": 256, "n_shared_experts": 1,
               "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
               "norm_topk_prob": True, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
               "qk_rope_head_dim": 64, "v_head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000,
               "vocab_size": 129280, "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False}
"""DeepSeek-V3's config.json without its yarn rope scaling (the fields that matter)."""


def test_deepseek_v3_config_file_maps_to_our_fields_and_back():
    m = model_config(DEEPSEEK_V3)
    assert (m.mla.q_lora_rank, m.mla.kv_lora_rank, m.mla.qk_rope_head_dim, m.head_size, m.n_kv_heads) == (
        1536, 512, 64, 192, 128)
    e = m.moe
    assert (e.router, e.n_experts, e.n_groups, e.topk_groups, e.first_dense_layers, e.dense_d_ff, m.d_ff) == (
        "sigmoid", 256, 8, 4, 3, 18432, 2048)
    assert model_config(hf_config(m)) == m
    v2_lite = {**DEEPSEEK_V3, "q_lora_rank": None}  # V2-Lite's full query projection
    assert model_config(v2_lite).mla.q_lora_rank is None
    for bad, message in [({"rope_scaling": {"type": "yarn", "factor": 40}}, "'yarn' needs original_max_position_emb"),
                         ({"rope_interleave": False}, "rope_interleave=false is not supported"),
                         ({"num_key_value_heads": 8}, "num_key_value_heads=8 is not supported"),
                         ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
                         ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config .* not supported")]:
        with pytest.raises(ConfigError, match=message):
            model_config({**DEEPSEEK_V3, **bad})
    qwen3_moe = model_config(read_config(FIXTURES / "qwen3_moe"))  # sigmoid routing: DeepSeek's alone
    with pytest.raises(ConfigError, match="Qwen3MoeForCausalLM, which cannot hold this model config.s router=sigmoid"):
        hf_config(dataclasses.replace(qwen3_moe, moe=dataclasses.replace(qwen3_moe.moe, router="sigmoid")),
                  base=read_config(FIXTURES / "qwen3_moe"))
