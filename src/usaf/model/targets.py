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
from dataclasses import dataclass

from torch import nn

from usaf.errors import UsafError
from usaf.model.layout import MoELayer, layer_number

DENSE_TARGETS = ("attention", "dense_mlp", "norms", "embeddings", "lm_head")
KINDS = {
    "attention": "linear",
    "dense_mlp": "linear",
    "norms": "vector",
    "embeddings": "rows",
    "lm_head": "linear",
}


@dataclass(frozen=True)
class TargetWeight:
    """One weight that may hold trained entries: `<path>.weight` of the module at `path`."""

    target: str  # one of DENSE_TARGETS
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
        return KINDS[self.target]


def tied_output_layer(model: nn.Module) -> nn.Module | None:
    """The output layer when it shares its weight with the input embedding, else None."""
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
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
    """The weights of `model` that play the roles in `targets` (a subset of DENSE_TARGETS), in module order."""
    wanted = [t for t in targets if t in DENSE_TARGETS]
    if not wanted:
        return []
    excluded = [layer.experts_name for layer in layers] + [
        layer.router_name for layer in layers if layer.router_name
    ]
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = tied_output_layer(model) is not None
    if tied and {"embeddings", "lm_head"} & set(wanted):
        # one weight, two uses: its entries live on the embedding, the output layer reads the same ones
        wanted = [t for t in wanted if t != "lm_head"] + ([] if "embeddings" in wanted else ["embeddings"])
    found, attention_paths = [], []
    for path, module in model.named_modules():
        if any(path == e or path.startswith(e + ".") for e in excluded):
            continue
        if _is_attention(module):
            attention_paths.append(path)
        role = None
        if module is embeddings:
            role = "embeddings"
        elif module is head:
            role = None if tied else "lm_head"  # tied: trained through the embedding's entries
        elif isinstance(module, nn.Linear):
            inside_attention = any(path.startswith(a + ".") for a in attention_paths)
            role = "attention" if inside_attention else "dense_mlp"
        elif _is_norm(module):
            role = "norms"
        if role in wanted:
            if role == "embeddings" and not isinstance(module, nn.Embedding):
                raise UsafError(
                    f"The input embedding '{path}' is a {type(module).__name__}, not an nn.Embedding; usaf cannot "
                    "train its rows. Leave 'embeddings' out of select.targets."
                )
            if role == "lm_head" and not isinstance(module, nn.Linear):
                raise UsafError(
                    f"The output layer '{path}' is a {type(module).__name__}, not an nn.Linear; leave 'lm_head' "
                    "out of select.targets."
                )
            found.append(TargetWeight(role, path, module, layer_number(path)))
    return found
