"""Calibration: what a task's tokens do to the experts, accumulated over many batches (never one sample).

Pass 1 (cheap, bounded by [layers, E, I]): per layer and expert, routed tokens and summed gate weight; and, when
gradients are wanted, a first-order importance per expert neuron, sum over its tokens of (h * dL/dh)^2, from the
intermediate activation h the engine exposes to observers.
Pass 2 (`probe_lines`): exact gradient magnitudes of the entries of candidate lines only (neurons that survived
pass 1), through the engine's probes: nothing the size of an expert stack is ever scored. The other targeted
weights work alike: pass 1 ranks their rows (`SparseWeight.row_score`), pass 2 probes the best rows only, so an
output layer of a 151 k vocabulary is never scored whole.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from usaf.engine import expert_parallel
from usaf.engine.installed import row_observers, sparse_experts, sparse_modules
from usaf.engine.loss import causal_lm_loss
from usaf.engine.sparse import LineProbe
from usaf.model.layout import ExpertGeometry
from usaf.selection.candidates import NeuronImportance


@dataclass
class Calibration:
    tokens: dict[str, torch.Tensor] = field(default_factory=dict)  # experts path -> [E] routed tokens
    gate_weight: dict[str, torch.Tensor] = field(
        default_factory=dict
    )  # experts path -> [E] summed gate weight
    neuron_score: dict[str, torch.Tensor] = field(default_factory=dict)  # experts path -> [E, I]
    # "<module path>.weight" of another targeted weight -> [rows]: SparseWeight.row_score over the batches
    row_score: dict[str, torch.Tensor] = field(default_factory=dict)
    batches: int = 0
    # what the calibration cost, for the run's first lines (`usaf.train.session.calibration_line`)
    supervised_tokens: int = 0
    seconds: float = 0.0

    def share(self, path: str) -> torch.Tensor:
        """Share of the layer's routed slots that went to each expert."""
        t = self.tokens[path].double()
        return t / t.sum().clamp_min(1)

    def mean_gate(self, path: str) -> torch.Tensor:
        return self.gate_weight[path] / self.tokens[path].clamp_min(1)

    def summary(self) -> dict:
        return {
            "batches": self.batches,
            "layers": {
                path: {"share": self.share(path).tolist(), "mean_gate": self.mean_gate(path).tolist()}
                for path in self.tokens
            },
        }


class _Observer(NeuronImportance):
    """Routing counts of one experts module and (with gradients) the importance of its neurons, kept in the
    calibration, only while `active` (so that activation recomputation in backward, which re-runs forwards,
    does not count twice)."""

    def __init__(self, calibration: Calibration, path: str, num_experts: int, with_gradients: bool):
        self.calibration, self.path, self.with_gradients = calibration, path, with_gradients
        self.active = (
            False  # not NeuronImportance.__init__: its score lives in the calibration, kept as it is
        )
        calibration.tokens.setdefault(path, torch.zeros(num_experts, dtype=torch.float64))
        calibration.gate_weight.setdefault(path, torch.zeros(num_experts, dtype=torch.float64))

    @property
    def score(self) -> torch.Tensor | None:
        return self.calibration.neuron_score.get(self.path)

    @score.setter
    def score(self, value: torch.Tensor | None) -> None:
        if value is None:
            self.calibration.neuron_score.pop(self.path, None)
        else:
            self.calibration.neuron_score[self.path] = value

    def __call__(self, state, plan, top_k_weights, h):
        if not self.active:
            return None
        cal = self.calibration
        cal.tokens[self.path] += torch.tensor(plan.rows.counts, dtype=torch.float64)
        gates = top_k_weights.detach().reshape(-1)[plan.order].double().cpu()
        cal.gate_weight[self.path].index_add_(0, plan.expert_of_row.cpu(), gates)
        return super().__call__(state, plan, top_k_weights, h) if self.with_gradients else None


class _RowObserver:
    """Switches a SparseWeight's row importance on while `active`, like the experts' observers."""

    def __init__(self, state):
        self.state = state

    @property
    def active(self) -> bool:
        return self.state.observing

    @active.setter
    def active(self, value: bool) -> None:
        self.state.observing = value


def _require_input_grad(model):
    """Make the embeddings' output require grad so the backward reaches every layer (all weights are frozen)."""
    return model.get_input_embeddings().register_forward_hook(lambda m, i, out: out.requires_grad_(True))


