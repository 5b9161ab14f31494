"""A run names its card (train.card): usaf train plans its autos against it, usaf plan needs no flag for it, and
step times are the card's own (or none); the expert cache (model.cache_mb) is in the ledger and the streaming."""

import re

import pytest
import torch

from usaf import planner
from usaf.cli import main
from usaf.config import RunConfig
from usaf.train.memory_plan import run_card

GiB = 1 << 30


def test_a_named_card_is_the_budget_usaf_train_plans_against():
    cpu = torch.device("cpu")
    card = run_card(RunConfig.load(None, ["train.card=rtx-4090"]), cpu)
    assert card.device == planner.DEVICES["rtx-4090"] and card.budget == 24 * GiB
    assert card.where == "24.00 GB (train.card=rtx-4090)" and card.memory == (24 * GiB, None)
    limited = run_card(RunConfig.load(None, ["train.card=rtx-4090", "train.memory_limit=20GB"]), cpu)
    assert limited.budget == limited.device.memory == 20 * GiB and "(train.memory_limit)" in limited.where
    assert limited.device.tflops == planner.DEVICES["rtx-4090"].tflops  # the card's own figures still
    assert run_card(RunConfig(), cpu).device.name == "cpu"  # no card: the device the run computes on


def _plan(capsys, *args) -> str:
    main(["plan", "--model", "qwen3-30b-a3b", "--quant", "nf4", "--ram", "64GB", *args])
    return capsys.readouterr().out


def test_step_times_are_quoted_for_the_card_given_or_not_at_all(capsys):
    out = _plan(capsys, "--vram", "20GB")  # no card of that memory: no other card's figures
    assert "step ~" not in out and "on rtx-3060-12gb" not in out
    assert re.search(r"^step time: no speed figures for a 20\.00 GB GPU \([\d.]+ TFLOP a step\)", out, re.M)
    assert "  card:      a 20.00 GB GPU, budget 20.00 GB (--vram); no speed figures" in out
    named = _plan(capsys, "--device", "rtx-4090")
    assert re.search(r"^step ~ [\d.]+ s on rtx-4090: ", named, re.M)


@pytest.mark.parametrize("residency", ["host", "mmap"])
def test_the_expert_cache_is_on_the_device_and_not_streamed_again(residency):
    shape = planner.model_shape(planner.load_model_config("qwen3-30b-a3b")[1], "qwen3-30b-a3b")
    gpu = planner.DEVICES["rtx-4090"]
    settings = planner.PlanSettings(seq=2048, batch=1, quant="nf4", residency=residency)
    plain = planner.plan(shape, settings, gpu, ram=64 * GiB)
    cached = planner.plan(shape, settings.replace(cache_mb=4096), gpu, ram=64 * GiB)
    lines = {line.name: line for line in cached.lines}
    assert lines["expert cache"].device == 4 * GiB and "expert cache" not in {x.name for x in plain.lines}
    assert cached.device_peak == pytest.approx(plain.device_peak + 4 * GiB, rel=0.01)
    experts = sum(
        line.device + line.host for line in plain.lines if line.name.startswith(("frozen", "quant"))
    )
    if residency == "host":  # a memory map's experts are read from the page cache or disk, not held
        assert cached.step.streaming_s == pytest.approx(plain.step.streaming_s * (1 - 4 * GiB / experts))
    assert cached.step.streaming_s < plain.step.streaming_s
    on_device = planner.plan(shape, settings.replace(residency="device", cache_mb=4096), gpu, ram=64 * GiB)
    assert "expert cache" not in {x.name for x in on_device.lines}  # resident experts need no cache
