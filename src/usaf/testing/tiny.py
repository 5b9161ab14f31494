"""Tiny random configurations of the MoE families usaf is tested on (no downloads: built from configs)."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

# Sizes chosen so that no expert tensor shape coincides with an activation shape in the tests.
_COMMON = dict(
    hidden_size=32,
    intermediate_size=40,
    moe_intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=97,
    max_position_embeddings=64,
    num_experts=6,
    num_local_experts=6,
    n_routed_experts=6,
    num_experts_per_tok=2,
    top_k_experts=2,
    tie_word_embeddings=False,
)

FAMILIES: dict[str, dict] = {
    "qwen3_moe": {},
    "qwen2_moe": dict(shared_expert_intermediate_size=40),
    "olmoe": dict(eos_token_id=1, pad_token_id=0, bos_token_id=2),
    "mixtral": {},
    "gpt_oss": dict(layer_types=["full_attention", "sliding_attention"], sliding_window=8),
    "deepseek_v3": dict(
        head_dim=None,
        num_key_value_heads=4,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        n_shared_experts=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        num_hidden_layers=3,
    ),
    "glm4_moe": dict(
        n_group=1, topk_group=1, first_k_dense_replace=1, n_shared_experts=1, num_hidden_layers=3
    ),
    "granitemoe": {},
    "gemma4_text": dict(
        enable_moe_block=True,
        hidden_size_per_layer_input=0,
        sliding_window=8,
        global_head_dim=8,
        layer_types=["sliding_attention", "full_attention"],
        num_global_key_value_heads=2,
    ),
}


# Families name the same quantity differently; an override of one name sets them all.
_ALIASES = [
    ("num_experts", "num_local_experts", "n_routed_experts"),
    ("num_experts_per_tok", "top_k_experts"),
]


def tiny_config(family: str, **overrides):
    for names in _ALIASES:
        given = [overrides[n] for n in names if n in overrides]
        if given:
            overrides = {**{n: given[0] for n in names}, **overrides}
    kwargs = {**_COMMON, **FAMILIES.get(family, {}), **overrides}  # other families: the common sizes alone
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    return AutoConfig.for_model(family, **kwargs)


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A randomly initialised tiny model of `family`, with routers and biases made non-trivial."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=dtype)
    randomize_routers_and_biases(model)
    return model.eval()


@torch.no_grad()
def randomize_routers_and_biases(model) -> None:
    """Zero-initialised routers and biases would hide routing and bias bugs: give them random values."""
    for name, param in model.named_parameters():
        if param.abs().sum() == 0 or name.endswith(("router.weight", "gate.weight", "_bias", "router.bias")):
            param.normal_(0.0, 0.5 if "router" in name or "gate" in name else 0.05)
