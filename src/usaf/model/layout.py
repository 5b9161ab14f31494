"""Find the MoE layers of any transformers model: experts modules, their layout flags, and their routers.

Everything here is discovered from the module tree and the flags that transformers'
`use_experts_implementation` decorator puts on every fused experts class, never from per-model tables.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from usaf.errors import ModelError
from usaf.store.dense import StoredExpertTensor

LAYOUT_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "has_post_expert_norm")


@dataclass(frozen=True)
class ExpertTensor:
    """One fused expert tensor of an experts module and the role it plays in the expert FFN."""

    name: str  # attribute on the experts module, e.g. "gate_up_proj" or "down_proj_bias"
    is_bias: bool
    is_input_projection: bool  # gate_up_proj / up_proj (hidden -> intermediate); else down_proj


@dataclass
class MoELayer:
    """An experts module, its router module, and where they sit in the model."""

    index: int  # ordinal among the model's MoE layers
    layer_index: int  # decoder layer number (from the module path), used for layer ranges
    experts_name: str
    experts: nn.Module
    router_name: str | None
    router: nn.Module | None
    num_experts: int
    tensors: tuple[ExpertTensor, ...]


# ---- an experts module's layout: every fact derived from its flags, in one place ------------------------------


def input_projection(experts: nn.Module) -> str:
    """The hidden -> intermediate tensor: a fused `gate_up_proj` where the experts are gated, else `up_proj`."""
    return "gate_up_proj" if experts.has_gate else "up_proj"


def hidden_size(experts: nn.Module) -> int:
    down = experts.down_proj
    return down.shape[2] if experts.is_transposed else down.shape[1]


def intermediate_size(experts: nn.Module) -> int:
    down = experts.down_proj
    return down.shape[1] if experts.is_transposed else down.shape[2]


def neuron_axes(experts: nn.Module) -> dict[str, int]:
    """The axis of each expert weight along which a neuron is one line (row j of gate/up, column j of down)."""
    return ExpertGeometry.of(experts).axes


def entries_per_neuron(stores: dict, axes: dict) -> int:
    """Entries of one neuron over the expert's weights (gate and up both, in a fused gate_up_proj)."""
    return sum(stores[n].shape[3 - axis] * lines_per_neuron(n) for n, axis in axes.items())


def lines_per_neuron(name: str) -> int:
    """A neuron is two lines of a fused gate_up_proj (its gate and its up line), one line of any other tensor."""
    return 2 if name == "gate_up_proj" else 1


@dataclass(frozen=True)
class ExpertGeometry:
    """Where a neuron's lines lie in an experts module's tensors: every gate/up and neuron fact in one place.

    Neuron j of an expert is row j of up (and of gate), column j of down (transposed layouts swap rows and
    columns). A fused gate_up_proj holds gate and up either concatenated (gate lines 0..I-1, up lines I..2I-1) or
    interleaved (gate 2j, up 2j+1). Line ids count lines across experts: expert * lines_per_expert + line."""

    input_name: str  # gate_up_proj (gated) or up_proj
    concatenated: bool
    transposed: bool
    intermediate: int  # neurons per expert

    @classmethod
    def of(cls, experts: nn.Module) -> ExpertGeometry:
        return cls(
            input_projection(experts),
            bool(getattr(experts, "is_concatenated", False)),
            bool(experts.is_transposed),
            intermediate_size(experts),
        )

    @property
    def axes(self) -> dict[str, int]:
        """{tensor: the axis along which one of its lines belongs to one neuron}."""
        return {self.input_name: 2 if self.transposed else 1, "down_proj": 1 if self.transposed else 2}

    def lines_of(self, name: str, neurons: torch.Tensor) -> torch.Tensor:
        """Line indices within an expert of neurons j (< I) in tensor `name`: gate and up lines of a fused
        gate_up_proj (gate lines first), else j itself."""
        if name != "gate_up_proj":
            return neurons
        if self.concatenated:
            return torch.cat([neurons, neurons + self.intermediate])
        return torch.cat([2 * neurons, 2 * neurons + 1])

    def line_ids(self, name: str, neurons: torch.Tensor, lines_per_expert: int) -> torch.Tensor:
        """Sorted line ids of neurons (expert * I + j) in tensor `name`."""
        expert, j = neurons // self.intermediate, neurons % self.intermediate
        lines = self.lines_of(name, j)
        owners = torch.cat([expert] * lines_per_neuron(name))
        return (owners * lines_per_expert + lines).sort().values

    def owners(self, name: str, line_ids: torch.Tensor, lines_per_expert: int) -> torch.Tensor:
        """The neuron (expert * I + j) owning each line id of tensor `name` (the inverse of `line_ids`)."""
        expert, line = line_ids // lines_per_expert, line_ids % lines_per_expert
        if name == "gate_up_proj":
            line = line % self.intermediate if self.concatenated else line // 2
        return expert * self.intermediate + line

    def per_neuron(self, name: str, per_line: torch.Tensor) -> torch.Tensor:
        """[..., lines] of one expert's tensor `name` summed into [..., I]: gate and up lines added together."""
        if name != "gate_up_proj":
            return per_line
        size = self.intermediate
        if self.concatenated:
            return per_line[..., :size] + per_line[..., size:]
        return per_line[..., 0::2] + per_line[..., 1::2]

    def entries_per_line_group(self, name: str, store_shape) -> int:
        """Entries of one neuron in tensor `name` (`store_shape` [E, A, B]): a line's length times its lines."""
        return store_shape[3 - self.axes[name]] * lines_per_neuron(name)


