"""Issue 12: bad options, bad config files and misused run folders get one clear line, and nothing is lost."""

import json
import os
import signal
import subprocess
import time
from dataclasses import fields
from pathlib import Path

import pytest
from helpers import FAST_RUN, make_model_dir, start_usaf, wait_for_rows, write_copy_task

from usaf.cli import main
from usaf.config import SECTIONS, DataSection, ModelSection, OptimSection, RunConfig, UsafConfig
from usaf.errors import UsafError
from usaf.train.loop import train

BASE = FAST_RUN


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("hardening")
    make_model_dir(root / "model")
    write_copy_task(root / "train.jsonl", 60)
    return root


def config_for(workspace, *extra):
    return RunConfig.load(
        None, [f"model.path={workspace / 'model'}", f"data.train={workspace / 'train.jsonl'}", *BASE, *extra]
    )


def cli_args(workspace, out: Path, *sets):
    args = ["train", f"--model={workspace / 'model'}", f"--data={workspace / 'train.jsonl'}", f"--out={out}"]
    return [*args, *(f"--set={s}" for s in [*BASE, *sets])]


# ---------------------------------------------------------------------------------------------------------
# item 2: every numeric option's range is checked when the config is read
# ---------------------------------------------------------------------------------------------------------

OUT_OF_RANGE = [
    ("optim.lr=0", "optim.lr must be > 0, got 0.0"),
    ("optim.lr=-1e-3", "optim.lr must be > 0, got -0.001"),
    ("optim.lr=.nan", "optim.lr must be > 0, got nan"),
    ("optim.lr=.inf", "optim.lr must be > 0, got inf"),
    ("optim.beta1=1", "optim.beta1 must be in [0, 1), got 1.0"),
    ("optim.eps=0", "optim.eps must be > 0, got 0.0"),
    ("optim.clip_grad_norm=-1", "optim.clip_grad_norm must be >= 0, got -1.0"),
    ("schedule.grad_accum=0", "schedule.grad_accum must be >= 1, got 0"),
    ("schedule.max_steps=0", "schedule.max_steps must be >= 1, got 0"),
    ("schedule.warmup_steps=-2", "schedule.warmup_steps must be >= 0, got -2"),
    ("schedule.min_lr_ratio=1.5", "schedule.min_lr_ratio must be in [0, 1], got 1.5"),
    ("checkpoint.every_steps=-1", "checkpoint.every_steps must be >= 0, got -1"),
    ("checkpoint.keep_last=-1", "checkpoint.keep_last must be >= 0, got -1"),
    ("log.every_steps=-1", "log.every_steps must be >= 0, got -1"),
    ("log.eval_every_steps=-5", "log.eval_every_steps must be >= 0, got -5"),
    ("data.batch_size=0", "data.batch_size must be >= 1, got 0"),
    ("data.max_seq_len=1", "data.max_seq_len must be >= 2, got 1"),
    ("data.eval_fraction=1", "data.eval_fraction must be in [0, 1), got 1.0"),
    ("data.eval_batches=-1", "data.eval_batches must be >= 0, got -1"),
    ("router.health_window_steps=0", "router.health_window_steps must be >= 1, got 0"),
    ("router.guard_max_dead_share=2", "router.guard_max_dead_share must be in [0, 1], got 2.0"),
    ("router.lr_multiplier=-0.1", "router.lr_multiplier must be >= 0, got -0.1"),
    ("train.logits_chunk_tokens=0", "train.logits_chunk_tokens must be >= 1, got 0"),
    ("train.max_bad_steps=-1", "train.max_bad_steps must be >= 0, got -1"),
    ("model.cache_mb=-1", "model.cache_mb must be >= 0, got -1"),
]


@pytest.mark.parametrize("override, message", OUT_OF_RANGE)
def test_an_option_out_of_range_is_refused_when_read(override, message):
    with pytest.raises(UsafError) as err:
        RunConfig.load(None, [override])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_an_option_out_of_range_in_a_file_names_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  lr: -0.01\n")
    with pytest.raises(UsafError, match=r"run\.yaml: optim\.lr must be > 0, got -0\.01"):
        RunConfig.load(str(path))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: OptimSection(lr=0), "optim.lr must be > 0, got 0.0"),
        (lambda: ModelSection(quant="gptq"), "model.quant = 'gptq' is not allowed"),
        (lambda: DataSection(batch_size="four"), "data.batch_size must be an integer, got 'four'"),
        (
            lambda: UsafConfig(density_ratios={"attention": -1}),
            "UsafConfig.density_ratios['attention'] must be > 0",
        ),
        (lambda: UsafConfig(targets=[]), "UsafConfig.targets must be a non-empty list of"),
    ],
)
def test_every_section_made_in_python_is_checked_when_made(make, message):
    """Each section checks its options' declarations (type, choices, range) on construction, not first at
    `RunConfig.check()`; a file's values get the same checks under its YAML keys."""
    with pytest.raises(UsafError) as err:
        make()
    assert message in str(err.value) and "\n" not in str(err.value)


def test_train_router_is_a_deprecated_alias_of_routers_in_targets(tmp_path):
    """A 0.1.x config's `train_router: false` takes routers out of `targets`, the one place that says what trains."""
    path = tmp_path / "old.yaml"
    path.write_text("select:\n  targets: [experts, routers]\n  train_router: false\n")
    select = RunConfig.load(str(path)).select
    assert select.targets == ["experts"] and not select.trains_routers
    assert UsafConfig(targets=["routers", "experts"]).trains_routers  # train_router's default changes nothing
    assert RunConfig.load(str(path), ["select.train_router=true"]).select.targets == ["experts", "routers"]


