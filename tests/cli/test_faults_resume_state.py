"""Issue 23, by class: state that a resume trusts without checking (state.json, config.yaml), deltas with bad
content, crashes that lose work, and the poorly said starts (NaN in the base, nothing to train). The machinery
and the workspace `ws` are in tests/faults.py; the faults that are not one command line are plain tests below."""

from __future__ import annotations

import errno
import json
import re
import shutil

import pytest
import torch
from faults import NEW, SET_ARGS, Row, T, delta_parts, table_test, train_args, write_delta
from helpers import write_copy_task
from safetensors.torch import load_file, save_file

from usaf.cli import main
from usaf.errors import UsafError

LAST = "checkpoints/step-00000002"  # the unfinished run's latest checkpoint

# ---- faults a row sets up (tmp: the row's own folder; run: its copy of a run) ------------------------------------


def flip_data_position(ctx, monkeypatch):
    """One bit of the data position in the latest checkpoint's state.json: "position": 2 -> 3 (0x32 -> 0x33)."""
    path = ctx.run / LAST / "state.json"
    text = path.read_text()
    assert '"position": 2,' in text
    path.write_text(text.replace('"position": 2,', '"position": 3,'))


def edit_config(key: str, value: str):
    section, name = key.split(".")

    def setup(ctx, monkeypatch):
        path = ctx.run / "config.yaml"
        text = path.read_text()
        pattern = re.compile(rf"(^{section}:\n(?:  .*\n)*?  {name}: ).*$", re.M)
        assert pattern.search(text), text
        path.write_text(pattern.sub(rf"\g<1>{value}", text, count=1))

    return setup


def _indexed_name(tensors: dict) -> str:
    return sorted(k for k in tensors if k.endswith(":flat_indices") and tensors[k].numel() > 2)[0][
        : -len(":flat_indices")
    ]


def bad_delta(how: str):
    """{tmp}/bad.safetensors: the workspace's delta with one tensor's content made bad, its checksum recomputed."""

    def setup(ctx, monkeypatch):
        tensors, info = delta_parts(ctx.ws.delta)
        name = _indexed_name(tensors)
        indices, values = tensors[f"{name}:flat_indices"].clone(), tensors[f"{name}:values"].clone()
        if how == "negative":
            indices[0] = -1
        elif how == "duplicate":
            indices[1] = indices[0]
        elif how == "float":
            indices = indices.to(torch.float32)
        elif how == "beyond":
            indices[-1] = 10**8
        elif how == "nan":
            values[0] = float("nan")
        elif how == "inf":
            values[-1] = float("inf")
        elif how == "stripped":
            info = {k: v for k, v in info.items() if k != "base"}
        tensors[f"{name}:flat_indices"], tensors[f"{name}:values"] = indices, values
        write_delta(ctx.tmp / "bad.safetensors", tensors, info)

    return setup


def nan_in_checkpoint(ctx, monkeypatch):
    """A NaN in the finished run's trained values, with every checksum of the checkpoint made to match."""
    from usaf.train.checkpoint import file_sha256

    folder = ctx.run / "checkpoints" / "step-00000003"
    path = folder / "trainable.safetensors"
    tensors = load_file(str(path))
    key = sorted(k for k in tensors if k.endswith(".values"))[0]
    tensors[key].view(-1)[0] = float("nan")
    save_file(tensors, str(path))
    state = json.loads((folder / "state.json").read_text())
    state["files"]["trainable.safetensors"] = file_sha256(path)
    (folder / "state.json").write_text(json.dumps(state, indent=1))
    (folder / "state.sha256").write_text(file_sha256(folder / "state.json") + "\n")


def nan_base(ctx, monkeypatch):
    shutil.copytree(ctx.ws.base, ctx.tmp / "nanbase")
    path = ctx.tmp / "nanbase" / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.1.self_attn.o_proj.weight"][0, 0] = float("nan")
    save_file(tensors, str(path), {"format": "pt"})


