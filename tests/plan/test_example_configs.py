"""examples/configs: every run configuration we advertise validates as `usaf train` reads it, names its card
(train.card), and fits it, as `usaf plan --config` says from the model's preset (no download) with no card flag."""

import re
import shlex
from pathlib import Path

import pytest
import yaml

from usaf.cli import main

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "examples" / "configs").glob("*.yaml"))
ADVERTISED = {  # the models the README promises, each with a configuration
    "Qwen/Qwen3-30B-A3B",
    "openai/gpt-oss-20b",
    "mistralai/Mixtral-8x7B-v0.1",
    "deepseek-ai/DeepSeek-V2-Lite",
    "allenai/OLMoE-1B-7B-0924",
}


def check_line(path: Path) -> list[str]:
    """The `usaf plan` arguments of the header's "Check it" line, after the config's own path."""
    match = re.search(r"^# Check it: usaf plan --config (\S+) (.*)$", path.read_text(), re.M)
    assert match, f"{path.name} has no '# Check it: usaf plan --config ...' line"
    assert match.group(1) == f"examples/configs/{path.name}"
    return shlex.split(match.group(2))


def test_every_advertised_model_has_a_configuration():
    models = {yaml.safe_load(p.read_text())["model"]["path"] for p in CONFIGS}
    assert models >= ADVERTISED
    qwen = [p.name for p in CONFIGS if "qwen3-30b-a3b" in p.name]
    assert sorted(qwen) == ["qwen3-30b-a3b-12gb.yaml", "qwen3-30b-a3b-24gb.yaml"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_a_configuration_validates_and_fits_its_card(path, capsys):
    assert main(["train", "--config", str(path), "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    given = yaml.safe_load(path.read_text())
    for section, values in given.items():
        for key, value in values.items():
            assert printed[section][key] == value, f"{path.name}: {section}.{key}"
    args = check_line(path)
    assert "--device" not in args and "--vram" not in args  # the config names its card
    assert main(["plan", "--config", str(path), *args]) == 0
    shown = capsys.readouterr().out
    card = given["train"]["card"]
    assert f"  card:      {card}, budget " in shown and f" on {card}: compute " in shown  # its own figures
    verdict = next(line for line in shown.splitlines() if line.startswith("verdict:"))
    assert verdict.startswith(("verdict: fits on device", "verdict: needs host offload")), verdict
    assert f"residency {given['model']['residency']}" in shown.split("verdict:")[0]