def test_the_cli_refuses_a_bad_range_before_making_the_run_folder(workspace, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(cli_args(workspace, out, "schedule.grad_accum=0")) == 2
    err = capsys.readouterr().err
    assert "schedule.grad_accum must be >= 1, got 0" in err and "Traceback" not in err
    assert not out.exists()


def test_a_config_changed_in_python_is_checked_by_train(workspace, tmp_path):
    config = config_for(workspace)
    config.optim.lr = -1.0
    with pytest.raises(UsafError, match=r"optim\.lr must be > 0, got -1\.0"):
        train(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_every_numeric_run_option_has_a_range_shown_by_list_options(capsys):
    assert main(["train", "--list-options"]) == 0
    listing = capsys.readouterr().out.splitlines()
    for name, section_cls in SECTIONS.items():
        for f in fields(section_cls):
            default = f.default
            if isinstance(default, (int, float)) and not isinstance(default, bool):
                assert f.metadata.get("bounds"), f"{name}.{f.name} has no range"
                line = next(row for row in listing if row.startswith(f"{name}.{f.name} = "))
                assert "(allowed: " in line, line
    assert any(row.startswith("optim.lr = ") and row.endswith("(allowed: > 0)") for row in listing)
    assert any(row.startswith("checkpoint.every_steps = ") and "0: off" in row for row in listing)


def test_every_run_option_has_help_text_and_lists_its_choices(capsys):
    assert main(["train", "--list-options"]) == 0
    listing = capsys.readouterr().out.splitlines()
    for name, section_cls in SECTIONS.items():
        for f in fields(section_cls):
            line = next(row for row in listing if row.startswith(f"{name}.{f.name} = "))
            assert len(f.metadata.get("doc") or "") > 10, f"{name}.{f.name} has no help text"
            assert f.metadata["doc"] in line, line
            if f.metadata.get("choices"):
                shown = ", ".join(
                    str(c).lower() if isinstance(c, bool) else str(c) for c in f.metadata["choices"]
                )
                assert f"(one of {shown})" in line, line
    seed = next(row for row in listing if row.startswith("train.seed = "))
    assert "data order" in seed and "select.seed" in seed, seed


def test_zero_means_off_for_checkpoint_and_log_intervals(workspace, tmp_path):
    run = tmp_path / "run"
    summary = train(
        config_for(workspace, "schedule.max_steps=3", "checkpoint.every_steps=0", "log.every_steps=0"), run
    )
    assert summary["steps"] == 3
    # no periodic checkpoints, but the final one is written
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-00000003"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows and all("loss" not in r for r in rows)  # only the evaluation before training
    assert all(any(k.startswith("eval/") for k in r) for r in rows)


# ---------------------------------------------------------------------------------------------------------
# item 3: a config file that is not a mapping of sections
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, kind",
    [("- optim\n- lr: 3\n", "list"), ("[]\n", "list"), ("just words\n", "str"), ("42\n", "int")],
)
def test_a_config_file_that_is_not_a_mapping_is_named(workspace, tmp_path, capsys, text, kind):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    out = tmp_path / "run"
    # --model and --data become overrides: they must not be pushed into a list
    assert main([*cli_args(workspace, out), f"--config={path}"]) == 2
    err = capsys.readouterr().err
    assert f"Config file {path}: the top level is a {kind}, not a mapping of sections" in err
    assert "Traceback" not in err and err.count("\n") == 1
    assert not out.exists()
    with pytest.raises(UsafError, match="not a mapping of sections"):
        RunConfig.load(str(path))  # without overrides too


def test_a_section_that_is_not_a_mapping_is_named(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optim: []\n")
    with pytest.raises(UsafError, match=r"run\.yaml: optim must be a mapping of keys to values"):
        RunConfig.load(str(path))
    path.write_text("optim:\n")  # an empty section: its defaults
    assert RunConfig.load(str(path), ["optim.lr=0.5"]).optim.lr == 0.5


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
# item 10: a run stopped before its end exits non-zero
# ---------------------------------------------------------------------------------------------------------


def test_an_interrupt_outside_the_loop_exits_130_without_a_traceback(
    workspace, tmp_path, monkeypatch, capsys
):
    import usaf.train.session

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # e.g. Ctrl-C while the model loads, or a second Ctrl-C in the loop

    monkeypatch.setattr(usaf.train.session, "load_model", interrupted)
    assert main(cli_args(workspace, tmp_path / "run")) == 130
    err = capsys.readouterr().err
    assert err.startswith("usaf: interrupted") and err.count("\n") == 1 and "Traceback" not in err


def test_a_router_collapse_stop_exits_non_zero(workspace, tmp_path, capsys):
    run = tmp_path / "run"
    sets = [
        "select.targets=[experts,routers]",
        "router.guard_action=stop",
        "router.guard_min_entropy=1",  # every layer's loads fall below a perfect entropy: the guard trips
        "router.health_every_steps=1",
        "router.health_window_steps=1",
        "schedule.max_steps=5",
    ]
    assert main(cli_args(workspace, run, *sets)) == 1
    assert "router collapse guard" in capsys.readouterr().out
    assert not (run / "summary.json").exists() and (run / "checkpoints" / "step-00000001").is_dir()


# ---------------------------------------------------------------------------------------------------------
# item 7: one writer per run folder
# ---------------------------------------------------------------------------------------------------------


def _start_training(workspace, run: Path, *sets) -> subprocess.Popen:
    return start_usaf(cli_args(workspace, run, "schedule.max_steps=100000", *sets))


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


def test_a_prefix_cache_over_no_frozen_layer_is_a_usaf_error():
    from usaf.testing.tiny import tiny_model
    from usaf.train.prefix_cache import FrozenPrefixCache

    with pytest.raises(UsafError, match=r"select\.layers"):
        FrozenPrefixCache(tiny_model("qwen3_moe"), 0, "ram")
