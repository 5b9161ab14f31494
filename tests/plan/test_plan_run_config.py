"""When `usaf plan` changes settings, it says them as a run configuration too: YAML that `usaf train --config`
reads as it is, and that plans to the same verdict."""

import re

import pytest

from usaf.cli import main


def suggested(out: str) -> str:
    block = out.split(
        "as a run configuration (save it as run.yaml, then usaf train --config run.yaml ...):\n", 1
    )
    assert len(block) == 2, out
    lines = []
    for line in block[1].splitlines():
        if not line.startswith("  "):
            break
        lines.append(line[2:])
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "args, code, verdict",
    [
        # too big: settings that fit (memory-mapped experts, a lower density)
        (["--model", "qwen3-30b-a3b", "--device", "rtx-3060-12gb", "--ram", "8GB", "--seq", "8192", "--batch", "4"],
         1, "needs host offload"),
        # host offload requested where the device holds it all: the on-device alternative
        (["--model", "olmoe-1b-7b", "--device", "rtx-3060-12gb", "--residency", "host", "--ram", "32GB"],
         0, "fits on device"),
    ],
)  # fmt: skip
def test_a_changed_plan_is_a_run_configuration_that_plans_to_fit(tmp_path, capsys, args, code, verdict):
    assert main(["plan", *args]) == code  # 1: what was asked does not fit
    yaml_text = suggested(capsys.readouterr().out)
    assert re.search(r"^model:\n  path: [\w.-]+/[\w.-]+$", yaml_text, re.M)  # a hub repository, not a preset
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(yaml_text)
    assert main(["train", "--config", str(run_yaml), "--print-config"]) == 0
    capsys.readouterr()
    device = args[args.index("--device") + 1]
    assert (
        main(["plan", "--config", str(run_yaml), "--device", device, "--ram", args[args.index("--ram") + 1]])
        == 0
    )
    assert f"verdict: {verdict}" in capsys.readouterr().out
