"""Run folders (issue 12, items 4 to 7): resuming a finished run, one writer per run folder, --out into a folder
that is not a usaf run, failed and killed starts that leave nothing behind, --resume with --set applied and
recorded or refused; and a hub id that cannot be reached fails at once, leaving no run folder."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import (
    FAST_RUN,
    start_usaf,
    train_cli_args,
    wait_for_rows,
)

from usaf.cli import main
from usaf.config import RunConfig

BASE = FAST_RUN


def cli_args(workspace, out: Path, *sets):
    return train_cli_args(workspace, out, BASE, *sets)


# ---------------------------------------------------------------------------------------------------------
# item 6: resuming a finished run
# ---------------------------------------------------------------------------------------------------------


def _snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_resuming_a_finished_run_says_so_and_changes_nothing(workspace, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(cli_args(workspace, run, "schedule.max_steps=2", "checkpoint.every_steps=1")) == 0
    before = _snapshot(run)
    summary = json.loads(before["summary.json"])
    assert summary["steps"] == 2 and summary["first_loss"] is not None
    capsys.readouterr()
    assert main(["train", f"--resume={run}"]) == 0
    out = capsys.readouterr().out
    assert f"{run} is finished (step 2 of schedule.max_steps=2); nothing changed" in out
    assert _snapshot(run) == before  # summary.json, metrics, checkpoints: byte for byte
    # a shorter schedule than the run went: still finished, still untouched
    assert main(["train", f"--resume={run}", "--set=schedule.max_steps=1"]) == 0
    assert _snapshot(run) == before


def test_resuming_below_the_last_checkpoint_without_a_summary_is_refused(workspace, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(cli_args(workspace, run, "schedule.max_steps=2", "checkpoint.every_steps=1")) == 0
    original = json.loads((run / "summary.json").read_text())
    (run / "summary.json").unlink()  # e.g. killed between the last checkpoint and the summary
    before = _snapshot(run)
    capsys.readouterr()
    assert main(["train", f"--resume={run}", "--set=schedule.max_steps=1"]) == 2
    err = capsys.readouterr().err
    assert "the run is at step 2, beyond schedule.max_steps=1; give --set schedule.max_steps=2" in err
    assert _snapshot(run) == before
    # at its last step without a summary: the resume writes the summary and nothing else changes
    assert main(["train", f"--resume={run}"]) == 0
    rewritten = json.loads((run / "summary.json").read_text())
    assert {k: rewritten[k] for k in ("steps", "tokens", "first_loss", "last_loss", "eval_loss_before")} == {
        k: original[k] for k in ("steps", "tokens", "first_loss", "last_loss", "eval_loss_before")
    }


# ---------------------------------------------------------------------------------------------------------
# item 7: one writer per run folder
# ---------------------------------------------------------------------------------------------------------


def _start_training(workspace, run: Path, *sets) -> subprocess.Popen:
    return start_usaf(cli_args(workspace, run, "schedule.max_steps=100000", *sets))


@pytest.mark.slow
def test_a_second_training_into_a_busy_run_folder_is_refused(workspace, tmp_path, capsys):
    run = tmp_path / "run"
    # no checkpoint yet (every_steps=0): the busy folder must not pass for a dead start
    proc = _start_training(workspace, run, "checkpoint.every_steps=0")
    try:
        wait_for_rows(proc, run / "metrics.jsonl", 3)
        config_before = (run / "config.yaml").read_bytes()
        assert main(cli_args(workspace, run, "schedule.max_steps=2")) == 2
        err = capsys.readouterr().err
        assert f"{run} is in use by another usaf train (process {proc.pid})" in err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert (run / "config.yaml").read_bytes() == config_before
    finally:
        proc.kill()  # SIGKILL: the lock must die with the process
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.slow
def test_a_resume_of_a_busy_run_is_refused_and_the_lock_dies_with_its_process(workspace, tmp_path, capsys):
    run = tmp_path / "run"
    proc = _start_training(workspace, run, "checkpoint.every_steps=2")
    try:
        wait_for_rows(proc, run / "metrics.jsonl", 4)
        assert main(["train", f"--resume={run}", "--set=schedule.max_steps=3"]) == 2
        assert f"{run} is in use by another usaf train (process {proc.pid})" in capsys.readouterr().err
    finally:
        proc.kill()
        proc.communicate()
    done = max(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*"))
    assert main(["train", f"--resume={run}", f"--set=schedule.max_steps={done + 1}"]) == 0


# ---------------------------------------------------------------------------------------------------------
# item 4: --out into a folder that is not a usaf run; failed starts leave nothing behind
# ---------------------------------------------------------------------------------------------------------


def test_out_into_a_folder_that_is_not_a_run_is_refused_without_force(workspace, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.yaml").write_text("my: own settings\n")
    (out / "notes.txt").write_text("keep me\n")
    before = _snapshot(out)
    assert main(cli_args(workspace, out, "schedule.max_steps=1")) == 2
    err = capsys.readouterr().err
    assert f"--out {out} is not empty and not a usaf run (it holds config.yaml, notes.txt)" in err
    assert "give --force" in err and err.count("\n") == 1
    assert sorted(os.listdir(out)) == ["config.yaml", "notes.txt"] and _snapshot(out) == before
    assert main([*cli_args(workspace, out, "schedule.max_steps=1"), "--force"]) == 0
    assert (out / "notes.txt").read_text() == "keep me\n" and (out / "summary.json").exists()


def test_out_that_is_a_file_is_refused(workspace, tmp_path, capsys):
    out = tmp_path / "file"
    out.write_text("x")
    assert main(cli_args(workspace, out)) == 2
    assert f"--out {out} is a file, not a folder" in capsys.readouterr().err


def test_a_failed_start_leaves_no_run_behind(workspace, tmp_path, capsys):
    new = tmp_path / "new"
    bad_model = [f"--model={tmp_path / 'no-such-model'}"]
    assert main([*cli_args(workspace, new), *bad_model]) == 2
    assert "no such model directory" in capsys.readouterr().err
    assert not new.exists()  # the folder it made is gone
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([*cli_args(workspace, empty), *bad_model]) == 2
    assert set(os.listdir(empty)) <= {".usaf-lock"}  # the folder given stays, emptied of usaf's files
    # and the next start takes it, without --force
    assert main(cli_args(workspace, empty, "schedule.max_steps=1")) == 0


@pytest.mark.slow
def test_a_killed_start_is_started_over_not_continued(workspace, tmp_path):
    run = tmp_path / "run"
    proc = _start_training(workspace, run, "checkpoint.every_steps=0")
    wait_for_rows(proc, run / "metrics.jsonl", 3)
    proc.kill()  # no checkpoint, no clean-up: a dead start
    proc.communicate()
    assert main(cli_args(workspace, run, "schedule.max_steps=2")) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]  # none of the dead start's rows


# ---------------------------------------------------------------------------------------------------------
# item 5: --resume with --set: applied and recorded, or refused
# ---------------------------------------------------------------------------------------------------------


def _rows(run: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


def test_a_resume_applies_and_records_a_new_peak_lr_and_length(workspace, tmp_path, capsys):
    sets = ["checkpoint.every_steps=1", "schedule.warmup_steps=1", "optim.lr=0.01"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(cli_args(workspace, straight, *sets, "optim.lr=0.02", "schedule.max_steps=4")) == 0
    assert main(cli_args(workspace, resumed, *sets, "schedule.max_steps=2")) == 0
    capsys.readouterr()
    assert main(["train", f"--resume={resumed}", "--set", "optim.lr=0.02", "schedule.max_steps=4"]) == 0
    assert "resumed with optim.lr 0.01 -> 0.02, schedule.max_steps 2 -> 4" in capsys.readouterr().out
    a, b = _rows(straight), _rows(resumed)
    assert sorted(b) == [1, 2, 3, 4]
    assert [a[s]["lr"] for s in (3, 4)] == [b[s]["lr"] for s in (3, 4)]  # the new peak's curve, exactly
    recorded = RunConfig.load(str(resumed / "config.yaml"))
    assert recorded.optim.lr == 0.02 and recorded.schedule.max_steps == 4


@pytest.mark.parametrize(
    "override, key",
    [
        ("optim.beta1=0.95", "optim.beta1"),
        ("schedule.warmup_steps=5", "schedule.warmup_steps"),
        ("router.lr_multiplier=1", "router.lr_multiplier"),
        ("select.density=0.2", "select.density"),
        ("train.seed=9", "train.seed"),
    ],
)
def test_a_resume_refuses_a_setting_the_checkpoint_fixes(workspace, tmp_path, capsys, override, key):
    run = tmp_path / "run"
    assert main(cli_args(workspace, run, "schedule.max_steps=1")) == 0
    before = _snapshot(run)
    capsys.readouterr()
    assert main(["train", f"--resume={run}", "--set", override, "schedule.max_steps=2"]) == 2
    err = capsys.readouterr().err
    assert f"cannot resume: '{key}' differs from the original run" in err
    assert "a resume may change only schedule.max_steps, optim.lr" in err and err.count("\n") == 1
    assert _snapshot(run) == before


def test_a_hub_id_while_offline_fails_at_once_naming_the_id(monkeypatch, tmp_path, capsys):
    """A hub id that is not cached, with the hub unreachable: one line at once, no minute of retries, no run
    folder left behind; a cached hub id is not probed (it loads offline)."""
    import socket

    import huggingface_hub

    from usaf.train.session import check_model_path

    def unreachable(*args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(socket, "create_connection", unreachable)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: None)
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello"}\n')
    args = ["train", "--model=someorg/some-moe", f"--data={data}", f"--out={tmp_path / 'run'}"]
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # the test suite's own setting
    assert main(args) == 2 and "HF_HUB_OFFLINE is set" in capsys.readouterr().err
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    began = time.monotonic()
    code = main(args)
    err = capsys.readouterr().err
    assert time.monotonic() - began < 10, "the hub's retries (1 + 2 + 4 + 8 + 8 s) ran before the check"
    assert code == 2 and "someorg/some-moe" in err and "cannot be reached" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: "/cache/config.json")
    check_model_path("someorg/some-moe")  # cached: no probe, no error
