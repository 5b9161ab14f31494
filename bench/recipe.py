"""The training recipe bench/compare.py and bench/quality.py share, so that speed and quality are measured on the
same methods: PEFT LoRA's shape, the stock baselines' trainable parameters and the learning-rate schedule."""

from __future__ import annotations

import math

LORA_RANK, LORA_ALPHA = 16, 32
LORA_ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA_EXPERTS = [
    "mlp.experts.gate_up_proj",
    "mlp.experts.down_proj",
]  # fused 3-D parameters: target_parameters


def lr_factor(total: int):
    """Linear warm-up over 10 % of `total` steps, then cosine down to 10 % of the peak (a LambdaLR factor)."""
    warmup = max(1, total // 10)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def stock_baseline(model, kind: str):
    """A baseline on transformers' own `grouped_mm` experts with exactly its trainable parameters: "full"
    (everything), "experts" (every expert weight and router), "routers", "lora" (PEFT LoRA on attention and the
    fused experts), anything else frozen. Returns the model (LoRA wraps it)."""
    model.set_experts_implementation("grouped_mm")  # the fastest stock path
    model.requires_grad_(kind == "full")
    if kind in ("experts", "routers"):
        from usaf.model.layout import find_moe_layers

        for layer in find_moe_layers(model):
            if layer.router is not None:
                layer.router.requires_grad_(True)
            if kind == "experts":
                for t in layer.tensors:
                    getattr(layer.experts, t.name).requires_grad_(True)
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(
            r=LORA_RANK,
            lora_alpha=LORA_ALPHA,
            lora_dropout=0.0,
            target_modules=LORA_ATTENTION,
            target_parameters=LORA_EXPERTS,
        )
        model = get_peft_model(model, config)
    return model
