"""Writes the golden data of tests/flax/test_golden.py: for a DeepSeek-V3.2 (`deepseek_v32`) and a GLM-5
(`glm_moe_dsa`) attention layer of small width but the kernels' real dims (576-wide latent rows, an
indexer of 32 heads of 128, top-128), a random checkpoint in Hugging Face naming and the reference
layer's outputs and selections, computed by `transformers` in float32.

Needs torch and transformers (>= 5.2, which define both model types); neither is a dependency of the
package or of CI, which only read what this writes. From the repository root:

    python tests/golden/make_golden.py            # rewrites tests/golden/<model_type>/

Per model type, in tests/golden/<model_type>/:
  config.json        the layer's Hugging Face config (one hidden layer)
  model.safetensors  layer 0's attention weights under model.layers.0.self_attn.*, bf16 (so that the
                     bf16 layer under test holds the same numbers as the float32 reference)
  reference.npz      x [N, hidden] f32 (bf16-representable), y [N, hidden] f32: the reference layer's
                     output for one causal sequence of N = 292 tokens (a prefill of 256, an extend of
                     32, 4 decode steps on the test's side), topk [N, 128] int32: the reference
                     indexer's selection (positions past the token are the -inf fillers it returns
                     when fewer than 128 keys are visible)
The reference runs the whole sequence in one causal forward: every output depends only on the
tokens at or before it, so the test can split the sequence into steps over its paged caches.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
NUM_TOKENS = 256 + 32 + 4
SHAPES = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48,
              kv_lora_rank=512, qk_rope_head_dim=64, v_head_dim=32, index_n_heads=32,
              index_head_dim=128, index_topk=128, num_hidden_layers=1, attention_bias=False,
              attention_dropout=0.0, vocab_size=16, intermediate_size=64, max_position_embeddings=512)
CONFIGS = {
    # DeepSeek-V3.2: YaRN (factor 4 over 128 positions, so that the sequence crosses the original
    # length), NeoX-paired indexer RoPE (no key in the config), rms_norm_eps 1e-6.
    "deepseek_v32": dict(
        SHAPES, model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"],
        qk_nope_head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        n_routed_experts=2, num_experts_per_tok=1, n_shared_experts=1, moe_intermediate_size=16,
        first_k_dense_replace=1),
    # GLM-5: default RoPE with theta 1e6, interleaved indexer RoPE, rms_norm_eps 1e-5.
    "glm_moe_dsa": dict(
        SHAPES, model_type="glm_moe_dsa", architectures=["GlmMoeDsaForCausalLM"],
        qk_nope_head_dim=48, qk_head_dim=112, rms_norm_eps=1e-5, rope_interleave=True,
        indexer_rope_interleave=True, rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
        indexer_types=["full"], mlp_layer_types=["dense"], n_routed_experts=2, num_experts_per_tok=1,
        n_shared_experts=1, moe_intermediate_size=16, first_k_dense_replace=1),
}


def attention_module(model_type: str, config_dict: dict):
    from transformers import AutoConfig

    config = AutoConfig.for_model(**config_dict)
    config._attn_implementation = "eager"
    if model_type == "deepseek_v32":
        from transformers.models.deepseek_v32 import modeling_deepseek_v32 as modeling
        return config, modeling.DeepseekV32Attention(config, 0), modeling.DeepseekV32RotaryEmbedding(config)
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as modeling
    return config, modeling.GlmMoeDsaAttention(config, 0), modeling.GlmMoeDsaRotaryEmbedding(config)


def randomize(attention: torch.nn.Module, generator: torch.Generator) -> None:
    """Weights of unit-variance outputs (Linear: N(0, 1/fan_in)), norm scales near 1, rounded to bf16."""
    with torch.no_grad():
        for name, param in attention.named_parameters():
            if param.ndim == 2:
                value = torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5
                if name.endswith("indexer.wq_b.weight"):
                    value *= 2.0  # index scores spread wide enough that the top-k is a real choice
            elif name.endswith("bias"):
                value = 0.1 * torch.randn(param.shape, generator=generator)
            else:
                value = 1.0 + 0.1 * torch.randn(param.shape, generator=generator)
            param.copy_(value.to(torch.bfloat16).float())


def reference(model_type: str) -> None:
    out_dir = os.path.join(HERE, model_type)
    os.makedirs(out_dir, exist_ok=True)
    config_dict = CONFIGS[model_type]
    config, attention, rotary = attention_module(model_type, config_dict)
    generator = torch.Generator().manual_seed(0 if model_type == "deepseek_v32" else 1)
    randomize(attention, generator)
    attention.eval()
    x = torch.randn((1, NUM_TOKENS, config.hidden_size), generator=generator).to(torch.bfloat16).float()
    positions = torch.arange(NUM_TOKENS)[None]
    position_embeddings = rotary(x, positions)
    mask = torch.full((NUM_TOKENS, NUM_TOKENS), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        y = attention(x, position_embeddings, mask, position_ids=positions)[0]
        q_resid = attention.q_a_layernorm(attention.q_a_proj(x))
        topk = attention.indexer(x, q_resid, position_embeddings, mask[:, 0], positions)
    weights = {f"model.layers.0.self_attn.{name}": param.detach().to(torch.bfloat16).contiguous()
               for name, param in attention.named_parameters()}
    save_file(weights, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config_dict, f, indent=1, sort_keys=True)
    np.savez_compressed(os.path.join(out_dir, "reference.npz"), x=x[0].numpy(),
                        y=y[0].numpy().astype(np.float32), topk=topk[0].numpy().astype(np.int32))
    sizes = {name: os.path.getsize(os.path.join(out_dir, name)) for name in os.listdir(out_dir)}
    print(f"{model_type}: {sizes}")


if __name__ == "__main__":
    for model_type in CONFIGS:
        reference(model_type)
