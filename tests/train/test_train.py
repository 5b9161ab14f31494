"""`usaf train` end to end: it learns, it resumes exactly after SIGKILL, it refuses what it must refuse."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import copy_task_workspace, losses, make_model_dir, run_killed, train_config, write_copy_task
from safetensors.torch import load_file

from usaf.cli import main
from usaf.config import RunConfig
from usaf.errors import UsafError
from usaf.train.loop import train
from usaf.train.session import PACKING_OFF

BASE = [
    "data.max_seq_len=48",
    "data.batch_size=4",
    "select.density=0.1",
    "optim.lr=0.01",
    "log.progress=false",
    "log.tensorboard=false",
    "schedule.warmup_steps=2",
]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return copy_task_workspace(tmp_path_factory.mktemp("train"), records=160)


def config_for(workspace, *extra):
    return train_config(workspace, BASE, *extra)


def test_training_lowers_eval_loss(workspace, tmp_path):
    summary = train(config_for(workspace, "schedule.max_steps=25"), tmp_path / "run")
    assert summary["steps"] == 25
    assert summary["eval_loss_after"] < summary["eval_loss_before"] - 0.05
    assert (tmp_path / "run" / "summary.json").exists()
    assert summary["trained_expert_entries"] > 0 and summary["skipped_steps"] == 0


@pytest.mark.parametrize(
    "kill_at, extra",
    [
        (10, ["checkpoint.every_steps=10"]),
        # data-driven selection, and a kill inside a reselection's gradient-probe window (steps 11-12)
        (
            11,
            [
                "checkpoint.every_steps=11",
                "select.strategy=routing",
                "select.selection=gradient",
                "select.reselect_every=4",
            ],
        ),
        # a schedule of transformers' get_scheduler, its warm-up as a ratio: its step count is what resumes
        (
            9,
            [
                "checkpoint.every_steps=9",
                "schedule.name=warmup_stable_decay",
                "schedule.warmup_ratio=0.2",
                "schedule.decay_ratio=0.5",
            ],
        ),
        # fp16 autocast with dynamic loss scaling: the scale is part of what resumes
        (10, ["checkpoint.every_steps=10", "train.precision=fp16"]),
        # entries in every native target, chosen by gradient, reselected (killed inside a probe window)
        (
            11,
            [
                "checkpoint.every_steps=11",
                "select.targets=[experts,routers,attention,dense_mlp,norms,embeddings,lm_head]",
                "select.selection=gradient",
                "select.reselect_every=4",
            ],
        ),
    ],
)
@pytest.mark.slow
def test_resume_after_sigkill_is_exact(workspace, tmp_path, kill_at, extra):
    args = [f"--model={workspace / 'model'}", f"--data={workspace / 'train.jsonl'}"]
    sets = [f"--set={s}" for s in [*BASE, "schedule.max_steps=20", "train.seed=3", *extra]]
    assert main(["train", *args, f"--out={tmp_path / 'straight'}", *sets]) == 0

    killed = run_killed(["train", *args, f"--out={tmp_path / 'killed'}", *sets], kill_at)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not (tmp_path / "killed" / "checkpoints" / "step-00000020").exists()
    assert main(["train", f"--resume={tmp_path / 'killed'}"]) == 0

    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "killed")
    assert sorted(resumed) == list(range(1, 21))
    assert all(straight[s] == resumed[s] for s in range(1, 21)), (straight, resumed)
    a = load_file(str(tmp_path / "straight" / "checkpoints" / "step-00000020" / "trainable.safetensors"))
    b = load_file(str(tmp_path / "killed" / "checkpoints" / "step-00000020" / "trainable.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _complete_lines(path: Path) -> int:
    return path.read_text().count("\n") if path.exists() else 0


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_with_a_checkpoint_that_resumes(workspace, tmp_path, sig):
    run = tmp_path / "run"
    sets = [f"--set={s}" for s in [*BASE, "schedule.max_steps=100000", "checkpoint.every_steps=100000"]]
    args = [f"--model={workspace / 'model'}", f"--data={workspace / 'train.jsonl'}", f"--out={run}", *sets]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from usaf.cli import main; sys.exit(main(sys.argv[1:]))",
            "train",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    deadline = time.monotonic() + 120
    while _complete_lines(run / "metrics.jsonl") < 3:  # a few steps done, then the signal
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err[-2000:]  # stopped, not finished: non-zero
    stopped_at = max(losses(run))
    checkpoints = sorted((run / "checkpoints").iterdir())
    assert [c.name for c in checkpoints] == [f"step-{stopped_at:08d}"]  # written on the signal, at its step
    assert f"Resume with: usaf train --resume {run}" in out + err
    assert main(["train", f"--resume={run}", f"--set=schedule.max_steps={stopped_at + 2}"]) == 0
    assert sorted(losses(run)) == list(range(1, stopped_at + 3))


def test_resume_refuses_incompatible_config_and_other_base(workspace, tmp_path):
    run = tmp_path / "run"
    train(config_for(workspace, "schedule.max_steps=2", "checkpoint.every_steps=1"), run)
    with pytest.raises(UsafError, match=r"'select\.density' differs"):
        train(config_for(workspace, "schedule.max_steps=4", "select.density=0.2"), run, resume=True)
    other = make_model_dir(tmp_path / "other", seed=7)
    with pytest.raises(UsafError, match="is not the base the run started from"):
        moved = RunConfig.load(str(run / "config.yaml"), [f"model.path={other}", "schedule.max_steps=4"])
        # same settings, other weights behind the path (as --set model.path gives); a finished run would say so
        # before loading anything
        saved = RunConfig.load(str(run / "config.yaml")).replace(
            {"model.path": moved.model.path, "schedule.max_steps": 4}
        )
        train(saved, run, resume=True)
    with pytest.raises(UsafError, match="already holds a run"):
        train(config_for(workspace, "schedule.max_steps=2"), run)


def test_fp16_trains_with_one_loss_scaling(workspace, tmp_path):
    """fp16 autocast: the loss is scaled once and the gradients unscaled once, so steps are taken (a second,
    double scaling would overflow every step and skip them all) and the loss goes down."""
    summary = train(config_for(workspace, "schedule.max_steps=25", "train.precision=fp16"), tmp_path / "run")
    assert summary["steps"] == 25 and summary["skipped_steps"] == 0
    assert summary["fp16_overflow_steps"] < 25
    assert summary["eval_loss_after"] < summary["eval_loss_before"] - 0.05
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    scales = [r["loss_scale"] for r in rows if "loss_scale" in r]
    assert len(scales) == 25 and all(0 < s <= 65536 for s in scales)


def test_prefix_cache_gives_equal_losses(workspace, tmp_path):
    common = ["schedule.max_steps=12", "select.layers=[1]", "data.batch_size=8", "train.recompute=false"]
    plain = train(config_for(workspace, *common), tmp_path / "plain")
    cached = train(config_for(workspace, *common, "train.prefix_cache=ram"), tmp_path / "cached")
    assert cached["prefix_cache_hits"] > 0
    a, b = losses(tmp_path / "plain"), losses(tmp_path / "cached")
    assert all(math.isclose(a[s], b[s], rel_tol=1e-5) for s in a), (a, b)
    assert plain["eval_loss_after"] == pytest.approx(cached["eval_loss_after"], rel=1e-5)


@pytest.mark.parametrize(
    "precision", ["none", "fp16"]
)  # fp16: a skipped step must still close the loss scaler
def test_nan_steps_are_skipped_then_the_run_stops(workspace, tmp_path, monkeypatch, precision):
    import usaf.train.objectives as train_module  # sft's loss

    real = train_module.causal_lm_loss
    calls = {"n": 0}

    def sometimes_nan(*args, **kwargs):
        calls["n"] += 1
        loss = real(*args, **kwargs)
        return loss * float("nan") if calls["n"] in (3, 5) or calls["n"] > 8 else loss

    monkeypatch.setattr(train_module, "causal_lm_loss", sometimes_nan)
    with pytest.raises(UsafError, match="NaN/Inf"):
        train(
            config_for(
                workspace,
                "schedule.max_steps=50",
                "train.max_bad_steps=3",
                "data.eval_fraction=0",
                f"train.precision={precision}",
            ),
            tmp_path / "run",
        )
    state = json.loads(
        sorted((tmp_path / "run" / "checkpoints").iterdir())[-1].joinpath("state.json").read_text()
    )
    assert state["bad_steps"] == 4 and state["step"] == 6


def test_cli_config_validation_and_print_config(workspace, capsys):
    assert (
        main(["train", "--model", "m", "--data", "d.jsonl", "--set", "optim.lr=3e-4", "--print-config"]) == 0
    )
    printed = capsys.readouterr().out
    assert "lr: 0.0003" in printed and "d.jsonl" in printed
    assert main(["train", "--model", "m", "--data", "d", "--set", "optim.lrr=1", "--out", "x"]) == 2
    assert "unknown key 'lrr'; did you mean 'lr'?" in capsys.readouterr().err
    assert main(["train", "--model", "m", "--data", "d", "--set", "model.quant=nf5", "--out", "x"]) == 2
    assert "allowed values: ['auto', 'none', 'nf4', 'int8', 'int4']" in capsys.readouterr().err
    assert main(["train", "--model", "m", "--data", "d", "--set", "model.cache_mb=-1", "--out", "x"]) == 2
    assert "model.cache_mb must be >= 0" in capsys.readouterr().err
    # several overrides after one --set, and --set repeated, alike
    assert (
        main(
            [
                "train",
                "--set",
                "optim.lr=2e-4",
                "data.batch_size=3",
                "--set",
                "optim.eps=1e-6",
                "--print-config",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "lr: 0.0002" in printed and "batch_size: 3" in printed and "eps: 1.0e-06" in printed


def test_packing_probe_detects_models_that_let_packed_documents_mix():
    from usaf.testing.tiny import tiny_model
    from usaf.train.session import packed_documents_are_isolated

    assert packed_documents_are_isolated(tiny_model("qwen3_moe"), torch.device("cpu"))
    assert not packed_documents_are_isolated(tiny_model("gpt_oss"), torch.device("cpu"))


def test_a_missing_model_directory_is_named_not_downloaded(tmp_path, monkeypatch):
    import huggingface_hub

    from usaf.train.session import check_model_path

    for missing in (tmp_path / "nowhere", "nowhere", "./models/x"):
        with pytest.raises(UsafError, match="no such model directory"):
            check_model_path(str(missing))
    check_model_path(str(tmp_path))  # a directory
    # a hub id in the local cache is left to the hub (one that is not: test_hardening's offline test)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: "/cache/config.json")
    check_model_path("Qwen/Qwen3-30B-A3B")


def test_router_health_after_resume_equals_an_uninterrupted_run(workspace, tmp_path, monkeypatch):
    """The health window spans the resume: the guard judges the same counts as in a straight run."""
    import usaf.train.checkpoint

    health = ["schedule.max_steps=8", "router.health_every_steps=2", "router.health_window_steps=4"]
    health.append("checkpoint.every_steps=4")

    def router_records(run_dir):
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["router/layers"] for r in rows if "router/layers" in r}

    train(config_for(workspace, *health), tmp_path / "straight")
    save = usaf.train.checkpoint.save

    def save_then_crash(run_dir, step, **kw):
        path = save(run_dir, step, **kw)
        if step == 4:
            raise RuntimeError("crash after the step-4 checkpoint")
        return path

    monkeypatch.setattr(usaf.train.checkpoint, "save", save_then_crash)
    with pytest.raises(RuntimeError, match="crash"):
        train(config_for(workspace, *health), tmp_path / "resumed")
    monkeypatch.undo()
    train(config_for(workspace, *health), tmp_path / "resumed", resume=True)
    straight, resumed = router_records(tmp_path / "straight"), router_records(tmp_path / "resumed")
    assert sorted(straight) == [2, 4, 6, 8] and sorted(resumed) == [2, 4, 6, 8]
    assert resumed[6] == straight[6] and resumed[8] == straight[8]  # windows of steps 3-6 and 5-8


def test_usaf_eval_of_a_gpt_oss_run_equals_the_runs_own_final_eval(tmp_path):
    """gpt-oss lets packed documents attend to each other: `usaf eval RUN` must unpack them as the run did."""
    from usaf.train.evaluate import evaluate_target

    make_model_dir(tmp_path / "model", family="gpt_oss")
    write_copy_task(tmp_path / "train.jsonl", 40)
    write_copy_task(tmp_path / "eval.jsonl", 12, seed=1)
    config = RunConfig.load(
        None,
        [
            f"model.path={tmp_path / 'model'}",
            f"data.train={tmp_path / 'train.jsonl'}",
            f"data.eval={tmp_path / 'eval.jsonl'}",
            *BASE,
            "schedule.max_steps=3",
        ],
    )
    summary = train(config, tmp_path / "run")
    evaluated = evaluate_target(str(tmp_path / "run"), [str(tmp_path / "eval.jsonl")], [])
    assert evaluated["notes"] == [PACKING_OFF]
    assert evaluated["loss"] == pytest.approx(summary["eval_loss_after"], rel=1e-6, abs=1e-6)


# ---- the loop's components: each decides its own cadence, and the loop holds no collective --------------------


def test_components_decide_their_own_cadence(tmp_path):
    from types import SimpleNamespace

    from usaf.train.checkpoint import Checkpointer
    from usaf.train.evaluate import Evaluator
    from usaf.train.metrics import MetricsLog, NullLog

    written = []
    checkpointer = Checkpointer(
        tmp_path, SimpleNamespace(every_steps=3, keep_last=1), lambda: written.append(1) or {}
    )
    assert [s for s in range(1, 10) if checkpointer.should_save(s)] == [3, 6, 9]
    never = Checkpointer(tmp_path, SimpleNamespace(every_steps=0, keep_last=1), dict)
    assert not any(never.should_save(s) for s in range(1, 10)) and never.save(4) is None and not written

    config = SimpleNamespace(log=SimpleNamespace(eval_every_steps=5))
    evaluator = Evaluator(None, object(), config, None, None)
    assert [s for s in range(1, 11) if evaluator.should_evaluate(s)] == [5, 10]
    assert not Evaluator(None, None, config, None, None).should_evaluate(5)  # no held-out data

    log = MetricsLog(tmp_path, 10, 0, progress=False, every_steps=0)
    assert not log.should_log(2, {"loss": 1.0}) and log.should_log(2, {"eval/loss": 1.0})
    log.close()
    assert NullLog(2).should_log(4, {}) and not NullLog(2).should_log(3, {})


def test_the_training_loop_holds_no_collective():
    """Every sum across ranks lives in the component that owns the state: TrainingRun calls no
    usaf.train.distributed function but the device choice of its setup."""
    import ast
    import inspect

    import usaf.train.loop as loop

    tree = ast.parse(inspect.getsource(loop.TrainingRun))
    calls = [
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "distributed"
    ]
    assert calls == ["local_device"]


def test_a_prefix_cache_over_no_frozen_layer_is_a_usaf_error():
    from usaf.testing.tiny import tiny_model
    from usaf.train.prefix_cache import FrozenPrefixCache

    with pytest.raises(UsafError, match=r"select\.layers"):
        FrozenPrefixCache(tiny_model("qwen3_moe"), 0, "ram")
