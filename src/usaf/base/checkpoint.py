"""A base checkpoint read against its model's skeleton: where a model parameter's entries live in the checkpoint's own
tensors and positions, found by running transformers' load-time conversion on tensors of position ids."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from usaf.errors import ModelError
from usaf.files import STORE_FILE
from usaf.io import shards
from usaf.io.model_source import read_store_metadata
from usaf.io.source import SourceCheckpoint, check_model_files
from usaf.model.hf import WeightRenaming, build_skeleton, load_config
from usaf.model.layout import expert_weight_names, find_moe_layers

_CHUNK_BYTES = 64 << 20


# ---- the base checkpoint ---------------------------------------------------------------------------------------


class BaseCheckpoint:
    """A full-precision Hugging Face checkpoint directory, read against its model's skeleton (no weights loaded)."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        if (self.dir / STORE_FILE).exists():
            source = read_store_metadata(self.dir)["source"]["dir"]
            raise ModelError(
                f"{self.dir} is a usaf prepared (quantized) store; use the full-precision checkpoint it was prepared "
                f"from ({source}) as the base: merged checkpoints are never re-quantized."
            )
        if not (self.dir / "config.json").is_file():
            raise ModelError(
                f"{self.dir} has no config.json; pass the Hugging Face model directory the model was trained from."
            )
        # an unreadable config.json or an unknown model_type: one line (the weights are mapped just below)
        check_model_files(str(self.dir), weights=False)
        self.config = load_config(self.dir)
        self.skeleton = build_skeleton(self.config)
        self.layers = find_moe_layers(self.skeleton)
        self.source = SourceCheckpoint(self.dir, self.skeleton, set(expert_weight_names(self.layers)))

    def identity(self) -> dict:
        return {
            "model_type": getattr(self.config, "model_type", None),
            "config_sha256": hashlib.sha256((self.dir / "config.json").read_bytes()).hexdigest(),
            "name_or_path": str(self.dir.resolve()),
        }

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._target(name).shape)

    def dtype(self, name: str) -> torch.dtype:
        return self._target(name).dtype

    def _target(self, name: str):
        target = self.source.targets.get(name)
        if target is None:
            raise ModelError(
                f"The delta changes '{name}', which the model in {self.dir} does not have: it was trained on "
                "another model."
            )
        return target

    def sha256(self, key: str) -> str:
        return self.source.finish_checksums([key])[key]  # hashed once, cached by the source

    def shard_files(self) -> list[str]:
        return sorted({entry.file.name for entry in self.source.entries.values()})

    def locate(self, name: str, flat: torch.Tensor) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """Where entries `flat` of parameter `name` are stored: (checkpoint key, positions in that tensor, which of
        the given entries) per checkpoint tensor involved."""
        target = self._target(name)
        group = self.source.groups[target.group]
        flat = flat.reshape(-1).to(torch.int64).cpu()
        keys = group.keys()
        if (
            isinstance(group.transform, WeightRenaming)
            and len(keys) == 1
            and tuple(self.source.entries[keys[0]].shape) == tuple(target.shape)
        ):
            return [(keys[0], flat, torch.arange(flat.numel()))]
        if target.per_expert:
            return self._locate_per_expert(name, group, target, flat)
        ids, sources = _position_ids(self.source, group, self.source.groups[target.group].sources, name)
        return _split_by_source(ids.reshape(-1)[flat], sources)

    def _locate_per_expert(self, name, group, target, flat):
        per_expert = torch.Size(target.shape[1:]).numel()
        # the conversion is the same for every expert: map expert 0 (one expert's worth of ids, not cached: a
        # parameter is located once per export) and reuse its pattern with each expert's own checkpoint keys
        ids, sources = _position_ids(self.source, group, self.source._expert_sources(group, 0), name)
        slot, position = _decode(ids.reshape(-1), sources)
        expert = torch.div(flat, per_expert, rounding_mode="floor")
        local = flat - expert * per_expert
        combined = expert * len(sources) + slot[local]
        out = []
        for code in torch.unique(combined).tolist():
            e, s = divmod(code, len(sources))
            keys = [k for ks in self.source._expert_sources(group, e).values() for k in ks]
            picked = (combined == code).nonzero(as_tuple=True)[0]
            out.append((keys[s], position[local[picked]], picked))
        return out

    def read(self, name: str, saved: dict[str, shards.TensorEntry] | None = None, where: Path | None = None):
        """The whole parameter `name` as the model holds it, read from this checkpoint, or from `saved` (the tensors
        of a checkpoint in the same layout, e.g. written by transformers.Trainer, in folder `where`)."""
        entries = self.source.entries if saved is None else saved
        shape = self.shape(name)
        if saved is not None and name in saved and name not in self.source.entries:
            # saved under the model's own name: written without converting back to the checkpoint's layout
            return shards.read_tensor(saved[name]).to(self.dtype(name)).reshape(shape)
        numel = torch.Size(shape).numel()
        out = torch.empty(numel, dtype=self.dtype(name))
        for key, positions, picked in self.locate(name, torch.arange(numel)):
            if key not in entries:
                raise ModelError(f"Tensor '{key}' (part of '{name}') is missing from {where or self.dir}.")
            out[picked] = shards.read_tensor(entries[key]).reshape(-1)[positions].to(out.dtype)
        return out.reshape(shape)


def _position_ids(source, group, sources: dict[str, list[str]], name: str) -> tuple[torch.Tensor, list]:
    """Run the group's conversion on tensors holding their own element ids: the result says, for every element of
    `name`, which checkpoint element it comes from. Conversions only move data, so ids pass through unchanged."""
    keys = [k for ks in sources.values() for k in ks]
    offsets, total = {}, 0
    for key in keys:
        offsets[key] = total
        total += torch.Size(source.entries[key].shape).numel()

    def ids_of(key: str) -> torch.Tensor:
        entry = source.entries[key]
        return (torch.arange(torch.Size(entry.shape).numel()) + offsets[key]).reshape(entry.shape)

    try:
        ids = source._convert(group, sources, ids_of)[name]
    except Exception as err:
        raise ModelError(f"Cannot map '{name}' onto the checkpoint tensors {keys[:3]}: {err}") from err
    flat = ids.reshape(-1)
    if flat.dtype != torch.int64 or torch.unique(flat).numel() != flat.numel():
        raise ModelError(
            f"The checkpoint's conversion into '{name}' does not just move values ({type(group.transform).__name__}); "
            "usaf cannot write entries back into this checkpoint layout."
        )
    return ids, [(key, offsets[key]) for key in keys]


def _decode(ids: torch.Tensor, sources: list[tuple[str, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.tensor([offset for _, offset in sources])
    slot = torch.searchsorted(starts, ids, right=True) - 1
    return slot, ids - starts[slot]


def _split_by_source(ids: torch.Tensor, sources: list[tuple[str, int]]):
    slot, position = _decode(ids, sources)
    out = []
    for s in torch.unique(slot).tolist():
        picked = (slot == s).nonzero(as_tuple=True)[0]
        out.append((sources[s][0], position[picked], picked))
    return out