NAN_BASE = ["--model={tmp}/nanbase", "--data={ws.data}", "--out={tmp}/run"]
BAD = "Delta file {tmp}/bad.safetensors: tensor '"
APPLY_BAD = ["apply", "{ws.base}", "{tmp}/bad.safetensors", "{tmp}/out"]

# ---- the table ---------------------------------------------------------------------------------------------------

ROWS = [
    # ---- state that a resume trusts without checking
    Row("resume-state-json-bit-flip", ["train", "--resume={run}"], 2,
        ["Checkpoint file {run}/" + LAST + "/state.json is damaged", "delete {run}/" + LAST + " to fall back"],
        run="unfinished", setup=flip_data_position, keeps=["{run}"]),
    Row("export-state-json-bit-flip", ["export", "{run}", "--delta={tmp}/d.safetensors"], 2,
        ["Checkpoint file {run}/" + LAST + "/state.json is damaged"], run="unfinished",
        setup=flip_data_position, keeps=["{run}"], absent=["{tmp}/d.safetensors"]),
    Row("eval-state-json-bit-flip", ["eval", "{run}", "--data={ws.data}"], 2,
        ["Checkpoint file {run}/" + LAST + "/state.json is damaged"], run="unfinished",
        setup=flip_data_position, keeps=["{run}"]),
    Row("resume-edited-reselect-every", ["train", "--resume={run}"], 2,
        ["{run}/config.yaml was edited: 'select.reselect_every' is 2 there, but the run recorded 10",
         "put 10 back (or resume with --set select.reselect_every=10)", "a resume may change only"],
        run="unfinished", setup=edit_config("select.reselect_every", "2"), keeps=["{run}"]),
    Row("resume-edited-beta1", ["train", "--resume={run}"], 2,
        ["{run}/config.yaml was edited: 'optim.beta1' is 0.8 there, but the run recorded 0.9"],
        run="unfinished", setup=edit_config("optim.beta1", "0.8"), keeps=["{run}"]),
    Row("resume-edited-lr-in-config-yaml", ["train", "--resume={run}"], 2,
        ["'optim.lr' is 0.05 there", "to change it on resume, give --set optim.lr=VALUE"],
        run="unfinished", setup=edit_config("optim.lr", "0.05"), keeps=["{run}"]),
    # ---- deltas with bad content (a checksum recomputed over it passes: the content is what is checked)
    Row("apply-negative-index", APPLY_BAD, 2, [BAD, "has negative indices (e.g. -1)"],
        setup=bad_delta("negative"), absent=["{tmp}/out"]),
    Row("apply-duplicate-index", APPLY_BAD, 2, [BAD, "more than once"],
        setup=bad_delta("duplicate"), absent=["{tmp}/out"]),
    Row("apply-float-indices", APPLY_BAD, 2, [BAD, "has indices of type torch.float32, not int32/int64"],
        setup=bad_delta("float"), absent=["{tmp}/out"]),
    Row("apply-index-beyond-shape", APPLY_BAD, 2, [BAD, "has indices beyond its shape", "100000000"],
        setup=bad_delta("beyond"), absent=["{tmp}/out"]),
    Row("apply-nan-values", APPLY_BAD, 2, [BAD, "holds 1 NaN/Inf values"],
        setup=bad_delta("nan"), absent=["{tmp}/out"]),
    Row("apply-inf-values", APPLY_BAD, 2, [BAD, "holds 1 NaN/Inf values"],
        setup=bad_delta("inf"), absent=["{tmp}/out"]),
    Row("apply-stripped-base-record", APPLY_BAD, 2,
        ["{tmp}/bad.safetensors has no record of the base it was trained on", "pass --unchecked-base"],
        setup=bad_delta("stripped"), absent=["{tmp}/out"]),
    Row("apply-stripped-base-record-unchecked", [*APPLY_BAD, "--unchecked-base"], 0,
        ["merged checkpoint: {tmp}/out"], setup=bad_delta("stripped")),
    Row("export-nan-in-checkpoint", ["export", "{run}", "--delta={tmp}/d.safetensors"], 2,
        ["checkpoint {run}/checkpoints/step-00000003: tensor '", "holds 1 NaN/Inf values"], run="finished",
        setup=nan_in_checkpoint, absent=["{tmp}/d.safetensors"]),
    Row("export-merged-nan-in-checkpoint", ["export", "{run}", "--merged={tmp}/m"], 2,
        ["holds 1 NaN/Inf values"], run="finished", setup=nan_in_checkpoint, absent=["{tmp}/m"]),
    # ---- poorly said: a damaged base, nothing to train
    Row("train-nan-in-base", T(*NAN_BASE), 2,
        ["the base model has NaN/Inf values in tensor 'model.layers.1.self_attn.o_proj.weight'",
         "use an intact copy of the model"], setup=nan_base, absent=["{tmp}/run"]),
    Row("train-no-layers", T(*NEW, "--set=select.layers=[]"), 2,
        ["nothing to train: select.layers is []"], absent=["{tmp}/run"]),
    Row("select-no-layers", ["select", "--model={ws.base}", "--data={ws.data}", "--out={tmp}/s.safetensors",
        "--set=select.layers=[]"], 2, ["nothing to train: select.layers is []"], absent=["{tmp}/s.safetensors"]),
    Row("train-routers-only-frozen", T(*NEW, "--set=select.targets=[routers]", "--set=select.train_router=false"),
        2, ["nothing to train: select.targets is [routers] with select.train_router=false"], absent=["{tmp}/run"]),
    Row("train-embeddings-outside-layers",
        T(*NEW, "--set=select.targets=[embeddings,lm_head]", "--set=select.layers=[0]"), 2,
        ["nothing to train: select.targets ['embeddings', 'lm_head'] are outside the decoder layers"],
        absent=["{tmp}/run"]),
    Row("train-targets-the-model-lacks", T(*NEW, "--set=select.targets=[dense_mlp]"), 2,
        ["nothing to train: select.targets ['dense_mlp'] select no weight of the model at"],
        absent=["{tmp}/run"]),
]  # fmt: skip


