"""The loop's contracts, as a contributor meets them: a loop part (a gradient-norm logger with its own cadence) and
an objective (next-token loss with label smoothing), each one class and one registration, trained on the tiny
model; and the loop that names neither its parts nor its objectives."""

import ast
import inspect
import json

import pytest
import torch
import torch.nn.functional as F
from helpers import FAST_RUN, train_cli_args, train_config

import usaf.train.loop as loop
from usaf.cli import main
from usaf.engine.loss import IGNORE_INDEX
from usaf.errors import UsafError
from usaf.registry import OBJECTIVES
from usaf.train import distributed
from usaf.train.parts import LOOP_PARTS, Part, StepDone


class GradNormLogger(Part):
    """Every second step: the step's gradient norm (before clipping) under its own name."""

    name, every = "grad_norm_logger", 2

    @classmethod
    def build(cls, run):
        return cls()

    def after_step(self, done: StepDone) -> dict:
        return {"grad_norm_every_2": done.grad_norm}


class SmoothedNextToken:
    """Next-token cross entropy with label smoothing, summed over the supervised tokens."""

    name, pairs, reference_forward, default_lr = "sft_smoothed", False, False, 1e-2
    smoothing = 0.1

    def __init__(self):
        self.losses: list[float] = []  # each micro-batch's loss per token, as computed here

    def check(self, train) -> None:
        pass

    def loss_sum(self, model, batch: dict, train) -> tuple[torch.Tensor, None]:
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[:, :-1]
        labels = batch["labels"][:, 1:]
        loss = F.cross_entropy(
            logits.flatten(0, 1).float(),
            labels.flatten(),
            ignore_index=IGNORE_INDEX,
            label_smoothing=self.smoothing,
            reduction="sum",
        )
        self.losses.append(float(loss) / self.supervised_units(batch))
        return loss, None

    def supervised_units(self, batch: dict) -> int:
        return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())

    def step_metrics(self, extras: list, supervised: int, total) -> dict:
        return {"label_smoothing": self.smoothing}


SMOOTHED = SmoothedNextToken()
FAST = [*FAST_RUN, "data.eval_fraction=0"]  # no evaluation: the tests watch the steps


@pytest.fixture
def registered():
    """Registers the test's part and objective for one test (the registries are the package's)."""
    LOOP_PARTS.register(GradNormLogger)
    OBJECTIVES.register(SMOOTHED)
    yield
    LOOP_PARTS.unregister(GradNormLogger.name)
    OBJECTIVES.unregister(SMOOTHED.name)


def rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_part_of_ones_own_logs_at_its_cadence(workspace, tmp_path, registered):
    summary = loop.train(train_config(workspace, FAST, "schedule.max_steps=4"), tmp_path / "run")
    assert summary["steps"] == 4
    steps = {r["step"]: r for r in rows(tmp_path / "run")}
    assert sorted(steps) == [1, 2, 3, 4]
    assert [s for s in steps if "grad_norm_every_2" in steps[s]] == [2, 4]
    assert all(steps[s]["grad_norm_every_2"] == steps[s]["grad_norm"] for s in (2, 4))


@pytest.mark.slow
def test_an_objective_of_ones_own_trains_from_the_command_line(workspace, tmp_path, registered):
    SMOOTHED.losses.clear()
    out = tmp_path / "run"
    assert (
        main(train_cli_args(workspace, out, [*FAST, "schedule.max_steps=2", "train.objective=sft_smoothed"]))
        == 0
    )
    trained = rows(out)
    assert [r["step"] for r in trained] == [1, 2] and all(r["label_smoothing"] == 0.1 for r in trained)
    # the step's loss is the objective's own (one micro-batch a step)
    assert [r["loss"] for r in trained] == pytest.approx(SMOOTHED.losses, rel=1e-6)


def test_an_objective_is_checked_when_registered_and_named_when_unknown(workspace):
    class NoUnits:
        name, pairs = "no_units", False

    with pytest.raises(UsafError, match=r"lacks .*supervised_units"):
        OBJECTIVES.register(NoUnits())
    with pytest.raises(UsafError, match=r"train\.objective"):
        train_config(workspace, FAST_RUN, "train.objective=no_units")
    with pytest.raises(UsafError, match="prefix_cache"):
        OBJECTIVES["dpo"].check(train_config(workspace, FAST_RUN, "train.prefix_cache=ram").train)


def test_a_part_without_build_is_refused():
    class Unbuildable(Part):
        name = "unbuildable"

    with pytest.raises(UsafError, match="lacks build"):
        LOOP_PARTS.register(Unbuildable)


def test_the_loop_names_no_part_and_no_objective():
    """TrainingRun iterates its parts and asks its objective: none of them is named in its methods."""
    source = inspect.getsource(loop.TrainingRun)
    names = {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}
    named = {n.attr for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Attribute)}
    for part in (
        "Reselector",
        "FrozenPrefixCache",
        "RouterTraining",
        "reselector",
        "prefix_cache",
        "routers",
    ):
        assert part not in names | named
    assert '"dpo"' not in source and '"sft"' not in source


def test_sum_scalars_is_always_a_tuple():
    assert distributed.sum_scalars(3) == (3,) and distributed.sum_scalars(3, 1.5) == (3, 1.5)
