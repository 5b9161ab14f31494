"""The one place that touches transformers' internals: the experts-implementation registry, the checkpoint
renamings and conversions, the model skeleton and its initialisation, the decoder body. A transformers release
that moves one of them is mended here alone (tests/test_layers.py keeps the rest of usaf off these names)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    apply_renamings,
    dot_natural_key,
    rename_source_key,
)
from transformers.integrations.moe import ExpertsInterface
from transformers.utils import logging

__all__ = [
    "WeightConverter",
    "WeightRenaming",
    "apply_renamings",
    "build_skeleton",
    "checkpoint_renamings",
    "compute_missing_buffers",
    "conversion_mapping",
    "decoder_body",
    "dot_natural_key",
    "gated_activation",
    "mark_loaded",
    "quiet_progress_bars",
    "register_experts_implementation",
    "rename_source_key",
    "use_experts_implementation",
]


# ---- experts implementations ----------------------------------------------------------------------------------


def register_experts_implementation(name: str, forward) -> None:
    """Make `name` a valid `experts_implementation` that runs `forward` (idempotent)."""
    if name not in ExpertsInterface._global_mapping:
        ExpertsInterface.register(name, forward)


def use_experts_implementation(model: nn.Module, experts_modules, name: str) -> None:
    """Dispatch every fused experts module of `model` to the implementation `name`, including modules whose own
    config was copied before the model-wide switch (their config's private field decides)."""
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(name)
    for experts in experts_modules:
        config_of = getattr(experts, "config", None)
        if config_of is not None and config_of._experts_implementation != name:
            config_of._experts_implementation_internal = name


def gated_activation(experts: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """act(gate) * up of a fused gate_up projection, as the experts module itself combines them."""
    return experts._apply_gate(h)


# ---- checkpoint names and conversions -------------------------------------------------------------------------


def conversion_mapping(model: nn.Module) -> list:
    """The renamings and converters transformers applies when loading `model`'s checkpoints."""
    return get_model_conversion_mapping(model)


def checkpoint_renamings(model: nn.Module) -> list:
    """The key renamings transformers applies when loading `model`'s checkpoints (and reverses when saving)."""
    return [m for m in get_model_conversion_mapping(model) if isinstance(m, WeightRenaming)]


# ---- the model skeleton ---------------------------------------------------------------------------------------


def build_skeleton(config, dtype: torch.dtype | None = None) -> nn.Module:
    """The causal-LM model of `config` on the meta device: no memory, no initialisation cost."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, **({"dtype": dtype} if dtype is not None else {}))
    return model.eval()


def compute_missing_buffers(model: nn.Module) -> None:
    """Buffers no checkpoint holds (rotary frequencies, embedding scales) are made real and computed by the
    model's own initialisation, as `from_pretrained` does; loaded tensors carry `mark_loaded`, which that
    initialisation respects."""
    for module in model.modules():
        missing = [n for n, b in module._buffers.items() if b is not None and b.device.type == "meta"]
        if missing:
            for name in missing:
                module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
            model._init_weights(module)


def mark_loaded(tensor: torch.Tensor) -> None:
    """Tell transformers' initialisation to leave a loaded tensor alone."""
    tensor._is_hf_initialized = True


def decoder_body(model: nn.Module) -> nn.Module:
    """The decoder stack under the language-model head (what returns hidden states); a bare decoder is its own."""
    return model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)


def quiet_progress_bars() -> None:
    """Weight-loading bars would bury usaf's own progress."""
    logging.disable_progress_bar()
