"""examples/configs: every run configuration we advertise validates as `usaf train` reads it, names its card
(train.card), and fits it, as `usaf plan --config` says from the model's preset (no download) with no card flag;
the README's "What fits on which card" table says of each what its file and its plan say."""

import re
import shlex
from pathlib import Path

import pytest
import yaml

from usaf.cli import main

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.yaml"))
ADVERTISED = {  # the models the README promises (its "What fits on which card"), each with a configuration
    "Qwen/Qwen3-30B-A3B",
    "openai/gpt-oss-20b",
    "mistralai/Mixtral-8x7B-v0.1",
    "deepseek-ai/DeepSeek-V2-Lite",
    "allenai/OLMoE-1B-7B-0924",
}


def fits_table() -> dict[str, dict[str, str]]:
    """The README's "What fits on which card" rows by configuration file name, each cell by its column."""
    section = (ROOT / "README.md").read_text().split("## What fits on which card", 1)[1].split("\n## ", 1)[0]
    header, *rows = [x for x in section.splitlines() if x.startswith("| ")]  # (the rule starts "|---")
    columns = ["file", "model", "card", "quant", "residency", "density", "shape", "verdict"]
    assert len(header.split(" | ")) == len(columns), header
    table = {}
    for row in rows:
        cells = dict(zip(columns, (c.strip(" |`") for c in row.split(" | ")), strict=True))
        name = re.fullmatch(r"\[(\S+)\]\(examples/configs/(\S+)\)", cells["file"])
        assert name and name.group(1) == name.group(2), cells["file"]
        table[name.group(1)] = cells
    return table


def row_of(given: dict) -> dict[str, str]:
    """What the table's row must say of a configuration file."""
    model, data, schedule = given["model"], given["data"], given["schedule"]
    residency = model["residency"] + (f", cache {model['cache_mb']} MB" if model.get("cache_mb") else "")
    shape = f"{data['max_seq_len']} × {data['batch_size']} × {schedule['grad_accum']}"
    return {
        "model": model["path"], "card": given["train"]["card"], "quant": model["quant"],
        "residency": residency, "density": str(given["select"]["density"]), "shape": shape,
    }  # fmt: skip


def test_the_readme_table_is_the_configurations():
    table = fits_table()
    # a row for every file, none for a file that is not there
    assert sorted(table) == [p.name for p in CONFIGS]
    for path in CONFIGS:
        row = {k: v for k, v in table[path.name].items() if k not in ("file", "verdict")}
        assert row == row_of(yaml.safe_load(path.read_text())), path.name


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
    readme = fits_table()[path.name]["verdict"]  # what the README's table says of it
    assert verdict.startswith(f"verdict: {readme}"), (path.name, verdict)
    assert f"residency {given['model']['residency']}" in shown.split("verdict:")[0]
