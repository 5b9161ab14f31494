"""Dynamic reselection (SpIEL/RigL-style): every K steps, drop the trained entries whose values moved least
from the base and grow as many where the task's gradient is largest, with a drop share that decays to zero.
Every target is reselected: the experts' entries (or neurons), and the entries of the other targeted weights.

Decisions (tested in tests/selection/test_reselect.py):
- A dropped entry is reverted to its base value, in the weights the forward uses as well as in every later
  checkpoint and export, so what is evaluated in-run is exactly what resume and export produce. The entries
  dropped are the ones that moved least, so reverting them costs the least.
- Kept entries keep their values and their Adam moments; grown entries start at their original value with zero
  moments; the optimizer's step count (and so its bias correction) is untouched. The `values` parameters keep
  their identity, so the optimizer needs no rebuilding.
- Where to grow: neurons are ranked by first-order importance (h * dL/dh)^2 summed since the last reselection
  (cheap, [E, I] per layer); for element granularity the entries of the best candidate neurons are then scored
  exactly by gradient probes over the last `reselect_probe_steps` steps. The other targets' rows are ranked by
  `SparseWeight.row_score` (a linear layer's sum_t g^2 |x|^2 per output row, an embedding row's squared gradient
  norm) and their best rows probed the same way. Nothing dense is ever scored.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from usaf.engine import expert_parallel
from usaf.engine.installed import row_observers, sparse_experts
from usaf.engine.sparse import LineProbe, line_flat_indices
from usaf.engine.state import model_state
from usaf.errors import ConfigError
from usaf.kernels.host import read_ints
from usaf.model.layout import ExpertGeometry, find_moe_layers
from usaf.selection import across_ranks
from usaf.selection.candidates import NeuronImportance, best_neurons, best_rows, lines_wanted


class Reselector:
    def __init__(self, model: torch.nn.Module, config, total_steps: int, optimizer_eight_bit: bool = False):
        if optimizer_eight_bit:
            raise ConfigError(
                "select.reselect_every needs 32-bit optimizer state: set optim.eight_bit=false."
            )
        self.model, self.config, self.total_steps = model, config, total_steps
        self.states = dict(sparse_experts(model))
        # the other targets' weights: entries (never neurons) reselected the same way, rows ranked by
        # SparseWeight.row_score; an output layer tied to the embedding is the embedding's state
        self.weights = row_observers(model)
        self.geometry = {
            layer.experts_name: ExpertGeometry.of(layer.experts) for layer in find_moe_layers(model)
        }
        self.importance = {path: NeuronImportance() for path in self.states}
        for path, state in self.states.items():
            state.observers.append(self.importance[path])
        self.reselections = 0

    # -------------------------------------------------------------------------------------------- schedule
    def fraction(self, step: int) -> float:
        """Share of each tensor's entries replaced at `step`: cosine decay to 0 at `reselect_until`."""
        end = self.config.reselect_until * self.total_steps
        if step >= end:
            return 0.0
        return self.config.reselect_fraction * 0.5 * (1 + math.cos(math.pi * step / end))

    def is_reselection_step(self, step: int) -> bool:
        every = self.config.reselect_every
        return every > 0 and step % every == 0 and self.fraction(step) > 0

    def set_observing(self, active: bool) -> None:
        for importance in self.importance.values():
            importance.active = active
        for state in self.weights.values():
            state.observing = active

    def before_step(self, step: int) -> None:
        """`step` is the optimizer step about to run (1-based): open the probe window before a reselection (from
        the global statistics), then start this rank's share of the step's."""
        self._open_probe_window(step)
        self._clear_rank_share()

    def _open_probe_window(self, step: int) -> None:
        every = self.config.reselect_every
        if every <= 0:
            return
        upcoming = math.ceil(step / every) * every
        window_open = upcoming - step < self.config.reselect_probe_steps
        probing = any(s.probes for s in [*self.states.values(), *self.weights.values()])
        if (
            self.config.granularity == "element"
            and self.is_reselection_step(upcoming)
            and window_open
            and not probing
        ):
            self._install_probes(upcoming)

    def after_step(self, step: int, optimizer: torch.optim.Optimizer) -> dict | None:
        if not self.is_reselection_step(step):
            return None
        fraction = self.fraction(step)
        moved = 0
        for path, state in self.states.items():
            if self.config.granularity == "element":
                for name, entries in list(state.items()):
                    if name in state.probes:
                        moved += self._reselect_elements(state, name, entries, fraction, optimizer)
            else:
                moved += self._reselect_neurons(path, state, fraction, optimizer)
            state.probes.clear()
            self.importance[path].score = None
        for state in self.weights.values():
            if "weight" in state.probes and state.entries is not None:
                moved += self._reselect_elements(state, "weight", state.entries, fraction, optimizer)
            state.probes.clear()
            state.row_score = None
        self.reselections += 1
        return {"reselected_entries": moved, "reselect_fraction": fraction}

    # ------------------------------------------------------------------------------------------- element
    def _install_probes(self, step: int) -> None:
        """Probes on the candidate lines of every tensor (`usaf.selection.candidates`) for the reselection at
        `step`: `oversample` x the entries it will grow."""
        fraction, oversample = self.fraction(step), self.config.oversample
        for path, state in self.states.items():
            geometry, score = self.geometry[path], self.importance[path].score
            if score is None:
                continue
            for name, axis in geometry.axes.items():
                entries = state[name] if name in state else None  # noqa: SIM401 (ModuleDict has no .get)
                # the job's (a collective under expert parallelism)
                trained = across_ranks.job_expert_count(0 if entries is None else entries.numel())
                if trained == 0:
                    continue
                store = state.stores[name]
                grow = max(1, round(fraction * trained))
                line_length = geometry.entries_per_line_group(name, store.shape)
                neurons = best_neurons(score, lines_wanted(oversample, grow, line_length, score.numel()))
                lines = geometry.line_ids(name, neurons, store.shape[axis])
                state.probes[name] = LineProbe(store.shape, axis, lines.to(store.device))
        for state in self.weights.values():
            entries, store = state.entries, state.stores["weight"]
            if entries is None or entries.numel() == 0:
                continue
            rows, width = store.shape[1:]
            if state.kind == "vector":  # a norm: its one line
                lines = torch.zeros(1, dtype=torch.int64)
            elif state.row_score is None:
                continue
            else:
                grow = max(1, round(fraction * entries.numel()))
                lines = best_rows(state.row_score, rows, lines_wanted(oversample, grow, width, rows))
            state.probes["weight"] = LineProbe(store.shape, 1, lines.to(store.device))

    def _reselect_elements(self, state, name, entries, fraction, optimizer) -> int:
        """Drop the `fraction` of the tensor's entries that moved least, grow as many of the best probed
        candidates; the entries replaced. Under expert parallelism an expert stack's decision is the job's: the
        ranks' entries are gathered (their concatenation is the one-process order), and each rank applies its
        share of the drops and grows."""
        probe, store = state.probes[name], state.stores[name]
        flat = entries.flat_indices  # int64, derived: one tensor's transient
        # what dropping an entry changes in the weight the forward reads: back to the kept base on a resident
        # store, to the dequantized base on a quantized one (which keeps no base: it reads it back)
        base = entries.base_values if entries.keeps_base else store.read(flat)
        moved = (entries.values.detach() - base.float()).abs()
        sharded = state.is_expert_stack and expert_parallel.layout() is not None
        all_flat, sizes = expert_parallel.gather_ragged(flat) if sharded else (flat, [flat.numel()])
        all_moved = expert_parallel.gather_ragged(moved)[0] if sharded else moved
        n = all_flat.numel()
        count = min(round(fraction * n), n)
        candidates = probe.flat_indices()
        scores = probe.score.reshape(-1)
        fresh = ~torch.isin(candidates, all_flat)
        candidates, scores = candidates[fresh], scores[fresh]
        count = min(count, candidates.numel())
        if count == 0:
            return 0
        # ties (entries that never moved, candidates without gradient) broken by position: a total order, so the
        # decision does not hang on how a kernel orders equal values
        drop = torch.argsort(all_moved, stable=True)[:count]
        grow = candidates[torch.argsort(scores, descending=True, stable=True)[:count]]
        if sharded:  # this rank's share: its block of the gathered entries, its experts' candidates
            start = sum(sizes[: expert_parallel.layout().ep_rank])
            drop = drop[(drop >= start) & (drop < start + flat.numel())] - start
            grow = grow[expert_parallel.owned_mask(store.shape, None, grow, store.owned)]
        self._replace(state, name, flat, base, drop, grow, optimizer)
        return count

    def _replace(self, state, name, flat, base, drop, grow, optimizer) -> None:
        """The entries at positions `drop` of tensor `name` reverted and replaced by `grow` (flat indices); the
        others keep their values and moments."""
        entries, store = state[name], state.stores[name]
        keep = torch.ones(flat.numel(), dtype=torch.bool, device=flat.device)
        keep[drop] = False
        if store.resident:  # revert the dropped entries in the weights the forward reads
            store.full().view(-1).index_copy_(0, flat[drop], base[drop].to(store.dtype))
        grow_base = self._original(state, name, store, grow)
        merged = torch.cat([flat[keep], grow])
        order = torch.argsort(merged)
        old_position = torch.cat(
            [keep.nonzero().squeeze(1), torch.full((grow.numel(),), -1, device=merged.device)]
        )[order]
        values = torch.cat([entries.values.detach()[keep], grow_base.float()])[order]
        kept_base = None
        if entries.keeps_base:
            kept_base = torch.cat([base[keep], grow_base.to(base.dtype)])[order]
        del base, flat
        _remap_optimizer_state(optimizer, entries.values, old_position)
        entries.set_selection(merged[order], kept_base, values)

    def _original(self, state, name, store, flat) -> torch.Tensor:
        prepared = model_state(self.model)
        original = prepared.original_values if prepared is not None else None
        path = next(p for p, s in self._all().items() if s is state)
        return original(f"{path}.{name}", flat) if original is not None else store.read(flat)

    # -------------------------------------------------------------------------------------------- neuron
    def _reselect_neurons(self, path, state, fraction, optimizer) -> int:
        geometry = self.geometry[path]
        axes = geometry.axes
        score = self.importance[path].score
        if score is None or any(name not in state for name in axes):
            return 0
        # a neuron's movement: summed |value - base| over its lines in every tensor
        first = next(iter(axes))
        lines_first = state.stores[first].shape[axes[first]]
        neurons = torch.unique(geometry.owners(first, state[first].line_ids, lines_first))
        movement = torch.zeros(neurons.numel(), device=score.device)
        for name in axes:
            e = state[name]
            per_line = (e.values.detach() - e.base_values.float()).abs().sum(1)
            owner = geometry.owners(name, e.line_ids, state.stores[name].shape[axes[name]])
            movement.index_add_(0, torch.searchsorted(neurons, owner), per_line.to(movement.device))
        count = min(round(fraction * neurons.numel()), neurons.numel())
        flat_score = score.reshape(-1).clone()
        flat_score[neurons] = float("-inf")
        count = min(count, int((flat_score > float("-inf")).sum()))
        if count == 0:
            return 0
        drop = neurons[torch.topk(movement, count, largest=False, sorted=False).indices]
        grow = torch.topk(flat_score, count, sorted=False).indices
        new_neurons = torch.cat([neurons[~torch.isin(neurons, drop)], grow]).sort().values
        for name, axis in axes.items():
            e, store = state[name], state.stores[name]
            lines = geometry.line_ids(name, new_neurons, store.shape[axis])
            old = e.line_ids
            kept = torch.isin(lines, old)
            old_position = torch.full_like(lines, -1)
            old_position[kept] = torch.searchsorted(old, lines[kept])
            dropped = ~torch.isin(old, lines)
            if store.resident and dropped.any():
                flat = line_flat_indices(store.shape, axis, old[dropped])
                store.full().view(-1).index_copy_(0, flat, e.base_values[dropped].reshape(-1))
            new_lines = lines[~kept]
            grow_base = self._original(state, name, store, line_flat_indices(store.shape, axis, new_lines))
            grow_base = grow_base.view(new_lines.numel(), -1)
            values = torch.empty(lines.numel(), e.values.shape[1], device=e.values.device)
            base = torch.empty(
                lines.numel(), e.values.shape[1], dtype=e.base_values.dtype, device=e.values.device
            )
            values[kept], base[kept] = (
                e.values.detach()[old_position[kept]],
                e.base_values[old_position[kept]],
            )
            values[~kept], base[~kept] = grow_base.float(), grow_base.to(base.dtype)
            _remap_optimizer_state(optimizer, e.values, old_position)
            e.set_selection(lines, base, values)
        return count * sum(geometry.entries_per_line_group(n, state.stores[n].shape) for n in axes)

    # ------------------------------------------------------------------------------------------ across ranks
    # The statistics are sums over micro-batches: rank 0 keeps the running sum, the other ranks only their share
    # since the last step, and `after_backward` sums them, so every rank holds the global statistics and takes
    # the same decisions (the 1-process ones).
    def _statistics(self) -> list[tuple[object, str, bool]]:
        """(holder, attribute, kept) of every summed statistic, in the same order on every rank; `kept`: a probe's
        score, zeroed rather than dropped."""
        slots: list[tuple[object, str, bool]] = [(imp, "score", False) for imp in self.importance.values()]
        slots += [(state, "row_score", False) for state in self.weights.values()]
        for state in [*self.states.values(), *self.weights.values()]:
            slots += [(state.probes[name], "score", True) for name in sorted(state.probes)]
        return slots

    def _clear_rank_share(self) -> None:
        """Before a step's micro-batches: ranks other than 0 start their statistics from zero."""
        if not across_ranks.active() or across_ranks.is_main():
            return
        for holder, attr, kept in self._statistics():
            value = getattr(holder, attr)
            if value is not None:
                if kept:
                    value.zero_()
                else:
                    setattr(holder, attr, None)

    def after_backward(self) -> None:
        """After a step's backward passes: the statistics summed across ranks. One no rank has stays None; one
        some ranks lack starts from zeros there."""
        if not across_ranks.active():
            return
        slots = self._statistics()
        if not slots:
            return
        device = across_ranks.comm_device()
        shapes = torch.zeros(len(slots), 5, dtype=torch.int64, device=device)
        where = None
        for i, (holder, attr, _) in enumerate(slots):
            value = getattr(holder, attr)
            if value is not None:
                where = value.device
                shapes[i, 0] = value.dim() + 1
                shapes[i, 1 : 1 + value.dim()] = torch.tensor(value.shape, dtype=torch.int64)
        dist.all_reduce(shapes, op=dist.ReduceOp.MAX)
        # one read a step (a host sync under NCCL); where every rank holds every statistic, its own shapes
        flat = read_ints(shapes.reshape(-1), lambda: _shape_rows(slots))
        rows = [flat[i : i + 5] for i in range(0, len(flat), 5)]
        tensors = []
        for (holder, attr, _), row in zip(slots, rows, strict=True):
            if row[0] == 0:
                continue
            if getattr(holder, attr) is None:
                if where is None:
                    where = device if device.type == "cuda" else torch.device("cpu")
                setattr(holder, attr, torch.zeros(row[1 : row[0]], device=where))
            tensors.append(getattr(holder, attr))
        across_ranks.all_reduce_flat(tensors)

    # -------------------------------------------------------------------------------------------- resume
    def _all(self) -> dict:
        return {**self.states, **self.weights}

    def state_dict(self) -> dict[str, torch.Tensor]:
        tensors = {}
        for path, importance in self.importance.items():
            if importance.score is not None:
                tensors[f"importance/{path}"] = importance.score.cpu()
        for path, state in self.weights.items():
            if state.row_score is not None:
                tensors[f"rows/{path}"] = state.row_score.cpu()
        for path, state in self._all().items():
            for name, probe in state.probes.items():
                tensors[f"probe/{path}/{name}/lines"] = probe.line_ids.cpu()
                tensors[f"probe/{path}/{name}/score"] = probe.score.cpu()
                tensors[f"probe/{path}/{name}/axis"] = torch.tensor(probe.axis)
        return tensors

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        for key, value in tensors.items():
            kind, rest = key.split("/", 1)
            if kind == "importance":
                self.importance[rest].score = value.to(next(iter(self.states[rest].stores.values())).device)
            elif kind == "rows":
                self.weights[rest].row_score = value.to(self.weights[rest].stores["weight"].device)
            elif kind == "probe" and key.endswith("/lines"):
                path, name, _ = rest.rsplit("/", 2)
                store = self._all()[path].stores[name]
                axis = int(tensors[f"probe/{path}/{name}/axis"])
                probe = LineProbe(store.shape, axis, value.to(store.device))
                probe.score.copy_(tensors[f"probe/{path}/{name}/score"])
                self._all()[path].probes[name] = probe


def _shape_rows(slots) -> list[int]:
    """`after_backward`'s shape table of this rank's statistics, flat: per slot its dimensions + 1, then its sizes
    (zeros for one this rank lacks)."""
    flat = []
    for holder, attr, _ in slots:
        value = getattr(holder, attr)
        row = [0] * 5 if value is None else [value.dim() + 1, *value.shape, *[0] * (4 - value.dim())]
        flat += row
    return flat


def _remap_optimizer_state(optimizer, param: torch.nn.Parameter, old_position: torch.Tensor) -> None:
    """Carry per-entry optimizer state to the new selection: kept entries keep theirs, new ones start at zero."""
    state = optimizer.state.get(param)
    if not state:
        return
    kept = old_position >= 0
    for key, value in list(state.items()):
        if isinstance(value, torch.Tensor) and value.shape == param.shape:
            fresh = torch.zeros(
                (old_position.numel(), *value.shape[1:]), dtype=value.dtype, device=value.device
            )
            fresh[kept] = value[old_position[kept]]
            state[key] = fresh
