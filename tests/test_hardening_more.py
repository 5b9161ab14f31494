"""Issue 12, items 8, 9 and 11: export checks a --base as apply does; checkpoints carry checksums; runs store
absolute paths."""

import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import make_model_dir, write_copy_task
from safetensors.torch import load_file, save_file

from usaf.cli import main

SETS = [
    "data.max_seq_len=48",
    "data.batch_size=4",
    "select.density=0.1",
    "log.progress=false",
    "log.tensorboard=false",
    "schedule.warmup_steps=1",
    "checkpoint.every_steps=1",
    "checkpoint.keep_last=0",
]


def train_args(model: Path, data: Path, out, *sets: str) -> list[str]:
    args = ["train", f"--model={model}", f"--data={data}", f"--out={out}"]
    return [*args, *(f"--set={s}" for s in [*SETS, *sets])]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A base, a run of 3 steps on it (a checkpoint at every step), its data."""
    root = tmp_path_factory.mktemp("more")
    base = make_model_dir(root / "base")
    data = write_copy_task(root / "train.jsonl", 60)
    run = root / "run"
    assert main(train_args(base, data, run, "schedule.max_steps=3")) == 0
    return {"root": root, "base": base, "data": data, "run": run}


def copy_run(finished, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(finished["run"], run)
    return run


# ---------------------------------------------------------------------------------------------------------
# item 8: usaf export --base OTHER is checked as usaf apply checks a delta's base
# ---------------------------------------------------------------------------------------------------------


def altered_copy(base: Path, folder: Path) -> Path:
    """The same architecture with other weights: every expert tensor of layer 1 slightly changed."""
    shutil.copytree(base, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    for name in tensors:
        if ".experts." in name or "mlp.gate" in name:
            tensors[name] = tensors[name] + 0.01
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("kind", ["--merged", "--delta"])
def test_export_refuses_a_base_with_other_weights(finished, tmp_path, capsys, kind):
    other = altered_copy(finished["base"], tmp_path / "other")
    out = tmp_path / ("merged" if kind == "--merged" else "delta.safetensors")
    capsys.readouterr()
    assert main(["export", str(finished["run"]), f"--base={other}", f"{kind}={out}"]) == 2
    err = capsys.readouterr().err
    assert f"differs from the base the run {finished['run']} was trained on (sha256 mismatch)" in err
    assert "Use the exact checkpoint it was made from" in err and "Traceback" not in err
    assert err.count("\n") == 1 and not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_export_refuses_a_base_of_another_family(finished, tmp_path, capsys):
    other = make_model_dir(tmp_path / "olmoe", "olmoe")
    out = tmp_path / "merged"
    assert main(["export", str(finished["run"]), f"--base={other}", f"--merged={out}"]) == 2
    err = capsys.readouterr().err
    assert f"the run {finished['run']} was made for a qwen3_moe model, but {other} is olmoe" in err
    assert not out.exists()


def test_export_takes_an_identical_copy_of_the_base(finished, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(finished["base"], copy)
    assert (
        main(["export", str(finished["run"]), f"--base={copy}", f"--delta={tmp_path / 'd.safetensors'}"]) == 0
    )
    assert main(["apply", str(copy), str(tmp_path / "d.safetensors"), str(tmp_path / "applied")]) == 0
    record = json.loads((finished["run"] / "base.json").read_text())
    assert record["model_type"] == "qwen3_moe" and all(
        len(t["sha256"]) == 64 for t in record["tensors"].values()
    )


# ---------------------------------------------------------------------------------------------------------
# item 9: checkpoint files carry checksums, verified on resume, export and eval
# ---------------------------------------------------------------------------------------------------------


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40  # inside the last tensor's values: the file still parses
    path.write_bytes(bytes(data))


def damage(path: Path, how: str) -> None:
    if how == "flipped":
        flip_last_byte(path)
    else:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize(
    "name, how",
    [
        ("trainable.safetensors", "flipped"),
        ("optimizer.safetensors", "truncated"),
        ("rng.safetensors", "flipped"),
    ],
)
@pytest.mark.parametrize("command", ["resume", "export", "eval"])
def test_a_damaged_checkpoint_file_is_named_as_damaged(finished, tmp_path, capsys, name, how, command):
    run = copy_run(finished, tmp_path)
    last = run / "checkpoints" / "step-00000003"
    damage(last / name, how)
    before = snapshot(run)
    capsys.readouterr()
    if command == "resume":
        args = ["train", f"--resume={run}", "--set=schedule.max_steps=4"]
    elif command == "export":
        args = ["export", str(run), f"--delta={tmp_path / 'd.safetensors'}"]
    else:
        args = ["eval", str(run), f"--data={finished['data']}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"Checkpoint file {last / name} is damaged: its sha256 differs" in err
    assert f"delete {last} to fall back to an earlier checkpoint" in err
    assert "different base model" not in err and "Traceback" not in err and err.count("\n") == 1
    assert snapshot(run) == before and not (tmp_path / "d.safetensors").exists()


def test_after_deleting_the_damaged_checkpoint_the_run_resumes_from_the_one_before(finished, tmp_path):
    run = copy_run(finished, tmp_path)
    flip_last_byte(run / "checkpoints" / "step-00000003" / "trainable.safetensors")
    shutil.rmtree(run / "checkpoints" / "step-00000003")
    (run / "summary.json").unlink()
    assert main(["train", f"--resume={run}"]) == 0
    assert json.loads((run / "summary.json").read_text())["steps"] == 3


def test_every_checkpoint_records_the_sha256_of_its_files(finished):
    state = json.loads((finished["run"] / "checkpoints" / "step-00000001" / "state.json").read_text())
    assert sorted(state["files"]) == sorted(
        ["trainable.safetensors", "optimizer.safetensors", "rng.safetensors", "extra.safetensors"]
    )


def test_a_folder_named_like_a_checkpoint_is_not_taken_for_one(finished, tmp_path, capsys):
    run = copy_run(finished, tmp_path)
    (run / "checkpoints" / "step-foo").mkdir()
    (run / "checkpoints" / "step-foo" / "state.json").write_text("{}")
    assert main(["export", str(run), f"--delta={tmp_path / 'd.safetensors'}"]) == 0
    assert (
        "step-00000003"
        in json.loads(
            __import__("safetensors").safe_open(str(tmp_path / "d.safetensors"), "pt").metadata()["usaf"]
        )["source"]["checkpoint"]
    )


# ---------------------------------------------------------------------------------------------------------
# item 11: runs store absolute paths; a moved base or data file is named, with how to go on
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def relative_run(finished, tmp_path, monkeypatch):
    """A run started with relative --model, --data and --out, from tmp_path/work."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copytree(finished["base"], work / "base")
    shutil.copy(finished["data"], work / "train.jsonl")
    monkeypatch.chdir(work)
    assert main(train_args(Path("base"), Path("train.jsonl"), "run", "schedule.max_steps=2")) == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return work


