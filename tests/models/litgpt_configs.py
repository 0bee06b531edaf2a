"""Shrunk LitGPT configurations: one per distinct architecture in `litgpt.config.configs`."""

from __future__ import annotations

from litgpt.config import Config, configs


def architecture_key(config: Config) -> tuple:
    """What makes model.py take a different path: the config fields that select code."""
    return (
        config.mlp_class_name, config.norm_class_name, config.parallel_residual, config.shared_attention_norm,
        config.bias, config.attention_logit_softcapping is not None, config.final_logit_softcapping is not None,
        config.rotary_percentage < 1, config.n_query_groups == config.n_head, config.n_query_groups == 1,
        config.post_attention_norm, config.post_mlp_norm, config.norm_qk, config.norm_qk_type,
        config.sliding_window_size is not None, config.rope_adjustments is not None,
        config.attention_scores_scalar is not None, config.scale_embeddings, config.gelu_approximate,
        config.rope_interleave, config.rope_indices is not None, config.n_expert_groups is not None,
        config.lm_head_bias, config.attn_bias, config.latent_attention is not None,
    )


def shrunk(name: str) -> Config:
    full = Config.from_name(name)
    if full.n_query_groups == full.n_head:
        groups = 4
    elif full.n_query_groups == 1:
        groups = 1
    else:
        groups = 2
    overrides = dict(
        n_layer=2, n_embd=64, n_head=4, n_query_groups=groups, head_size=16, intermediate_size=96,
        padded_vocab_size=96, vocab_size=96, block_size=32,
    )
    if full.sliding_window_size is not None:
        overrides["sliding_window_size"] = 8
    if full.n_expert:
        overrides.update(n_expert=4, n_expert_per_token=2, moe_intermediate_size=32)
        if full.n_expert_groups:
            overrides.update(n_expert_groups=2, n_topk_groups=1, n_topk_scores_per_group=2)
    if full.latent_attention is not None:
        overrides["latent_attention"] = dict(full.latent_attention, q_lora_rank=32, kv_lora_rank=16,
                                             qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
    if full.rope_indices is not None:
        overrides["rope_indices"] = [i % 2 for i in range(2)]
    return Config.from_name(name, **overrides)


def representative_names() -> list[str]:
    seen: dict[tuple, str] = {}
    for entry in configs:
        config = Config(**entry)
        seen.setdefault(architecture_key(config), entry["name"])
    return sorted(seen.values())
