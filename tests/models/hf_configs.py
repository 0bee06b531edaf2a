"""Tiny random Hugging Face transformers models of every text decoder, encoder and encoder-decoder family.

The families are transformers' own auto mappings (causal LM, masked LM, sequence-to-sequence LM). Each builds from
its config class with the sizes below (2 layers, hidden 32, vocabulary 96), plus the few settings a family needs
to stay consistent at that size. Families whose configs bundle other models (vision or audio towers, an encoder
and a decoder given separately) are not text families and are left out; so are those that still do not build tiny.
Nothing is downloaded: configs and weights are made here, at random.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import AutoConfig
from transformers.models.auto import modeling_auto

GROUPS = {
    "decoder": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    "encoder": modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    "encoder-decoder": modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
}
VOCAB = 96
BATCH, LENGTH = 2, 8
MAX_PARAMETERS = 400_000

# Every spelling the config classes use for the same few sizes.
SMALL: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=32, d_model=32, n_embd=32, embed_dim=32, dim=32, d_kv=8, d_ff=64, ffn_dim=64,
    intermediate_size=64, encoder_ffn_dim=64, decoder_ffn_dim=64, hidden_dim=64, n_inner=64,
    num_hidden_layers=2, num_layers=2, n_layer=2, n_layers=2, num_decoder_layers=2, encoder_layers=2,
    decoder_layers=2, num_attention_heads=4, num_heads=4, n_head=4, n_heads=4, encoder_attention_heads=4,
    decoder_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, num_local_experts=4, num_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    max_position_embeddings=64, max_source_positions=64, max_target_positions=64, pad_token_id=0, bos_token_id=1,
    eos_token_id=2, decoder_start_token_id=0, sep_token_id=2, cls_token_id=1,
)
_LORA = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
             v_head_dim=8, qk_head_dim=16, first_k_dense_replace=1, n_group=1, topk_group=1)
# Settings a family needs on top of SMALL (or spellings of SMALL it rejects, set to None to leave out).
FAMILY: dict[str, dict[str, Any]] = {
    "falcon": dict(head_dim=None),
    "codegen": dict(rotary_dim=8),
    "gptj": dict(rotary_dim=8),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=8),
    "deepseek_v2": _LORA,
    "deepseek_v3": _LORA,
    "youtu": _LORA,
    "glm4_moe_lite": dict(_LORA, mlp_layer_types=["dense", "sparse"]),
    "dots1": dict(layer_types=["full_attention", "sliding_attention"], sliding_window=8, first_k_dense_replace=1),
    "ctrl": dict(dff=64, n_positions=64),
    "cpmant": dict(dim_head=8, dim_ff=64, position_bias_num_buckets=16, position_bias_max_distance=32),
    "fsmt": dict(src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, langs=["en", "de"]),
    "led": dict(attention_window=[4, 4], max_encoder_position_embeddings=64, max_decoder_position_embeddings=64),
    "roc_bert": dict(pronunciation_embed_dim=16, pronunciation_vocab_size=16, shape_embed_dim=16,
                     shape_vocab_size=16),
    "mobilebert": dict(embedding_size=32, intra_bottleneck_size=32, true_hidden_size=32),
    "squeezebert": dict(embedding_size=32),
    "funnel": dict(block_sizes=[1, 1], num_decoder_layers=1, num_hidden_layers=None, num_layers=None, d_inner=64),
    "xlnet": dict(max_position_embeddings=None, d_inner=64),
    "jamba": dict(attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1, expert_layer_period=2),
    "prophetnet": dict(num_encoder_layers=2, num_decoder_layers=2, num_encoder_attention_heads=4,
                       num_decoder_attention_heads=4, num_hidden_layers=None),
    "dbrx": dict(attn_config={"kv_n_heads": 2, "rope_theta": 10000.0}, ffn_config={"ffn_hidden_size": 64,
                 "moe_num_experts": 4, "moe_top_k": 2}),
    "lfm2_moe": dict(num_dense_layers=1),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=8,
                       linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4),
    "zamba2": dict(attention_hidden_size=64, attention_head_dim=16, mamba_headdim=8, chunk_size=8,
                   adapter_rank=8, layers_block_type=["mamba", "hybrid"], hybrid_layer_ids=[1]),
    "mamba2": dict(num_heads=8, head_dim=8, expand=2, state_size=8, n_groups=1, chunk_size=8, time_step_rank=4),
    "bamba": dict(mamba_n_heads=8, mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=8),
    "granitemoehybrid": dict(mamba_n_heads=8, mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=8),
    "falcon_h1": dict(mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=8),
}


@dataclass(frozen=True)
class Family:
    name: str  # the model type, e.g. "llama"
    group: str  # "decoder", "encoder" or "encoder-decoder"
    class_name: str  # e.g. "LlamaForCausalLM"


def families() -> list[Family]:
    found: dict[str, Family] = {}
    for group, mapping in GROUPS.items():
        for name, class_name in mapping.items():
            found.setdefault(name, Family(name, group, class_name))
    return sorted(found.values(), key=lambda family: family.name)


def config(family: Family) -> Any:
    settings = {**SMALL, **FAMILY.get(family.name, {})}
    return AutoConfig.for_model(family.name, **{k: v for k, v in settings.items() if v is not None})


def why_not_built(family: Family) -> str | None:
    """Why the family is left out (not a text family, or too big even tiny), or None."""
    cfg = config(family)
    if set(getattr(cfg, "sub_configs", {})) & {"vision_config", "audio_config", "text_config", "encoder", "decoder"}:
        return f"not a text family: its config bundles {sorted(cfg.sub_configs)}"
    with torch.device("meta"):
        model = getattr(transformers, family.class_name)._from_config(cfg)
    count = sum(p.numel() for p in model.parameters())
    return f"{count} parameters at the tiny sizes" if count > MAX_PARAMETERS else None


def build(family: Family) -> torch.nn.Module:
    torch.manual_seed(0)
    return getattr(transformers, family.class_name)._from_config(config(family)).eval()


def batch(padded: bool) -> dict[str, torch.Tensor]:
    """Token ids (never the special ids 0-2) as inputs and labels; with `padded`, a mask that left-pads row 0."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, LENGTH), generator=generator)
    inputs = {"input_ids": ids, "labels": ids}
    if padded:
        mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
        mask[0, :3] = 0
        inputs["attention_mask"] = mask
    return inputs
