"""The planner reads what an objective declares (usaf.registry.Objective: `pairs`, `reference_forward`), not its
name: a new objective is planned as it runs."""

import re

import pytest

from usaf.cli import main
from usaf.registry import OBJECTIVES
from usaf.train.objectives import NextToken


class Anchored(NextToken):
    """Next-token loss with a reference forward a step (e.g. a KL anchor to the base), on single rows."""

    name, pairs, reference_forward, default_lr = "anchored", False, True, 1e-2


@pytest.fixture
def anchored():
    OBJECTIVES.register(Anchored())
    yield
    OBJECTIVES.unregister(Anchored.name)


def _plan(tmp_path, capsys, objective: str) -> tuple[str, float]:
    config = tmp_path / f"{objective}.yaml"
    config.write_text(
        f"model:\n  path: olmoe-1b-7b\ndata:\n  batch_size: 4\ntrain:\n  objective: {objective}\n"
    )
    main(["plan", "--config", str(config), "--device", "h100"])
    out = capsys.readouterr().out
    settings = next(line for line in out.splitlines() if line.startswith("settings: "))
    tflop = float(re.search(r"^step ~ .*\(([\d.]+) TFLOP\)", out, re.M).group(1))
    return settings, tflop


def test_the_plan_reads_the_objectives_declared_pairs_and_reference_forward(tmp_path, capsys, anchored):
    sft, sft_tflop = _plan(tmp_path, capsys, "sft")
    dpo, _ = _plan(tmp_path, capsys, "dpo")
    new, new_tflop = _plan(tmp_path, capsys, "anchored")
    assert "x batch 4," in sft and not sft.endswith(")")
    assert "x batch 8," in dpo  # pairs: a chosen and a rejected row each
    assert dpo.endswith(
        ", dpo (batch counts the chosen and rejected rows; the reference forward is a fourth pass)"
    )
    assert "x batch 4," in new and new.endswith(", anchored (the reference forward is a fourth pass)")
    assert new_tflop > sft_tflop  # the fourth pass is counted
