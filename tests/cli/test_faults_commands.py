"""Issue 12: a table of bad inputs and faults across the commands (the machinery, and the workspace `ws` the rows
use, are in tests/faults.py), and the faults that are not one command line."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from faults import NEW, SET_ARGS, Row, T, table_test, train_args
from helpers import FAST_RUN, losses, run_killed, start_usaf

from usaf.cli import main

# ---- faults a row sets up (tmp: the row's own folder; run: its copy of a run, when it asks for one) ---------------


def damage_trainable(ctx, monkeypatch):
    path = ctx.run / "checkpoints" / "step-00000003" / "trainable.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))


def truncate_optimizer(ctx, monkeypatch):
    path = ctx.run / "checkpoints" / "step-00000003" / "optimizer.safetensors"
    path.write_bytes(path.read_bytes()[:1000])


def move_data(ctx, monkeypatch):
    config = ctx.run / "config.yaml"
    config.write_text(config.read_text().replace(str(ctx.ws.data), str(ctx.tmp / "gone.jsonl")))


def disk_full_on_checkpoint(ctx, monkeypatch):
    import usaf.train.checkpoint

    def full(tensors, path, *args, **kwargs):
        Path(path).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(usaf.train.checkpoint, "save_file", full)


def disk_full_on_delta(ctx, monkeypatch):
    import safetensors.torch

    def full(tensors, path, *args, **kwargs):
        Path(path).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(safetensors.torch, "save_file", full)


def read_only_out(ctx, monkeypatch):
    real = os.open

    def refuse(path, *args, **kwargs):
        if str(path).startswith(str(ctx.tmp / "ro")):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)


def read_only_merged(ctx, monkeypatch):
    real = Path.mkdir

    def refuse(self, *args, **kwargs):
        if str(self).startswith(str(ctx.tmp)) and "usaf-tmp" in self.name:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refuse)


def disk_full_on_store(ctx, monkeypatch):
    import usaf.io.shards

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))

    monkeypatch.setattr(usaf.io.shards.StreamingWriter, "write", full)


def start_in_its_first_instant(ctx, monkeypatch):
    """The folder as another start leaves it while it writes its marker (here: a dead one's)."""
    (ctx.tmp / "run").mkdir()
    (ctx.tmp / "run" / ".usaf-lock").write_text("")
    (ctx.tmp / "run" / "..usaf-run.usaf-tmp-4194999-0a1b2c3d").write_text("{")


def existing_output(ctx, monkeypatch):
    (ctx.tmp / "d.safetensors").write_bytes(b"keep me")


# ---- the table ---------------------------------------------------------------------------------------------------


ROWS = [
    # ---- usaf train: the model
    Row("train-missing-model", T("--model={tmp}/nope", "--data={ws.data}", "--out={tmp}/run"), 2,
        ["{tmp}/nope: no such model directory"], absent=["{tmp}/run"]),
    Row("train-truncated-weights", T("--model={ws.trunc}", "--data={ws.data}", "--out={tmp}/run"), 2,
        ["{ws.trunc}/model.safetensors is truncated", "re-download or re-create it"], absent=["{tmp}/run"]),
    Row("train-unknown-model-type", T("--model={ws.unknown}", "--data={ws.data}", "--out={tmp}/run"), 2,
        ["{ws.unknown}/config.json: model_type 'qwen9_moe' is not known to transformers", "upgrade transformers"],
        absent=["{tmp}/run"]),
    Row("train-no-tokenizer-text", T("--model={ws.bare}", "--data={ws.text}", "--out={tmp}/run"), 2,
        ["{ws.text}:1: 'text' records need a tokenizer, and the model folder {ws.bare} has no tokenizer"],
        absent=["{tmp}/run"]),
    Row("train-unreadable-config", T("--model={ws.bad_config}", "--data={ws.data}", "--out={tmp}/run"), 2,
        ["{ws.bad_config}/config.json is not a readable JSON object"], absent=["{tmp}/run"]),
    # ---- usaf train: the data
    Row("train-data-folder", T("--model={ws.base}", "--data={ws.data_dir}", "--out={tmp}/run"), 2,
        ["{ws.data_dir} is a folder; give the data files in it", "--data {ws.data_dir}/part1.jsonl"],
        absent=["{tmp}/run"]),
    Row("train-data-missing", T("--model={ws.base}", "--data={tmp}/none.jsonl", "--out={tmp}/run"), 2,
        ["{tmp}/none.jsonl: data file not found"], absent=["{tmp}/run"]),
    Row("train-data-xlsx", T("--model={ws.base}", "--data={ws.xlsx}", "--out={tmp}/run"), 2,
        ["{ws.xlsx}: unknown data file type '.xlsx'; use one of"], absent=["{tmp}/run"]),
    Row("train-data-bad-json", T("--model={ws.base}", "--data={ws.bad_json}", "--out={tmp}/run"), 2,
        ["{ws.bad_json}:2:", "--skip-bad-records"], absent=["{tmp}/run"]),
    Row("train-data-unknown-keys", T("--model={ws.base}", "--data={ws.bad_keys}", "--out={tmp}/run"), 2,
        ["{ws.bad_keys}:1: unknown record keys ['txt']"], absent=["{tmp}/run"]),
    Row("train-positions-beyond-the-model-clamped",  # one rule for every objective (issue 35: test_faults_bounds)
        [*T("--model={ws.base}", "--data={ws.long}", "--out={tmp}/run"), "--set=data.max_seq_len=128"], 0,
        ["data.max_seq_len=128 is above the model's 64 positions", "using 64"]),
    # ---- usaf train: the options
    Row("train-lr-zero", [*T(*NEW), "--set=optim.lr=0"], 2, ["optim.lr must be > 0, got 0.0"],
        absent=["{tmp}/run"]),
    Row("train-grad-accum-zero", [*T(*NEW), "--set=schedule.grad_accum=0"], 2,
        ["schedule.grad_accum must be >= 1, got 0"], absent=["{tmp}/run"]),
    Row("train-unknown-key", [*T(*NEW), "--set=optim.lrr=1"], 2,
        ["optim: unknown key 'lrr'; did you mean 'lr'?"], absent=["{tmp}/run"]),
    Row("train-unknown-section", [*T(*NEW), "--set=optimizer.lr=1"], 2, ["unknown section 'optimizer'; did you mean 'optim'?"],
        absent=["{tmp}/run"]),
    Row("train-config-is-a-list", [*T(*NEW), "--config={ws.yaml_list}"], 2,
        ["Config file {ws.yaml_list}: the top level is a list, not a mapping of sections"], absent=["{tmp}/run"]),
    Row("train-no-out", T("--model={ws.base}", "--data={ws.data}"), 2, ["give --out RUN_DIR"]),
    # ---- usaf train: the run folder
    Row("train-out-is-a-file", T("--model={ws.base}", "--data={ws.data}", "--out={ws.data}"), 2,
        ["--out {ws.data} is a file, not a folder"], keeps=["{ws.data}"]),
    Row("train-out-not-a-run", T("--model={ws.base}", "--data={ws.data}", "--out={ws.user_dir}"), 2,
        ["--out {ws.user_dir} is not empty and not a usaf run", "give --force"], keeps=["{ws.user_dir}"]),
    Row("train-out-holds-a-run", T("--model={ws.base}", "--data={ws.data}", "--out={run}"), 2,
        ["{run} already holds a run; resume it with --resume"], run="finished", keeps=["{run}"]),
    Row("train-into-a-dead-start-at-its-first-write", T("--model={ws.base}", "--data={ws.data}", "--out={tmp}/run"),
        0, [" expert entries + "], setup=start_in_its_first_instant),
    Row("train-read-only-out", T("--model={ws.base}", "--data={ws.data}", "--out={tmp}/ro"), 2,
        ["cannot write into {tmp}/ro: Read-only file system; choose another --out"], setup=read_only_out),
    # ---- usaf train --resume
    Row("resume-not-a-run", ["train", "--resume={ws.empty}"], 2,
        ["--resume {ws.empty}: no config.yaml there; is it a usaf run directory?"], keeps=["{ws.empty}"]),
    Row("resume-finished", ["train", "--resume={run}"], 0, ["{run} is finished (step 3 of schedule.max_steps=3)"],
        run="finished", keeps=["{run}"]),
    Row("resume-fixed-setting", ["train", "--resume={run}", "--set", "select.density=0.2", "schedule.max_steps=4"],
        2, ["cannot resume: 'select.density' differs from the original run"], run="finished", keeps=["{run}"]),
    Row("resume-damaged-trainable", ["train", "--resume={run}", "--set=schedule.max_steps=4"], 2,
        ["Checkpoint file {run}/checkpoints/step-00000003/trainable.safetensors is damaged",
         "delete {run}/checkpoints/step-00000003 to fall back"], run="finished", setup=damage_trainable,
        keeps=["{run}"]),
    Row("resume-truncated-optimizer", ["train", "--resume={run}", "--set=schedule.max_steps=4"], 2,
        ["Checkpoint file {run}/checkpoints/step-00000003/optimizer.safetensors is damaged"], run="finished",
        setup=truncate_optimizer, keeps=["{run}"]),
    Row("resume-moved-data", ["train", "--resume={run}", "--set=schedule.max_steps=4"], 2,
        ["data.train {tmp}/gone.jsonl does not exist (has it moved?)", "--data NEW_FILES"], run="finished",
        setup=move_data, keeps=["{run}"]),
    Row("resume-disk-full-on-checkpoint", ["train", "--resume={run}", "--set=schedule.max_steps=4"], 2,
        ["No space left on device; free some space"], run="finished", setup=disk_full_on_checkpoint,
        keeps=["{run}/checkpoints/step-00000003"], absent=["{run}/checkpoints/step-00000004"]),
    # ---- usaf eval
    Row("eval-missing-model", ["eval", "{tmp}/nope", "--data={ws.data}"], 2, ["{tmp}/nope: no such model directory"]),
    Row("eval-unreadable-config", ["eval", "{ws.bad_config}", "--data={ws.data}"], 2,
        ["{ws.bad_config}/config.json is not a readable JSON object"]),
    Row("eval-data-folder", ["eval", "{ws.base}", "--data={ws.data_dir}"], 2, ["{ws.data_dir} is a folder"]),
    Row("eval-damaged-checkpoint", ["eval", "{run}", "--data={ws.data}"], 2,
        ["step-00000003/trainable.safetensors is damaged"], run="finished", setup=damage_trainable),
    Row("eval-no-tokenizer-text", ["eval", "{ws.bare}", "--data={ws.text}"], 2,
        ["the model folder {ws.bare} has no tokenizer"]),
    # ---- usaf select
    Row("select-out-suffix", ["select", "--model={ws.base}", "--data={ws.data}", "--out={tmp}/sel.bin"], 2,
        ["--out {tmp}/sel.bin: the selection file must end in .safetensors"], absent=["{tmp}/sel.bin"]),
    Row("select-no-data", ["select", "--model={ws.base}", "--out={tmp}/s.safetensors"], 2,
        ["usaf select needs --model and --data"]),
    Row("select-no-tokenizer-text",
        ["select", "--model={ws.bare}", "--data={ws.text}", "--out={tmp}/s.safetensors"], 2,
        ["the model folder {ws.bare} has no tokenizer"], absent=["{tmp}/s.safetensors"]),
    Row("select-truncated-weights",
        ["select", "--model={ws.trunc}", "--data={ws.data}", "--out={tmp}/s.safetensors"], 2,
        ["{ws.trunc}/model.safetensors is truncated"], absent=["{tmp}/s.safetensors"]),
    # ---- usaf prepare
    Row("prepare-missing-model", ["prepare", "{tmp}/nope", "--out={tmp}/store"], 2,
        ["MODEL_DIR {tmp}/nope: no such model directory", "download a hub model first"], absent=["{tmp}/store"]),
    Row("prepare-model-is-a-file", ["prepare", "{ws.data}", "--out={tmp}/store"], 2,
        ["MODEL_DIR {ws.data} is a file; give the model's folder"], absent=["{tmp}/store"]),
    Row("prepare-no-config", ["prepare", "{ws.empty}", "--out={tmp}/store"], 2,
        ["{ws.empty} has no config.json"], absent=["{tmp}/store"]),
    Row("prepare-unreadable-config", ["prepare", "{ws.bad_config}", "--out={tmp}/store"], 2,
        ["{ws.bad_config}/config.json is not a readable JSON object"], absent=["{tmp}/store"]),
    Row("prepare-unknown-model-type", ["prepare", "{ws.unknown}", "--out={tmp}/store"], 2,
        ["{ws.unknown}/config.json: model_type 'qwen9_moe' is not known", "upgrade transformers"],
        absent=["{tmp}/store"]),
    Row("prepare-truncated-weights", ["prepare", "{ws.trunc}", "--out={tmp}/store"], 2,
        ["{ws.trunc}/model.safetensors is truncated", "re-download or re-create it"], absent=["{tmp}/store"]),
    Row("prepare-pickles-only", ["prepare", "{ws.pickles}", "--out={tmp}/store"], 2,
        ["{ws.pickles} holds its weights only as pickles", "convert them to safetensors"],
        absent=["{tmp}/store"]),
    Row("prepare-pre-quantized", ["prepare", "{ws.prequantized}", "--out={tmp}/store"], 2,
        ["{ws.prequantized}/config.json: quantization_config.quant_method is 'gptq'", "use the model's bf16 checkpoint"],
        absent=["{tmp}/store"]),
    Row("prepare-unknown-quant", ["prepare", "{ws.base}", "--quant=nf3", "--out={tmp}/store"], 2,
        ["usaf prepare: argument --quant: invalid choice: 'nf3'", "see `usaf prepare --help`"],
        absent=["{tmp}/store"]),
    Row("option-typo", ["train", "--model={ws.base}", "--dta={ws.data}", "--out={tmp}/run"], 2,
        ["usaf train: unrecognized arguments: --dta=", "(did you mean --data?); see `usaf train --help`"],
        absent=["{tmp}/run"]),
    Row("command-typo", ["tran", "--out={tmp}/run"], 2,
        ["usaf: unknown command 'tran'; did you mean 'train'? See `usaf --help`."], absent=["{tmp}/run"]),
    Row("key-nothing-like", [*T(*NEW), "--set=select.zzzz=1"], 2,
        ["select: unknown key 'zzzz'; allowed keys: ['calibration_batches',"], absent=["{tmp}/run"]),
    Row("prepare-no-out", ["prepare", "{ws.base}"], 2,
        ["the following arguments are required: --out", "see `usaf prepare --help`"]),
    Row("prepare-unknown-device", ["prepare", "{ws.base}", "--device=tpu", "--out={tmp}/store"], 2,
        ["--device 'tpu' is not a device torch knows"], absent=["{tmp}/store"]),
    Row("prepare-absent-device", ["prepare", "{ws.base}", "--device=cuda:7", "--out={tmp}/store"], 2,
        ["--device cuda:7: "], absent=["{tmp}/store"]),
    Row("prepare-out-is-a-file", ["prepare", "{ws.base}", "--out={ws.data}", "--force"], 2,
        ["--out {ws.data} is a file, not a folder"], keeps=["{ws.data}"]),
    Row("prepare-out-inside-the-model", ["prepare", "{ws.base}", "--out={ws.base}/store"], 2,
        ["must not be inside the checkpoint directory {ws.base}"], absent=["{ws.base}/store"]),
    Row("prepare-out-exists", ["prepare", "{ws.base}", "--out={ws.store}"], 2,
        ["{ws.store} already exists; choose another --out or pass --force"], keeps=["{ws.store}"]),
    Row("prepare-out-not-a-store", ["prepare", "{ws.base}", "--out={ws.user_dir}", "--force"], 2,
        ["{ws.user_dir} exists and is not a usaf prepared store"], keeps=["{ws.user_dir}"]),
    Row("prepare-disk-full", ["prepare", "{ws.base}", "--out={tmp}/store"], 2,
        ["No space left on device; free some space"], setup=disk_full_on_store, absent=["{tmp}/store"]),
    # ---- usaf export
    Row("export-nothing-to-write", ["export", "{ws.finished}"], 2, ["say what to write: --delta"]),
    Row("export-run-is-a-file", ["export", "{ws.data}", "--delta={tmp}/d.safetensors"], 2,
        ["{ws.data} is a file, not a run directory"], keeps=["{ws.data}"], absent=["{tmp}/d.safetensors"]),
    Row("export-missing-run", ["export", "{tmp}/nope", "--delta={tmp}/d.safetensors"], 2,
        ["Run directory {tmp}/nope does not exist"], absent=["{tmp}/d.safetensors"]),
    Row("export-output-exists", ["export", "{ws.finished}", "--delta={tmp}/d.safetensors"], 2,
        ["{tmp}/d.safetensors already exists", "--force"], setup=existing_output, keeps=["{tmp}/d.safetensors"]),
    Row("export-base-of-another-family", ["export", "{ws.finished}", "--base={ws.olmoe}", "--merged={tmp}/m"], 2,
        ["the run {ws.finished} was made for a qwen3_moe model, but {ws.olmoe} is olmoe"], absent=["{tmp}/m"]),
    Row("export-base-with-other-weights", ["export", "{ws.finished}", "--base={ws.altered}", "--merged={tmp}/m"],
        2, ["differs from the base the run {ws.finished} was trained on (its first and last bytes differ)"], absent=["{tmp}/m"]),
    Row("export-base-with-unreadable-config",
        ["export", "{ws.finished}", "--base={ws.bad_config}", "--delta={tmp}/d.safetensors"], 2,
        ["{ws.bad_config}/config.json is not a readable JSON object"], absent=["{tmp}/d.safetensors"]),
    Row("export-damaged-checkpoint", ["export", "{run}", "--delta={tmp}/d.safetensors"], 2,
        ["trainable.safetensors is damaged"], run="finished", setup=damage_trainable, keeps=["{run}"],
        absent=["{tmp}/d.safetensors"]),
    Row("export-run-without-checkpoint", ["export", "{ws.empty}", "--delta={tmp}/d.safetensors"], 2,
        ["{ws.empty} has no finished checkpoint"], absent=["{tmp}/d.safetensors"]),
    Row("export-disk-full", ["export", "{ws.finished}", "--delta={tmp}/d.safetensors"], 2,
        ["No space left on device"], setup=disk_full_on_delta, absent=["{tmp}/d.safetensors"]),
    Row("export-read-only", ["export", "{ws.finished}", "--merged={tmp}/m"], 2,
        ["Read-only file system; choose a writable folder"], setup=read_only_merged, absent=["{tmp}/m"]),
    Row("export-unfinished-says-its-step", ["export", "{ws.unfinished}", "--delta={tmp}/d.safetensors"], 0,
        ["exported step 2 of schedule.max_steps=3 (step-00000002): the run is NOT finished",
         "usaf train --resume {ws.unfinished}"], keeps=["{ws.unfinished}"]),
    # ---- usaf apply
    Row("apply-missing-delta", ["apply", "{ws.base}", "{tmp}/none.safetensors", "{tmp}/out"], 2,
        ["Delta file {tmp}/none.safetensors does not exist"], absent=["{tmp}/out"]),
    Row("apply-not-a-delta", ["apply", "{ws.base}", "{ws.not_delta}", "{tmp}/out"], 2,
        ["{ws.not_delta} is not a usaf delta file"], absent=["{tmp}/out"]),
    Row("apply-truncated-delta", ["apply", "{ws.base}", "{ws.trunc_delta}", "{tmp}/out"], 2,
        ["{ws.trunc_delta} is truncated"], absent=["{tmp}/out"]),
    Row("apply-base-of-another-family", ["apply", "{ws.olmoe}", "{ws.delta}", "{tmp}/out"], 2,
        ["{ws.delta} was made for a qwen3_moe model, but {ws.olmoe} is olmoe"], absent=["{tmp}/out"]),
    Row("apply-base-with-other-weights", ["apply", "{ws.altered}", "{ws.delta}", "{tmp}/out"], 2,
        ["differs from the base {ws.delta} was trained on (its first and last bytes differ)"], absent=["{tmp}/out"]),
    Row("apply-base-of-unknown-model-type", ["apply", "{ws.unknown}", "{ws.delta}", "{tmp}/out"], 2,
        ["{ws.unknown}/config.json: model_type 'qwen9_moe' is not known"], absent=["{tmp}/out"]),
    Row("apply-out-exists", ["apply", "{ws.base}", "{ws.delta}", "{ws.empty}"], 2,
        ["{ws.empty} already exists; choose another output directory or pass --force"]),
    Row("apply-into-the-base", ["apply", "{ws.base}", "{ws.delta}", "{ws.base}", "--force"], 2,
        ["would replace the base checkpoint"]),
    # ---- usaf plan
    Row("plan-vram-without-unit", ["plan", "--model=qwen3-30b-a3b", "--vram", "12"], 2,
        ["--vram 12 has no unit; write 12GB"]),
    Row("plan-vram-zero", ["plan", "--model=qwen3-30b-a3b", "--vram", "0GB"], 2,
        ["--vram 0GB is no memory; give a size above zero"]),
    Row("plan-vram-negative", ["plan", "--model=qwen3-30b-a3b", "--vram", "-5GB"], 2, ["--vram -5GB is negative"]),
    Row("plan-ram-negative", ["plan", "--model=qwen3-30b-a3b", "--ram", "-3"], 2, ["--ram -3 is negative"]),
    Row("plan-size-unreadable", ["plan", "--model=qwen3-30b-a3b", "--vram", "12XB"], 2,
        ["Cannot read the size '12XB'"]),
    Row("plan-seq-zero", ["plan", "--model=qwen3-30b-a3b", "--seq", "0"], 2, ["--seq must be at least 1, got 0"]),
    Row("plan-density-above-one", ["plan", "--model=qwen3-30b-a3b", "--density", "2"], 2,
        ["--density must be in (0, 1], got 2"]),
    Row("plan-unknown-model", ["plan", "--model={tmp}/nope"], 2, ["Unknown model '{tmp}/nope'", "Presets:"]),
    Row("plan-unknown-device", ["plan", "--model=qwen3-30b-a3b", "--device=tpu"], 2,
        ["Unknown device 'tpu'; device presets:"]),
    # ---- usaf report
    Row("report-not-a-run", ["report", "{ws.empty}"], 2, ["{ws.empty} has neither metrics.jsonl nor router_load"]),
    Row("report-torn-router-load", ["report", "{ws.torn_report}"], 2,
        ["{ws.torn_report}/router_load.json is not readable JSON", "delete the file"], keeps=["{ws.torn_report}"]),
]  # fmt: skip


test_fault = table_test(ROWS)


def test_the_table_has_at_least_40_rows_across_the_commands():
    assert len(ROWS) >= 40
    commands = {"train", "eval", "select", "prepare", "export", "apply", "plan", "report"}
    assert {row.argv[0] for row in ROWS} >= commands


# ---- faults that are not one command line --------------------------------------------------------------------------

# kill -9 at random steps: in the middle of a step (after its metrics row, before any checkpoint of it) or right
# after a checkpoint; a resume then equals the uninterrupted run bit for bit. The steps are drawn from
# USAF_FAULT_SEED (fixed by default, so that a failure repeats; set it to draw others).
KILL_STEPS = 8
KILL_SETS = [
    *FAST_RUN,
    f"schedule.max_steps={KILL_STEPS}",
    "checkpoint.every_steps=3",
    "checkpoint.keep_last=0",
    "select.reselect_every=3",  # a reselection (and its probe window) inside the killed stretch
    "train.seed=5",
]
_draw = random.Random(int(os.environ.get("USAF_FAULT_SEED", "12")))
KILLS = [
    ("row", _draw.randint(1, KILL_STEPS - 1)),
    ("checkpoint", 3 * _draw.randint(1, (KILL_STEPS - 1) // 3)),
]


@pytest.fixture(scope="module")
def straight_run(ws):
    run = ws.root / "straight"
    assert main(train_args(ws, run, *(f"--set={s}" for s in KILL_SETS))) == 0
    return run


@pytest.mark.parametrize("when, step", KILLS, ids=[f"kill-9-at-{w}-of-step-{s}" for w, s in KILLS])
def test_kill_9_at_a_random_step_then_resume_equals_an_uninterrupted_run(
    ws, straight_run, tmp_path, when, step
):
    from safetensors.torch import load_file as load

    run = tmp_path / "run"
    args = train_args(ws, run, *(f"--set={s}" for s in KILL_SETS))
    killed = run_killed(args, step, when)
    assert killed.returncode == -9, killed.stderr[-2000:]
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    last = step if when == "checkpoint" else 3 * (step // 3)
    assert saved == [f"step-{s:08d}" for s in range(3, last + 1, 3)]  # nothing half-written beside them
    assert not (run / "summary.json").exists()
    assert main(["train", f"--resume={run}"]) == 0
    assert losses(run) == losses(straight_run)  # every step once, equal to the last bit
    final = f"checkpoints/step-{KILL_STEPS:08d}/trainable.safetensors"
    a, b = load(str(straight_run / final)), load(str(run / final))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_two_writers_starting_into_one_run_folder_at_once(ws, tmp_path):
    """Both start at the same moment: one trains, the other is refused with one clear line, and the run it
    would have shared is whole (every step once, no rows of the other)."""
    run = tmp_path / "run"
    args = train_args(ws, run, *SET_ARGS)
    procs = [start_usaf([*args, "--set=schedule.max_steps=4"]) for _ in range(2)]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    codes = sorted(rc for rc, _, _ in results)
    assert codes == [0, 2], results
    _, _, err = next(r for r in results if r[0] == 2)
    winner = next(p for p, r in zip(procs, results, strict=True) if r[0] == 0)
    assert (
        f"{run} is in use by another usaf train (process {winner.pid})" in err
        or f"{run} already holds a run; resume it with --resume" in err
    ), err
    assert err.startswith("usaf: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
    assert main(["export", str(run), f"--delta={tmp_path / 'd.safetensors'}"]) == 0  # its checkpoints load


def test_a_resume_drops_stale_metrics_rows_and_dead_checkpoint_temporaries(ws, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(ws.finished, run)
    (run / "summary.json").unlink()
    with open(run / "metrics.jsonl", "a") as f:  # a killed process's rows after its last checkpoint, torn
        f.write(json.dumps({"step": 4, "loss": 9.0}) + "\n" + json.dumps({"step": 5, "loss": 9.0}) + '\n{"st')
    dead = run / "checkpoints" / ".tmp-step-00000004-4194999"  # above any pid: its writer is gone
    dead.mkdir()
    (dead / "trainable.safetensors").write_bytes(b"half")
    assert main(["train", f"--resume={run}", "--set=schedule.max_steps=4"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert all(r["loss"] != 9.0 for r in rows if "loss" in r)
    assert not dead.exists()


def test_list_options_into_a_closed_pipe_has_no_traceback():
    code = "import sys; from usaf.cli import main; sys.exit(main(['train', '--list-options']))"
    proc = subprocess.run(
        f'{sys.executable} -c "{code}" | head -1',
        shell=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.stdout.startswith("model.path = ") and "Traceback" not in proc.stderr, proc.stderr
    assert "BrokenPipeError" not in proc.stderr


def test_the_demo_returns_non_zero_when_training_stops(monkeypatch, tmp_path, capsys):
    import usaf.demo.run
    import usaf.demo.task
    from usaf.cli import main as cli

    monkeypatch.setattr(usaf.demo.task, "task_accuracy", lambda *args, **kwargs: 0.0)
    stopped = {"stopped": True, "step": 7, "reason": "router collapse"}
    monkeypatch.setattr(usaf.demo.run, "train", lambda *args, **kwargs: stopped)
    assert cli(["demo", f"--out={tmp_path / 'demo'}", "--set=schedule.max_steps=2"]) == 1
    out = capsys.readouterr().out
    assert "training stopped at step 7 (router collapse); nothing exported" in out
    assert not (tmp_path / "demo" / "model").exists()
    monkeypatch.setattr(
        usaf.demo.run, "train", lambda *args, **kwargs: {"stopped": True, "step": 3, "signal": 15}
    )
    assert cli(["demo", f"--out={tmp_path / 'demo'}"]) == 128 + 15


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]).returncode == 0


def test_a_real_full_disk_during_checkpoint_and_export(ws, tmp_path, capsys):
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "400k"):
        pytest.skip("needs root and a tmpfs mount for a small disk")
    try:
        run = disk / "run"
        args = train_args(ws, run, *SET_ARGS)
        # each checkpoint of the tiny run is ~60 kB (trainable values, optimizer moments): the disk fills up
        rc = main([*args, "--set=schedule.max_steps=100", "--set=checkpoint.keep_last=0"])
        err = capsys.readouterr().err
        assert rc == 2 and "No space left on device; free some space" in err and "Traceback" not in err, err
        saved = sorted(p.name for p in (run / "checkpoints").iterdir())
        assert saved and all(name.startswith("step-") for name in saved)  # no half-written .tmp- folder
        last = run / "checkpoints" / saved[-1]
        assert json.loads((last / "state.json").read_text())["files"]  # the last one is whole: it loads
        from usaf.train import checkpoint

        checkpoint.load(last)
        # an export into the full disk fails the same way and leaves no partial output
        assert main(["export", str(ws.finished), f"--merged={disk / 'merged'}"]) == 2
        assert "No space left on device" in capsys.readouterr().err
        assert not (disk / "merged").exists() and not [p for p in disk.iterdir() if "usaf-tmp" in p.name]
    finally:
        subprocess.run(["umount", str(disk)])


@pytest.mark.slow
def test_the_first_lines_of_a_run_come_whole_before_its_progress(ws, tmp_path):
    """stdout and stderr into one pipe (`> log 2>&1`): the information line and notes come whole, then the
    progress as plain lines (not a terminal: no bar, no carriage returns)."""
    run = tmp_path / "run"
    args = train_args(ws, run, *SET_ARGS)
    args += ["--set=schedule.max_steps=2", "--set=log.progress=true"]
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from usaf.cli import main; sys.exit(main(sys.argv[1:]))", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.returncode == 0, proc.stdout[-2000:]
    first = proc.stdout.split("\n", 1)[0]
    assert first.startswith("usaf ") and ": training " in first and "train:" not in first, proc.stdout[:500]
    assert "supervised tokens" in first  # the whole line, up to its end
    assert "\r" not in proc.stdout and "train:" not in proc.stdout  # no bar in a file
    assert [line for line in proc.stdout.splitlines() if line.startswith("step 1/2: loss ")]  # a line a step


def test_train_without_a_model_says_so_and_never_takes_the_current_folder(tmp_path, monkeypatch, capsys):
    # `usaf train --data x --out runs/a` in the data's folder: the folder is not the model (Path("") is ".")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.jsonl").write_text('{"text": "abc"}\n')
    assert main(["train", "--data", "x.jsonl", "--out", "runs/a"]) == 2
    assert (
        capsys.readouterr().err
        == "usaf: error: no model: give --model DIR (or model.path in the config file).\n"
    )
    assert not (tmp_path / "runs").exists()
