"""The loop's parts: one contract (`LoopPart`) for everything a training step does beside its forward, backward and
update, so the loop iterates its parts instead of naming them.

A part acts at the hooks it needs and inherits a no-op for the others (from `Part`):

    start_step(step)          before the step's micro-batches (`step`: the step being taken, 1-based)
    step_batches(micro)       the step's micro-batches (batch, dataset rows) as the step trains on them: GRPO's
                              completions are generated here (`usaf.train.grpo`); the others return them as they are
    begin_batch(batch, rows)  before a micro-batch's forward (its tensors on the device, its dataset rows)
    end_forward(step)         after that forward, before its backward: a loss term to add (0.0: none)
    end_batch()               after the micro-batch's backward
    after_backward()          after the step's backward passes (gradients summed across ranks)
    before_update(step)       after clipping, before the optimizer's update
    due(step) / after_step(done)  its cadence, and what it does after the step (`step`: the step just taken)
                              when due: its entries for the step's metrics row
    ends_training()           before each step: why the training ends here as after its last step (early
                              stopping: final evaluation, checkpoint, summary), or None to go on
    finish(state)             after the last step, before the summary is written
    state_dict / tensor_state / load_state   what it checkpoints (plain values at the top of state.json, tensors
                              in extra.safetensors) and restores, before the optimizer is built
    shard_tensor_state        under expert parallelism, tensors of this rank's own (its experts'): in its shard
                              of the checkpoint; load_state gets them with the others

A part may end the run after a step by raising `StopRun` (the loop checkpoints and returns its summary).

The optional parts are built from `LOOP_PARTS` (a part class's `build(run)` returns the part, or None when the run
does not use it), in registration order, after the loop's own: adding one is a class and a registration. The
frame's parts (stop requests first; the metrics log and the checkpoint last, which read the complete row) are
declared by the loop itself: their places are fixed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from usaf.data import collate
from usaf.data.stream import first_rows
from usaf.engine.loss import IGNORE_INDEX
from usaf.registry import Registry
from usaf.report import write_router_load
from usaf.selection.reselect import Reselector
from usaf.train import distributed
from usaf.train.best import BestEvaluation
from usaf.train.checkpoint import BEST_KEY, Checkpointer, folder_name
from usaf.train.evaluate import Evaluator
from usaf.train.metrics import EVAL_PREFIX, MetricsLog, eval_record
from usaf.train.optim import router_params
from usaf.train.prefix_cache import FrozenPrefixCache
from usaf.train.router_health import RouterCollapse
from usaf.train.router_training import RouterTraining
from usaf.train.state import TrainState
from usaf.train.stop import StopRequest


@dataclass
class StepDone:
    """What a step just taken hands its parts: its numbers, the optimizer (a reselection remaps its state), and
    the row being built (`record`: the metrics so far; `show`: the progress bar's fields; `messages`: lines for
    the log before the row)."""

    step: int
    loss: float
    grad_norm: float
    optimizer: torch.optim.Optimizer
    record: dict[str, Any]
    show: dict[str, str] = field(default_factory=dict)
    messages: list[str] = field(default_factory=list)


class StopRun(Exception):
    """A part ends the run after this step: the loop saves a checkpoint, logs `message(checkpoint path)` and returns
    `summary`."""

    def __init__(self, summary: dict, message: Callable[[Path | None], str]):
        super().__init__(summary.get("reason", "stopped"))
        self.summary, self.message = summary, message


@runtime_checkable
class LoopPart(Protocol):
    """A part of the training loop (the module's docstring says when each hook runs)."""

    name: str

    def due(self, step: int) -> bool: ...

    def start_step(self, step: int) -> None: ...

    def step_batches(self, micro: list[tuple[dict, list[int]]]) -> list[tuple[dict, list[int]]]: ...

    def begin_batch(self, batch: dict, rows: list[int]) -> None: ...

    def end_forward(self, step: int) -> torch.Tensor | float: ...

    def end_batch(self) -> None: ...

    def after_backward(self) -> None: ...

    def before_update(self, step: int) -> None: ...

    def after_step(self, done: StepDone) -> dict[str, Any]: ...

    def ends_training(self) -> str | None: ...

    def finish(self, state: TrainState) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def tensor_state(self) -> dict[str, torch.Tensor]: ...

    def shard_tensor_state(self) -> dict[str, torch.Tensor]: ...

    def load_state(self, state: dict, tensors: dict[str, torch.Tensor]) -> None: ...


@runtime_checkable
class PartKind(Protocol):
    """A registered part: its name, and `build(run)`: the part for a loaded TrainingRun (its `model`, `config`,
    `run_dir`, `device`, `share`, `session`, `evaluator`), or None when the run does not use it."""

    name: str

    def build(self, run) -> LoopPart | None: ...


# the loop's optional parts, built in this order for each run (a class with `name` and a classmethod `build`)
LOOP_PARTS: Registry[PartKind] = Registry("loop part", PartKind)


class Part:
    """A loop part that does nothing at any hook: a part overrides the hooks it needs. `every`: its cadence, the
    steps whose `after_step` it runs (every `every`-th step; 0: never), unless it overrides `due`."""

    name = "part"
    every = 1

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def start_step(self, step: int) -> None:
        pass

    def step_batches(self, micro: list[tuple[dict, list[int]]]) -> list[tuple[dict, list[int]]]:
        return micro

    def begin_batch(self, batch: dict, rows: list[int]) -> None:
        pass

    def end_forward(self, step: int) -> torch.Tensor | float:
        return 0.0

    def end_batch(self) -> None:
        pass

    def after_backward(self) -> None:
        pass

    def before_update(self, step: int) -> None:
        pass

    def after_step(self, done: StepDone) -> dict[str, Any]:
        return {}

    def ends_training(self) -> str | None:
        return None

    def finish(self, state: TrainState) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def tensor_state(self) -> dict[str, torch.Tensor]:
        return {}

    def shard_tensor_state(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state(self, state: dict, tensors: dict[str, torch.Tensor]) -> None:
        pass


# ---- the optional parts (registered below, in this order) ---------------------------------------------------


class Reselection(Part):
    """select.reselect_every: the Reselector's observing, its statistics across ranks, and the reselection on its
    steps (it remaps the optimizer's state of the entries it moves)."""

    name = "reselection"

    def __init__(self, reselector: Reselector):
        self.reselector = reselector

    @classmethod
    def build(cls, run) -> Reselection | None:
        config = run.config
        if not config.select.reselect_every:
            return None
        return cls(Reselector(run.model, config.select, config.schedule.max_steps, config.optim.eight_bit))

    def due(self, step: int) -> bool:
        return self.reselector.is_reselection_step(step)

    def start_step(self, step: int) -> None:
        self.reselector.before_step(step)

    def begin_batch(self, batch: dict, rows: list[int]) -> None:
        self.reselector.set_observing(True)

    def end_forward(self, step: int) -> float:
        self.reselector.set_observing(False)  # recomputation in backward re-runs forwards: count them once
        return 0.0

    def after_backward(self) -> None:
        self.reselector.after_backward()

    def after_step(self, done: StepDone) -> dict[str, Any]:
        return self.reselector.after_step(done.step, done.optimizer) or {}

    def tensor_state(self) -> dict[str, torch.Tensor]:
        return self.reselector.state_dict()

    def shard_tensor_state(self) -> dict[str, torch.Tensor]:
        return self.reselector.shard_state_dict()  # its experts' probes, under expert parallelism

    def load_state(self, state: dict, tensors: dict[str, torch.Tensor]) -> None:
        self.reselector.load_state_dict(tensors)


class PrefixCache(Part):
    """train.prefix_cache: each micro-batch's frozen prefix replayed or recorded; its hits counted in the run."""

    name, every = "prefix_cache", 0

    def __init__(self, cache: FrozenPrefixCache):
        self.cache = cache

    @classmethod
    def build(cls, run) -> PrefixCache | None:
        cache = FrozenPrefixCache.for_run(run.model, run.config, run.run_dir)
        return cls(cache) if cache is not None else None

    def begin_batch(self, batch: dict, rows: list[int]) -> None:
        # each row's length up to its last supervised token (a row with none: all of it), what the cache stores of
        # it, read from the device once for the batch
        labels = batch["labels"]
        width = labels.shape[-1]
        positions = torch.arange(1, width + 1, device=labels.device)
        ends = torch.where(labels != IGNORE_INDEX, positions, 0).amax(dim=-1)
        self.cache.begin_batch(rows, ends.masked_fill(ends == 0, width).tolist(), batch["input_ids"])

    def end_batch(self) -> None:
        self.cache.end_batch()

    def finish(self, state: TrainState) -> None:
        state.prefix_cache_hits = self.cache.hits

    def state_dict(self) -> dict[str, Any]:
        return self.cache.state_dict()

    def load_state(self, state: dict, tensors: dict[str, torch.Tensor]) -> None:
        self.cache.load_state_dict(state)


class Routers(Part):
    """The routers (RouterTraining): capture and auxiliary losses per micro-batch, their updates held back while
    frozen, health and the collapse guard after each step (a "stop" guard ends the run), their load heatmap at
    the end."""

    name = "routers"

    def __init__(self, routers: RouterTraining, run_dir: Path):
        self.routers, self.run_dir = routers, run_dir
        self.capturing = contextlib.ExitStack()

    @classmethod
    def build(cls, run) -> Routers:
        """Their drift is measured on a fixed reference batch: the first rows of the eval data (else of the
        training data)."""
        session = run.session
        rows = session.eval_data if session.eval_data is not None else session.train_data
        reference = collate(first_rows(rows, 4), rows.pad_id)
        routers = RouterTraining(
            run.model,
            run.config.router,
            router_params(run.model),
            {k: v.to(run.device) for k, v in reference.items()},
            run.share.micro_batches,
        )
        return cls(routers, run.run_dir)

    def begin_batch(self, batch: dict, rows: list[int]) -> None:
        self.capturing.enter_context(self.routers.capture())

    def end_forward(self, step: int) -> torch.Tensor | float:
        with self.capturing:  # closed after the losses are read
            return self.routers.aux_loss(step - 1)  # balancing + z-loss from this forward's raw logits

    def end_batch(self) -> None:
        self.routers.after_micro_batch()

    def before_update(self, step: int) -> None:
        if not self.routers.training_routers(step - 1):
            for param in self.routers.router_params:
                param.grad = None  # AdamW skips parameters without gradients

    def after_step(self, done: StepDone) -> dict[str, Any]:
        try:
            record, show, message = self.routers.after_step(done.step)
        except RouterCollapse as err:
            said = str(err)  # `err` is gone once the handler ends; the message is read after the checkpoint
            raise StopRun(
                {"stopped": True, "step": done.step, "reason": "router collapse"},
                lambda path: f"{said}\ncheckpoint: {path}",
            ) from None
        done.show.update(show)
        if message:
            done.messages.append(message)
        return record

    def finish(self, state: TrainState) -> None:
        # [usaf.distributed] every rank measures (under expert parallelism a forward needs every rank); rank 0 writes
        measured = self.routers.load_before_after()
        if measured is not None and distributed.is_main():
            write_router_load(self.run_dir, *measured)

    def state_dict(self) -> dict[str, Any]:
        return {"router": self.routers.state_dict()}

    def tensor_state(self) -> dict[str, torch.Tensor]:
        return self.routers.tensor_state()

    def load_state(self, state: dict, tensors: dict[str, torch.Tensor]) -> None:
        self.routers.load_state_dict(state["router"])
        self.routers.load_tensor_state(tensors)


class Evaluation(Part):
    """The held-out evaluation every log.eval_every_steps: its numbers in the step's row."""

    name = "evaluation"

    def __init__(self, evaluator: Evaluator):
        self.evaluator = evaluator

    @classmethod
    def build(cls, run) -> Evaluation:
        return cls(run.evaluator)

    def due(self, step: int) -> bool:
        return self.evaluator.should_evaluate(step)

    def after_step(self, done: StepDone) -> dict[str, Any]:
        return eval_record(self.evaluator.evaluate())


class Best(Part):
    """checkpoint.keep_best and schedule.early_stopping_patience (`usaf.train.best`): each evaluation during
    training updates the best so far, whose checkpoint the Checkpointer then saves and spares (keep_best), and the
    evaluations since it; once they reach the patience, the training ends before the next step."""

    name = "best"

    def __init__(
        self, best: BestEvaluation, checkpointer: Checkpointer, keep: bool, patience: int, max_steps: int
    ):
        self.best, self.checkpointer, self.keep, self.patience = best, checkpointer, keep, patience
        self.max_steps = max_steps

    @classmethod
    def build(cls, run) -> Best | None:
        config = run.config
        keep, patience = config.checkpoint.keep_best, config.schedule.early_stopping_patience
        if not (keep or patience):
            return None
        return cls(
            BestEvaluation.for_config(config), run.checkpointer, keep, patience, config.schedule.max_steps
        )

    def after_step(self, done: StepDone) -> dict[str, Any]:
        keys = [key for key in done.record if key.startswith(EVAL_PREFIX)]
        if not keys:
            return {}
        # [usaf.distributed] rank 0's numbers on every rank: the ranks keep and stop alike
        values = distributed.per_rank([float(done.record[key]) for key in keys])[0]
        if self.best.observe(done.step, dict(zip(keys, values, strict=True))) and self.keep:
            self.checkpointer.keep_best(done.step)
        if done.step < self.max_steps and (reason := self.ends_training()) is not None:
            done.messages.append(f"{reason}: the training ends after step {done.step}")
        return {}

    def ends_training(self) -> str | None:
        best = self.best
        if not self.patience or best.since < self.patience:
            return None
        return (
            f"early stopping: eval/{best.metric} did not improve on {best.value:.6g} (step {best.step}) for "
            f"{best.since} evaluations (schedule.early_stopping_patience={self.patience})"
        )

    def finish(self, state: TrainState) -> None:
        best = self.best
        if best.step is not None:
            state.best = {
                "metric": EVAL_PREFIX + best.metric,
                "step": best.step,
                "value": best.value,
                **({"checkpoint": folder_name(best.step)} if self.keep else {}),
            }

    def state_dict(self) -> dict[str, Any]:
        return {BEST_KEY: {**self.best.state_dict(), "kept": self.keep}}

    def load_state(self, state: dict, tensors: dict[str, torch.Tensor]) -> None:
        self.best.load_state_dict(state.get(BEST_KEY))
        if self.keep:
            self.checkpointer.keep_best(self.best.step)


for _kind in (Reselection, PrefixCache, Routers, Evaluation, Best):
    LOOP_PARTS.register(_kind)


# ---- the frame's parts (declared by the loop: first and last) ------------------------------------------------


class Stop(Part):
    """SIGINT/SIGTERM (StopRequest): the run stops before the next step, agreed by every rank, with a
    checkpoint."""

    name, every = "stop", 0

    def __init__(self, request: StopRequest, run_dir: Path):
        self.request, self.run_dir = request, run_dir

    def start_step(self, step: int) -> None:
        distributed.die_if_asked(step)  # a test hook: a rank that crashes ($USAF_TEST_DIE_AT_STEP)
        if self.request.agreed():
            self.stop(step - 1)

    def stop(self, step: int) -> None:
        request, run_dir = self.request, self.run_dir
        raise StopRun(
            {"stopped": True, "step": step, "signal": request.signal_number},
            lambda path: (
                f"stopped at step {step} ({request.signal_name}); checkpoint {path}. "
                f"Resume with: usaf train --resume {run_dir}"
            ),
        )


class Log(Part):
    """The step's row in metrics.jsonl and the trackers (when due there, or it holds an evaluation), the messages
    before it, and the progress bar."""

    name = "log"

    def __init__(self, log: MetricsLog):
        self.log = log

    def after_step(self, done: StepDone) -> dict[str, Any]:
        for message in done.messages:
            self.log.message(message)
        if self.log.should_log(done.step, done.record):
            self.log.log(done.step, done.record, done.show)
        self.log.advance()
        return {}


class Checkpoint(Part):
    """A checkpoint every checkpoint.every_steps (the Checkpointer's cadence), after the step's row."""

    name = "checkpoint"

    def __init__(self, checkpointer: Checkpointer):
        self.checkpointer = checkpointer

    def due(self, step: int) -> bool:
        return self.checkpointer.should_save(step)

    def after_step(self, done: StepDone) -> dict[str, Any]:
        self.checkpointer.save(done.step)
        return {}
