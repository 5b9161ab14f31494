"""Memory and step-time planner: will a sparse fine-tune of this MoE fit, where, and how fast - from config.json alone.

Parameter shapes come from the transformers skeleton built on the meta device (exact and generic: the engine's own
`find_moe_layers` tells experts and routers apart); model types transformers does not know fall back to formulas
over the config's fields. The ledger models what the usaf engine allocates:

- frozen experts at the stores' own layouts (`usaf.quant`), where the residency keeps them (device, pinned host
  memory, memory map), and their quantization constants;
- dense weights in the compute dtype (`--quant-dense` stores them as int8 on disk; loading dequantizes them);
- the sparse state: per trained entry the fp32 value, its int32 index within its expert, the fp32 gradient and
  the optimizer moments (bf16 by default, `usaf.train.optim`): 16 B; entries of a resident (unquantized) weight also
  keep their base value, the only copy left once the trained values are written into it;
- routers, trained densely in fp32 as the engine trains them (`make_routers_fp32`: an fp32 master weight in place
  of the model-dtype one, fp32 gradient and moments);
- activations with per-layer recomputation: every layer's input, plus one layer's working set (what autograd saves
  in the recomputed layer: frozen linear layers save nothing, so it is attention's q/k/v/output and the routed
  experts' gathered input, gate/up output, activation, product and down output);
- one chunk of logits (the loss is computed chunk by chunk and recomputed in backward);
- the dequantized routed-expert workspace and, when streaming, two layers of quantized experts on the device;
- the framework: the CUDA context and allocator slack on a GPU; the runtime's first-step warm-up on the CPU.

Transient items live in phases (a layer's backward, the loss chunk, the optimizer step); the peak is the persistent
sum plus the largest phase. `bench/plan_accuracy.py` checks the CPU model against measured peaks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from usaf.config import (
    DEFAULT_DENSITY,
    DEFAULT_LOGITS_CHUNK,
    DEFAULT_RESELECT_EVERY,
    DEFAULT_TARGETS,
    DEFAULT_WORKSPACE_MB,
    RESIDENCIES,
    TARGETS,
    RunConfig,
    UsafConfig,
)
from usaf.errors import UsafError
from usaf.model.layout import find_moe_layers, intermediate_size
from usaf.model.targets import DENSE_TARGETS, find_target_weights
from usaf.quant import get_format

GiB = 1 << 30
MiB = 1 << 20

# ---- sizes ----------------------------------------------------------------------------------------------------

_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE_FORMS = "a number with an optional unit, e.g. 12GB, 12GiB, 12G, 512MB, 1.5TB, or bytes (12884901888)"


def parse_size(text: str | int) -> int:
    """Bytes from '12GB', '12GiB', '12G', '512MB', '1.5T', '4096B' or a plain number of bytes.

    Units are binary (12GB = 12 GiB = 12 * 2**30 bytes), as memory cards and modules are sized.
    """
    if isinstance(text, int) and not isinstance(text, bool) and text >= 0:
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])(?:i?b)?|b)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise UsafError(f"Cannot read the size {text!r}; write {_SIZE_FORMS}.")
    return int(float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").lower()])


def format_size(num_bytes: float) -> str:
    if num_bytes <= 0:
        return "-"
    if num_bytes >= 0.95 * GiB:
        return f"{num_bytes / GiB:.2f} GB"
    if num_bytes >= 0.95 * MiB:
        return f"{num_bytes / MiB:.0f} MB"
    return f"{num_bytes / 1024:.0f} KB"


def _count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(int(n))


# ---- devices, formats, settings -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    """Datasheet figures of a compute device; the step-time model applies the efficiencies below to them."""

    name: str
    memory: int  # bytes of device memory (0 for the CPU: it uses --ram)
    tflops: float  # dense matmul peak at the compute dtype (bf16 tensor cores; fp32 SIMD on the CPU)
    memory_gbps: float  # device memory bandwidth
    link_gbps: float  # host -> device copy rate from pinned memory
    is_gpu: bool = True
    fast_bf16: bool = True  # bf16 matrix units; without them `usaf train` computes in fp16 with loss scaling


DEVICES: dict[str, Device] = {
    "rtx-3060-12gb": Device("rtx-3060-12gb", 12 * GiB, 51.0, 360.0, 25.0),
    "rtx-3090": Device("rtx-3090", 24 * GiB, 71.0, 936.0, 25.0),
    "rtx-4090": Device("rtx-4090", 24 * GiB, 165.0, 1008.0, 25.0),
    "h100": Device("h100", 80 * GiB, 989.0, 3350.0, 50.0),
    # AMD (ROCm), from amd.com product specifications. RX 6750 XT (RDNA2, gfx1031): 12 GB GDDR6 at 432 GB/s,
    # 13.3 TFLOPS fp32 and 26.6 fp16 (packed, twice fp32), no bf16 matrix units; PCIe 4.0 x16
    "rx-6750-xt": Device("rx-6750-xt", 12 * GiB, 26.6, 432.0, 25.0, fast_bf16=False),
    # RX 7900 XTX (RDNA3, gfx1100): 24 GB at 960 GB/s, 122.8 TFLOPS fp16/bf16 (WMMA, dual issue); PCIe 4.0 x16
    "rx-7900-xtx": Device("rx-7900-xtx", 24 * GiB, 122.8, 960.0, 25.0),
    # Instinct MI300X (CDNA3, gfx942): 192 GB HBM3 at 5.3 TB/s, 1307.4 TFLOPS dense bf16; PCIe 5.0 x16 host link
    "mi300x": Device("mi300x", 192 * GiB, 1307.4, 5300.0, 50.0),
    "cpu": Device("cpu", 0, 0.2, 20.0, 0.0, is_gpu=False),
}
# Shares of the datasheet peaks MoE training reaches: grouped matmuls over a few hundred tokens per expert and
# gather-heavy routing keep matmul units far from peak; streaming copies run near the link rate.
COMPUTE_EFFICIENCY = 0.35
MEMORY_EFFICIENCY = 0.7
DISK_GBPS = 3.0  # NVMe reads for memory-mapped experts that the page cache cannot hold
CUDA_CONTEXT = GiB // 2  # CUDA/HIP context and kernel images resident on the card
GPU_ALLOCATOR_SLACK = 0.10  # caching-allocator fragmentation, as a share of the transient peak
GPU_HOST_FRAMEWORK = 3 * GiB  # Python, torch, transformers and the GPU runtime in host memory
# Measured on Linux x86-64 (torch 2.13 CPU, transformers 5.24): resident memory of the imported libraries, and what
# the first training step adds whatever the model size (the family's modeling code, thread pools, oneDNN/MKL).
CPU_IMPORTS = 600 * MiB
CPU_WARMUP = 85 * MiB

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
QUANTS = {
    "none": "unquantized (compute dtype)",
    "int8": "int8, one fp32 scale per row",
    "nf4": "NF4, one fp32 absmax per 64 weights",
    "int4": "int4, fp16 scale and offset per group of 64",
}
QUANT_ORDER = ("none", "int8", "nf4", "int4")  # most to least precise
# Bytes per element a dequantization holds besides its output: int8 widens codes and scales to fp32 before the
# cast; int4 unpacks nibbles (uint8), widens them to fp32 and forms the fp32 result; NF4's kernel writes the dtype.
DEQUANT_TEMPORARIES = {"none": 0, "nf4": 0, "int8": 8, "int4": 9}
OPTIMIZERS = {
    "adamw": "AdamW, the values' moments in bf16 with stochastic rounding (4 B per value; routers fp32)",
    "adamw-fp32": "AdamW with fp32 moments (8 B per value; optim.moments=fp32)",
    "adamw8bit": "8-bit AdamW (2 B per value)",
}
VALUE_MOMENT_BYTES = {"adamw": 4, "adamw-fp32": 8, "adamw8bit": 2}


@dataclass(frozen=True)
class PlanSettings:
    seq: int = 2048
    batch: int = 1
    density: float = DEFAULT_DENSITY
    quant: str = "nf4"
    quant_dense: bool = False
    granularity: str = "element"
    residency: str = "device"  # device | host | mmap
    recompute: bool = True
    reselect: bool = (
        DEFAULT_RESELECT_EVERY > 0
    )  # select.reselect_every: probe windows hold candidates' gradients
    logits_chunk: int = DEFAULT_LOGITS_CHUNK  # train.logits_chunk_tokens
    optimizer: str = "adamw"
    dtype: str = "bf16"
    workspace_mb: int = DEFAULT_WORKSPACE_MB  # select.workspace_mb
    targets: tuple = DEFAULT_TARGETS  # select.targets: which weights hold trained entries

    def __post_init__(self):

        checks = [
            (
                bool(self.targets) and all(t in TARGETS for t in self.targets),
                f"--targets must name some of {', '.join(TARGETS)}, got {','.join(self.targets)!r}",
            ),
            (self.seq >= 2, f"--seq must be at least 2, got {self.seq}"),
            (self.batch >= 1, f"--batch must be at least 1, got {self.batch}"),
            (0 < self.density <= 1, f"--density must be in (0, 1], got {self.density}"),
            (self.quant in QUANTS, f"--quant must be one of {', '.join(QUANTS)}, got {self.quant!r}"),
            (
                self.granularity in ("element", "neuron"),
                f"--granularity must be element or neuron, got {self.granularity!r}",
            ),
            (
                self.residency in RESIDENCIES,
                f"--residency must be one of {', '.join(RESIDENCIES)}, got {self.residency!r}",
            ),
            (self.logits_chunk >= 1, f"--logits-chunk must be at least 1, got {self.logits_chunk}"),
            (
                self.optimizer in OPTIMIZERS,
                f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}",
            ),
            (
                self.dtype in DTYPE_BYTES,
                f"--dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}",
            ),
            (self.workspace_mb >= 1, f"--workspace-mb must be at least 1, got {self.workspace_mb}"),
        ]
        for ok, message in checks:
            if not ok:
                raise UsafError(message + ".")

    def replace(self, **changes) -> PlanSettings:
        return dataclasses.replace(self, **changes)


def default_dtype(device: Device) -> str:
    """What `usaf train` picks (`usaf.train.runtime.resolve_dtype`): bf16 on accelerators with bf16 matrix units, fp16 on
    those without (AMD RDNA2), fp32 on the CPU (bf16 matmuls are slow on most CPUs)."""
    if not device.is_gpu:
        return "fp32"
    return "bf16" if device.fast_bf16 else "fp16"


# ---- model configs and presets --------------------------------------------------------------------------------


def _presets_dir():
    return resources.files("usaf").joinpath("presets")  # package data (see pyproject.toml)


def list_presets() -> list[str]:
    names = (p.name for p in _presets_dir().iterdir())
    return sorted(n[: -len(".json")] for n in names if n.endswith(".json"))


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UsafError(f"{path} is not valid JSON: {err}.") from err
    if not isinstance(data, dict):
        raise UsafError(f"{path} does not hold a config object.")
    return data


def load_model_config(model: str) -> tuple[str, dict]:
    """(name, config) of a model directory, a config.json, a preset name, or a preset's Hugging Face repo id."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsafError(f"{path} has no config.json.")
        return path.name, _read_json(path / "config.json")
    if path.is_file():
        return (path.parent.name if path.name == "config.json" else path.stem), _read_json(path)
    presets = list_presets()
    for name in presets:
        config = json.loads(_presets_dir().joinpath(f"{name}.json").read_text())
        if model.lower() in (name, str(config.get("_source", "")).lower()):
            return name, config
    raise UsafError(
        f"Unknown model {model!r}: not a directory, a config.json or a preset. Presets: {', '.join(presets)}."
    )


