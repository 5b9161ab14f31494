"""The config package's house (issue 36, settings by section): frozen sections changed only through a checked
copy (`RunConfig.replace`), `auto` a typed value that files still write as the word, each module of
`usaf.config` doing its one job, and no stage below `usaf.train` handed the whole run configuration."""

import ast
import copy
import dataclasses
import pickle
from pathlib import Path

import pytest
import yaml

from usaf.config import (
    AUTO,
    DEFAULT_DENSITY,
    DEFAULT_WORKSPACE_MB,
    SECTIONS,
    RunConfig,
    UsafConfig,
    YamlRefusedError,
    apply_override,
    check_option,
    describe,
    read_yaml,
)
from usaf.errors import ConfigError

SRC = Path(__file__).resolve().parents[2] / "src" / "usaf"
# the stages below usaf.train: each is handed the sections it reads, never the whole RunConfig
BELOW_TRAIN = (
    "base",
    "planner",
    "data",
    "selection",
    "engine",
    "store",
    "model",
    "quant",
    "io",
    "export",
    "generate",
)


@pytest.mark.parametrize("name", sorted(SECTIONS))
def test_every_section_is_frozen(name):
    config = RunConfig()
    section = getattr(config, name)
    first = dataclasses.fields(section)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(section, first, getattr(section, first))
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(config, name, section)


def test_replace_is_a_checked_copy_that_shares_what_it_does_not_change():
    config = RunConfig()
    changed = config.replace({"schedule.max_steps": 12, "model.path": "/abs/model", "select.density": "0.05"})
    assert (changed.schedule.max_steps, changed.model.path, changed.select.density) == (
        12,
        "/abs/model",
        0.05,
    )
    assert (config.schedule.max_steps, config.model.path, config.select.density) == (100, "", AUTO)
    assert changed.optim is config.optim  # untouched sections are shared, not copied
    with pytest.raises(ConfigError, match=r"schedule\.max_steps must be >= 1, got 0"):
        config.replace({"schedule.max_steps": 0})
    with pytest.raises(ConfigError, match=r"optim: unknown key 'learning_rate'; allowed keys: \["):
        config.replace({"optim.learning_rate": 1e-3})
    with pytest.raises(ConfigError, match=r"'steps' is not a section\.key option"):
        config.replace({"steps": 3})
    # the rules between options hold for a copy as for a file
    with pytest.raises(ConfigError, match=r"strategy='file' needs `file`"):
        config.replace({"select.strategy": "file"})


def test_auto_is_one_typed_value_written_as_the_word():
    config = RunConfig.load(None, ["select.density=auto", ("select.workspace_mb", "auto")])
    assert config.select.density is AUTO and config.select.workspace_mb is AUTO
    assert AUTO == "auto" and repr(AUTO) == "auto" and "auto" in {AUTO}
    assert copy.deepcopy(AUTO) is AUTO and pickle.loads(pickle.dumps(AUTO)) is AUTO
    assert (config.select.fixed_density, config.select.fixed_workspace_mb) == (
        DEFAULT_DENSITY,
        DEFAULT_WORKSPACE_MB,
    )
    text = config.to_yaml()
    assert "density: auto\n" in text and "workspace_mb: auto\n" in text
    again = RunConfig.from_dict(yaml.safe_load(text))
    assert again == config and again.select.density is AUTO
    numbers = config.replace({"select.density": 0.02, "select.workspace_mb": 512})
    assert RunConfig.from_dict(yaml.safe_load(numbers.to_yaml())) == numbers
    assert numbers.select.fixed_density == 0.02 and numbers.select.to_dict()["workspace_mb"] == 512
    with pytest.raises(ConfigError, match=r"select\.density must be a number or auto, got 'most'"):
        config.replace({"select.density": "most"})
    assert UsafConfig().to_dict()["density"] == "auto"  # a plain value, as a selection's summary records it


def test_the_yaml_loader_refuses_an_alias_bomb_as_a_config_error():
    levels = ["a: &a [" + ", ".join(["x"] * 10) + "]"]
    levels += [
        f"{b}: &{b} [" + ", ".join([f"*{a}"] * 10) + "]" for a, b in zip("abcde", "bcdef", strict=True)
    ]
    with pytest.raises(YamlRefusedError, match=r"bomb\.yaml:\d+: the document's aliases") as refused:
        read_yaml("\n".join(levels) + "\n", "bomb.yaml")
    assert isinstance(refused.value, ConfigError)


def test_overrides_values_and_listing_each_do_their_job():
    data: dict = {}
    apply_override(data, "select.layers=[0, 2]")  # the value read as YAML
    apply_override(data, ("data.train", "a #1.jsonl"))  # a typed pair is taken as it is
    assert data == {"select": {"layers": [0, 2]}, "data": {"train": "a #1.jsonl"}}
    with pytest.raises(ConfigError, match=r"expected section\.key=value"):
        apply_override(data, "lr=3e-4")
    spec = {f.name: f for f in dataclasses.fields(UsafConfig)}["density"]
    assert check_option(spec, " Auto ", "select.density") is AUTO
    assert check_option(spec, 1, "select.density") == 1.0
    with pytest.raises(ConfigError, match=r"select\.density must be in \(0, 1\], got 2\.0"):
        check_option(spec, 2, "select.density")
    listing = describe().splitlines()
    assert len(listing) == sum(len(dataclasses.fields(cls)) for cls in SECTIONS.values())
    assert any(line.startswith("select.density = 'auto'  ") for line in listing)  # as before AUTO


def run_config_imports(path: Path) -> list[int]:
    """Lines of `path` that import RunConfig (from usaf.config or any of its modules)."""
    tree = ast.parse(path.read_text(), str(path))
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and (node.module or "").startswith("usaf.config")
        and any(alias.name == "RunConfig" for alias in node.names)
    ]


def test_no_stage_below_train_imports_the_run_config(tmp_path):
    found = {
        str(path.relative_to(SRC)): lines
        for package in BELOW_TRAIN
        for path in sorted((SRC / package).rglob("*.py"))
        if (lines := run_config_imports(path))
    }
    assert found == {}
    # the check sees such an import
    (tmp_path / "stage.py").write_text("from usaf.config.run import RunConfig, SECTIONS\n")
    assert run_config_imports(tmp_path / "stage.py") == [1]
