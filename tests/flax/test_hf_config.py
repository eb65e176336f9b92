"""MLAConfig.from_hf_config and the presets against the models' published config.json files.

DeepSeek-V3.2-Exp's and GLM-5's configs below are the published files' fields (deepseek-ai/
DeepSeek-V3.2-Exp, zai-org/GLM-5 on the Hugging Face hub); GLM-5.1 ships GLM-5's architecture and
config fields with new weights. GLM-5.2's holds the fields that differ from GLM-5's as serving stacks
quote its published config (rope theta 8e6, a 1M-token context, the shared-indexer schedule). A test
of the reader must not depend on the network.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from jax_sparse_mla.flax import DEEPSEEK_V32, GLM5, MLAConfig
from jax_sparse_mla.flax import hf_config

DEEPSEEK_V32_EXP_CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "index_head_dim": 128, "index_n_heads": 64,
    "index_topk": 2048, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v32", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}

GLM5_CONFIG = {
    "architectures": ["GlmMoeDsaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "dtype": "bfloat16", "eos_token_id": [154820, 154827, 154829], "ep_size": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "head_dim": 64, "hidden_size": 6144,
    "index_head_dim": 128, "index_n_heads": 32, "index_topk": 2048, "indexer_rope_interleave": True,
    "initializer_range": 0.02, "intermediate_size": 12288, "kv_lora_rank": 512,
    "max_position_embeddings": 202752, "model_type": "glm_moe_dsa", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 64, "num_experts_per_tok": 8,
    "num_hidden_layers": 78, "num_key_value_heads": 64, "num_nextn_predict_layers": 1,
    "pad_token_id": 154820, "pretraining_tp": 1, "q_lora_rank": 2048, "qk_head_dim": 256,
    "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "rope_interleave": True,
    "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 1, "topk_method": "noaux_tc", "use_cache": True, "v_head_dim": 256,
    "vocab_size": 154880,
}


GLM52_INDEXER_TYPES = ["full" if i < 3 or (i - 2) % 4 == 0 else "shared" for i in range(78)]
GLM52_CONFIG = dict(
    GLM5_CONFIG, max_position_embeddings=1048576,
    rope_parameters={"rope_theta": 8000000, "rope_type": "default"},
    index_topk_freq=4, index_skip_topk_offset=3, indexer_types=GLM52_INDEXER_TYPES,
    index_share_for_mtp_iteration=True, mlp_layer_types=["dense"] * 3 + ["sparse"] * 75)


def test_deepseek_v32_config_is_the_preset():
    config = MLAConfig.from_hf_config(DEEPSEEK_V32_EXP_CONFIG)
    assert config == DEEPSEEK_V32
    assert (config.rope_factor, config.original_max_position_embeddings, config.rope_theta) == (
        40.0, 4096, 10000.0)
    assert not config.indexer_rope_interleave and config.index_n_heads == 64
    # qk_head_dim**-0.5 with YaRN's mscale squared: (0.1 ln 40 + 1)^2 / sqrt(192).
    assert math.isclose(config.softmax_scale, (0.1 * math.log(40) + 1) ** 2 / math.sqrt(192))


def test_glm5_config_is_the_preset():
    config = MLAConfig.from_hf_config(GLM5_CONFIG)
    assert config == GLM5
    # The four fields a DeepSeek-shaped preset got wrong, and the norm epsilon.
    assert config.index_n_heads == 32 and config.indexer_rope_interleave
    assert config.rope_theta == 1e6 and config.rope_factor == 1.0
    assert config.softmax_scale == 1 / 16
    assert config.rms_norm_eps == 1e-5


def test_glm52_config():
    """GLM-5's attention with theta 8e6, and 21 of 78 layers running their own indexer: the explicit
    list and the frequency / offset rule agree."""
    config = MLAConfig.from_hf_config(GLM52_CONFIG)
    assert config == dataclasses.replace(GLM5, rope_theta=8e6)
    types = hf_config.indexer_types(GLM52_CONFIG)
    assert types == tuple(GLM52_INDEXER_TYPES) and types.count("full") == 21
    by_rule = dict(GLM52_CONFIG)
    del by_rule["indexer_types"]
    assert hf_config.indexer_types(by_rule) == types


def test_reads_a_config_file_or_its_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GLM5_CONFIG))
    assert MLAConfig.from_hf_config(tmp_path / "config.json") == GLM5
    assert MLAConfig.from_hf_config(str(tmp_path)) == GLM5


def test_rope_theta_is_read_never_assumed():
    """A later release may change theta (and keeps it under rope_parameters): the reader takes it."""
    config = dict(GLM5_CONFIG, rope_parameters={"rope_theta": 8000000.0, "rope_type": "default"})
    assert MLAConfig.from_hf_config(config).rope_theta == 8e6
    old_style = dict(DEEPSEEK_V32_EXP_CONFIG, rope_theta=50000)
    assert MLAConfig.from_hf_config(old_style).rope_theta == 5e4


def test_yarn_under_rope_parameters():
    parameters = dict(DEEPSEEK_V32_EXP_CONFIG["rope_scaling"], rope_type="yarn", rope_theta=10000,
                      factor=16, mscale_all_dim=0.707)
    parameters.pop("type")
    config = dict(DEEPSEEK_V32_EXP_CONFIG, rope_parameters=parameters)
    del config["rope_scaling"], config["rope_theta"]
    layer = MLAConfig.from_hf_config(config)
    assert (layer.rope_factor, layer.mscale_all_dim, layer.rope_theta) == (16.0, 0.707, 1e4)


@pytest.mark.parametrize("change,message", [
    (dict(model_type="deepseek_v3"), "model_type"),
    (dict(num_key_value_heads=8), "num_key_value_heads"),
    (dict(q_lora_rank=None), "q_lora_rank"),
    (dict(rope_interleave=False), "rope_interleave"),
    (dict(qk_head_dim=192), "qk_head_dim"),
    (dict(index_n_heads=0), "index_n_heads"),
    (dict(hidden_size="6144"), "hidden_size"),
    (dict(indexer_rope_interleave="yes"), "indexer_rope_interleave"),
    (dict(rope_parameters={"rope_theta": 1e6, "rope_type": "llama3"}), "llama3"),
])
def test_unsupported_fields_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        MLAConfig.from_hf_config(dict(GLM5_CONFIG, **change))


def test_missing_fields_are_named():
    config = dict(GLM5_CONFIG)
    del config["v_head_dim"]
    with pytest.raises(ValueError, match="'v_head_dim'"):
        MLAConfig.from_hf_config(config)
    config = dict(GLM5_CONFIG)
    del config["indexer_rope_interleave"]
    with pytest.raises(ValueError, match="indexer_rope_interleave"):
        MLAConfig.from_hf_config(config)
    config = dict(DEEPSEEK_V32_EXP_CONFIG)
    del config["rope_theta"]
    with pytest.raises(ValueError, match="rope_theta"):
        MLAConfig.from_hf_config(config)


def test_every_layer_runs_its_indexer_without_a_pattern():
    assert hf_config.indexer_types(GLM5_CONFIG) == ("full",) * 78
    assert hf_config.indexer_types(DEEPSEEK_V32_EXP_CONFIG) == ("full",) * 61


def test_indexer_pattern_from_frequency_and_offset():
    """GLM-5.2's schedule (index_topk_freq 4, index_skip_topk_offset 3 over 78 layers): indexers at
    layers 0, 1, 2, 6, 10, ..., 74, 21 in all (the layer ids SGLang's resolver gives)."""
    config = dict(GLM5_CONFIG, index_topk_freq=4, index_skip_topk_offset=3)
    types = hf_config.indexer_types(config)
    full = [i for i, t in enumerate(types) if t == "full"]
    assert full[:4] == [0, 1, 2, 6] and full[-1] == 74 and len(full) == 21
    assert all(types[i] == "shared" for i in (3, 4, 5, 7, 75, 76, 77))


def test_explicit_indexer_types():
    config = dict(GLM5_CONFIG, num_hidden_layers=4, indexer_types=["full", "full", "full", "shared"])
    assert hf_config.indexer_types(config) == ("full", "full", "full", "shared")
    for bad in (["full", "shared"], ["full", "full", "full", "both"]):
        with pytest.raises(ValueError, match="indexer_types"):
            hf_config.indexer_types(dict(config, indexer_types=bad))
    with pytest.raises(ValueError, match="first layer"):
        hf_config.indexer_types(dict(config, indexer_types=["shared", "full", "full", "full"]))
    with pytest.raises(ValueError, match="index_topk_freq"):
        hf_config.indexer_types(dict(GLM5_CONFIG, index_topk_freq=0))
