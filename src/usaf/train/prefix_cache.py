"""Frozen-prefix cache: when the lowest trained layer is L > 0, the hidden states entering layer L depend on
frozen weights only, so they are computed once per training row and replayed in later epochs.

On a cached batch, decoder layers below L-1 pass their input through untouched and layer L-1 returns the
cached states (real positions; right padding is zero-filled, which causal attention never lets a real token
see and whose labels are ignored). Embeddings, masks and rotary tables are still computed: they are cheap.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from usaf.errors import ConfigError
from usaf.model.hf import decoder_body
from usaf.model.layout import find_moe_layers
from usaf.train import distributed


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    body = decoder_body(model)
    return body.layers


class FrozenPrefixCache:
    @classmethod
    def for_run(cls, model: torch.nn.Module, config, run_dir: Path) -> FrozenPrefixCache | None:
        """The run's cache below its lowest trained layer (None: train.prefix_cache=off), or why it cannot be."""
        if config.train.prefix_cache == "off":
            return None
        if distributed.active():  # [usaf.distributed]
            raise ConfigError(
                "train.prefix_cache is not supported with more than one process yet; set train.prefix_cache=off."
            )
        trained = config.select.layers
        lowest = min(trained) if trained else 0
        if lowest < 1:
            raise ConfigError(
                "train.prefix_cache needs select.layers to leave the lowest layers frozen (e.g. [2, 3])."
            )
        for layer in find_moe_layers(model):
            if layer.layer_index < lowest and any(p.requires_grad for p in layer.router.parameters()):
                raise ConfigError("train.prefix_cache: a router below the lowest trained layer is trainable.")
        return cls(model, lowest, config.train.prefix_cache, run_dir / "prefix_cache")

    def __init__(
        self, model: torch.nn.Module, first_trained_layer: int, where: str, folder: Path | None = None
    ):
        if first_trained_layer < 1:
            raise ConfigError(
                "the frozen-prefix cache needs a lowest trained layer above 0: set select.layers to leave layer 0 frozen."
            )
        self.layers = decoder_layers(model)[:first_trained_layer]
        self.where, self.folder = where, Path(folder) if folder else None
        if where == "disk":
            self.folder.mkdir(parents=True, exist_ok=True)
        self.ram: dict[int, torch.Tensor] = {}
        self.rows: list[int] | None = None  # dataset rows of the current batch (None: cache off)
        self.lengths: list[int] = []
        self.replay: torch.Tensor | None = None
        self.hits = self.misses = 0
        for index, layer in enumerate(self.layers):
            layer.forward = self._wrap(layer.forward, last=index == len(self.layers) - 1)

    def state_dict(self) -> dict:
        """What a checkpoint keeps (at the top of its state, with the run's counters)."""
        return {"prefix_cache_hits": self.hits}

    def load_state_dict(self, state: dict) -> None:
        self.hits = int(state.get("prefix_cache_hits", 0))

    def _wrap(self, forward, last: bool):
        def cached_forward(hidden_states, *args, **kwargs):
            if self.rows is not None and self.replay is not None:
                return self.replay.to(hidden_states.dtype) if last else hidden_states
            out = forward(hidden_states, *args, **kwargs)
            if last and self.rows is not None:
                self._store(out)
            return out

        return cached_forward

    def begin_batch(self, rows: list[int], lengths: list[int], like: torch.Tensor) -> None:
        """Before the forward of a training batch: replay it if every row is cached, else record it."""
        self.rows, self.lengths = list(rows), list(lengths)
        cached = [self._load(r) for r in self.rows]
        if all(c is not None for c in cached):
            width = like.shape[1]
            replay = torch.zeros(len(cached), width, cached[0].shape[-1], dtype=cached[0].dtype)
            for i, states in enumerate(cached):
                replay[i, : states.shape[0]] = states
            self.replay = replay.to(like.device)
            self.hits += 1
        else:
            self.replay = None
            self.misses += 1

    def end_batch(self) -> None:
        self.rows, self.replay = None, None

    def _store(self, out: torch.Tensor) -> None:
        for i, row in enumerate(self.rows):
            states = out[i, : self.lengths[i]].detach().to("cpu").contiguous()
            if self.where == "ram":
                self.ram[row] = states
            else:
                path = self.folder / f"row-{row}.safetensors"
                tmp = path.with_suffix(".tmp")
                save_file({"h": states}, str(tmp))
                tmp.replace(path)

    def _load(self, row: int) -> torch.Tensor | None:
        if self.where == "ram":
            return self.ram.get(row)
        path = self.folder / f"row-{row}.safetensors"
        return load_file(str(path))["h"] if path.exists() else None