def _text_config(config: dict) -> dict:
    """The language model's fields: multimodal configs keep them under text_config."""
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def _first(config: dict, *names, default=None):
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return default


# ---- model shape ----------------------------------------------------------------------------------------------


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

    @property
    def largest_expert_tensor(self) -> int:
        """Entries of the largest fused tensor ([E, A, B]: one layer's gate_up, usually)."""
        return self.num_experts * self.largest_expert_matrix


def model_shape(config: dict, name: str = "model") -> ModelShape:
    """Shapes from the transformers skeleton on the meta device; config formulas where transformers cannot build
    the model (a model_type it does not know)."""
    try:
        return _shape_from_skeleton(config, name)
    except UsafError:
        raise
    except Exception as err:
        warnings.warn(
            f"transformers cannot build {name} ({type(err).__name__}: {err}); planning from formulas.",
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
    import torch
    import transformers

    # The published fields only: a quantization_config would ask transformers for quantizer kernels.
    fields_ = {k: v for k, v in config.items() if not k.startswith("_") and k != "quantization_config"}
    if "model_type" not in fields_:
        raise ValueError("the config has no model_type")
    hf_config = transformers.AutoConfig.for_model(**fields_)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    text = _text_config(config)
    layers = find_moe_layers(model)
    expert_ids, router_ids, matrices = set(), set(), {}
    expert_biases = 0
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
    embedding = model.get_input_embeddings().weight
    router = dense = 0
    for param in model.parameters():  # tied parameters count once
        if id(param) in router_ids:
            router += param.numel()
        elif id(param) not in expert_ids:
            dense += param.numel()
    first = layers[0]
    qk_norm = any(n.endswith(("q_norm", "k_norm")) for n, _ in model.named_modules())
    head = model.get_output_embeddings()
    roles = [
        t for t in DENSE_TARGETS if not (head is not None and head.weight is embedding and t == "lm_head")
    ]
    target_params: dict[str, int] = {}
    for weight in find_target_weights(
        model, layers, [r for r in roles if r not in ("embeddings", "lm_head")]
    ):
        target_params[weight.target] = target_params.get(weight.target, 0) + weight.module.weight.numel()
    target_params["embeddings"] = embedding.numel()
    if "lm_head" in roles and head is not None:
        target_params["lm_head"] = head.weight.numel()
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


def _moe_layer_count(text: dict, layers: int) -> int:
    if "first_k_dense_replace" in text or "moe_layer_freq" in text:
        first, freq = int(text.get("first_k_dense_replace") or 0), int(text.get("moe_layer_freq") or 1)
        return sum(1 for i in range(first, layers) if (i - first) % freq == 0)
    dense = set(text.get("mlp_only_layers") or [])
    step = int(text.get("decoder_sparse_step") or 1)
    return sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)