@contextlib.contextmanager
def _recomputing_layers(model, backward: bool):
    """Calibration runs in eval mode (no dropout), but transformers recomputes a checkpointed layer only in training
    mode: the checkpointed layers alone (not their submodules) are marked as training while a backward is wanted,
    so that calibration recomputes exactly when training does and peaks no higher than a training step."""
    layers = [
        m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True and not m.training
    ]
    if backward:
        for layer in layers:
            layer.training = True
    try:
        yield
    finally:
        if backward:
            for layer in layers:
                layer.training = False


def run_batches(
    model, batches, num_batches: int, backward: bool, observers=(), chunk_tokens: int = 1024
) -> int:
    """Forward (and backward) `num_batches` batches; gradients of trainable parameters are discarded."""
    device = next(model.parameters()).device
    hook = _require_input_grad(model) if backward else None
    done = 0
    try:
        for batch in batches:
            if done >= num_batches:
                break
            batch = {k: v.to(device) for k, v in batch.items()}
            for o in observers:
                o.active = True
            with torch.set_grad_enabled(backward), _recomputing_layers(model, backward):
                loss = causal_lm_loss(
                    model,
                    batch["input_ids"],
                    batch["labels"],
                    position_ids=batch.get("position_ids"),
                    chunk_tokens=chunk_tokens,
                )
            for o in observers:
                o.active = False
            if backward:
                loss.backward()
            done += 1
    finally:
        if hook is not None:
            hook.remove()
        for o in observers:
            o.active = False
        for p in model.parameters():
            p.grad = None
    return done


def calibrate(model, batches, num_batches: int, with_gradients: bool) -> Calibration:

    calibration = Calibration()
    observers = []
    for path, state in sparse_experts(model):
        observer = _Observer(calibration, path, state.num_experts, with_gradients)
        state.observers.append(observer)
        observers.append((state, observer))
    weights = row_observers(model) if with_gradients else {}
    try:
        calibration.batches = run_batches(
            model,
            batches,
            num_batches,
            with_gradients,
            [o for _, o in observers] + [_RowObserver(s) for s in weights.values()],
        )
        for path, state in weights.items():
            if state.row_score is not None:
                calibration.row_score[f"{path}.weight"] = state.row_score.cpu()
    finally:
        for state, observer in observers:
            state.observers.remove(observer)
        for state in weights.values():
            state.row_score = None
    calibration.neuron_score = {k: v.cpu() for k, v in calibration.neuron_score.items()}
    if expert_parallel.layout() is not None:
        _sum_over_experts(model, calibration, with_gradients)
    return calibration


def _sum_over_experts(model, calibration: Calibration, with_gradients: bool) -> None:
    """Expert parallelism: each rank observed only its own experts; the sums over the EP group are the statistics
    one process makes (`expert_sum`), on every rank, so that every rank chooses the same global selection."""
    for path, state in sparse_experts(model):
        expert_parallel.expert_sum(calibration.tokens[path])
        expert_parallel.expert_sum(calibration.gate_weight[path])
        if with_gradients:
            score = calibration.neuron_score.get(path)
            if score is None:  # none of this rank's experts was routed to
                score = torch.zeros(
                    state.num_experts, ExpertGeometry.of(model.get_submodule(path)).intermediate
                )
            calibration.neuron_score[path] = expert_parallel.expert_sum(score)


@dataclass(frozen=True)
class ProbedLines:
    """The entries of a tensor's candidate lines and their summed |gradient| over the calibration batches."""

    flat_indices: torch.Tensor  # [n] int64, into the flattened tensor
    score: torch.Tensor  # [n]


def probe_lines(
    model, candidates: dict[str, tuple[int, torch.Tensor]], batches, num_batches: int
) -> dict[str, ProbedLines]:
    """Gradient magnitudes of candidate lines, by tensor key.

    candidates: {"<experts path>.<tensor name>": (axis, sorted line ids)}.
    """

    installed = []
    for path, state in sparse_modules(model):
        for name, store in state.stores.items():
            key = f"{path}.{name}"
            if key in candidates:
                axis, lines = candidates[key]
                state.probes[name] = LineProbe(store.shape, axis, lines.to(store.device))
                installed.append((state, name, key))
    try:
        run_batches(model, batches, num_batches, backward=True)
        probed = {}
        for state, name, key in installed:
            score = state.probes[name].score.reshape(-1).cpu()
            if state.is_expert_stack:  # expert parallelism: each line's gradient arose on its expert's owner
                expert_parallel.expert_sum(score)
            probed[key] = ProbedLines(state.probes[name].flat_indices().cpu(), score)
        return probed
    finally:
        for state, name, _ in installed:
            state.probes.pop(name, None)
