"""A selection as data (`Chosen` per tensor: flat indices or line ids) and its file: safetensors (the indices)
and a JSON companion (what they mean, and a summary)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import torch

from usaf.errors import ModelError
from usaf.io.atomic import atomic_file, atomic_json


class Chosen(NamedTuple):
    """A selection for one tensor: flat indices (axis None) or line ids along `axis`."""

    axis: int | None
    indices: torch.Tensor


def save_selection(path: str | Path, chosen: dict[str, Chosen], summary: dict | None = None) -> None:
    """Write `<path>` (.safetensors) and its `.json` companion, atomically."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors = {key: c.indices.contiguous().cpu() for key, c in chosen.items()}
    meta = {"axes": {key: c.axis for key, c in chosen.items()}, "summary": summary or {}}
    atomic_file(path, lambda tmp: save_file(tensors, str(tmp)))
    atomic_json(path.with_suffix(".json"), meta)


def load_selection(path: str | Path) -> dict[str, Chosen]:
    from safetensors.torch import load_file

    path = Path(path)
    try:
        tensors = load_file(str(path))
        meta = json.loads(path.with_suffix(".json").read_text())
    except (OSError, ValueError) as err:
        raise ModelError(f"Cannot read the selection file {path} (and its .json companion): {err}") from None
    return {key: Chosen(meta["axes"].get(key), t.to(torch.int64)) for key, t in tensors.items()}
