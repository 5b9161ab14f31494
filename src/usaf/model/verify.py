"""A model's weights checked against its config.json before anything trains or evaluates on them.

transformers initialises at random a parameter the checkpoint lacks and drops, with a warning, a tensor the model
does not expect, so a config.json that disagrees with its weights (one layer more, another hidden size or expert
count) would train a partly random model without a word. `usaf.io.source.SourceCheckpoint` maps the checkpoint's
tensors (from their headers only) onto the model built from the config, as transformers' loader does; every
disagreement it finds is said here, in one line naming the tensor and the config field most likely responsible."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from torch import nn

from usaf.errors import ModelError
from usaf.model.config_json import EXPERT_COUNTS
from usaf.model.hf import text_config

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# the config fields that set a weight's dimensions, most telling first: a dimension that differs is blamed on the
# fields whose value (or product) it is
_WIDTHS = (
    "hidden_size",
    "vocab_size",
    *EXPERT_COUNTS,
    "moe_intermediate_size",
    "intermediate_size",
    "head_dim",
)
_RESTORE = "restore the model's original config.json, or the weights that belong to it"


def _value(config, name: str):
    value = getattr(config, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _dimension_fields(config) -> dict[int, list[str]]:
    """{dimension: the config fields (or products of them) that set it}."""
    config = text_config(config)
    out: dict[int, list[str]] = {}

    def add(value, name):
        if value is not None and name not in out.setdefault(value, []):
            out[value].append(name)

    present = set(config.to_dict()) if hasattr(config, "to_dict") else set()
    for name in _WIDTHS:
        if name in present or name not in EXPERT_COUNTS:  # an expert count as config.json spells it
            add(_value(config, name), name)
    head_dim = _value(config, "head_dim")
    for heads in ("num_attention_heads", "num_key_value_heads"):
        if head_dim is not None and _value(config, heads) is not None:
            add(_value(config, heads) * head_dim, f"head_dim (× {heads})")
    for name in ("moe_intermediate_size", "intermediate_size"):
        if _value(config, name) is not None:
            add(2 * _value(config, name), name)  # gate and up projections fused
    return out


def _blame(config, got: tuple[int, ...], want: tuple[int, ...]) -> str:
    """The config field that makes a weight `want` where the file holds `got`, as `field = value` (the most
    telling one when several fields have that value)."""
    fields = _dimension_fields(config)
    if len(got) == len(want):
        for g, w in zip(got, want, strict=True):
            if g != w and w in fields:
                return f"{fields[w][0]} = {w}"
    return "shape fields"


def misshapen(folder: Path, keys: list[str], name: str, got, want, config) -> ModelError:
    if keys == [name]:
        what = f"tensor '{name}' is {list(got)}"
    else:
        what = f"tensors '{keys[0]}', ... ({len(keys)}) make '{name}' {list(got)}"
    return ModelError(
        f"{folder}: {what}, but config.json's {_blame(config, got, want)} makes it {list(want)}: the config and "
        f"the weights disagree; {_RESTORE}."
    )


def unmappable(folder: Path, keys: list[str], name: str, want, err: Exception) -> ModelError:
    return ModelError(
        f"{folder}: tensors '{keys[0]}', ... ({len(keys)}) cannot form '{name}' {list(want)} as config.json "
        f"describes it ({str(err).splitlines()[0] if str(err) else type(err).__name__}): the config and the weights "
        f"disagree; {_RESTORE}."
    )


def missing(folder: Path, name: str, config) -> ModelError:
    return ModelError(
        f"{folder}: the weights have no tensor for '{name}', which config.json asks for ({_field_of(name, config)})"
        f": the config and the weights disagree (transformers would initialise it at random); {_RESTORE}."
    )


def check_unexpected(folder: Path, model: nn.Module, keys: Iterable[str]) -> None:
    """Checkpoint tensors that map onto nothing the model has: an error, unless transformers itself expects such
    leftovers (the model's `_keys_to_ignore_on_load_unexpected`, old copies of buffers it now computes)."""
    patterns = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
    tails = {".".join(name.split(".")[-2:]) for name, _ in model.named_buffers()}
    for key in keys:
        if any(re.search(p, key) for p in patterns) or ".".join(key.split(".")[-2:]) in tails:
            continue
        if key.endswith("position_ids"):
            continue
        raise ModelError(
            f"{folder}: the weights hold tensor '{key}', which config.json does not expect "
            f"({_field_of(key, model.config)}): the config and the weights disagree; {_RESTORE}."
        )


def _field_of(name: str, config) -> str:
    """The config field a tensor's existence depends on, as `field = value`."""
    text = text_config(config)
    if _LAYER.search(name) is not None:
        layers = _value(text, "num_hidden_layers")
        return f"num_hidden_layers = {layers}"
    if "lm_head" in name or "embed" in name:
        return f"tie_word_embeddings = {getattr(text, 'tie_word_embeddings', None)}"
    return f"model_type = {getattr(config, 'model_type', None)}"