def test_a_run_started_with_relative_paths_resumes_and_exports_from_elsewhere(relative_run, capsys):
    run = relative_run / "run"
    saved = (run / "config.yaml").read_text()
    assert f"path: {relative_run / 'base'}\n" in saved and f"- {relative_run / 'train.jsonl'}\n" in saved
    assert main(["train", f"--resume={run}", "--set=schedule.max_steps=3"]) == 0
    assert main(["export", str(run), "--delta=d.safetensors"]) == 0 and Path("d.safetensors").exists()
    assert main(["eval", str(run), f"--data={relative_run / 'train.jsonl'}"]) == 0


def test_a_moved_base_is_named_and_can_be_given_anew(relative_run, finished, tmp_path, capsys):
    run = relative_run / "run"
    moved = tmp_path / "moved-base"
    os.rename(relative_run / "base", moved)
    before = snapshot(run)
    capsys.readouterr()
    assert main(["train", f"--resume={run}", "--set=schedule.max_steps=3"]) == 2
    err = capsys.readouterr().err
    assert f"model.path {relative_run / 'base'} does not exist (has it moved?)" in err
    assert "give its new place with --model NEW_DIR" in err and err.count("\n") == 1
    assert snapshot(run) == before
    assert main(["export", str(run), "--delta=d.safetensors"]) == 2
    assert (
        f"trained on '{relative_run / 'base'}', which is not a local model directory"
        in capsys.readouterr().err
    )
    # another model at the new place is refused; the moved base is taken, and recorded
    other = altered_copy(finished["base"], tmp_path / "other")
    assert main(["train", f"--resume={run}", f"--model={other}", "--set=schedule.max_steps=3"]) == 2
    assert "is not the base the run started from" in capsys.readouterr().err
    assert snapshot(run) == before
    assert main(["train", f"--resume={run}", f"--model={moved}", "--set=schedule.max_steps=3"]) == 0
    assert f"model.path '{relative_run / 'base'}' -> '{moved}'" in capsys.readouterr().out
    assert f"path: {moved}\n" in (run / "config.yaml").read_text()
    assert main(["export", str(run), "--delta=d.safetensors"]) == 0


def test_moved_data_is_named_and_can_be_given_anew(relative_run, tmp_path, capsys):
    run = relative_run / "run"
    moved = tmp_path / "moved.jsonl"
    os.rename(relative_run / "train.jsonl", moved)
    assert main(["train", f"--resume={run}", "--set=schedule.max_steps=3"]) == 2
    err = capsys.readouterr().err
    assert f"data.train {relative_run / 'train.jsonl'} does not exist (has it moved?)" in err
    assert "--data NEW_FILES" in err
    assert main(["train", f"--resume={run}", f"--data={moved}", "--set=schedule.max_steps=3"]) == 0
    # other data under the moved name is refused by the data position's fingerprint
    moved.write_text(moved.read_text().replace("copy", "kopy"))
    assert main(["train", f"--resume={run}", f"--data={moved}", "--set=schedule.max_steps=4"]) == 2
    assert "cannot resume the data position" in capsys.readouterr().err
