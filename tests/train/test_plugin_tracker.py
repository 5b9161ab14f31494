"""A contributor's exercise: an experiment tracker written outside usaf (here, one that records what it is given),
registered with one call, is a value of log.report_to, and a run sends it every row of metrics.jsonl; a name no
tracker is registered under is refused when the config is read, before anything is written."""

import json

import pytest
from helpers import FAST_RUN, make_model_dir, write_copy_task

from usaf.cli import main
from usaf.registry import TRACKERS
from usaf.train.trackers import Tracker, register_tracker

STARTED: list = []  # each Recorder a run started


class Recorder(Tracker):
    """Keeps the run's configuration and every row it is sent."""

    name, package, install = "recorder_test", "json", "nothing to install"

    def start(self, run_dir, config, start_step):
        self.config, self.rows, self.closed = config, {}, False
        STARTED.append(self)

    def log(self, step, scalars):
        self.rows[step] = dict(scalars)

    def close(self):
        self.closed = True


@pytest.fixture
def recorder():
    register_tracker(Recorder)
    yield Recorder
    TRACKERS.unregister(Recorder.name)
    STARTED.clear()


def train(tmp_path, run, *sets) -> int:
    model, data = make_model_dir(tmp_path / "model"), write_copy_task(tmp_path / "train.jsonl", 24)
    args = [f"--set={s}" for s in [*FAST_RUN, "schedule.max_steps=3", *sets]]
    return main(["train", f"--model={model}", f"--data={data}", f"--out={run}", *args])


@pytest.mark.slow
def test_a_tracker_from_outside_gets_the_metrics_rows(recorder, tmp_path):
    run = tmp_path / "run"
    assert train(tmp_path, run, f"log.report_to={recorder.name}") == 0
    (started,) = STARTED
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    numbers = {
        row["step"]: {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for row in rows
    }
    assert {1, 2, 3} <= set(started.rows)  # the three training steps, besides the evaluations
    for step, scalars in started.rows.items():
        assert scalars.items() <= numbers[step].items(), step  # what metrics.jsonl has at that step
    assert started.config["schedule"]["max_steps"] == 3 and started.closed


def test_a_tracker_that_is_not_registered_is_refused_when_the_config_is_read(tmp_path, capsys):
    run = tmp_path / "run"
    assert train(tmp_path, run, f"log.report_to={Recorder.name}") == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "usaf: error: config: log.report_to: unknown tracker 'recorder_test'; known: none, tensorboard, wandb, "
        "mlflow, aim, comet_ml, clearml, dvclive, swanlab, trackio."  # accelerate.tracking's, in usaf's order
    )
    assert not run.exists()