def _shape_from_formulas(config: dict, name: str) -> ModelShape:
    """A standard decoder's counts (gated MLPs; grouped-query or latent attention) from the config's fields."""
    text = _text_config(config)
    try:
        hidden, layers, vocab = (
            int(text["hidden_size"]),
            int(text["num_hidden_layers"]),
            int(text["vocab_size"]),
        )
    except KeyError as err:
        raise UsafError(f"The config of {name} lacks {err.args[0]!r}, which the planner needs.") from err
    experts = int(
        _first(text, "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", default=0)
    )
    if not experts:
        raise UsafError(
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
        target_params={
            "attention": layers * attention,
            "dense_mlp": mlp,
            "norms": (2 * layers + 1) * hidden,
            "embeddings": vocab * hidden,
            **({} if tied else {"lm_head": vocab * hidden}),
        },
        **geo,
    )


# ---- the ledger -----------------------------------------------------------------------------------------------

PERSISTENT = frozenset()
LAYER, LOSS, STEP = "layer backward", "loss chunk", "optimizer step"


@dataclass
class LedgerLine:
    name: str
    device: float = 0.0  # bytes on the compute device (RAM on the CPU)
    host: float = 0.0  # bytes of host RAM besides (GPU devices only)
    detail: str = ""
    phases: frozenset = PERSISTENT  # transient items: the phases they are alive in; empty: always

    @property
    def persistent(self) -> bool:
        return not self.phases


@dataclass
class StepTime:
    compute_s: float
    memory_s: float
    streaming_s: float
    flops: float

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.memory_s, self.streaming_s)  # prefetching overlaps the three

    @property
    def dominant(self) -> str:
        terms = {
            "compute": self.compute_s,
            "memory traffic": self.memory_s,
            "host->device streaming": self.streaming_s,
        }
        return max(terms, key=terms.get)


