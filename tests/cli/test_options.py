"""Run options and config files (issue 12, items 2 and 3): every option's range, type and choices are checked
when the config is read or a section is made, `--list-options` shows them with their help, and a config file
that is not a mapping of sections gets one clear line."""

import dataclasses
import json
import re
from dataclasses import fields
from pathlib import Path

import pytest
from helpers import (
    FAST_RUN,
    train_cli_args,
    train_config,
)

from usaf.cli import main
from usaf.config import SECTIONS, DataSection, ModelSection, OptimSection, RunConfig, UsafConfig
from usaf.errors import ConfigError, UsafError
from usaf.train.loop import train

BASE = FAST_RUN


def config_for(workspace, *extra):
    return train_config(workspace, BASE, *extra)


def cli_args(workspace, out: Path, *sets):
    return train_cli_args(workspace, out, BASE, *sets)


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


def test_a_config_changed_in_python_is_checked(workspace):
    """Sections are frozen: a change is a checked copy (`RunConfig.replace`), never a bad value set in place."""
    config = config_for(workspace)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.optim.lr = -1.0
    with pytest.raises(ConfigError, match=r"optim\.lr must be > 0, got -1\.0"):
        config.replace({"optim.lr": -1.0})
    assert config.optim.lr == "auto"  # unchanged: the objective's own rate


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


def test_a_saved_run_config_without_a_later_option_trains_as_the_run_began(tmp_path):
    """A run's config.yaml written before optim.decay_to_base existed (0.1.x) resumes without the decay that is
    now the default; a config the user writes gets today's defaults; --set still wins."""
    from usaf.config import EARLIER_DEFAULTS

    old_run = Path(__file__).parents[1] / "fixtures" / "compat-0.1" / "run" / "config.yaml"
    assert "decay_to_base" not in old_run.read_text()
    assert (
        RunConfig.load_saved(str(old_run)).optim.decay_to_base == EARLIER_DEFAULTS[("optim", "decay_to_base")]
    )
    assert RunConfig.load(str(old_run)).optim.decay_to_base == RunConfig().optim.decay_to_base > 0
    assert RunConfig.load_saved(str(old_run), ["optim.decay_to_base=2"]).optim.decay_to_base == 2.0
    today = tmp_path / "config.yaml"
    today.write_text(RunConfig.from_dict({"optim": {"decay_to_base": 3.0}}).to_yaml())
    assert RunConfig.load_saved(str(today)).optim.decay_to_base == 3.0


def test_density_is_a_share_or_auto():
    assert UsafConfig().density == "auto" and UsafConfig().fixed_density == 0.01
    assert UsafConfig(density="AUTO").density == "auto" and UsafConfig(density="0.02").density == 0.02
    for bad, says in (
        ("lots", "must be a number or auto"),
        (0, "must be in (0, 1]"),
        (True, "number or auto"),
    ):
        with pytest.raises(UsafError, match=re.escape(says)):
            UsafConfig(density=bad)
