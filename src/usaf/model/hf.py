"""The one place that touches transformers' internals: the experts-implementation registry, the checkpoint
renamings and conversions, the model skeleton and its initialisation, the decoder body; and the loaders of a
model's config, tokenizer and weights (`load_config`, `load_tokenizer`, `load_causal_lm`), which never run code
that a model folder ships (config.json's `auto_map`). A transformers release that moves one of them is mended here
alone (tests/package/test_layers.py keeps the rest of usaf off these names); `usaf.model.hf_guard` lists them and
checks them at import, and each use below first requires its name (one line, not an AttributeError mid-step)."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    apply_renamings,
    dot_natural_key,
    rename_source_key,
)
from transformers.integrations.moe import ExpertsInterface
from transformers.utils import chat_template_utils, logging

from usaf.errors import ModelError
from usaf.model.hf_guard import require

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
    "load_causal_lm",
    "load_config",
    "load_tokenizer",
    "mark_loaded",
    "quiet_progress_bars",
    "register_experts_implementation",
    "rename_source_key",
    "use_experts_implementation",
]


# ---- loading: no model code, ever ------------------------------------------------------------------------------
# A model folder's .py files are code from whoever published it: transformers runs them when config.json's auto_map
# names them and trust_remote_code allows it (or a prompt on stdin is answered 'y'). usaf passes False everywhere,
# so a model_type transformers knows is built by transformers' own class and any other is refused in one line.


def load_config(path, **kwargs):
    """AutoConfig.from_pretrained without model code."""
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=False, **kwargs)
    except ValueError as err:
        raise _custom_code_error(path, err) from None


def text_config(config):
    """The config of a model's text part (a composite config's text_config; the config itself otherwise)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def max_positions(config) -> int | None:
    """The model's max_position_embeddings (its text part's), or None where its config does not say."""
    positions = getattr(text_config(config), "max_position_embeddings", None)
    return positions if isinstance(positions, int) and positions > 0 else None


def load_tokenizer(path, **kwargs):
    """AutoTokenizer.from_pretrained without model code."""
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False, **kwargs)
    except ValueError as err:
        raise _custom_code_error(path, err) from None


def load_causal_lm(path, **kwargs) -> nn.Module:
    """AutoModelForCausalLM.from_pretrained without model code."""
    try:
        return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=False, **kwargs)
    except ValueError as err:
        raise _custom_code_error(path, err) from None


def _custom_code_error(path, err: ValueError) -> Exception:
    """transformers' refusal of a model's own code as usaf's one line (ModelError); any other error as it was."""
    if "trust_remote_code" not in str(err):
        return err
    folder = Path(path).expanduser()
    named = f"{folder / 'config.json'}'s auto_map" if folder.is_dir() else f"{path}'s auto_map (config.json)"
    for name in ("config.json", "tokenizer_config.json"):
        try:
            auto_map = json.loads((folder / name).read_text()).get("auto_map")
        except (OSError, ValueError, AttributeError):
            continue
        if auto_map:
            named = f"{folder / name}'s auto_map ({', '.join(sorted(map(str, auto_map)))})"
            break
    return ModelError(
        f"{named} asks to run the model folder's own Python code, and usaf never runs model code; use a "
        "model whose model_type transformers knows (upgrade transformers if it is newer), or a copy of the "
        "model converted to one."
    )


# ---- experts implementations ----------------------------------------------------------------------------------


def register_experts_implementation(name: str, forward) -> None:
    """Make `name` a valid `experts_implementation` that runs `forward` (idempotent)."""
    require("_global_mapping")
    if name not in ExpertsInterface._global_mapping:
        ExpertsInterface.register(name, forward)


def use_experts_implementation(model: nn.Module, experts_modules, name: str) -> None:
    """Dispatch every fused experts module of `model` to the implementation `name`, including modules whose own
    config was copied before the model-wide switch (their config's private field decides)."""
    require("_experts_implementation", "_experts_implementation_internal")
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(name)
    for experts in experts_modules:
        config_of = getattr(experts, "config", None)
        if config_of is not None and config_of._experts_implementation != name:
            config_of._experts_implementation_internal = name


def gated_activation(experts: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """act(gate) * up of a fused gate_up projection, as the experts module itself combines them."""
    require("_apply_gate")
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
        model = AutoModelForCausalLM.from_config(
            config, trust_remote_code=False, **({"dtype": dtype} if dtype is not None else {})
        )
    return model.eval()


def compute_missing_buffers(model: nn.Module) -> None:
    """Buffers no checkpoint holds (rotary frequencies, embedding scales) are made real and computed by the
    model's own initialisation, as `from_pretrained` does; loaded tensors carry `mark_loaded`, which that
    initialisation respects."""
    require("_init_weights")
    for module in model.modules():
        missing = [n for n, b in module._buffers.items() if b is not None and b.device.type == "meta"]
        if missing:
            for name in missing:
                module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
            model._init_weights(module)


def mark_loaded(tensor: torch.Tensor) -> None:
    """Tell transformers' initialisation to leave a loaded tensor alone."""
    require("_is_hf_initialized")
    tensor._is_hf_initialized = True


def transformers_scheduler(name: str, optimizer, warmup: int, total: int, extra: dict | None):
    """transformers' `get_scheduler(name, ...)`, imported when asked: transformers.optimization imports its
    Trainer's utilities, and with them PEFT and bitsandbytes (seconds, and a warning on the CPU), which a run on
    usaf's own schedule never needs."""
    from transformers.optimization import get_scheduler

    return get_scheduler(name, optimizer, warmup, total, scheduler_specific_kwargs=extra)


def decoder_body(model: nn.Module) -> nn.Module:
    """The decoder stack under the language-model head (what returns hidden states); a bare decoder is its own."""
    return model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)


def quiet_progress_bars() -> None:
    """Weight-loading bars would bury usaf's own progress."""
    logging.disable_progress_bar()


# ---- chat templates ------------------------------------------------------------------------------------------------


def chat_template_environment():
    """transformers' own Jinja environment for chat templates (its extensions, filters, globals and tests)."""
    require("_cached_compile_jinja_template")
    return chat_template_utils._cached_compile_jinja_template("").environment


@contextmanager
def chat_template_compiler(compile_template):
    """transformers' chat-template compiler replaced by `compile_template` for the duration: transformers has no
    hook for the environment a template renders in, and usaf renders templates within bounds (usaf.data.render)."""
    require("_compile_jinja_template")
    saved = chat_template_utils._compile_jinja_template
    chat_template_utils._compile_jinja_template = compile_template
    try:
        yield
    finally:
        chat_template_utils._compile_jinja_template = saved