test_fault = table_test(ROWS)


# ---- faults that are not one command line ------------------------------------------------------------------------


def test_a_set_back_to_the_original_value_resumes_and_config_yaml_states_the_run(ws, tmp_path, capsys):
    """config.yaml edited (reselect_every 10 -> 2): --set back to the recorded value is accepted (it was refused,
    compared with the edited file), and config.yaml then states the run again."""
    run = tmp_path / "run"
    shutil.copytree(ws.unfinished, run)
    setup = edit_config("select.reselect_every", "2")
    setup(type("ctx", (), {"run": run})(), None)
    assert main(["train", f"--resume={run}", "--set=select.reselect_every=10"]) == 0, capsys.readouterr().err
    assert "reselect_every: 10" in (run / "config.yaml").read_text()
    assert (run / "summary.json").exists()


def test_a_set_of_a_changeable_setting_is_recorded_with_the_checkpoint(ws, tmp_path, capsys):
    """--set optim.lr on resume: applied, and config.yaml states it, so a second resume without --set is not
    taken for an edit; the checkpoint records the same settings."""
    run = tmp_path / "run"
    shutil.copytree(ws.unfinished, run)
    assert main(["train", f"--resume={run}", "--set=optim.lr=0.02", "--set=schedule.max_steps=4"]) == 0
    assert "lr: 0.02" in (run / "config.yaml").read_text()
    state = json.loads((run / "checkpoints" / "step-00000004" / "state.json").read_text())
    assert state["run_config"]["optim"]["lr"] == 0.02
    assert main(["train", f"--resume={run}", "--set=schedule.max_steps=5"]) == 0, capsys.readouterr().err


