"""Issue 23, outputs: a command never destroys its own inputs or the user's files (`--force` replaces only an earlier
output of the same kind), never writes outside its output (no symbolic link in a run or an output folder is
followed), two writers into one output never both succeed, and a SIGTERM leaves no partial output. The rows use the
shared workspace `ws` (tests/faults.py); the faults that are not one command line follow the table."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from faults import NEW, SET_ARGS, Row, T, snapshot, table_test
from helpers import start_usaf

from usaf.cli import main

RESUME = ["train", "--resume={run}", "--set=schedule.max_steps=4"]

# ---- what rows set up (tmp: the row's own folder; run: its copy of a run) -------------------------------------------


def delta_in_out_dir(ctx, monkeypatch):
    (ctx.tmp / "dir").mkdir()
    shutil.copy(ctx.ws.delta, ctx.tmp / "dir" / "d.safetensors")


def earlier_delta(ctx, monkeypatch):
    shutil.copy(ctx.ws.delta, ctx.tmp / "d.safetensors")


def a_file_at_the_out(ctx, monkeypatch):
    (ctx.tmp / "s.safetensors").write_text("someone's file\n")


def earlier_merged(ctx, monkeypatch):
    assert main(["export", str(ctx.ws.finished), f"--merged={ctx.tmp / 'm'}"]) == 0


def user_folder(ctx, monkeypatch):
    (ctx.tmp / "mine").mkdir()
    (ctx.tmp / "mine" / "notes.txt").write_text("keep me\n")


def earlier_selection(ctx, monkeypatch):
    """A selection file as `usaf select` writes it (its .json companion holds the axes)."""
    import torch
    from safetensors.torch import save_file

    save_file({"layer.experts": torch.arange(4)}, str(ctx.tmp / "s.safetensors"))
    (ctx.tmp / "s.json").write_text(json.dumps({"axes": {"layer.experts": None}, "summary": {}}))


def folder_named_like_a_selection(ctx, monkeypatch):
    (ctx.tmp / "s.safetensors").mkdir()


def data_in_a_folder(ctx, monkeypatch):
    (ctx.tmp / "mine").mkdir()
    shutil.copy(ctx.ws.data, ctx.tmp / "mine" / "train.jsonl")


def link_in_run(name: str):
    """RUN/NAME a symbolic link to `tmp/victim`, which holds what RUN/NAME held (so the run otherwise resumes)."""

    def setup(ctx, monkeypatch):
        path, victim = ctx.run / name, ctx.tmp / "victim"
        if path.is_dir():
            shutil.copytree(path, victim)
            shutil.rmtree(path)
        elif path.exists():
            shutil.copy(path, victim)
            path.unlink()
        else:
            victim.write_text("someone's file\n")
        path.symlink_to(victim)

    return setup


def lock_link_in_empty_out(ctx, monkeypatch):
    (ctx.tmp / "victim").write_text("someone's file\n")
    (ctx.tmp / "run").mkdir()
    (ctx.tmp / "run" / ".usaf-lock").symlink_to(ctx.tmp / "victim")


# ---- the table ---------------------------------------------------------------------------------------------------

RUN_LINKS = ["metrics.jsonl", "router_load.json", "summary.json", "config.yaml", "base.json", ".usaf-run",
             ".usaf-lock", "checkpoints", "selection.safetensors"]  # fmt: skip

ROWS = [
    # ---- an output that is, holds or lies inside an input of the command
    Row("export-merged-into-its-own-run", ["export", "{run}", "--merged={run}", "--force"], 2,
        ["--merged {run} would replace the run {run}, an input of this command"], run="finished",
        keeps=["{run}"]),
    Row("export-merged-into-its-checkpoints", ["export", "{run}", "--merged={run}/checkpoints", "--force"], 2,
        ["--merged {run}/checkpoints must not be inside the run {run}"], run="finished", keeps=["{run}"]),
    Row("export-delta-over-its-config", ["export", "{run}", "--delta={run}/config.yaml", "--force"], 2,
        ["--delta {run}/config.yaml must not be inside the run {run}"], run="finished", keeps=["{run}"]),
    Row("export-delta-into-its-run", ["export", "{run}", "--delta={run}/d.safetensors"], 2,
        ["--delta {run}/d.safetensors must not be inside the run {run}"], run="finished", keeps=["{run}"],
        absent=["{run}/d.safetensors"]),
    Row("export-merged-over-its-base", ["export", "{ws.finished}", "--merged={ws.base}", "--force"], 2,
        ["--merged {ws.base} would replace the base checkpoint {ws.base}"]),
    Row("export-merged-over-another-run", ["export", "{ws.unfinished}", "--merged={run}", "--force"], 2,
        ["--merged {run} exists and is not a merged checkpoint usaf wrote (it is a usaf run)"], run="finished",
        keeps=["{run}", "{ws.unfinished}"]),
    Row("export-merged-over-a-store", ["export", "{ws.finished}", "--merged={ws.store}", "--force"], 2,
        ["--merged {ws.store} exists and is not a merged checkpoint usaf wrote (it is a usaf prepared store)"],
        keeps=["{ws.store}", "{ws.finished}"]),
    Row("export-merged-over-a-user-folder", ["export", "{ws.finished}", "--merged={tmp}/mine", "--force"], 2,
        ["--merged {tmp}/mine exists and is not a merged checkpoint usaf wrote"], setup=user_folder,
        keeps=["{tmp}/mine"]),
    Row("export-merged-inside-another-model", ["export", "{ws.finished}", "--merged={ws.olmoe}/m"], 2,
        ["--merged {ws.olmoe}/m must not be inside the model folder {ws.olmoe}"], keeps=["{ws.olmoe}"],
        absent=["{ws.olmoe}/m"]),
    Row("export-delta-over-a-data-file", ["export", "{ws.finished}", "--delta={ws.data}", "--force"], 2,
        ["--delta {ws.data} exists and is not a usaf delta file"], keeps=["{ws.data}"]),
    Row("export-delta-over-a-base", ["export", "{ws.finished}", "--delta={ws.olmoe}", "--force"], 2,
        ["--delta {ws.olmoe} exists and is not a usaf delta file (it is a model folder)"], keeps=["{ws.olmoe}"]),
    Row("export-delta-replaces-an-earlier-delta", ["export", "{ws.finished}", "--delta={tmp}/d.safetensors",
        "--force"], 0, ["delta: {tmp}/d.safetensors"], setup=earlier_delta),
    Row("export-merged-replaces-an-earlier-merged", ["export", "{ws.finished}", "--merged={tmp}/m", "--force"], 0,
        ["merged checkpoint: {tmp}/m"], setup=earlier_merged),
    Row("apply-into-the-folder-of-its-delta", ["apply", "{ws.base}", "{tmp}/dir/d.safetensors", "{tmp}/dir",
        "--force"], 2, ["OUT_DIR {tmp}/dir holds the delta file {tmp}/dir/d.safetensors, an input of this command"],
        setup=delta_in_out_dir, keeps=["{tmp}/dir"]),
    Row("apply-over-a-run", ["apply", "{ws.base}", "{ws.delta}", "{run}", "--force"], 2,
        ["OUT_DIR {run} exists and is not a merged checkpoint usaf wrote (it is a usaf run)"], run="finished",
        keeps=["{run}"]),
    Row("apply-over-the-folder-holding-the-base", ["apply", "{ws.base}", "{ws.delta}", "{ws.root}", "--force"], 2,
        ["OUT_DIR {ws.root} holds the base checkpoint {ws.base}, an input of this command"]),
    Row("select-over-the-base-weights", ["select", "--model={ws.base}", "--data={ws.data}",
        "--out={ws.base}/model.safetensors", *SET_ARGS], 2,
        ["--out {ws.base}/model.safetensors must not be inside the model folder {ws.base}"]),
    Row("select-into-a-run", ["select", "--model={ws.base}", "--data={ws.data}", "--out={run}/s.safetensors",
        *SET_ARGS], 2, ["--out {run}/s.safetensors must not be inside the usaf run {run}"], run="finished",
        keeps=["{run}"], absent=["{run}/s.safetensors"]),
    Row("select-existing-out-needs-force", ["select", "--model={ws.base}", "--data={ws.data}",
        "--out={tmp}/s.safetensors", *SET_ARGS], 2,
        ["{tmp}/s.safetensors already exists; choose another --out or pass --force"], setup=a_file_at_the_out,
        keeps=["{tmp}/s.safetensors"]),
    Row("select-force-over-a-delta", ["select", "--model={ws.base}", "--data={ws.data}",
        "--out={tmp}/d.safetensors", "--force", *SET_ARGS], 2,
        ["--out {tmp}/d.safetensors exists and is not a usaf selection file"], setup=earlier_delta,
        keeps=["{tmp}/d.safetensors"]),
    Row("select-force-replaces-an-earlier-selection", ["select", "--model={ws.base}", "--data={ws.data}",
        "--out={tmp}/s.safetensors", "--force", *SET_ARGS], 0, ['"file": "{tmp}/s.safetensors"'],
        setup=earlier_selection),
    Row("select-out-a-folder", ["select", "--model={ws.base}", "--data={ws.data}", "--out={tmp}/s.safetensors",
        *SET_ARGS], 2, ["--out {tmp}/s.safetensors is a folder; the selection is one file"],
        setup=folder_named_like_a_selection),
    Row("prepare-into-a-run", ["prepare", "{ws.base}", "--quant=int8", "--out={run}/store"], 2,
        ["--out {run}/store must not be inside the usaf run {run}"], run="finished", keeps=["{run}"],
        absent=["{run}/store"]),
    Row("prepare-over-a-run", ["prepare", "{ws.base}", "--quant=int8", "--out={run}", "--force"], 2,
        ["{run} exists and is not a usaf prepared store (it is a usaf run)"], run="finished", keeps=["{run}"]),
    Row("train-into-the-base", T("--model={ws.base}", "--data={ws.data}", "--out={ws.base}", "--force"), 2,
        ["--out {ws.base} would replace the model folder {ws.base}, an input of this command"]),
    Row("train-inside-another-model", T("--model={ws.base}", "--data={ws.data}", "--out={ws.olmoe}/run"), 2,
        ["--out {ws.olmoe}/run must not be inside the model folder {ws.olmoe}"], keeps=["{ws.olmoe}"],
        absent=["{ws.olmoe}/run"]),
    Row("train-inside-a-run", T("--model={ws.base}", "--data={ws.data}", "--out={run}/inner"), 2,
        ["--out {run}/inner must not be inside the usaf run {run}"], run="finished", keeps=["{run}"],
        absent=["{run}/inner"]),
    Row("train-forced-into-the-folder-of-its-data", T("--model={ws.base}", "--data={tmp}/mine/train.jsonl",
        "--out={tmp}/mine", "--force"), 2,
        ["--out {tmp}/mine holds the data file {tmp}/mine/train.jsonl, an input of this command"],
        setup=data_in_a_folder, keeps=["{tmp}/mine"]),
    Row("demo-inside-a-model", ["demo", "--out={ws.base}/demo"], 2,
        ["--out {ws.base}/demo must not be inside the model folder {ws.base}"], absent=["{ws.base}/demo"]),
    # ---- no symbolic link in a run or an output folder is followed
    *(
        Row(f"resume-through-a-linked-{name.strip('.')}", RESUME, 2,
            [f"{{run}}/{name} is a symbolic link; usaf never writes through one"], run="finished",
            setup=link_in_run(name), keeps=["{tmp}/victim"])
        for name in RUN_LINKS
    ),
    Row("report-through-a-linked-png", ["report", "{run}"], 2,
        ["{run}/report.png is a symbolic link; usaf never writes through one"], run="finished",
        setup=link_in_run("report.png"), keeps=["{tmp}/victim"]),
    Row("train-into-an-empty-out-with-a-linked-lock", T(*NEW), 2,
        ["{tmp}/run/.usaf-lock is a symbolic link; usaf never writes through one"], setup=lock_link_in_empty_out,
        keeps=["{tmp}/victim"]),
]  # fmt: skip


test_fault = table_test(ROWS)


# ---- faults that are not one command line --------------------------------------------------------------------------


def test_a_linked_metrics_file_appears_mid_run_and_is_not_written_through(ws, tmp_path, capsys):
    """The check at the start cannot see a link made later: the metrics file itself is opened without following."""
    from usaf.train.metrics import MetricsLog

    victim = tmp_path / "victim"
    victim.write_text("someone's file\n")
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(Exception, match=r"metrics\.jsonl is a symbolic link"):
        MetricsLog(tmp_path, 3, 0, progress=False)
    assert victim.read_text() == "someone's file\n"


def test_two_exports_into_one_folder_at_once_never_both_succeed(ws, tmp_path, monkeypatch, capsys):
    """Deterministic interleaving: a second export writes the same folder while the first is writing; the first
    is then refused with one line, and the second's output stands whole."""
    import usaf.export.merged

    out, real = tmp_path / "m", usaf.export.merged.write_json
    state = {"inner": None}

    def the_other_export_finishes_first(path, data):
        if state["inner"] is None:
            state["inner"] = "running"
            state["inner"] = main(["export", str(ws.unfinished), f"--merged={out}"])
        return real(path, data)

    monkeypatch.setattr(usaf.export.merged, "write_json", the_other_export_finishes_first)
    capsys.readouterr()
    rc = main(["export", str(ws.finished), f"--merged={out}"])
    _, err = capsys.readouterr()
    assert state["inner"] == 0 and rc == 2, err
    assert f"{out} appeared while this command was writing it" in err and err.count("\n") == 1, err
    metadata = json.loads((out / "usaf_delta.json").read_text())
    assert metadata["source"]["step"] == 2  # the unfinished run's: the other's output, not replaced
    assert not [p for p in tmp_path.iterdir() if "usaf-tmp" in p.name or "usaf-old" in p.name]