@dataclass
class Plan:
    shape: ModelShape
    settings: PlanSettings
    device: Device
    vram: int
    ram: int
    lines: list[LedgerLine]
    step: StepTime
    imports: float = 0.0  # the part of the device peak that is the imported libraries (CPU)
    notes: list[str] = field(default_factory=list)

    @property
    def device_peak(self) -> float:
        return _peak(self.lines, "device")[0]

    @property
    def peak_phase(self) -> str:
        return _peak(self.lines, "device")[1]

    @property
    def host_peak(self) -> float:
        return _peak(self.lines, "host")[0]

    @property
    def device_budget(self) -> int:
        return self.vram if self.device.is_gpu else self.ram

    @property
    def fits(self) -> bool:
        host_ok = not self.device.is_gpu or self.host_peak <= self.ram
        return self.device_peak <= self.device_budget and host_ok


def _peak(lines: list[LedgerLine], where: str) -> tuple[float, str]:
    persistent = sum(getattr(line, where) for line in lines if line.persistent)
    best, best_phase = 0.0, ""
    for phase in sorted({p for line in lines for p in line.phases}):
        size = sum(getattr(line, where) for line in lines if phase in line.phases)
        if size > best:
            best, best_phase = size, phase
    return persistent + best, best_phase


def stored_bytes(matrices, quant: str, dtype_bytes: int) -> tuple[float, float]:
    """(payload, constants) of matrices ((count, rows, cols), ...) in a usaf store format."""
    import torch

    if quant == "none":
        return float(sum(n * r * c for n, r, c in matrices) * dtype_bytes), 0.0
    payload = constants = 0.0
    for count, rows, cols in matrices:
        for part, (dtype, shape) in get_format(quant).layout(rows, cols, torch.bfloat16).items():
            numel = 1
            for size in shape:
                numel *= size
            nbytes = count * numel * torch.empty((), dtype=dtype).element_size()
            if part == "data":
                payload += nbytes
            else:
                constants += nbytes
    return payload, constants


def trained_entries(shape: ModelShape, settings: PlanSettings) -> int:
    """Trained entries in the targeted weights (neuron granularity rounds each layer's expert budget to whole
    neurons: about the same)."""
    experts = shape.expert_weights + shape.expert_biases if "experts" in settings.targets else 0
    others = sum(n for t, n in shape.target_params.items() if t in settings.targets)
    return round(settings.density * experts) + round(settings.density * others)


def trained_router_params(shape: ModelShape, settings: PlanSettings) -> int:
    return shape.router_params if "routers" in settings.targets else 0


