"""A model's shape from its config.json alone: parameters by role, from the transformers skeleton on the meta device
(exact) or from the config's fields (families transformers does not know); presets of known models."""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from usaf.errors import ModelError, UsafError, first_line
from usaf.model.config_json import EXPERT_COUNTS, check_model_config, text_fields
from usaf.model.layout import find_moe_layers, intermediate_size
from usaf.model.targets import find_target_weights
from usaf.registry import TARGET_KINDS


def _presets_dir():
    return resources.files("usaf").joinpath("presets")  # package data (see pyproject.toml)


def list_presets() -> list[str]:
    names = (p.name for p in _presets_dir().iterdir())
    return sorted(n[: -len(".json")] for n in names if n.endswith(".json"))


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ModelError(f"{path} is not valid JSON: {err}.") from err
    if not isinstance(data, dict):
        raise ModelError(f"{path} does not hold a config object.")
    return data


def load_model_config(model: str) -> tuple[str, dict]:
    """(name, config) of a model directory, a config.json, a preset name, or a preset's Hugging Face repo id."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} has no config.json.")
        path = path / "config.json"
        config = _read_json(path)
        check_model_config(config, str(path))
        return path.parent.name, config
    if path.is_file():
        config = _read_json(path)
        check_model_config(config, str(path))
        return (path.parent.name if path.name == "config.json" else path.stem), config
    presets = list_presets()
    for name in presets:
        config = json.loads(_presets_dir().joinpath(f"{name}.json").read_text())
        if model.lower() in (name, str(config.get("_source", "")).lower()):
            return name, config
    raise ModelError(
        f"Unknown model {model!r}: not a directory, a config.json or a preset. Presets: {', '.join(presets)}."
    )


def _first(config: dict, *names, default=None):
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return default


@dataclass
class ModelShape:
    """What the planner needs of a model: parameter counts by role, matrix shapes, activation widths per token."""

    name: str
    model_type: str
    shapes_from: str  # "transformers skeleton" or "config formulas"
    hidden_size: int
    num_layers: int
    vocab_size: int
    num_moe_layers: int
    num_experts: int
    experts_per_token: int
    moe_intermediate: int  # width of one expert
    expert_matrices: tuple  # ((count, rows, cols), ...): every expert's weight matrices, by shape
    expert_biases: int
    router_params: int
    dense_params: int  # everything else: attention, embeddings, lm_head, norms, shared experts, dense MLPs
    dense_matmul: int  # the matmul weights among them that every token passes (all but the input embeddings)
    embedding_params: int  # the input embedding table (some authors leave it out of "active" counts)
    q_width: int
    k_width: int
    v_width: int
    o_width: int  # attention output before o_proj
    qk_norm: bool
    softmax_attention_layers: int
    sliding_window: int | None
    sliding_layers: int
    shared_intermediate: int  # always-on expert width per MoE layer
    dense_intermediate: int  # MLP width of the dense (non-MoE) layers
    # weights of each select.targets role beyond the experts (attention, dense_mlp, norms, embeddings, lm_head)
    target_params: dict = dataclasses.field(default_factory=dict)

    @property
    def expert_weights(self) -> int:
        return sum(n * r * c for n, r, c in self.expert_matrices)

    @property
    def expert_rows(self) -> int:
        return sum(n * r for n, r, _ in self.expert_matrices)

    @property
    def total_params(self) -> int:
        return self.expert_weights + self.expert_biases + self.router_params + self.dense_params

    @property
    def active_params(self) -> int:
        share = self.experts_per_token / max(1, self.num_experts)
        return self.total_params - round((self.expert_weights + self.expert_biases) * (1 - share))

    @property
    def largest_expert_matrix(self) -> int:
        return max(r * c for _, r, c in self.expert_matrices)


def model_shape(config: dict, name: str = "model") -> ModelShape:
    """Shapes from the transformers skeleton on the meta device; config formulas where transformers cannot build
    the model (a model_type it does not know)."""
    try:
        return _shape_from_skeleton(config, name)
    except UsafError:
        raise
    except Exception as err:
        warnings.warn(
            f"transformers cannot build {name} ({type(err).__name__}: {first_line(err)}); planning from formulas.",
            stacklevel=2,
        )
        return _shape_from_formulas(config, name)


def _geometry(text: dict) -> dict:
    """Attention and MLP widths per token from the config's fields (the same for both shape sources)."""
    hidden = int(text["hidden_size"])
    heads = int(_first(text, "num_attention_heads", default=1))
    kv_heads = int(_first(text, "num_key_value_heads", default=heads))
    head_dim = int(_first(text, "head_dim", default=hidden // heads))
    if text.get("kv_lora_rank"):  # multi-head latent attention: keys and values expanded per head
        qk_dim = int(text.get("qk_nope_head_dim", 0)) + int(text.get("qk_rope_head_dim", 0))
        v_dim = int(text.get("v_head_dim", head_dim))
        q_width, k_width, v_width, o_width = heads * qk_dim, heads * qk_dim, heads * v_dim, heads * v_dim
    else:
        q_width, k_width, v_width, o_width = (
            heads * head_dim,
            kv_heads * head_dim,
            kv_heads * head_dim,
            heads * head_dim,
        )
    layers = int(text["num_hidden_layers"])
    kinds = list(text.get("layer_types") or [])
    if not kinds and text.get("full_attention_interval"):
        interval = int(text["full_attention_interval"])
        kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    kinds = kinds or ["full_attention"] * layers
    window = text.get("sliding_window") if "sliding_attention" in kinds else None
    n_shared = int(_first(text, "n_shared_experts", "num_shared_experts", default=0))
    moe_width = int(_first(text, "moe_intermediate_size", "intermediate_size", default=0))
    return dict(
        q_width=q_width,
        k_width=k_width,
        v_width=v_width,
        o_width=o_width,
        softmax_attention_layers=sum(
            k in ("full_attention", "sliding_attention", "attention") for k in kinds
        ),
        sliding_window=int(window) if window else None,
        sliding_layers=kinds.count("sliding_attention"),
        shared_intermediate=int(
            _first(text, "shared_expert_intermediate_size", default=n_shared * moe_width)
        ),
        dense_intermediate=int(_first(text, "intermediate_size", default=0)),
    )


def _experts_per_token(text: dict) -> int:
    return int(
        _first(
            text,
            "num_experts_per_tok",
            "experts_per_token",
            "num_experts_per_token",
            "moe_top_k",
            "top_k_experts",
            default=1,
        )
    )


def _shape_from_skeleton(config: dict, name: str) -> ModelShape:
    model = _meta_skeleton(config)
    text = text_fields(config)
    layers = find_moe_layers(model)
    expert_ids, router_ids, matrices, expert_biases = _expert_tensors(layers)
    embedding = model.get_input_embeddings().weight
    router = dense = 0
    for param in model.parameters():  # tied parameters count once
        if id(param) in router_ids:
            router += param.numel()
        elif id(param) not in expert_ids:
            dense += param.numel()
    first = layers[0]
    qk_norm = any(n.endswith(("q_norm", "k_norm")) for n, _ in model.named_modules())
    target_params = _skeleton_target_params(model, layers)
    return ModelShape(
        name=name,
        model_type=str(config.get("model_type")),
        shapes_from="transformers skeleton",
        hidden_size=int(text["hidden_size"]),
        num_layers=int(text["num_hidden_layers"]),
        vocab_size=int(text["vocab_size"]),
        num_moe_layers=len(layers),
        num_experts=first.num_experts,
        experts_per_token=_experts_per_token(text),
        moe_intermediate=intermediate_size(first.experts),
        expert_matrices=tuple((n, r, c) for (r, c), n in sorted(matrices.items())),
        expert_biases=expert_biases,
        router_params=router,
        dense_params=dense,
        dense_matmul=dense - embedding.numel() if model.get_output_embeddings() is not None else dense,
        embedding_params=embedding.numel(),
        qk_norm=qk_norm,
        target_params=target_params,
        **_geometry(text),
    )


def _meta_skeleton(config: dict):
    """The model of `config` on the meta device (shapes, no memory)."""
    import torch
    import transformers

    # The published fields only: a quantization_config would ask transformers for quantizer kernels.
    fields_ = {k: v for k, v in config.items() if not k.startswith("_") and k != "quantization_config"}
    if "model_type" not in fields_:
        raise ValueError("the config has no model_type")
    hf_config = transformers.AutoConfig.for_model(**fields_)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_config(hf_config, trust_remote_code=False)


def _expert_tensors(layers) -> tuple[set, set, dict, int]:
    """(ids of the expert tensors, ids of the routers' parameters, {(rows, cols): matrices}, expert bias
    entries) over the MoE layers."""
    expert_ids, router_ids, matrices, expert_biases = set(), set(), {}, 0
    for layer in layers:
        for t in layer.tensors:
            tensor = getattr(layer.experts, t.name)
            expert_ids.add(id(tensor))
            if t.is_bias:
                expert_biases += tensor.numel()
            else:
                key = tuple(tensor.shape[1:])
                matrices[key] = matrices.get(key, 0) + tensor.shape[0]
        if layer.router is not None:
            router_ids.update(id(p) for p in layer.router.parameters())
    return expert_ids, router_ids, matrices, expert_biases


def _skeleton_target_params(model, layers) -> dict[str, int]:
    """Parameters of each registered target role in the skeleton; a tied output layer counts as the embedding."""
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    roles = [
        t for t in TARGET_KINDS if not (head is not None and head.weight is embedding and t == "lm_head")
    ]
    target_params: dict[str, int] = {}
    for weight in find_target_weights(
        model, layers, [r for r in roles if r not in ("embeddings", "lm_head")]
    ):
        target_params[weight.target] = target_params.get(weight.target, 0) + weight.module.weight.numel()
    target_params["embeddings"] = embedding.numel()
    if "lm_head" in roles and head is not None:
        target_params["lm_head"] = head.weight.numel()
    return target_params


def _target_params(counts: dict) -> dict[str, int]:
    """Parameters of each registered target role from a config's counts (its `formula`; roles without one, or
    counting nothing, are left out)."""
    found = {}
    for name in TARGET_KINDS:
        formula = TARGET_KINDS[name].formula
        count = formula(counts) if formula is not None else 0
        if count:
            found[name] = count
    return found


def _moe_layer_count(text: dict, layers: int) -> int:
    if "first_k_dense_replace" in text or "moe_layer_freq" in text:
        first, freq = int(text.get("first_k_dense_replace") or 0), int(text.get("moe_layer_freq") or 1)
        return sum(1 for i in range(first, layers) if (i - first) % freq == 0)
    dense = set(text.get("mlp_only_layers") or [])
    step = int(text.get("decoder_sparse_step") or 1)
    return sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)


def _shape_from_formulas(config: dict, name: str) -> ModelShape:
    """A standard decoder's counts (gated MLPs; grouped-query or latent attention) from the config's fields."""
    text = text_fields(config)
    try:
        hidden, layers, vocab = (
            int(text["hidden_size"]),
            int(text["num_hidden_layers"]),
            int(text["vocab_size"]),
        )
    except KeyError as err:
        raise ModelError(f"The config of {name} lacks {err.args[0]!r}, which the planner needs.") from err
    experts = int(_first(text, *EXPERT_COUNTS, default=0))
    if not experts:
        raise ModelError(
            f"{name} has no experts in its config (num_experts, num_local_experts or n_routed_experts)."
        )
    geo = _geometry(text)
    heads = int(_first(text, "num_attention_heads", default=1))
    width = int(_first(text, "moe_intermediate_size", "intermediate_size"))
    moe_layers = _moe_layer_count(text, layers)
    if text.get("kv_lora_rank"):
        q_rank, kv_rank = text.get("q_lora_rank"), int(text["kv_lora_rank"])
        rope, nope = int(text.get("qk_rope_head_dim", 0)), int(text.get("qk_nope_head_dim", 0))
        q = hidden * q_rank + q_rank * geo["q_width"] if q_rank else hidden * geo["q_width"]
        kv = hidden * (kv_rank + rope) + kv_rank * heads * nope + kv_rank * geo["v_width"]
        attention = q + kv + geo["o_width"] * hidden
    else:
        attention = hidden * (geo["q_width"] + geo["k_width"] + geo["v_width"]) + geo["o_width"] * hidden
    mlp = 3 * hidden * geo["shared_intermediate"] * moe_layers + 3 * hidden * geo["dense_intermediate"] * (
        layers - moe_layers
    )
    matmul = layers * attention + mlp + vocab * hidden
    tied = bool(text.get("tie_word_embeddings", False))
    return ModelShape(
        name=name,
        model_type=str(config.get("model_type")),
        shapes_from="config formulas",
        hidden_size=hidden,
        num_layers=layers,
        vocab_size=vocab,
        num_moe_layers=moe_layers,
        num_experts=experts,
        experts_per_token=_experts_per_token(text),
        moe_intermediate=width,
        expert_matrices=((moe_layers * experts, 2 * width, hidden), (moe_layers * experts, hidden, width)),
        expert_biases=0,
        router_params=moe_layers * experts * hidden,
        dense_params=matmul + (0 if tied else vocab * hidden) + (2 * layers + 1) * hidden,
        dense_matmul=matmul,
        embedding_params=vocab * hidden,
        qk_norm=False,
        target_params=_target_params(
            {
                "layers": layers,
                "hidden": hidden,
                "vocab": vocab,
                "attention": attention,
                "mlp": mlp,
                "tied": tied,
            }
        ),
        **geo,
    )
