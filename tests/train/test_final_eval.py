"""Issue 35: the final evaluation is a row of metrics.jsonl (eval/* keys, "final": true, at the last step), reaches
the trackers and `usaf report`; a resume neither duplicates nor loses it; a tracker that fails mid-run or at its
close is one warning, and the run finishes with every row. (TensorBoard's copy of the row, read from its event
file: tests/train/test_trackers.py.)"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
from faults import SET_ARGS

from usaf.cli import main
from usaf.train import trackers
from usaf.train.metrics import truncate_metrics
from usaf.train.trackers import Tracker

STEPS = 3


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def final_rows(run: Path) -> list[dict]:
    return [r for r in rows(run) if r.get("final") is True]


class Seen(Tracker):
    """Keeps what it is given; `fail_at`: its log raises from that step on; `fail_close`: its close raises."""

    package, install, fail_at, fail_close = "json", "nothing", None, False

    def start(self, run_dir, config, start_step):
        self.logged = type(self).logged = []

    def log(self, step, scalars):
        if self.fail_at is not None and step >= self.fail_at:
            raise ConnectionError(f"the server went away\nat step {step}")  # a second line, not shown
        self.logged.append((step, scalars))

    def close(self):
        if self.fail_close:
            raise OSError("disk quota exceeded")


class Healthy(Seen):
    name = "healthy"


class FailsMidRun(Seen):
    name, fail_at = "fails-mid-run", 2


class FailsAtClose(Seen):
    name, fail_close = "fails-at-close", True


@pytest.fixture(scope="module")
def run(ws, tmp_path_factory):
    """One run of STEPS steps with three trackers: one healthy, one that fails at step 2, one whose close fails."""
    out = tmp_path_factory.mktemp("final-eval") / "run"
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(err):
        for tracker in (Healthy, FailsMidRun, FailsAtClose):
            mp.setitem(trackers.TRACKERS, tracker.name, tracker)
        rc = main(
            [
                "train",
                f"--model={ws.base}",
                f"--data={ws.data}",
                f"--out={out}",
                *SET_ARGS,
                f"--set=schedule.max_steps={STEPS}",
                "--set=log.report_to=[healthy,fails-mid-run,fails-at-close]",
            ]
        )
    return out, rc, err.getvalue()


def test_the_final_evaluation_is_a_row_of_the_metrics(run):
    out, rc, _ = run
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    (final,) = final_rows(out)
    assert final["step"] == STEPS and rows(out)[-1] == final  # the last row, at the last step
    assert final["eval/loss"] == pytest.approx(summary["eval_loss_after"])
    assert final["eval/perplexity"] == pytest.approx(summary["eval_perplexity_after"])
    (before,) = [r for r in rows(out) if r["step"] == 0]  # the evaluation before training, as before
    assert before["eval/loss"] == pytest.approx(summary["eval_loss_before"]) and "final" not in before


def test_every_tracker_gets_the_final_evaluation(run):
    out, _, _ = run
    final = final_rows(out)[0]
    last_step, last_scalars = Healthy.logged[-1]
    assert last_step == STEPS
    assert last_scalars == {k: v for k, v in final.items() if k not in ("step", "final")}


def test_a_tracker_that_fails_is_one_warning_and_the_run_goes_on(run):
    out, rc, err = run
    assert rc == 0 and "Traceback" not in err
    warnings = [line for line in err.splitlines() if line.startswith("usaf: warning: ")]
    assert warnings == [
        "usaf: warning: log.report_to=fails-mid-run failed at step 2 (ConnectionError: the server went away); "
        "the run goes on without it, and metrics.jsonl has every row.",
        "usaf: warning: log.report_to=fails-at-close did not close (OSError: disk quota exceeded); the run's own "
        "files are complete.",
    ]
    assert [step for step, _ in FailsMidRun.logged] == [0, 1]  # dropped after its failure
    assert [step for step, _ in FailsAtClose.logged] == [step for step, _ in Healthy.logged]
    assert sorted({r["step"] for r in rows(out)}) == list(range(STEPS + 1))  # metrics.jsonl has every row


def test_usaf_report_names_the_final_evaluation(run, tmp_path, capsys):
    out, _, _ = run
    shutil.copytree(out, tmp_path / "run")
    assert main(["report", str(tmp_path / "run")]) == 0
    final, before = final_rows(out)[0], rows(out)[0]
    assert (
        f"final eval at step {STEPS}: loss {final['eval/loss']:.4f}, perplexity {final['eval/perplexity']:.4f}; "
        f"before training: loss {before['eval/loss']:.4f}"
    ) in capsys.readouterr().out


def test_usaf_report_says_when_a_run_has_no_final_evaluation(ws, tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows(ws.finished) if not r.get("final"))
    )
    from usaf.report import eval_lines

    assert eval_lines(tmp_path)[0].startswith("last eval (the run has no final evaluation yet) at step 0")


@pytest.mark.parametrize(
    "how, steps",
    [
        # ws.unfinished: its log still has step 3's rows and final row (the cut is also test_truncating_...)
        pytest.param("killed before step 3", STEPS, marks=pytest.mark.slow),
        ("killed after the final row, before its summary", STEPS),
        ("extended by a step", STEPS + 1),
    ],
)
def test_a_resumed_run_has_one_final_evaluation(ws, tmp_path, how, steps):
    run = tmp_path / "run"
    shutil.copytree(ws.unfinished if how.startswith("killed before") else ws.finished, run)
    if how.startswith("killed after"):
        (run / "summary.json").unlink()
    assert main(["train", f"--resume={run}", f"--set=schedule.max_steps={steps}"]) == 0
    (final,) = final_rows(run)
    summary = json.loads((run / "summary.json").read_text())
    assert final["step"] == steps and final["eval/loss"] == pytest.approx(summary["eval_loss_after"])
    evals = [r["step"] for r in rows(run) if "eval/loss" in r]
    assert evals == [0, STEPS] if steps == STEPS else evals == [0, STEPS, steps]  # the old one kept, unmarked


def test_truncating_the_log_for_a_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    written = [
        {"step": 0, "eval/loss": 3.0},
        {"step": 1, "loss": 2.5},
        {"step": 2, "loss": 2.0},
        {"step": 2, "eval/loss": 2.2, "final": True},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in written))
    truncate_metrics(path, 2, 2)  # resumed at its last step: the final row is the resumed run's to write
    assert [json.loads(line) for line in path.read_text().splitlines()] == written[:3]
    path.write_text("".join(json.dumps(r) + "\n" for r in written) + '{"step": 3, "lo')
    truncate_metrics(path, 2, 5)  # extended: the earlier final evaluation stays, unmarked; the torn line goes
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        *written[:3],
        {"step": 2, "eval/loss": 2.2},
    ]