def plan(
    shape: ModelShape, settings: PlanSettings, device: Device, vram: int | None = None, ram: int | None = None
) -> Plan:
    """The ledger, peak and step time of one configuration."""
    s, gpu = settings, device.is_gpu
    vram = (device.memory if vram is None else vram) if gpu else 0
    ram = _machine_ram() if ram is None else ram
    d = DTYPE_BYTES[s.dtype]
    tokens = s.seq * s.batch
    residency = (
        s.residency if gpu or s.residency != "host" else "device"
    )  # host memory is the CPU's own memory
    lines: list[LedgerLine] = []
    notes: list[str] = []

    def add(name, size, detail, where="device", phases=PERSISTENT):
        on_host = gpu and where == "host"
        lines.append(LedgerLine(name, 0.0 if on_host else size, size if on_host else 0.0, detail, phases))

    # frozen experts and their constants, where the residency keeps them
    payload, constants = stored_bytes(shape.expert_matrices, s.quant, d)
    payload += shape.expert_biases * d  # biases stay in the dtype
    bits = 8 * (payload + constants) / max(1, shape.expert_weights)
    experts_detail = (
        f"{shape.num_moe_layers} layers x {shape.num_experts} experts, {_count(shape.expert_weights)} "
        f"weights, {QUANTS[s.quant]} ({bits:.2f} bits/weight)"
    )
    if residency == "mmap":
        add(
            "frozen experts",
            0,
            experts_detail + f"; memory-mapped ({format_size(payload + constants)} on disk)",
        )
    else:
        where = "host" if residency == "host" else "device"
        add(
            "frozen experts",
            payload,
            experts_detail + (", pinned host memory" if where == "host" else ""),
            where,
        )
        if constants:
            add("quantization constants", constants, QUANTS[s.quant].split(", ", 1)[1], where)

    dense_detail = (
        f"{_count(shape.dense_params + shape.router_params)} attention/embedding/norm/shared parameters "
        f"and routers, {s.dtype}"
    )
    if s.quant_dense:
        dense_detail += " (--quant-dense stores linear layers as int8 on disk; loading dequantizes them)"
    add("dense weights", (shape.dense_params + shape.router_params) * d, dense_detail)

    # sparse trainable state
    entries = trained_entries(shape, s)
    moments = VALUE_MOMENT_BYTES[s.optimizer]
    beyond = trained_entries(
        shape, s.replace(targets=tuple(t for t in s.targets if t != "experts") or ("routers",))
    )
    if beyond:  # entries of attention, embeddings, ...: elements of resident weights, which keep their base
        element_bytes = 4 + 4 + 4 + moments + d
        targets = ", ".join(t for t in s.targets if t not in ("experts", "routers"))
        add(
            "sparse state beyond the experts",
            beyond * element_bytes,
            f"{_count(beyond)} entries of {targets} x {element_bytes} B (value 4, index 4, grad 4, "
            f"moments {moments}, base {d}: resident weights are written into)",
        )
        entries -= beyond
    base = (
        d if s.quant == "none" else 0
    )  # a quantized store gives the base back; a resident one is overwritten
    kept = f", base {d}" if base else ", no base (the quantized store gives it back)"
    if s.granularity == "element":
        per_entry = 4 + 4 + 4 + moments + base
        detail = f"{_count(entries)} entries x {per_entry} B (value 4, int32 index 4, grad 4, moments {moments}{kept})"
    else:
        per_entry = 4 + 4 + moments + d
        detail = (
            f"{_count(entries)} entries x {per_entry} B (value 4, base {d}, grad 4, moments {moments}); "
            "whole neurons need no per-entry index"
        )
    add("sparse state + optimizer", entries * per_entry, detail)
    if s.granularity == "element" and entries:
        old_bytes = 4 + d + 8 + 8 + 4 + (2 if s.optimizer == "adamw8bit" else 8)
        notes.append(
            f"{per_entry} B per trained expert entry where usaf 0.1.0 kept {old_bytes} (an int64 flat index, "
            f"cached int32 rows and columns, a base copy, fp32 moments): {format_size(entries * (old_bytes - per_entry))}"
            " freed at this density"
        )
    if s.reselect:
        # a probe window (select.reselect_probe_steps before each reselection) sums |gradient| over candidate
        # lines: oversample x the share regrown x the entries, fp32, largest at the first reselection
        select = UsafConfig.__dataclass_fields__
        share = select["oversample"].default * select["reselect_fraction"].default
        add(
            "reselection probes",
            int(4 * share * (entries + beyond)),
            f"candidates' gradient sums during a probe window: {share:g} x the trained entries x 4 B "
            "(select.oversample x select.reselect_fraction, at the first reselection)",
        )
    router_moments = 2 if s.optimizer == "adamw8bit" else 8
    routers = trained_router_params(shape, s)
    add(
        "routers (trainable)",
        routers * (4 - d + 4 + router_moments),
        f"{_count(routers)} parameters in fp32: master weight +{4 - d} B over the dense weights' {d} B, grad 4 B, "
        f"moments {router_moments} B",
    )

    # activations
    inputs = (shape.num_layers + 1) * tokens * shape.hidden_size * d
    working = tokens * _layer_working_set(shape, d)
    if s.recompute:
        add(
            "activations: layer inputs",
            inputs,
            f"{shape.num_layers + 1} x {tokens} tokens x {shape.hidden_size} x {d} B, kept for recomputation",
            phases=frozenset({LAYER, LOSS}),
        )
        add(
            "activations: one layer",
            working,
            f"what a recomputed layer saves for backward: attention q/k/v/output, {shape.experts_per_token} routed "
            "experts' gathered input, gate/up, activation, product and output",
            phases=frozenset({LAYER}),
        )
    else:
        add(
            "activations: all layers",
            inputs + shape.num_layers * working,
            f"{shape.num_layers} layers' saved tensors (no recomputation)",
            phases=frozenset({LAYER, LOSS}),
        )
    chunk = min(s.logits_chunk, s.batch * (s.seq - 1))
    # the recomputed chunk's fp32 log-softmax, its incoming gradient and its input gradient (12 B per logit), and
    # the final hidden states sliced, masked and their gradient
    add(
        "logits chunk",
        chunk * shape.vocab_size * 12 + 3 * tokens * shape.hidden_size * d,
        f"{chunk} tokens x {shape.vocab_size} vocab x 12 B, recomputed in backward",
        phases=frozenset({LOSS}),
    )

    # dequantization workspace and streaming buffers
    quantized_store = s.quant != "none" or residency != "device"
    if quantized_store:
        routed = _routed_experts(shape, tokens)
        chunk_bytes = min(s.workspace_mb * MiB, routed * shape.largest_expert_matrix * d)
        elements = chunk_bytes / d
        add(
            "dequant workspace",
            elements * (2 * d + DEQUANT_TEMPORARIES[s.quant]),
            f"routed experts of one projection in chunks of <= {s.workspace_mb} MB: the chunk being built with its "
            "temporaries while the last is alive",
            phases=frozenset({LAYER}),
        )
    if residency in ("host", "mmap"):
        per_layer = (payload + constants) / max(1, shape.num_moe_layers)
        add(
            "offload buffers",
            2 * per_layer,
            "two layers of quantized experts: the current and the prefetched",
        )

    if gpu:
        if s.optimizer == "adamw":  # one tensor at a time: fp32 moments, denominator, rounding noise
            step_bytes = 16 * (entries + beyond) // max(1, shape.num_moe_layers) + 4 * routers
            step_detail = (
                "bf16 moments widened to fp32 one tensor at a time; the routers' foreach square roots"
            )
        else:
            step_bytes = 4 * (entries + beyond + routers)
            step_detail = "AdamW's foreach kernels copy the moments' square roots of a whole group"
        add("optimizer step temporaries", step_bytes, step_detail, phases=frozenset({STEP}))
        transient = _peak([line for line in lines if not line.persistent], "device")[0]
        add(
            "framework overhead",
            CUDA_CONTEXT + GPU_ALLOCATOR_SLACK * transient,
            f"CUDA/HIP context and kernels {format_size(CUDA_CONTEXT)} + caching-allocator slack "
            f"{GPU_ALLOCATOR_SLACK:.0%} of the transients",
        )
        add("framework (host)", GPU_HOST_FRAMEWORK, "Python, torch, transformers, GPU runtime", "host")
        if residency == "mmap":
            notes.append(
                "mmap: the experts page in from the prepared store; host memory beyond this ledger speeds "
                "streaming as page cache"
            )
        _, rows, cols = max(shape.expert_matrices, key=lambda m: m[1] * m[2])
        largest_part = sum(stored_bytes(((shape.num_experts, rows, cols),), s.quant, d))
        add(
            "load staging",
            2 * largest_part,
            "loading: one stored tensor read and its device or pinned copy",
            "host",
            phases=frozenset({"load"}),
        )
    else:
        add("framework: imports", CPU_IMPORTS, "Python, torch and transformers after import")
        add("framework: warm-up", CPU_WARMUP, "first step: model code, thread pools, oneDNN/MKL buffers")
        notes.append(
            "CPU: glibc's malloc keeps freed memory mapped when its mmap threshold grows; set "
            "MALLOC_MMAP_THRESHOLD_=131072 for the peak above (the default can hold up to twice as much)"
        )

    result = Plan(
        shape,
        s.replace(residency=residency),
        device,
        vram,
        ram,
        lines,
        _step_time(shape, s, device, residency, ram),
        notes=notes,
    )
    result.imports = 0.0 if gpu else CPU_IMPORTS
    return result


