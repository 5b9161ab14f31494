"""What a run records of its inputs, and the checks on it (issue 12, items 8, 9 and 11): export checks a --base
as apply does (base.json, which hashes only the tensors the run can train); checkpoints carry checksums; runs
store absolute paths."""

import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import FAST_RUN, make_model_dir, write_copy_task
from safetensors.torch import load_file, save_file

from usaf.cli import main

SETS = [*FAST_RUN, "checkpoint.every_steps=1", "checkpoint.keep_last=0"]


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


def test_export_refuses_a_base_with_other_weights(finished, tmp_path, capsys):
    # --merged and another family: rows of tests/cli/test_faults_commands.py
    other = altered_copy(finished["base"], tmp_path / "other")
    out = tmp_path / "delta.safetensors"
    capsys.readouterr()
    assert main(["export", str(finished["run"]), f"--base={other}", f"--delta={out}"]) == 2
    err = capsys.readouterr().err
    assert f"differs from the base the run {finished['run']} was trained on" in err
    assert "Use the exact checkpoint it was made from" in err and "Traceback" not in err
    assert err.count("\n") == 1 and not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_export_takes_an_identical_copy_of_the_base(finished, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(finished["base"], copy)
    assert (
        main(["export", str(finished["run"]), f"--base={copy}", f"--delta={tmp_path / 'd.safetensors'}"]) == 0
    )
    assert main(["apply", str(copy), str(tmp_path / "d.safetensors"), str(tmp_path / "applied")]) == 0
    record = json.loads((finished["run"] / "base.json").read_text())
    assert record["model_type"] == "qwen3_moe" and all(
        len(t["sample_sha256"]) == 64 for t in record["tensors"].values()
    )
    # hashed whole: what this run's targets can train (not the norms)
    assert len(record["tensors"]["model.layers.0.self_attn.q_proj.weight"]["sha256"]) == 64
    assert "sha256" not in record["tensors"]["model.norm.weight"]


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


def test_a_truncated_optimizer_file_is_named_as_damaged_by_export(finished, tmp_path, capsys):
    # the other files and commands: rows of tests/cli/test_faults_commands.py
    run = copy_run(finished, tmp_path)
    last = run / "checkpoints" / "step-00000003"
    damage(last / "optimizer.safetensors", "truncated")
    before = snapshot(run)
    capsys.readouterr()
    assert main(["export", str(run), f"--delta={tmp_path / 'd.safetensors'}"]) == 2
    err = capsys.readouterr().err
    assert f"Checkpoint file {last / 'optimizer.safetensors'} is damaged: its sha256 differs" in err
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


def test_a_run_with_relative_paths_works_from_elsewhere_and_a_moved_base_or_data_is_named(
    finished, tmp_path, monkeypatch, capsys
):
    work = tmp_path / "work"  # the run is started with relative --model, --data and --out from here
    work.mkdir()
    shutil.copytree(finished["base"], work / "base")
    shutil.copy(finished["data"], work / "train.jsonl")
    monkeypatch.chdir(work)
    assert main(train_args(Path("base"), Path("train.jsonl"), "run", "schedule.max_steps=2")) == 0
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    run = work / "run"
    saved = (run / "config.yaml").read_text()
    assert f"path: {work / 'base'}\n" in saved and f"- {work / 'train.jsonl'}\n" in saved
    assert main(["train", f"--resume={run}", "--set=schedule.max_steps=3"]) == 0
    assert main(["export", str(run), "--delta=d.safetensors"]) == 0 and Path("d.safetensors").exists()
    assert main(["eval", str(run), f"--data={work / 'train.jsonl'}"]) == 0

    # the data moves: named, and given anew; other data under the new name is refused by the data fingerprint
    moved_data = tmp_path / "moved.jsonl"
    os.rename(work / "train.jsonl", moved_data)
    before = snapshot(run)
    capsys.readouterr()
    assert main(["train", f"--resume={run}", "--set=schedule.max_steps=4"]) == 2
    err = capsys.readouterr().err
    assert f"data.train {work / 'train.jsonl'} does not exist (has it moved?)" in err
    assert "--data NEW_FILES" in err and err.count("\n") == 1
    assert snapshot(run) == before
    other_data = tmp_path / "other.jsonl"
    other_data.write_text(moved_data.read_text().replace("copy", "kopy"))
    assert main(["train", f"--resume={run}", f"--data={other_data}", "--set=schedule.max_steps=4"]) == 2
    assert "cannot resume the data position" in capsys.readouterr().err
    assert snapshot(run) == before
    assert main(["train", f"--resume={run}", f"--data={moved_data}", "--set=schedule.max_steps=4"]) == 0

    # the base moves: named (resume and export), another model at the new place refused, the moved base taken
    moved = tmp_path / "moved-base"
    os.rename(work / "base", moved)
    before = snapshot(run)
    capsys.readouterr()
    assert main(["train", f"--resume={run}", "--set=schedule.max_steps=5"]) == 2
    err = capsys.readouterr().err
    assert f"model.path {work / 'base'} does not exist (has it moved?)" in err
    assert "give its new place with --model NEW_DIR" in err and err.count("\n") == 1
    assert main(["export", str(run), "--delta=d2.safetensors"]) == 2
    assert f"trained on '{work / 'base'}', which is not a local model directory" in capsys.readouterr().err
    other = altered_copy(finished["base"], tmp_path / "other")
    assert main(["train", f"--resume={run}", f"--model={other}", "--set=schedule.max_steps=5"]) == 2
    assert "is not the base the run started from" in capsys.readouterr().err
    assert snapshot(run) == before
    assert main(["train", f"--resume={run}", f"--model={moved}", "--set=schedule.max_steps=5"]) == 0
    assert f"model.path '{work / 'base'}' -> '{moved}'" in capsys.readouterr().out
    assert f"path: {moved}\n" in (run / "config.yaml").read_text()
    assert main(["export", str(run), "--delta=d2.safetensors"]) == 0


# ---------------------------------------------------------------------------------------------------------
# base.json: a start hashes only the tensors that can hold trained entries; the rest by cheap facts
# ---------------------------------------------------------------------------------------------------------


def test_a_run_start_hashes_only_the_tensors_it_can_train(finished, tmp_path, monkeypatch, capsys):
    import usaf.io.shards

    hashed: list[str] = []
    real = usaf.io.shards.sha256_of
    monkeypatch.setattr(usaf.io.shards, "sha256_of", lambda entry: hashed.append(entry.name) or real(entry))
    everything = set(load_file(str(finished["base"] / "model.safetensors")))
    # layer 1's expert tensors (stored one per expert and projection, fused by the model) and its router
    trained = {key for key in everything if key.startswith("model.layers.1.mlp.")}
    assert len(trained) == 6 * 3 + 1
    run = tmp_path / "run"
    sets = ["schedule.max_steps=1", "select.layers=[1]", "select.targets=[experts,routers]"]
    assert main(train_args(finished["base"], finished["data"], run, *sets)) == 0
    assert sorted(hashed) == sorted(trained)  # each once, nothing else read whole
    record = json.loads((run / "base.json").read_text())
    assert {key for key, t in record["tensors"].items() if "sha256" in t} == trained
    assert set(record["tensors"]) == everything and record["files"] == {
        "model.safetensors": (finished["base"] / "model.safetensors").stat().st_size
    }
    assert all(len(t["sample_sha256"]) == 64 for t in record["tensors"].values())

    # a resume from a moved copy, an export: again only the recorded tensors are hashed
    copy = tmp_path / "copy"
    shutil.copytree(finished["base"], copy)
    hashed.clear()
    assert main(["train", f"--resume={run}", f"--model={copy}", "--set=schedule.max_steps=2"]) == 0
    assert sorted(hashed) == sorted(trained)
    hashed.clear()
    assert main(["export", str(run), f"--merged={tmp_path / 'merged'}"]) == 0
    assert set(hashed) <= trained

    # a base that differs only where this run trains nothing is still refused: by resume, export and apply
    other = tmp_path / "other"
    shutil.copytree(finished["base"], other)
    tensors = load_file(str(other / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.weight"] += 0.01
    save_file(tensors, str(other / "model.safetensors"), metadata={"format": "pt"})
    capsys.readouterr()
    before = snapshot(run)
    assert main(["train", f"--resume={run}", f"--model={other}", "--set=schedule.max_steps=3"]) == 2
    err = capsys.readouterr().err
    assert f"the model at {other} is not the base the run started from" in err
    assert "tensor 'model.layers.0.self_attn.q_proj.weight' differs" in err and err.count("\n") == 1
    assert snapshot(run) == before
    assert main(["export", str(run), f"--base={other}", f"--delta={tmp_path / 'd.safetensors'}"]) == 2
    err = capsys.readouterr().err
    assert f"Tensor 'model.layers.0.self_attn.q_proj.weight' in {other / 'model.safetensors'} differs" in err
    assert "Use the exact checkpoint it was made from" in err and not (tmp_path / "d.safetensors").exists()
    assert main(["export", str(run), f"--delta={tmp_path / 'd.safetensors'}"]) == 0
    assert main(["apply", str(other), str(tmp_path / "d.safetensors"), str(tmp_path / "applied")]) == 2
    assert "differs from the base" in capsys.readouterr().err and not (tmp_path / "applied").exists()


def test_an_older_runs_base_json_with_every_tensor_hashed_is_still_read_and_checked(
    finished, tmp_path, capsys
):
    from usaf.base import record

    run = copy_run(finished, tmp_path)
    full = record.base_record(finished["base"])  # no trained names: every tensor hashed
    assert all("sha256" in t for t in full["tensors"].values())
    keep = ("file", "dtype", "shape", "sha256")
    old = {  # as usaf wrote base.json before: every tensor's sha256, no sampled bytes, no file sizes
        **{k: full[k] for k in ("model_type", "config_sha256", "name_or_path")},
        "tensors": {key: {k: t[k] for k in keep} for key, t in full["tensors"].items()},
    }
    (run / "base.json").write_text(json.dumps(old))
    assert record.base_difference(old, finished["base"]) is None
    assert main(["export", str(run), f"--delta={tmp_path / 'd.safetensors'}"]) == 0
    other = altered_copy(finished["base"], tmp_path / "other")
    assert "sha256 mismatch" in record.base_difference(old, other)
    capsys.readouterr()
    assert main(["export", str(run), f"--base={other}", f"--delta={tmp_path / 'e.safetensors'}"]) == 2
    assert f"differs from the base the run {run} was trained on (sha256 mismatch)" in capsys.readouterr().err