def test_two_deltas_into_one_file_at_once_never_both_succeed(ws, tmp_path, monkeypatch, capsys):
    import safetensors.torch

    out, real = tmp_path / "d.safetensors", safetensors.torch.save_file
    state = {"inner": None}

    def the_other_export_finishes_first(tensors, path, *args, **kwargs):
        if state["inner"] is None:
            state["inner"] = "running"
            state["inner"] = main(["export", str(ws.unfinished), f"--delta={out}"])
        return real(tensors, path, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", the_other_export_finishes_first)
    capsys.readouterr()
    rc = main(["export", str(ws.finished), f"--delta={out}"])
    _, err = capsys.readouterr()
    assert state["inner"] == 0 and rc == 2, err
    assert f"{out} appeared while this command was writing it" in err and err.count("\n") == 1, err
    monkeypatch.undo()
    from usaf.export.delta import read_delta

    assert read_delta(out).info["source"]["step"] == 2
    assert not [p for p in tmp_path.iterdir() if "usaf-tmp" in p.name]


def test_two_export_processes_into_one_folder(ws, tmp_path):
    out = tmp_path / "m"
    procs = [start_usaf(["export", str(run), f"--merged={out}"]) for run in (ws.finished, ws.unfinished)]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    assert sorted(rc for rc, _, _ in results) == [0, 2], results
    _, _, err = next(r for r in results if r[0] == 2)
    assert f"{out} already exists" in err or f"{out} appeared while this command was writing it" in err, err
    assert err.startswith("usaf: error: ") and err.count("\n") == 1, err
    assert not [p for p in tmp_path.iterdir() if p.name != "m"]


# `python -c TERMINATE ARGS...`: usaf's command line, sent SIGTERM by itself in the middle of writing its output
TERMINATE = """
import os, signal, sys
import usaf.base.writer as load
import usaf.export.merged as merged
from usaf.cli import main
write_shard, write_tensors = merged._write_shard, load._write_tensors
def shard_then_term(*args, **kwargs):
    write_shard(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)
def tensors_then_term(*args, **kwargs):
    write_tensors(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)
merged._write_shard, load._write_tensors = shard_then_term, tensors_then_term
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command", ["export", "apply", "prepare"])
def test_sigterm_while_writing_leaves_no_partial_output(ws, tmp_path, command):
    out = tmp_path / "out"
    args = {
        "export": ["export", str(ws.finished), f"--merged={out}"],
        "apply": ["apply", str(ws.base), str(ws.delta), str(out)],
        "prepare": ["prepare", str(ws.base), "--quant=int8", f"--out={out}"],
    }[command]
    proc = subprocess.run(
        [sys.executable, "-c", TERMINATE, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-2000:]
    assert proc.stderr.startswith("usaf: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "SIGTERM" in proc.stderr and "Traceback" not in proc.stderr
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)  # no hidden partial folder, no output


def _rotating_load(ws, monkeypatch, times: int):
    """checkpoint.load as a training run's rotation makes it: the checkpoint being read is replaced by a newer one
    (its copy, one step on) and removed, `times` times."""
    import usaf.train.checkpoint as checkpoint

    real, state = checkpoint.load, {"left": times}

    def load(path):
        path = Path(path)
        if state["left"] > 0:
            state["left"] -= 1
            newer = path.parent / f"step-{checkpoint.step_of(path) + 1:08d}"
            shutil.copytree(path, newer)
            shutil.rmtree(path)
        return real(path)

    monkeypatch.setattr(checkpoint, "load", load)


def test_an_export_racing_rotation_reads_the_newer_checkpoint(ws, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    shutil.copytree(ws.finished, run)
    _rotating_load(ws, monkeypatch, times=1)
    assert main(["export", str(run), f"--delta={tmp_path / 'd.safetensors'}"]) == 0
    assert "(step-00000004)" in capsys.readouterr().out


def test_an_export_racing_rotation_says_rotated_not_delete(ws, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    shutil.copytree(ws.finished, run)
    _rotating_load(ws, monkeypatch, times=100)
    capsys.readouterr()
    assert main(["export", str(run), f"--delta={tmp_path / 'd.safetensors'}"]) == 2
    err = capsys.readouterr().err
    assert "rotated away while this export read" in err and "run the export again" in err, err
    assert "delete" not in err and err.count("\n") == 1, err
    assert not (tmp_path / "d.safetensors").exists()


def test_nothing_of_the_refused_rows_changed_the_workspace(ws):
    """After the rows above (which aim outputs and lock files at the workspace's base and models): the model
    folders hold nothing usaf wrote, not even a lock file."""
    for folder in (ws.base, ws.olmoe):
        assert {p.name for p in folder.iterdir()} <= {
            "config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
        }  # fmt: skip
    assert snapshot(ws.store)


def test_a_new_run_forced_into_the_folder_of_its_config_file(ws, tmp_path, capsys):
    """--config DIR/config.yaml --out DIR --force: the config file is an input, never replaced by the run's."""
    folder = tmp_path / "mine"
    folder.mkdir()
    config = folder / "config.yaml"
    config.write_text("optim:\n  lr: 0.001\n")
    before = snapshot(folder)
    rc = main(["train", f"--config={config}", f"--model={ws.base}", f"--data={ws.data}", f"--out={folder}",
               "--force", *SET_ARGS, "--set=schedule.max_steps=1"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and f"--out {folder} holds the config file {config}" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert snapshot(folder) == before