def _routed_experts(shape: ModelShape, tokens: int) -> float:
    """Expected distinct experts `tokens` tokens are routed to in one layer (uniform routing)."""
    e, k = shape.num_experts, shape.experts_per_token
    return e * (1 - (1 - k / e) ** tokens)


def _layer_working_set(shape: ModelShape, d: int) -> float:
    """Bytes per token a recomputed decoder layer holds at its peak: the end of its recomputed forward, with the
    gradient of its output already there (usaf.engine.experts' forward, non-reentrant checkpointing):

    - attention: q and k before and after rotary embedding, v, the attention output; the residual sum and the
      post-attention norm's output (the trained router's input); fp32 copies where the norms upcast a narrower dtype;
    - router: logits and fp32 probabilities;
    - per routed pair: the gathered input, gate/up output, activation and product, the down output, the weighted
      output, its gather back to token order and the incoming gradient (5 hidden + 4 expert widths), four int64
      routing indices and the routing weight;
    - shared experts, or a dense layer's MLP: gate, up and activation outputs.
    """
    h = shape.hidden_size
    attention = (2 * shape.q_width + 2 * shape.k_width + shape.v_width + shape.o_width + 2 * h) * d
    if d < 4:
        attention += 4 * (2 * h + ((shape.q_width + shape.k_width) if shape.qk_norm else 0))
    router = shape.num_experts * (d + 4)
    routed = shape.experts_per_token * ((5 * h + 4 * shape.moe_intermediate) * d + 4 * 8 + d)
    moe_layer = attention + router + routed + 3 * shape.shared_intermediate * d
    dense_layer = (
        attention + 3 * shape.dense_intermediate * d if shape.num_layers > shape.num_moe_layers else 0
    )
    return max(moe_layer, dense_layer)


def _step_time(shape: ModelShape, s: PlanSettings, device: Device, residency: str, ram: int) -> StepTime:
    """Three forward-equivalents (forward, recomputation, input-gradient backward: the frozen base has no weight
    gradients) at a share of peak throughput, against the bytes each pass moves and the streaming of experts."""
    tokens, d = s.seq * s.batch, DTYPE_BYTES[s.dtype]
    active = shape.dense_matmul + shape.expert_weights * shape.experts_per_token / max(1, shape.num_experts)
    full_context = s.seq / 2  # causal: a query sees half the sequence on average
    window = min(full_context, shape.sliding_window or s.seq)
    attention = (
        2
        * (shape.q_width + shape.o_width)
        * (
            (shape.softmax_attention_layers - shape.sliding_layers) * full_context
            + shape.sliding_layers * window
        )
    )
    forward = tokens * (2 * active + attention)
    sparse_grads = (
        2 * trained_entries(shape, s) * tokens * shape.experts_per_token / max(1, shape.num_experts)
    )
    flops = 3 * forward + sparse_grads
    compute_s = flops / (device.tflops * 1e12 * COMPUTE_EFFICIENCY)
    # each pass reads the routed experts' weights: quantized ones are read, written in the dtype and read again
    payload, constants = stored_bytes(shape.expert_matrices, s.quant, d)
    per_weight = ((payload + constants) / shape.expert_weights + 2 * d) if s.quant != "none" else d
    routed = _routed_experts(shape, tokens) / max(1, shape.num_experts) * shape.expert_weights
    memory_s = (
        3 * (routed * per_weight + shape.dense_matmul * d) / (device.memory_gbps * 1e9 * MEMORY_EFFICIENCY)
    )
    streaming_s = 0.0
    if residency in ("host", "mmap") and device.is_gpu:
        rate = device.link_gbps
        if (
            residency == "mmap" and payload + constants > ram / 2
        ):  # the page cache cannot hold them: disk reads
            rate = min(rate, DISK_GBPS)
        streaming_s = (
            2 * (payload + constants) / (rate * 1e9)
        )  # forward, then backward (recomputation shares it)
    return StepTime(compute_s, memory_s, streaming_s, flops)


