"""Tiny random Hugging Face models, built locally with transformers (the test-only reference)."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=97, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=112, max_position_embeddings=256)

# One config per family, each exercising that family's distinctive features.
FAMILIES = {
    "llama": dict(COMMON, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                  rope_theta=500000.0, tie_word_embeddings=True),
    "mistral": dict(COMMON, sliding_window=5, head_dim=24),
    "qwen2": dict(COMMON, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                        "original_max_position_embeddings": 64}),
    "mixtral": dict(COMMON, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02),
    "qwen2_moe": dict(COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      shared_expert_intermediate_size=80, norm_topk_prob=False,
                      decoder_sparse_step=1, mlp_only_layers=[1]),
}


def hf_classes(family: str):
    import transformers as tf

    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
        "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM),
    }[family]


def make_hf_model(family: str, path: Path, seed: int = 0, **overrides):
    """Build a random tiny HF model of `family`, save it to `path`, return it in eval mode."""
    config_cls, model_cls = hf_classes(family)
    torch.manual_seed(seed)
    config = config_cls(**{**FAMILIES[family], **overrides}, attn_implementation="sdpa")
    model = model_cls(config).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a missed mapping shows up
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return model
