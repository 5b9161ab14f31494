"""Issue 38: checkpoint.keep_best keeps the checkpoint of the best evaluation through the rotation and a resume,
`usaf export --best` exports it, schedule.early_stopping_patience ends a run whose evaluations stop improving (the
count surviving a resume), and a run's output off a terminal is plain lines."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import FAST_RUN, copy_task_workspace, losses, train_cli_args, train_config
from transformers import EarlyStoppingCallback, TrainerControl, TrainerState

from usaf.cli import main
from usaf.engine.sparse import line_flat_indices
from usaf.errors import ConfigError
from usaf.export.delta import read_delta
from usaf.train import checkpoint
from usaf.train.best import BestEvaluation
from usaf.train.loop import train

PATIENCE = 2
# a learning rate high enough that the evaluations stop improving within 20 steps (with decay 8, the default, the
# pull toward the base keeps them improving here)
SETS = [
    *FAST_RUN,
    "optim.lr=0.05",
    "optim.decay_to_base=4",
    "schedule.max_steps=20",
    "log.eval_every_steps=2",
    "checkpoint.keep_best=true",
    "checkpoint.every_steps=5",
    "checkpoint.keep_last=2",
    f"schedule.early_stopping_patience={PATIENCE}",
]


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def evaluations(run: Path) -> dict[int, float]:
    """{step: eval/loss} of the evaluations during training (not the one before, not the final one)."""
    return {
        r["step"]: r["eval/loss"] for r in rows(run) if "eval/loss" in r and r["step"] and not r.get("final")
    }


def expected_stop(evals: dict[int, float], patience: int) -> tuple[int, int]:
    """(the best step, the step early stopping ends at) of a run's evaluations, counted here by hand."""
    best_step, since = None, 0
    for step, value in sorted(evals.items()):
        if best_step is None or value < evals[best_step]:
            best_step, since = step, 0
        else:
            since += 1
        if since >= patience:
            return best_step, step
    raise AssertionError(f"no early stop in {evals}")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return copy_task_workspace(tmp_path_factory.mktemp("best"), records=60)


@pytest.fixture(scope="module")
def run(workspace, tmp_path_factory):
    out = tmp_path_factory.mktemp("best-run") / "run"
    assert main(train_cli_args(workspace, out, SETS)) == 0
    return out


def test_early_stopping_ends_the_run_at_the_expected_step(run):
    summary = json.loads((run / "summary.json").read_text())
    best_step, stop_step = expected_stop(evaluations(run), PATIENCE)
    assert summary["steps"] == stop_step < 20
    assert max(losses(run)) == stop_step  # no step trained after it
    assert summary["stop_reason"].startswith("early stopping: eval/loss did not improve")
    assert f"schedule.early_stopping_patience={PATIENCE}" in summary["stop_reason"]
    (final,) = [r for r in rows(run) if r.get("final")]
    assert final["step"] == stop_step and final["eval/loss"] == pytest.approx(summary["eval_loss_after"])
    assert summary["best_evaluation"] == {
        "metric": "eval/loss",
        "step": best_step,
        "value": pytest.approx(evaluations(run)[best_step]),
        "checkpoint": f"step-{best_step:08d}",
    }


def test_the_best_checkpoint_survives_the_rotation(run):
    best_step, stop_step = expected_stop(evaluations(run), PATIENCE)
    kept = [checkpoint.step_of(p) for p in checkpoint.list_checkpoints(run)]
    newest = [*list(range(5, stop_step + 1, 5))[-1:], stop_step]  # keep_last=2: the newest two saved
    assert best_step < min(newest) and best_step % 5  # saved for being the best, then spared
    assert kept == sorted({best_step, *newest})
    record = checkpoint.read_state(checkpoint.latest(run))[checkpoint.BEST_KEY]
    assert (record["step"], record["since"], record["kept"]) == (best_step, PATIENCE, True)


def trained_values(saved: dict) -> dict[str, dict[int, float]]:
    """{tensor name: {flat index: trained value}} of a loaded checkpoint's selections."""
    trainable, found = saved["trainable"], {}
    for name, layout in saved["selection"].items():
        prefix = layout["prefix"]
        if layout["kind"] == "lines":
            flat = line_flat_indices(layout["shape"], layout["axis"], trainable[prefix + "line_ids"])
        else:
            flat = trainable[prefix + "flat_indices"]
        values = trainable[prefix + "values"].reshape(-1)
        found[name] = dict(zip(flat.reshape(-1).tolist(), values.tolist(), strict=True))
    return found


