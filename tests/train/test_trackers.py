"""log.report_to: TensorBoard, W&B (offline) and MLflow (a local store in the run folder) get the scalars of
metrics.jsonl and the run's configuration; a tracker defined outside usaf plugs in; one that is not installed is
a one-line error before anything is written."""

import json
import time
from pathlib import Path

import pytest
from helpers import FAST_RUN, make_model_dir, write_copy_task

from usaf.cli import main
from usaf.train import trackers
from usaf.train.trackers import Tracker, register_tracker

STEPS = 3


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("trackers")
    return make_model_dir(root / "model"), write_copy_task(root / "train.jsonl", 24)


def train(inputs, out: Path, *sets) -> int:
    model, data = inputs
    fast = [s for s in FAST_RUN if s != "log.tensorboard=false"]  # report_to says which trackers run
    args = [f"--set={s}" for s in [*fast, f"schedule.max_steps={STEPS}", *sets]]
    return main(["train", f"--model={model}", f"--data={data}", f"--out={out}", *args])


def scalars(run: Path) -> dict[str, dict[int, float]]:
    """metrics.jsonl as name -> step -> value (numbers only)."""
    out: dict = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                out.setdefault(key, {})[row["step"]] = value
    return out


def test_tensorboard_gets_every_scalar(inputs, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    assert train(inputs, run, "log.report_to=tensorboard") == 0
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    want = scalars(run)
    assert set(events.Tags()["scalars"]) == set(want)
    for tag, values in want.items():
        got = {e.step: e.value for e in events.Scalars(tag)}
        assert got == pytest.approx(values, rel=1e-6), tag
    assert "config/text_summary" in events.Tags()["tensors"]
    # the final evaluation (issue 35): its row of metrics.jsonl, at the last step, is in the event file
    (final,) = [
        json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"final"' in line
    ]
    assert final["step"] == STEPS and final["final"] is True
    for tag in ("eval/loss", "eval/perplexity"):
        assert events.Scalars(tag)[-1].step == STEPS
        assert events.Scalars(tag)[-1].value == pytest.approx(final[tag], rel=1e-6)


def wandb_records(path: Path):
    """The protobuf records of an offline W&B run file: a 7-byte header (":W&B", magic, version), then LevelDB's
    log format (blocks of 32 KiB; each piece a crc32c, a little-endian length, a type: full, first, middle, last)."""
    from wandb.proto.wandb_internal_pb2 import Record

    blob, block, offset, pending = path.read_bytes(), 1 << 15, 7, b""
    assert blob[:4] == b":W&B"
    while offset + 7 <= len(blob):
        if block - offset % block < 7:  # a block's tail too short for a header is padding
            offset += block - offset % block
            continue
        length, kind = int.from_bytes(blob[offset + 4 : offset + 6], "little"), blob[offset + 6]
        if kind == 0:
            break
        pending += blob[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):  # full, last
            record = Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def finished_wandb_records(path: Path, wait_s: float = 30.0) -> list:
    """The records of an offline W&B run file once they end with the run's exit record: W&B's service writes the
    file after `finish()` returns (in the background, and at the latest when the process exits)."""
    deadline = time.monotonic() + wait_s
    while True:
        records = list(wandb_records(path))
        if (records and records[-1].WhichOneof("record_type") == "exit") or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def test_wandb_offline_writes_its_run_folder(inputs, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    assert train(inputs, run, "log.report_to=wandb") == 0
    (path,) = (run / "wandb").glob(f"offline-run-*-{trackers.run_id(run)}/run-*.wandb")
    logged, config = {}, {}
    for record in finished_wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            for key, value in items.items():
                if not key.startswith("_"):
                    logged.setdefault(key, {})[record.history.step.num] = value
        elif kind in ("config", "run"):
            updates = record.config.update if kind == "config" else record.run.config.update
            config.update({u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in updates})
    want = scalars(run)
    assert logged.keys() == want.keys()
    for key, values in want.items():
        assert logged[key] == pytest.approx(values), key
    assert config["schedule.max_steps"] == STEPS and config["select.density"] == pytest.approx(0.1)


def test_mlflow_keeps_its_store_in_the_run(inputs, tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)  # nothing may land in the working directory
    run = tmp_path / "run"
    assert train(inputs, run, "log.report_to=[mlflow]") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    client = mlflow.tracking.MlflowClient(tracking_uri=(run / "mlruns").as_uri())
    (found,) = client.search_runs(
        [e.experiment_id for e in client.search_experiments()], f"tags.usaf_run_id = '{trackers.run_id(run)}'"
    )
    for key, values in scalars(run).items():
        history = {m.step: m.value for m in client.get_metric_history(found.info.run_id, key)}
        assert history == pytest.approx(values, rel=1e-6), key
    assert found.data.params["schedule.max_steps"] == str(STEPS)


@pytest.mark.parametrize("store", ["file", pytest.param("sqlite", marks=pytest.mark.slow)])
def test_mlflow_takes_its_usual_stores(tmp_path, monkeypatch, store):
    """MLFLOW_TRACKING_URI as MLflow's documentation gives it: a file store, a SQLite database (its first start
    creates the tables: seconds). A server's URI is probed first: tests/cli/test_faults_trackers.py."""
    mlflow = pytest.importorskip("mlflow")
    uri = (tmp_path / "mlruns").as_uri() if store == "file" else f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    sessions = {  # started, then resumed at step 2; the final evaluation's row as metrics.jsonl has it
        0: [(1, {"loss": 2.5}), (2, {"loss": 2.25})],
        2: [(3, {"loss": 2.0}), (3, {"eval/loss": 1.5, "final": True})],
    }
    for start_step, records in sessions.items():
        started = trackers.Trackers(["mlflow"], run_dir, {"schedule": {"max_steps": 3}}, start_step)
        for step, record in records:
            started.log(step, record)
        started.close()
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    (found,) = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        f"tags.usaf_run_id = '{trackers.run_id(run_dir)}'",
    )
    assert {m.step: m.value for m in client.get_metric_history(found.info.run_id, "loss")} == {
        1: 2.5,
        2: 2.25,
        3: 2.0,
    }
    assert [(m.step, m.value) for m in client.get_metric_history(found.info.run_id, "eval/loss")] == [
        (3, 1.5)
    ]
    assert found.data.params["schedule.max_steps"] == "3" and found.info.status == "FINISHED"
    assert not (run_dir / "mlruns").exists()  # the user's store, not the run folder's


def test_a_tracker_defined_outside_usaf_plugs_in(inputs, tmp_path, monkeypatch):
    seen = {}

    class Notebook(Tracker):
        name, package, install = "notebook", "json", "nothing"

        def start(self, run_dir, config, start_step):
            seen["config"] = config

        def log(self, step, values):
            for key, value in values.items():
                seen.setdefault(key, {})[step] = value

    register_tracker(Notebook)
    run = tmp_path / "run"
    try:
        assert train(inputs, run, "log.report_to=[notebook]") == 0
    finally:
        trackers.TRACKERS.unregister(Notebook.name)
    assert {k: v for k, v in seen.items() if k != "config"} == scalars(run)
    assert seen["config"]["schedule"]["max_steps"] == STEPS


def test_a_missing_tracker_is_one_line_before_anything_is_written(inputs, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(trackers.WandB, "package", "no_such_package_here")
    run = tmp_path / "run"
    assert train(inputs, run, "log.report_to=[tensorboard,wandb]") == 2
    err = capsys.readouterr().err
    assert "log.report_to=wandb, but no_such_package_here is not installed: pip install 'usaf[wandb]'" in err
    assert len(err.strip().splitlines()) == 1 and not run.exists()
    assert train(inputs, run, "log.report_to=[comet]") == 2
    assert "unknown tracker 'comet'" in capsys.readouterr().err
    assert train(inputs, run, "log.report_to=[none,wandb]") == 2
    assert not run.exists()


def test_log_tensorboard_false_still_leaves_it_out(inputs, tmp_path):
    run = tmp_path / "run"
    assert train(inputs, run, "log.tensorboard=false") == 0
    assert not (run / "tensorboard").exists()


def test_every_tracker_accelerate_knows_is_a_choice():
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    assert set(LOGGER_TYPE_TO_CLASS) <= set(trackers.TRACKERS)
    assert all(
        issubclass(trackers.TRACKERS[name], trackers.OnAccelerate)
        for name in LOGGER_TYPE_TO_CLASS
        if name != "mlflow"
    )


def test_a_tracker_of_accelerate_is_driven_through_its_class(tmp_path, monkeypatch):
    """dvclive (not installed here) through a stand-in for accelerate's class: constructed to write into the run
    folder, started, given the configuration on a new run only, each row at its step, finished."""
    calls = []

    class StandIn:
        def __init__(self, **arguments):
            calls.append(("init", arguments))

        def start(self):
            calls.append(("start",))

        def store_init_configuration(self, values):
            calls.append(("config", values))

        def log(self, values, step=None):
            calls.append(("log", step, values))

        def finish(self):
            calls.append(("finish",))

    monkeypatch.setitem(trackers.LOGGER_TYPE_TO_CLASS, "dvclive", StandIn)
    monkeypatch.setattr(trackers.DVCLive, "package", "json")  # installed
    for start_step in (0, 2):  # a new run, then its resume
        started = trackers.Trackers(["dvclive"], tmp_path, {"schedule": {"max_steps": 3}}, start_step)
        started.log(start_step + 1, {"loss": 2.5, "final": True, "note": "text"})
        started.close()
    dvclive = {"dir": str(tmp_path / "dvclive")}
    assert calls == [
        ("init", {**dvclive, "resume": False}),
        ("start",),
        ("config", {"schedule.max_steps": 3}),
        ("log", 1, {"loss": 2.5}),
        ("finish",),
        ("init", {**dvclive, "resume": True}),
        ("start",),
        ("log", 3, {"loss": 2.5}),
        ("finish",),
    ]
