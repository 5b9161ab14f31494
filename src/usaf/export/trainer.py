"""A checkpoint written by transformers.Trainer for a model prepared by usaf, read as a usaf delta."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from usaf.base.checkpoint import BaseCheckpoint
from usaf.engine.sparse import line_flat_indices
from usaf.errors import ModelError
from usaf.export.delta import Delta, sorted_change, write_delta
from usaf.io import shards
from usaf.io.source import list_shards
from usaf.model.hf import apply_renamings
from usaf.model.layout import input_projection, neuron_axes
from usaf.prepare import TensorChange, model_renamings

# ---- Hugging Face Trainer checkpoints ----------------------------------------------------------------------------


def delta_from_trainer_checkpoint(
    checkpoint_dir: str | Path,
    base_model_dir: str | Path | BaseCheckpoint,
    out_path: str | Path,
    *,
    fp32: bool = False,
    force: bool = False,
) -> Path:
    """Turn the model a `transformers.Trainer` (or TRL) checkpoint saved for a model prepared by usaf into a usaf delta
    file against `base_model_dir`, the checkpoint the model was loaded from (its folder, or a `BaseCheckpoint`
    already open). Returns `out_path`."""
    base = base_model_dir if isinstance(base_model_dir, BaseCheckpoint) else BaseCheckpoint(base_model_dir)
    delta = trainer_checkpoint_delta(checkpoint_dir, base)
    return write_delta(delta, base, out_path, fp32=fp32, force=force)


def trainer_checkpoint_delta(checkpoint_dir: str | Path, base: BaseCheckpoint) -> Delta:
    """The trained entries (saved by the prepared model as `<experts>.usaf.<tensor>.*`) and the routers that differ
    from the base, from a checkpoint written by `save_pretrained` (Trainer saves through it)."""

    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise ModelError(f"Trainer checkpoint {checkpoint_dir} does not exist.")
    saved = list_shards(checkpoint_dir)
    selections = _usaf_keys_by_tensor(saved, base, checkpoint_dir)
    if not selections:
        raise ModelError(
            f"{checkpoint_dir} holds no usaf trained entries: was the model prepared with usaf.prepare_model before "
            "training, and is this the checkpoint folder (checkpoint-N) the Trainer wrote?"
        )
    layers = {layer.experts_name: layer for layer in base.layers}
    changes = {}
    for (path, tensor), keys in sorted(selections.items()):
        values = shards.read_tensor(saved[keys["values"]]).float()
        shape = base.shape(f"{path}.{tensor}")
        shape3 = shape if len(shape) == 3 else (shape[0], 1, shape[1])
        if "flat_indices" in keys:
            flat = shards.read_tensor(saved[keys["flat_indices"]])
        elif "line_ids" in keys:
            axis = _line_axis(layers[path], tensor, shape3, values.shape[-1], checkpoint_dir)
            flat = line_flat_indices(shape3, axis, shards.read_tensor(saved[keys["line_ids"]]))
        else:
            raise ModelError(f"{checkpoint_dir} has values for {path}.{tensor} but no selection for them.")
        changes[f"{path}.{tensor}"] = sorted_change(flat, values)
    for layer in base.layers:
        if layer.router is None:
            continue
        for param_name, _ in layer.router.named_parameters():
            name = f"{layer.router_name}.{param_name}"
            trained = base.read(name, saved, checkpoint_dir)
            if not torch.equal(trained, base.read(name)):
                changes[name] = TensorChange(None, trained.reshape(-1))
    state_file = checkpoint_dir / "trainer_state.json"
    step = json.loads(state_file.read_text()).get("global_step") if state_file.exists() else None
    return Delta(changes, {"source": {"trainer_checkpoint": str(checkpoint_dir.resolve()), "step": step}})


def _usaf_keys_by_tensor(
    saved: dict, base: BaseCheckpoint, where: Path
) -> dict[tuple[str, str], dict[str, str]]:
    """{(experts module path in the model, tensor name): {buffer or parameter name: saved key}}.

    save_pretrained renames keys back into the checkpoint's own layout (e.g. Mixtral's `.mlp.` becomes
    `.block_sparse_moe.`); the model's own renamings bring the experts path back."""
    renamings = model_renamings(base.skeleton)
    found: dict[tuple[str, str], dict[str, str]] = {}
    for key in saved:
        if ".usaf." not in key:
            continue
        owner, _, rest = key.partition(".usaf.")
        tensor, _, part = rest.rpartition(".")
        path = owner
        if f"{path}.{tensor}" not in base.source.targets:
            path = apply_renamings(key, renamings).partition(".usaf.")[0]
        if f"{path}.{tensor}" not in base.source.targets:
            raise ModelError(
                f"'{key}' in {where} belongs to no weight of the model in {base.dir}: pass the base the "
                "Trainer's model was loaded from."
            )
        found.setdefault((path, tensor), {})[part] = key
    return found


def _line_axis(layer, tensor: str, shape3, line_length: int, where: Path) -> int:
    """Which axis whole-line selections run along: rows hold B entries, columns A. When A == B, usaf's neurons
    decide (rows of the input projection and columns of down, transposed for transposed layouts)."""
    _, rows_a, cols_b = shape3
    if rows_a != cols_b:
        if line_length not in (rows_a, cols_b):
            raise ModelError(
                f"{where}: lines of {line_length} values do not fit {layer.experts_name}.{tensor}."
            )
        return 1 if line_length == cols_b else 2
    axes = neuron_axes(layer.experts)
    return axes["down_proj"] if tensor == "down_proj" else axes[input_projection(layer.experts)]
