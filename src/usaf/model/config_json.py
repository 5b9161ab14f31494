"""A model's config.json checked before anything is built from it (train, eval, select, prepare, export, plan).

transformers fills a missing shape field with its class's default (a `hidden_size` of 2048, a vocabulary of 151 936)
and builds whatever a negative size or a top-k above the expert count asks for, so a damaged file would fail deep in
the loader, at the first forward, or plan a model that is not there. Here it is one line naming the field."""

from __future__ import annotations

from usaf.errors import ModelError

# the shape every MoE decoder has; a family's config class tells which of these (and which spelling) it uses
REQUIRED = ("hidden_size", "num_hidden_layers", "vocab_size")
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
EXPERTS_PER_TOKEN = (
    "num_experts_per_tok",
    "experts_per_token",
    "num_experts_per_token",
    "moe_top_k",
    "top_k_experts",
)
# further widths that, where present and not null, must be positive integers too
SIZES = (
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "moe_intermediate_size",
    "max_position_embeddings",
)


def text_fields(config: dict) -> dict:
    """The language model's fields: multimodal configs keep them under text_config."""
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def check_model_config(config: dict, where: str) -> None:
    """Raise a ModelError naming `where` (the config.json) and the field when the model's shape is missing, not a
    positive integer, or impossible (more experts per token than experts)."""
    if not isinstance(config, dict):
        raise ModelError(f"{where} does not hold a JSON object; restore the model's original config.json.")
    text = text_fields(config)
    aliases, family_fields = _family(config)
    canonical = {key: aliases.get(key, key) for key in text}
    wanted = list(REQUIRED)
    if family_fields is None:  # a family transformers does not know: any spelling of the expert count
        counts = [k for k in EXPERT_COUNTS if k in text]
        if not counts:
            wanted.append(EXPERT_COUNTS[0])
    else:
        wanted += [k for k in EXPERT_COUNTS if k in family_fields][:1]
    for name in wanted:
        target = aliases.get(name, name)
        if any(k == name or c == target for k, c in canonical.items()):
            continue
        if name in EXPERT_COUNTS:
            spellings = [k for k in EXPERT_COUNTS if aliases.get(k, k) == target] or [name]
            what = f"the number of experts ({' or '.join(spellings)})"
        else:
            what = repr(name)
        raise ModelError(
            f"{where} lacks {what}; restore the model's original config.json (transformers would silently use a "
            "default that the weights do not fit)."
        )
    for name in (*REQUIRED, *EXPERT_COUNTS, *EXPERTS_PER_TOKEN, *SIZES):
        if name not in text or (text[name] is None and name not in REQUIRED):
            continue
        value = text[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelError(
                f"{where}: {name!r} must be a positive integer, got {value!r}; correct it (the model's original "
                "config.json has its value)."
            )
    experts = next((text[k] for k in EXPERT_COUNTS if text.get(k) is not None), None)
    per_token = next(((k, text[k]) for k in EXPERTS_PER_TOKEN if text.get(k) is not None), None)
    if experts is not None and per_token is not None and per_token[1] > experts:
        raise ModelError(
            f"{where}: {per_token[0]} = {per_token[1]} is more than the model's {experts} experts; correct it (at "
            f"most {experts})."
        )


def _family(config: dict) -> tuple[dict, set | None]:
    """(attribute_map, the fields its config class has) of the config's model_type, or ({}, None) when transformers
    does not know it."""
    try:
        from transformers import CONFIG_MAPPING

        cls = CONFIG_MAPPING[config.get("model_type")]
    except Exception:  # an unknown or missing model_type: check_model_files and the planner name it
        return {}, None
    if isinstance(config.get("text_config"), dict):
        cls = (getattr(cls, "sub_configs", None) or {}).get("text_config", cls)
    try:
        default = cls()
    except Exception:
        return dict(getattr(cls, "attribute_map", {}) or {}), None
    names = {n for n in (*REQUIRED, *EXPERT_COUNTS) if hasattr(default, n)}
    return dict(getattr(cls, "attribute_map", {}) or {}), names