def is_fused_experts(module: nn.Module) -> bool:
    """True for modules decorated by transformers' `use_experts_implementation`."""
    return all(hasattr(module, flag) for flag in ("has_gate", "is_transposed", "_is_expert_parallel"))


def expert_tensors(experts: nn.Module, where: str) -> tuple[ExpertTensor, ...]:
    """The fused tensors of an experts module, checked against its layout flags."""
    first = input_projection(experts)
    names = [(first, False, True), ("down_proj", False, False)]
    if experts.has_bias:
        names += [(first + "_bias", True, True), ("down_proj_bias", True, False)]
    found = []
    for name, is_bias, is_input in names:
        tensor = getattr(experts, name, None)
        want_dim = 2 if is_bias else 3
        if not isinstance(tensor, (torch.Tensor, StoredExpertTensor)) or tensor.dim() != want_dim:
            raise ModelError(
                f"Unknown experts layout at '{where}' ({type(experts).__name__}): expected a {want_dim}-D tensor "
                f"'{name}' for flags {layout_of(experts)}, found {type(tensor).__name__}. "
                "usaf supports experts classes that transformers dispatches through ExpertsInterface."
            )
        found.append(ExpertTensor(name, is_bias, is_input))
    for flag in LAYOUT_FLAGS:
        if not isinstance(getattr(experts, flag, False), bool):
            raise ModelError(f"Unknown experts layout at '{where}': flag {flag}={getattr(experts, flag)!r}.")
    if getattr(experts, "has_post_expert_norm", False) and not hasattr(experts, "post_expert_norm"):
        raise ModelError(
            f"Unknown experts layout at '{where}': has_post_expert_norm without a post_expert_norm."
        )
    return tuple(found)


def layout_of(experts: nn.Module) -> dict[str, bool]:
    return {flag: getattr(experts, flag, None) for flag in LAYOUT_FLAGS}


def layer_number(path: str, fallback: int | None = None) -> int | None:
    """The decoder layer number in a module path (`model.layers.3.mlp` -> 3), else `fallback`."""
    match = re.search(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)(?:\.|$)", path)
    return int(match.group(1)) if match else fallback


def _find_router(
    parent: nn.Module, experts: nn.Module, num_experts: int, hidden: int
) -> tuple[str, nn.Module] | None:
    """The sibling of the experts module that scores tokens against the experts: it owns an [E, hidden] weight.

    Among several candidates (e.g. an attention projection of coincidental shape), a child named or typed as a
    router/gate wins, since that is what every transformers MoE family calls it.
    """
    candidates = []
    for name, child in parent.named_children():
        if child is experts or "shared" in name:
            continue
        shapes = [tuple(p.shape) for p in child.parameters()]
        if (num_experts, hidden) in shapes:
            routerish = bool(re.search(r"router|gate", name + type(child).__name__, re.IGNORECASE))
            candidates.append((not routerish, name, child))
    if not candidates:
        return None
    candidates.sort(key=lambda c: c[0])
    _, name, child = candidates[0]
    return name, child


def find_moe_layers(model: nn.Module) -> list[MoELayer]:
    """Every fused experts module of `model` with its router, in module order."""
    modules = dict(model.named_modules())
    layers: list[MoELayer] = []
    old_style = None
    for path, module in modules.items():
        if not is_fused_experts(module):
            if isinstance(module, nn.ModuleList) and path.endswith("experts") and old_style is None:
                old_style = path
            continue
        tensors = expert_tensors(module, path)
        if getattr(module, "_is_expert_parallel", False):
            raise ModelError(
                f"'{path}' is sharded for expert parallelism; usaf trains unsharded experts only."
            )
        num_experts, hidden = module.down_proj.shape[0], hidden_size(module)
        parent_path = path.rsplit(".", 1)[0] if "." in path else ""
        parent = modules[parent_path]
        router = _find_router(parent, module, num_experts, hidden)
        router_name = (
            f"{parent_path}.{router[0]}" if router and parent_path else (router[0] if router else None)
        )
        layers.append(
            MoELayer(
                index=len(layers),
                layer_index=layer_number(path, len(layers)),
                experts_name=path,
                experts=module,
                router_name=router_name,
                router=router[1] if router else None,
                num_experts=num_experts,
                tensors=tensors,
            )
        )
    if not layers:
        kind = type(model).__name__
        hint = (
            f" It has a list of separate expert modules at '{old_style}' (an unknown experts layout); usaf needs "
            "fused 3-D experts dispatched through transformers' ExpertsInterface (transformers >= 5)."
            if old_style
            else " usaf fine-tunes Mixture-of-Experts models; for a dense model use a dense fine-tuning method."
        )
        raise ModelError(f"{kind} has no Mixture-of-Experts layers with fused experts.{hint}")
    return layers


def expert_weight_names(layers: list[MoELayer]) -> dict[str, int]:
    """{parameter name of each fused expert weight (biases excluded): its MoE layer's ordinal}."""
    return {
        f"{layer.experts_name}.{t.name}": layer.index
        for layer in layers
        for t in layer.tensors
        if not t.is_bias
    }