def _machine_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GiB


# ---- verdict and the search for settings that fit ------------------------------------------------------------


@dataclass
class Verdict:
    """The requested settings' plan, the one chosen, and what to change when it does not fit."""

    requested: Plan  # the requested settings, experts on the device (or at the requested residency)
    chosen: Plan  # the requested settings at the first residency that fits (else `requested`)
    status: str  # "fits on device" | "needs host offload" | "does not fit"
    suggestion: Plan | None = None  # the nearest settings that fit, when nothing requested does
    on_device: Plan | None = None  # when offloading: the nearest settings that fit on the device alone


def decide(
    shape: ModelShape,
    settings: PlanSettings,
    device: Device,
    vram: int | None = None,
    ram: int | None = None,
    residency: str = "auto",
) -> Verdict:
    """Plan at `residency` ("auto": the device, else host memory, else a memory map) and search when it fails."""
    order = (RESIDENCIES if device.is_gpu else ("device", "mmap")) if residency == "auto" else (residency,)
    plans = [plan(shape, settings.replace(residency=r), device, vram, ram) for r in order]
    fitting = [p for p in plans if p.fits]
    if fitting:
        chosen = fitting[0]
        on_device = chosen.settings.residency == "device"
        verdict = Verdict(plans[0], chosen, "fits on device" if on_device else "needs host offload")
        if not on_device:
            verdict.on_device = search(shape, settings, device, vram, ram, residencies=("device",))
        return verdict
    verdict = Verdict(plans[0], plans[0], "does not fit")
    verdict.suggestion = search(shape, settings, device, vram, ram, residencies=order) or search(
        shape, settings, device, vram, ram
    )
    return verdict