def test_export_best_writes_the_best_checkpoints_values(run, tmp_path, capsys):
    best_step, stop_step = expected_stop(evaluations(run), PATIENCE)
    out = tmp_path / "best.safetensors"
    assert main(["export", str(run), "--best", "--fp32", f"--delta={out}"]) == 0
    said = f"exported step {best_step} (step-{best_step:08d}): the run's best evaluation"
    assert said in capsys.readouterr().out
    delta = read_delta(out)
    exported = {
        name: dict(zip(c.flat_indices.tolist(), c.values.tolist(), strict=True))
        for name, c in delta.changes.items()
    }
    folder = checkpoint.checkpoints_dir(run)
    best = trained_values(checkpoint.load(folder / f"step-{best_step:08d}"))
    assert exported == best
    assert best != trained_values(checkpoint.load(folder / f"step-{stop_step:08d}"))  # not the latest's


def test_export_best_of_a_run_that_kept_none_names_the_setting(plain_run, tmp_path, capsys):
    out = tmp_path / "x.safetensors"
    assert main(["export", str(plain_run.dir), "--best", f"--delta={out}"]) != 0
    assert (
        "kept no best checkpoint" in (err := capsys.readouterr().err) and "checkpoint.keep_best=true" in err
    )
    assert not out.exists()


def test_a_resume_continues_the_patience_count_exactly(run, tmp_path):
    """Killed after the checkpoint of an evaluation that did not improve (its count above 0): the resumed run
    counts on from it and stops at the same step, with the same best."""
    best_step, stop_step = expected_stop(evaluations(run), PATIENCE)
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "summary.json").unlink()
    shutil.rmtree(checkpoint.checkpoints_dir(copy) / f"step-{stop_step:08d}")
    resumed_from = checkpoint.read_state(checkpoint.latest(copy))
    assert resumed_from["step"] > best_step and resumed_from[checkpoint.BEST_KEY]["since"] >= 1
    assert main(["train", f"--resume={copy}"]) == 0
    summary, straight = (
        json.loads((copy / "summary.json").read_text()),
        json.loads((run / "summary.json").read_text()),
    )
    assert summary["steps"] == stop_step and summary["best_evaluation"] == straight["best_evaluation"]
    assert evaluations(copy) == evaluations(run) and losses(copy) == losses(run)
    # resumed again, the run is finished: nothing trains, nothing is written
    before = (copy / "metrics.jsonl").read_text()
    assert main(["train", f"--resume={copy}"]) == 0
    assert (copy / "metrics.jsonl").read_text() == before


@pytest.mark.parametrize(
    "sets, named",
    [
        (
            ["log.eval_every_steps=0"],
            r"checkpoint\.keep_best=true and schedule\.early_stopping_patience=2 .*log\.eval_every_steps",
        ),
        (["data.eval_fraction=0"], r"held-out data: give data\.eval .*data\.eval_fraction"),
        (["data.streaming=true", "schedule.epochs=0"], r"data\.streaming holds none out of a stream"),
    ],
)
def test_keep_best_and_early_stopping_need_evaluations(workspace, tmp_path, sets, named):
    with pytest.raises(ConfigError, match=named):
        train(train_config(workspace, SETS, *sets), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_the_best_and_the_patience_count_are_the_trainers():
    """BestEvaluation against transformers' EarlyStoppingCallback and the Trainer's best metric, on one sequence
    with a threshold: an improvement under the threshold is a new best that does not reset the count."""
    values = [3.0, 2.0, 1.96, 1.97, 1.5, 1.6, 1.49, 1.7, 1.8]
    ours = BestEvaluation("loss", greater_is_better=False, threshold=0.05)
    callback, state = EarlyStoppingCallback(2, 0.05), TrainerState()
    args = SimpleNamespace(greater_is_better=False)
    for step, value in enumerate(values, 1):
        ours.observe(step, {"eval/loss": value})
        callback.check_metric_value(args, state, TrainerControl(), value)
        if state.best_metric is None or value < state.best_metric:  # the Trainer's _determine_best_metric
            state.best_metric = value
        assert (ours.since, ours.value) == (callback.early_stopping_patience_counter, state.best_metric)


@pytest.fixture(scope="module")
def plain_run(workspace, tmp_path_factory):
    """A run with progress on, its stdout and stderr captured (not a terminal), checkpoint.keep_best off."""
    out_dir = tmp_path_factory.mktemp("plain") / "run"
    sets = [*FAST_RUN, "schedule.max_steps=4", "log.every_steps=2", "log.progress=true"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(train_cli_args(workspace, out_dir, sets)) == 0
    return SimpleNamespace(dir=out_dir, out=out.getvalue(), err=err.getvalue())


def test_plain_lines_off_a_terminal(plain_run):
    """Progress on, the output not a terminal: a line every log.every_steps, no carriage return."""
    out = plain_run.out
    assert "\r" not in out + plain_run.err
    steps = [line.split(":")[0] for line in out.splitlines() if line.startswith("step ")]
    assert steps == ["step 0/4", "step 2/4", "step 4/4", "step 4/4 (final evaluation)"]
    line = next(line for line in out.splitlines() if line.startswith("step 2/4: "))
    assert all(f" {key} " in line for key in ("loss", "lr", "tok/s", "grad_norm"))