def test_load_delta_validates_content_and_the_base_record(ws, tmp_path):
    from transformers import AutoModelForCausalLM

    from usaf.export.apply_delta import load_delta

    for how, says in (
        ("negative", "negative indices"),
        ("nan", "NaN/Inf"),
        ("stripped", "unchecked_base=True"),
    ):
        ctx = type("ctx", (), {"ws": ws, "tmp": tmp_path})()
        bad_delta(how)(ctx, None)
        model = AutoModelForCausalLM.from_pretrained(ws.base)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(UsafError, match=re.escape(says)):
            load_delta(model, tmp_path / "bad.safetensors", base_dir=ws.base if how == "stripped" else None)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing merged


SHORT = [*SET_ARGS, "--set=log.every_steps=1"]


def test_a_failure_after_the_first_step_keeps_the_run_folder(ws, tmp_path, monkeypatch, capsys):
    """The first checkpoint fails (a full disk) after step 1: the run's folder, metrics and selection stay (they
    were deleted because no checkpoint existed); a failure before the first step still leaves nothing."""
    import usaf.train.checkpoint

    def full(tensors, path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(usaf.train.checkpoint, "save_file", full)
    run = tmp_path / "run"
    args = train_args(ws, run, *SHORT, "--set=schedule.max_steps=2")
    assert main(args) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert (run / "metrics.jsonl").read_text().strip() and (run / "selection.safetensors").exists()
    monkeypatch.undo()
    # the folder is a dead start: a new start into it goes ahead
    assert main(args) == 0 and (run / "summary.json").exists()


def test_eight_bit_optimizer_checkpoints_and_resumes_exactly(ws, tmp_path, capsys):
    """optim.eight_bit=true (bitsandbytes' nested 8-bit state) crashed at the first checkpoint; now its state is
    saved flat and a resumed run ends with the same trained values as an uninterrupted one."""
    pytest.importorskip("bitsandbytes")
    sets = [*SET_ARGS, "--set=optim.eight_bit=true", "--set=select.reselect_every=0"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = [f"--model={ws.base}", f"--data={ws.data}", *sets]
    assert main(["train", *common, f"--out={straight}", "--set=schedule.max_steps=3"]) == 0, (
        capsys.readouterr().err
    )
    assert main(["train", *common, f"--out={resumed}", "--set=schedule.max_steps=2"]) == 0
    assert main(["train", f"--resume={resumed}", "--set=schedule.max_steps=3"]) == 0
    a = load_file(straight / "checkpoints" / "step-00000003" / "trainable.safetensors")
    b = load_file(resumed / "checkpoints" / "step-00000003" / "trainable.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_tied_embedding_model_trains_and_its_delta_applies(tmp_path, capsys):
    """tie_word_embeddings=true with the default targets (embeddings and lm_head: one weight) crashed in the
    output layer's forward; it trains, and its delta applies to the base with the tied weight changed once."""
    from usaf.testing.tiny import tiny_model
    from usaf.train.tokenizer import char_tokenizer

    tokenizer = char_tokenizer()
    model = tiny_model("qwen3_moe", vocab_size=len(tokenizer), tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    base = tmp_path / "tied"
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    data = write_copy_task(tmp_path / "train.jsonl", 40)
    run, delta, merged = tmp_path / "run", tmp_path / "d.safetensors", tmp_path / "merged"
    assert main(["train", f"--model={base}", f"--data={data}", f"--out={run}", *T()[1:]]) == 0, (
        capsys.readouterr().err
    )
    assert main(["export", str(run), f"--delta={delta}"]) == 0
    assert main(["apply", str(base), str(delta), str(merged)]) == 0, capsys.readouterr().err
    changes = load_file(delta)
    rows = [k for k in changes if k.startswith("model.embed_tokens.weight:")]
    assert rows and not any(k.startswith("lm_head.") for k in changes)
    out = load_file(merged / "model.safetensors")
    index = changes["model.embed_tokens.weight:flat_indices"].long()
    values = changes["model.embed_tokens.weight:values"]
    assert torch.equal(
        out["model.embed_tokens.weight"].view(-1)[index], values.to(out["model.embed_tokens.weight"].dtype)
    )
