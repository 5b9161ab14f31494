"""Learning-rate schedules: usaf's cosine as it always was, transformers' get_scheduler under its own names, the
warm-up as a ratio, and a warm-up that cannot end before the run does said on the first lines."""

import json
import math

import pytest
import torch
from helpers import FAST_RUN, make_model_dir, write_copy_task
from transformers import get_scheduler

from usaf.cli import main
from usaf.config import SCHEDULES, RunConfig
from usaf.train.optim import build_scheduler, peak_lr, warmup_steps


def rates(config: RunConfig) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak_lr(config))
    scheduler = build_scheduler(optimizer, config)
    out = []
    for _ in range(config.schedule.max_steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def config_with(**schedule) -> RunConfig:
    return RunConfig.load(None, [f"schedule.{k}={v}" for k, v in schedule.items()])


def test_usafs_cosine_is_unchanged():
    config = config_with(max_steps=20, warmup_steps=4, min_lr_ratio=0.1)
    lr = peak_lr(config)
    want = [
        lr * (s + 1) / 5 if s < 4 else lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 4) / 16)))
        for s in range(20)
    ]
    assert rates(config) == pytest.approx(want, rel=1e-12)


def test_usafs_cosine_is_transformers_cosine_with_min_lr_after_its_warmup():
    config = config_with(max_steps=40, warmup_steps=6, min_lr_ratio=0.15)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak_lr(config))
    reference = get_scheduler(
        "cosine_with_min_lr", optimizer, 6, 40, scheduler_specific_kwargs={"min_lr_rate": 0.15}
    )
    want = [peak_lr(config) * reference.lr_lambdas[0](s) for s in range(6, 40)]
    assert rates(config)[6:] == want  # bit for bit
    assert rates(config)[0] == peak_lr(config) / 7  # usaf's warm-up: the first step trains


@pytest.mark.parametrize("name", [n for n in SCHEDULES if n != "cosine"])
def test_transformers_schedules_are_get_scheduler(name):
    config = config_with(name=name, max_steps=30, warmup_steps=5, min_lr_ratio=0.2, decay_ratio=0.3)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak_lr(config))
    extra = {
        "cosine_with_min_lr": {"min_lr_rate": 0.2},
        "warmup_stable_decay": {"num_decay_steps": 9, "min_lr_ratio": 0.2},
    }.get(name)
    reference = get_scheduler(name, optimizer, 5, 30, scheduler_specific_kwargs=extra)
    want = [peak_lr(config) * f(s) for s in range(30) for f in reference.lr_lambdas]
    got = rates(config)
    assert got == pytest.approx(want, rel=1e-12)
    assert max(got) == pytest.approx(peak_lr(config))  # the peak is reached


def test_warmup_ratio_replaces_warmup_steps():
    assert warmup_steps(config_with(max_steps=95, warmup_steps=3, warmup_ratio=0.1)) == 10
    assert warmup_steps(config_with(max_steps=95, warmup_steps=3)) == 3


def test_a_warmup_longer_than_the_run_is_said(tmp_path, capsys):
    model, data = make_model_dir(tmp_path / "m"), write_copy_task(tmp_path / "d.jsonl", 24)
    sets = [f"--set={s}" for s in [*FAST_RUN, "schedule.max_steps=3", "schedule.warmup_steps=5"]]
    assert main(["train", f"--model={model}", f"--data={data}", f"--out={tmp_path / 'run'}", *sets]) == 0
    out = capsys.readouterr().out
    assert "note: the warm-up (5 steps) does not end before schedule.max_steps=3" in out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in rows if "lr" in r]
    assert lrs and max(lrs) < peak_lr(RunConfig())  # never reached optim.lr, as said


def test_an_unknown_schedule_is_refused(capsys):
    assert main(["train", "--print-config", "--set=schedule.name=triangular"]) == 2
    err = capsys.readouterr().err
    assert "schedule.name" in err and "cosine" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_epochs_set_the_steps_from_the_data_and_a_resume_finds_the_same(tmp_path, capsys):
    import re

    import yaml

    model, data = make_model_dir(tmp_path / "m"), write_copy_task(tmp_path / "d.jsonl", 40)
    run = tmp_path / "run"
    sets = [
        f"--set={s}" for s in [*FAST_RUN, "schedule.epochs=1.5", "schedule.grad_accum=2", "data.pack=false"]
    ]
    assert main(["train", f"--model={model}", f"--data={data}", f"--out={run}", *sets]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    found = re.search(
        r" for (\d+) steps \(schedule.epochs=1.5: (\d+) batches of 4 an epoch, 2 a step\); ", first
    )
    assert found, first
    steps, batches = int(found.group(1)), int(found.group(2))
    assert batches == 10 and steps == math.ceil(
        1.5 * batches / 2
    )  # 38 records after the held-out 2, batches of 4
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == steps
    assert yaml.safe_load((run / "config.yaml").read_text())["schedule"]["max_steps"] == steps
    assert main(["train", f"--resume={run}"]) == 0
    assert f"is finished (step {steps} of schedule.max_steps={steps})" in capsys.readouterr().out
