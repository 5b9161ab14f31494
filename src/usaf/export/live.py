"""A delta file from a live model: what a model prepared with `usaf.prepare_model` and trained in the user's own
loop (or a Trainer's) changed, written against the checkpoint it was loaded from."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from usaf.base.checkpoint import BaseCheckpoint
from usaf.export.delta import Delta, sorted_change, write_delta
from usaf.prepare import TensorChange, get_delta


@torch.no_grad()
def save_delta(
    model: nn.Module,
    base_model_dir: str | Path,
    out_path: str | Path,
    *,
    fp32: bool = False,
    force: bool = False,
) -> Path:
    """Write the trained entries of `model` (and any router it trained whole) as a delta file against
    `base_model_dir`, the checkpoint the model was loaded from; returns the file's path. The same file
    `usaf export --delta` writes: `usaf apply` merges it, `usaf.load_delta` loads it."""
    base = BaseCheckpoint(base_model_dir)
    changes = {name: sorted_change(c.flat_indices, c.values) for name, c in get_delta(model).items()}
    for layer in base.layers:
        if layer.router is None:
            continue
        for param_name, _ in layer.router.named_parameters():
            name = f"{layer.router_name}.{param_name}"
            live = model.get_parameter(name).detach().float().cpu()
            if not torch.equal(live, base.read(name).float()):
                changes[name] = TensorChange(None, live.reshape(-1))
    return write_delta(
        Delta(changes, {"source": {"live_model": True}}), base, out_path, fp32=fp32, force=force
    )
