"""One set of defaults: `usaf plan` and `usaf train` print the same effective settings for one configuration, every
auto resolved by the same functions against the same card."""

import pytest
from helpers import copy_task_workspace

from usaf.cli import main

# one step, no evaluation, no trackers: the first lines are what is compared
QUICK = ["schedule.max_steps=1", "data.eval_fraction=0", "log.progress=false", "log.report_to=[]"]


def effective_block(out: str) -> str:
    lines = out.splitlines()
    start = lines.index("effective settings:")
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("  ")), len(lines))
    return "\n".join(lines[start:end])


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return copy_task_workspace(tmp_path_factory.mktemp("agree"), records=40)


@pytest.mark.slow  # a training run each (about 10 s on a 2-core CPU)
@pytest.mark.parametrize(
    "settings",
    [
        [],  # usaf train's defaults, on this machine's device: density, workspace, recompute and precision auto
        ["train.card=rtx-3060-12gb", "model.dtype=float32", "train.memory_limit=1GB"],
    ],
    ids=["defaults", "a-card"],
)
def test_plan_and_train_print_the_same_effective_settings(workspace, tmp_path, capsys, settings):
    config = tmp_path / "run.yaml"
    lines = [f"model:\n  path: {workspace / 'model'}", f"data:\n  train: [{workspace / 'train.jsonl'}]"]
    config.write_text("\n".join(lines) + "\n")
    overrides = [x for s in [*QUICK, *settings] for x in ("--set", s)]
    plan_config = tmp_path / "plan.yaml"
    assert main(["train", "--config", str(config), *overrides, "--print-config"]) == 0
    plan_config.write_text(capsys.readouterr().out)  # the same configuration, as usaf plan reads it
    main(["plan", "--config", str(plan_config)])
    planned = effective_block(capsys.readouterr().out)
    assert main(["train", "--config", str(config), *overrides, "--out", str(tmp_path / "run")]) == 0
    trained = effective_block(capsys.readouterr().out)
    assert planned == trained
    if settings:
        assert "card:      rtx-3060-12gb, budget 1.00 GB (train.memory_limit)" in planned
        assert "fp32, precision none" in planned
