"""The state the engine keeps on a prepared model: one object on the model, one protocol on the prepared modules.

- `ModelState` (`model.usaf_state`, read with `model_state`): what `prepare_model` and `load_prepared` know about the
  whole model (the configuration, the calibration, where original values come from, the prepared store).
- `SparseState`: the base of the per-module state (`module.usaf`), shared by `SparseExperts` (an experts module's
  [E, A, B] stacks) and `SparseWeight` (one native weight). Consumers (selection, checkpoints, export, delta
  loading) use what it declares, and ask its declared capabilities (`is_expert_stack`, `observes_rows`) rather
  than its class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

STATE_ATTRIBUTE = "usaf_state"


@dataclass
class PreparedStore:
    """The prepared store a model was loaded from (`usaf.load_prepared`)."""

    dir: str
    metadata: dict
    streamer: Any = None  # usaf.store.offload.LayerStreamer, or None where the experts are resident


@dataclass
class ModelState:
    """usaf's state on a prepared model as a whole."""

    config: Any  # usaf.config.UsafConfig
    calibration: Any = None  # usaf.selection.calibrate.Calibration the selection was made with, or None
    # (tensor key, flat indices) -> the original full-precision values there (a quantized base), or None
    original_values: Callable[[str, torch.Tensor], torch.Tensor] | None = None
    store: PreparedStore | None = None


def model_state(model: nn.Module) -> ModelState | None:
    """usaf's state on `model` (None: not prepared by usaf)."""
    return getattr(model, STATE_ATTRIBUTE, None)


def set_model_state(model: nn.Module, state: ModelState) -> None:
    setattr(model, STATE_ATTRIBUTE, state)


def streamed_bytes(model: nn.Module) -> int:
    """Host -> device bytes the `LayerStreamer` of `model` (a `usaf.load_prepared` model) has moved so far; 0 where
    the experts are resident on the device (nothing streams)."""
    state = model_state(model)
    streamer = state.store.streamer if state is not None and state.store is not None else None
    return streamer.bytes_streamed if streamer is not None else 0


class SparseState(nn.ModuleDict):
    """usaf's state on one prepared module: the trained entries by tensor name (the dict's items, as submodules,
    so that they enter the state dict as `<module>.usaf.<tensor>.*`), the frozen store of every tensor that may
    hold entries (`stores`), and the probes of candidate lines (`probes`).

    The module's own parameters stay the effective weights for anyone reading them: before a state dict is taken
    the trained values are written into resident stores (`write_resident`), and after one is loaded they are
    written through (`after_load`).
    """

    # an [E, A, B] stack of experts: entries by lines or neurons, routing observers, expert parallelism
    is_expert_stack: ClassVar[bool]
    # ranks its rows by first-order importance while `observing` (into `row_score`): reselection and calibration
    observes_rows: ClassVar[bool]
    target: str  # the `UsafConfig.targets` name this state trains ("experts", "attention", "norms", ...)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        missing = [a for a in ("is_expert_stack", "observes_rows") if not hasattr(cls, a)]
        if missing:
            raise TypeError(f"{cls.__name__} must declare {missing} (the capabilities consumers ask)")

    def __init__(self, stores: dict, entries: dict | None = None):
        super().__init__(entries)
        self.stores = stores
        self.probes: dict = {}  # tensor name -> LineProbe: gradients of candidate lines (see usaf.engine.sparse)
        # The parent's parameters enter a state dict as views before this child's hook runs, so writing here counts.
        self.register_state_dict_pre_hook(_write_before_save)
        self.register_load_state_dict_post_hook(_write_after_load)

    def entries_of(self, name: str):
        """The trained entries of tensor `name`, or None."""
        return self[name] if name in self else None  # noqa: SIM401 (ModuleDict has no .get)

    @torch.no_grad()
    def write_resident(self) -> None:
        """Write the trained values into resident (unquantized) stores now. The forward does this lazily, so after an
        optimizer step the module's own parameters lag one step; `state_dict` and `save_pretrained` (what
        `transformers.Trainer` checkpoints) must see the effective weights."""
        for name, entries in self.items():
            store = self.stores.get(name)
            if store is not None and store.resident:
                entries.write_into(store.full(), None)

    def after_load(self) -> None:
        """After `load_state_dict` (e.g. Trainer's resume or best-model reload) replaced values and selections in
        place: forget cached groupings (keyed by storage) and write the loaded values through."""
        for entries in self.values():
            entries._grouping = None
        self.write_resident()


def _write_before_save(state: SparseState, prefix: str, keep_vars: bool) -> None:
    state.write_resident()


def _write_after_load(state: SparseState, incompatible_keys) -> None:
    state.after_load()


# An output layer tied to the embedding reads the embedding's state, kept out of the module tree (one owner, one
# entry in the state dict): a plain reference in the instance dictionary, never a registered submodule.
_TIED = "usaf_tied"


def owned_state(module: nn.Module) -> SparseState | None:
    """The state `module` owns (`module.usaf`), or None."""
    state = module._modules.get("usaf")
    return state if isinstance(state, SparseState) else None


def module_state(module: nn.Module) -> SparseState | None:
    """The state `module`'s forward uses: its own, or (a tied output layer) the one it shares."""
    tied = module.__dict__.get(_TIED)  # not `or`: a state without entries yet is an empty (falsy) container
    return tied if tied is not None else owned_state(module)


def share_state(module: nn.Module, state: SparseState) -> None:
    """`module` uses `state`, owned by another module (a tied output layer and its embedding)."""
    module.__dict__[_TIED] = state