def _halvings(value: int, floor: int) -> list[int]:
    values = [value]
    while values[-1] // 2 >= floor:
        values.append(values[-1] // 2)
    return values


# Cost of each change away from the requested settings: streaming the experts, coarser quantization and lower
# density change speed or quality; a smaller batch is recovered by gradient accumulation; a shorter sequence
# changes what the model sees; a smaller logits chunk only costs speed.
COSTS = {"residency": 1.0, "quant": 1.0, "batch": 0.5, "seq": 2.0, "density": 1.5, "logits_chunk": 0.25}


def search(
    shape: ModelShape,
    settings: PlanSettings,
    device: Device,
    vram: int | None = None,
    ram: int | None = None,
    residencies=RESIDENCIES,
) -> Plan | None:
    """The fitting settings nearest to `settings` (least total cost of changes, then the fastest step), over
    residency, quantization, batch, sequence length, density and logits chunk."""
    if not device.is_gpu:
        residencies = tuple(r for r in residencies if r != "host") or ("device",)
    quants = QUANT_ORDER[QUANT_ORDER.index(settings.quant) :]
    best, best_key = None, None
    for r_cost, residency in enumerate(residencies):
        for q_cost, quant in enumerate(quants):
            for b_cost, batch in enumerate(_halvings(settings.batch, 1)):
                for s_cost, seq in enumerate(_halvings(settings.seq, 128)):
                    for d_cost, density in enumerate(settings.density / 2**n for n in range(8)):
                        for c_cost, chunk in enumerate(_halvings(settings.logits_chunk, 64)):
                            cost = (
                                COSTS["residency"] * r_cost
                                + COSTS["quant"] * q_cost
                                + COSTS["batch"] * b_cost
                                + COSTS["seq"] * s_cost
                                + COSTS["density"] * d_cost
                                + COSTS["logits_chunk"] * c_cost
                            )
                            if best_key is not None and cost > best_key[0]:
                                continue
                            candidate = settings.replace(
                                residency=residency,
                                quant=quant,
                                batch=batch,
                                seq=seq,
                                density=density,
                                logits_chunk=chunk,
                            )
                            p = plan(shape, candidate, device, vram, ram)
                            key = (cost, p.step.seconds)
                            if p.fits and (best_key is None or key < best_key):
                                best, best_key = p, key
    return best


# ---- presentation ---------------------------------------------------------------------------------------------


def _size_arg(num_bytes: int) -> str:
    for unit, scale in (("GB", GiB), ("MB", MiB), ("KB", 1024)):
        if num_bytes % scale == 0:
            return f"{num_bytes // scale}{unit}"
    return f"{num_bytes}B"  # sizes are always given with a unit (a bare number is refused)


def command_line(model: str, p: Plan) -> str:
    """`usaf plan` arguments that reproduce this plan."""
    s, defaults = p.settings, PlanSettings()
    parts = [f"usaf plan --model {model} --device {p.device.name}"]
    if p.device.is_gpu:
        parts.append(f"--vram {_size_arg(p.vram)}")
    parts += [
        f"--ram {_size_arg(p.ram)}",
        f"--seq {s.seq}",
        f"--batch {s.batch}",
        f"--density {s.density:g}",
        f"--quant {s.quant}",
        f"--residency {s.residency}",
        f"--logits-chunk {s.logits_chunk}",
    ]
    flags = [
        (s.granularity != defaults.granularity, f"--granularity {s.granularity}"),
        (s.quant_dense, "--quant-dense"),
        (not s.recompute, "--no-recompute"),
        (s.optimizer != defaults.optimizer, f"--optimizer {s.optimizer}"),
        (s.dtype != default_dtype(p.device), f"--dtype {s.dtype}"),
        (s.workspace_mb != defaults.workspace_mb, f"--workspace-mb {s.workspace_mb}"),
    ]
    return " ".join(parts + [flag for wanted, flag in flags if wanted])


def format_plan(p: Plan) -> str:
    """The ledger as a table: device and host columns (one memory column on the CPU), peak marks, totals."""
    shape, s, gpu = p.shape, p.settings, p.device.is_gpu
    out = [
        f"{shape.name} ({shape.model_type}): {_count(shape.total_params)} parameters, "
        f"{_count(shape.active_params)} active per token (shapes from the {shape.shapes_from})",
        f"settings: seq {s.seq} x batch {s.batch}, density {s.density:g} ({s.granularity}), experts {s.quant}, "
        f"compute {s.dtype}, residency {s.residency}, recompute {'on' if s.recompute else 'off'}, "
        f"logits chunk {s.logits_chunk}, {s.optimizer}",
    ]
    width = max(len(line.name) for line in p.lines) + 2
    columns = ("device", "host") if gpu else ("memory",)
    out.append(" " * width + "".join(f"{c:>10}" for c in columns) + "  at peak           detail")
    for line in p.lines:
        values = (line.device, line.host) if gpu else (line.device,)
        when = (
            "yes" if line.persistent or p.peak_phase in line.phases else f"({', '.join(sorted(line.phases))})"
        )
        out.append(
            f"{line.name:{width}}"
            + "".join(f"{format_size(v):>10}" for v in values)
            + f"  {when:17} {line.detail}"
        )
    peaks = (p.device_peak, p.host_peak) if gpu else (p.device_peak,)
    budgets = (p.vram, p.ram) if gpu else (p.ram,)
    out.append(
        f"{'peak':{width}}"
        + "".join(f"{format_size(v):>10}" for v in peaks)
        + f"  during the {p.peak_phase or 'whole run'}"
    )
    out.append(f"{'available':{width}}" + "".join(f"{format_size(v):>10}" for v in budgets))
    st = p.step
    out.append(
        f"step ~ {st.seconds:.2f} s on {p.device.name}: compute {st.compute_s:.2f} s ({st.flops / 1e12:.1f} "
        f"TFLOP), memory traffic {st.memory_s:.2f} s, streaming {st.streaming_s:.2f} s -> {st.dominant} "
        "dominates"
    )
    out += [f"note: {note}" for note in p.notes]
    return "\n".join(out)


def format_verdict(model: str, v: Verdict) -> str:
    """The ledger of the configuration that fits (or of the request, when nothing does), the verdict, and the
    command line of the settings to use instead."""
    chosen = v.chosen
    if v.status == "fits on device":
        spare = format_size(chosen.device_budget - chosen.device_peak)
        return f"{format_plan(chosen)}\n\nverdict: fits on device ({spare} to spare)"
    if v.status == "needs host offload":
        lines = [
            format_plan(chosen),
            "",
            f"verdict: needs host offload - the experts live in {'host memory' if chosen.settings.residency == 'host' else 'a memory map'} "
            f"and stream to the device per layer (on the device alone: {format_size(v.requested.device_peak)} "
            f"of {format_size(v.requested.device_budget)})",
        ]
        if v.on_device is not None:
            lines.append(
                f"to fit on the device instead ({format_size(v.on_device.device_peak)}, step "
                f"~ {v.on_device.step.seconds:.2f} s):\n  {command_line(model, v.on_device)}"
            )
        return "\n".join(lines)
    need = f"{format_size(chosen.device_peak)} of {format_size(chosen.device_budget)}"
    if chosen.device.is_gpu and chosen.host_peak > chosen.ram:
        need += f" on the device, {format_size(chosen.host_peak)} of {format_size(chosen.ram)} host"
    lines = [format_plan(chosen), "", f"verdict: does not fit (needs {need})"]
    if v.suggestion is None:
        lines.append(
            "nothing searched fits (residency, quantization, batch, sequence, density, logits chunk): "
            "a larger device or more host memory is needed"
        )
    else:
        sp = v.suggestion
        lines += [
            f"settings that fit ({format_size(sp.device_peak)} on the device, step ~ {sp.step.seconds:.2f} s):",
            f"  {command_line(model, sp)}",
            "",
            format_plan(sp),
        ]
    return "\n".join(lines)


# ---- a run's own configuration ---------------------------------------------------------------------------------


def settings_for_run(config: RunConfig, dtype: str) -> PlanSettings:
    """The plan of a run's configuration (`usaf plan --config run.yaml`, and `train.recompute=auto`): the same
    sequence, batch, selection, storage, chunking and optimizer state the run will have."""
    return PlanSettings(
        seq=config.data.max_seq_len,
        batch=config.data.batch_size,
        density=config.select.density,
        quant=config.model.quant,
        granularity=config.select.granularity,
        residency=config.model.residency,
        recompute=config.train.recompute is not False,
        logits_chunk=config.train.logits_chunk_tokens,
        optimizer=run_optimizer(config),
        reselect=config.select.reselect_every > 0,
        dtype=dtype,
        workspace_mb=config.select.workspace_mb,
        targets=tuple(config.select.targets),
    )


def run_optimizer(config: RunConfig) -> str:
    """The planner's name for a run's optimizer state (`usaf.train.optim.build_optimizer`)."""
    if config.optim.eight_bit:
        return "adamw8bit"
    return "adamw" if config.optim.moments == "bf16" else "adamw-fp32"
