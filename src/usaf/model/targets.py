"""Which native weights beyond the experts may hold trained entries, found from the module tree.

A target is a role a weight plays, discovered the same way for every family (no per-model tables):
- `attention`: the linear layers inside a module whose class is an attention (q/k/v/o, fused qkv);
- `dense_mlp`: every other linear layer of the decoder outside experts and routers (shared experts, the dense
  MLPs of hybrid models' dense layers and beside the experts);
- `norms`: the 1-D weights of normalisation modules;
- `embeddings`, `lm_head`: the input embedding and the output layer (`get_input_embeddings` /
  `get_output_embeddings`). When the two share one weight (tied), either name trains that weight: its entries
  live on the embedding and the output layer uses the same values (gradients of both uses add up).
Experts (fused 3-D tensors) and routers are found by `usaf.model.layout`; their subtrees are never a dense target.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from usaf.errors import ModelError
from usaf.model.layout import MoELayer, layer_number
from usaf.registry import TARGET_KINDS


@dataclass
class Scan:
    """What a role's `claims` may read about the model being scanned."""

    embeddings: nn.Module | None
    head: nn.Module | None
    tied: bool  # the output layer shares the embedding's weight
    attention_paths: list[str] = field(default_factory=list)  # attention modules seen so far (parents first)

    def inside_attention(self, path: str) -> bool:
        return any(path.startswith(a + ".") for a in self.attention_paths)


@dataclass(frozen=True)
class TargetKind:
    """A role a weight beyond the experts plays, one of select.targets' values: which modules play it (`claims`,
    asked of every module outside experts and routers, in module order; one role per module: of those that
    claim it, the one registered last), the forward that trains their weight (`kind`, a key of
    `usaf.engine.sparse_weights.FORWARDS`: "linear", "rows" or "vector"; a role whose kind has no forward there
    is refused when it is registered), an optional `check` that refuses a weight usaf cannot train (one clear
    error), and the planner's count of the role's parameters from a config's fields (`formula`, given the
    planner's counts: layers, hidden, vocab, attention (one layer's weights), mlp (every dense MLP's), tied;
    None: counted only from the model's skeleton).

    Adding a role is one `TARGET_KINDS.register(TargetKind(...))`, here or from the code that defines it."""

    name: str
    kind: str
    claims: Callable[[str, nn.Module, Scan], bool]
    formula: Callable[[dict], int] | None = None
    check: Callable[[str, nn.Module], None] | None = None
    outside_layers: bool = (
        False  # its weights lie outside the decoder layers (frozen when select.layers is set)
    )


def _is_linear(path: str, module: nn.Module, scan: Scan) -> bool:
    return isinstance(module, nn.Linear) and module is not scan.head and module is not scan.embeddings


def _embedding_check(path: str, module: nn.Module) -> None:
    if not isinstance(module, nn.Embedding):
        raise ModelError(
            f"The input embedding '{path}' is a {type(module).__name__}, not an nn.Embedding; usaf cannot "
            "train its rows. Leave 'embeddings' out of select.targets."
        )


def _output_layer_check(path: str, module: nn.Module) -> None:
    if not isinstance(module, nn.Linear):
        raise ModelError(
            f"The output layer '{path}' is a {type(module).__name__}, not an nn.Linear; leave 'lm_head' "
            "out of select.targets."
        )


@dataclass(frozen=True)
class TargetWeight:
    """One weight that may hold trained entries: `<path>.weight` of the module at `path`."""

    target: str  # a TargetKind's name
    path: str
    module: nn.Module
    layer_index: (
        int | None
    )  # decoder layer number, None outside the decoder layers (embeddings, final norm, head)

    @property
    def key(self) -> str:
        return f"{self.path}.weight"

    @property
    def kind(self) -> str:
        return TARGET_KINDS[self.target].kind


def _embeddings(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """(input embedding, output layer) of a transformers model; (None, None) for a bare module (an MoE block
    prepared on its own has neither)."""
    get_input = getattr(model, "get_input_embeddings", None)
    get_output = getattr(model, "get_output_embeddings", None)
    return (get_input() if get_input else None), (get_output() if get_output else None)


def tied_output_layer(model: nn.Module) -> nn.Module | None:
    """The output layer when it shares its weight with the input embedding, else None."""
    embeddings, head = _embeddings(model)
    if embeddings is not None and head is not None and embeddings.weight is head.weight:
        return head
    return None


def _is_attention(module: nn.Module) -> bool:
    return bool(re.search(r"Attention$", type(module).__name__))


def _is_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        "norm" in type(module).__name__.lower()
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 1
        and all(p.dim() == 1 for p in module.parameters(recurse=False))
    )


def find_target_weights(model: nn.Module, layers: list[MoELayer], targets) -> list[TargetWeight]:
    """The weights of `model` that play the roles in `targets` (registered `TargetKind` names; "experts" and
    "routers" are found by `usaf.model.layout`), in module order."""
    wanted = [t for t in targets if t in TARGET_KINDS]
    if not wanted:
        return []
    excluded = [layer.experts_name for layer in layers] + [
        layer.router_name for layer in layers if layer.router_name
    ]
    scan = Scan(*_embeddings(model), tied_output_layer(model) is not None)
    if scan.tied and {"embeddings", "lm_head"} & set(wanted):
        # one weight, two uses: its entries live on the embedding, the output layer reads the same ones
        wanted = [t for t in wanted if t != "lm_head"] + ([] if "embeddings" in wanted else ["embeddings"])
    # the latest registered role first: a plug-in may carve its role out of a built-in one (the built-ins never
    # claim the same module)
    roles = [TARGET_KINDS[name] for name in reversed(list(TARGET_KINDS))]
    found = []
    for path, module in model.named_modules():
        if any(path == e or path.startswith(e + ".") for e in excluded):
            continue
        if _is_attention(module):
            scan.attention_paths.append(path)
        role = next((r for r in roles if r.claims(path, module, scan)), None)
        if role is not None and role.name in wanted:
            if role.check is not None:
                role.check(path, module)
            found.append(TargetWeight(role.name, path, module, layer_number(path)))
    return found


# the built-in roles, in the order select.targets lists them
for _kind in (
    TargetKind(
        "attention",
        "linear",
        lambda path, module, scan: _is_linear(path, module, scan) and scan.inside_attention(path),
        lambda c: c["layers"] * c["attention"],
    ),
    TargetKind(  # shared experts, the dense MLPs of hybrid models' dense layers and beside the experts
        "dense_mlp",
        "linear",
        lambda path, module, scan: _is_linear(path, module, scan) and not scan.inside_attention(path),
        lambda c: c["mlp"],
    ),
    TargetKind(
        "norms",
        "vector",
        lambda path, module, scan: _is_norm(module),
        lambda c: (2 * c["layers"] + 1) * c["hidden"],
    ),
    TargetKind(
        "embeddings",
        "rows",
        lambda path, module, scan: module is scan.embeddings,
        lambda c: c["vocab"] * c["hidden"],
        _embedding_check,
        outside_layers=True,
    ),
    TargetKind(  # tied: trained through the embedding's entries, never on its own
        "lm_head",
        "linear",
        lambda path, module, scan: module is scan.head and not scan.tied,
        lambda c: 0 if c["tied"] else c["vocab"] * c["hidden"],
        _output_layer_check,
        outside_layers=True,
    ),
):
    TARGET_KINDS.register(_kind)
