"""The command line itself: a run stopped before its end exits non-zero (issue 12, item 10), an unknown option
is named with its command, and `python -m usaf` runs it."""

from pathlib import Path

import pytest
from helpers import FAST_RUN, train_cli_args

from usaf.cli import main

BASE = FAST_RUN


def cli_args(workspace, out: Path, *sets):
    return train_cli_args(workspace, out, BASE, *sets)


# ---------------------------------------------------------------------------------------------------------
# item 10: a run stopped before its end exits non-zero
# ---------------------------------------------------------------------------------------------------------


def test_an_interrupt_outside_the_loop_exits_130_without_a_traceback(
    workspace, tmp_path, monkeypatch, capsys
):
    import usaf.train.session

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # e.g. Ctrl-C while the model loads, or a second Ctrl-C in the loop

    monkeypatch.setattr(usaf.train.session, "load_model", interrupted)
    assert main(cli_args(workspace, tmp_path / "run")) == 130
    err = capsys.readouterr().err
    assert err.startswith("usaf: interrupted") and err.count("\n") == 1 and "Traceback" not in err


def test_a_router_collapse_stop_exits_non_zero(workspace, tmp_path, capsys):
    run = tmp_path / "run"
    sets = [
        "select.targets=[experts,routers]",
        "router.guard_action=stop",
        "router.guard_min_entropy=1",  # every layer's loads fall below a perfect entropy: the guard trips
        "router.health_every_steps=1",
        "router.health_window_steps=1",
        "schedule.max_steps=5",
    ]
    assert main(cli_args(workspace, run, *sets)) == 1
    assert "router collapse guard" in capsys.readouterr().out
    assert not (run / "summary.json").exists() and (run / "checkpoints" / "step-00000001").is_dir()


def test_an_unknown_option_is_named_with_its_command(capsys):
    from usaf.cli import main

    assert main(["plan", "--model", "qwen3-30b-a3b", "--bogus"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "usaf: error: usaf plan: unrecognized arguments: --bogus; see `usaf plan --help`."


@pytest.mark.slow
def test_python_dash_m_usaf_runs_the_cli():
    import subprocess
    import sys

    import usaf

    done = subprocess.run(
        [sys.executable, "-m", "usaf", "--version"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == f"usaf {usaf.__version__}", done.stderr


# ---------------------------------------------------------------------------------------------------------
# one module per command (usaf.commands' protocol)
# ---------------------------------------------------------------------------------------------------------


def test_every_command_is_one_module_whose_docstring_is_its_help(capsys):
    import importlib
    import inspect

    import usaf.commands
    from usaf.cli import COMMANDS, build_parser
    from usaf.commands import command_texts

    folder = Path(usaf.commands.__file__).parent
    assert sorted(COMMANDS) == sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")
    listed = build_parser().format_help()  # the commands in COMMANDS' order, each with its help line
    places = [listed.index(f"\n    {name} ") for name in COMMANDS]
    assert places == sorted(places)
    for name in COMMANDS:
        module = importlib.import_module(f"usaf.commands.{name}")
        assert list(inspect.signature(module.add_arguments).parameters) == ["parser"], name
        assert list(inspect.signature(module.run).parameters) == ["args"], name
        help_line, description = command_texts(module)
        assert f" {name} {help_line} " in " ".join(listed.split()), name
        with pytest.raises(SystemExit):
            main([name, "--help"])
        shown = " ".join(capsys.readouterr().out.split())
        assert shown.startswith(f"usage: usaf {name} [-h]")
        assert description is None or description in shown, name


def test_a_docstring_gives_the_help_line_and_the_description():
    import types

    from usaf.commands import command_texts

    module = types.ModuleType(
        "usaf.commands.x", "one line\n    of help\n\nThe description,\nreflowed.\n\nMore.\n"
    )
    assert command_texts(module) == ("one line of help", "The description, reflowed. More.")
    assert command_texts(types.ModuleType("usaf.commands.y", "just help")) == ("just help", None)


# ---------------------------------------------------------------------------------------------------------
# a fast start: the command line is read before torch, transformers and datasets are imported
# ---------------------------------------------------------------------------------------------------------


def imported_by_the_command(*argv: str) -> set[str]:
    """The modules `python -m usaf ARGV` imports (the command's own process, as a user starts it)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "usaf", *argv], capture_output=True, text=True, timeout=120
    )
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("import time:")]
    return {line.rsplit("|", 1)[1].strip() for line in lines}


@pytest.mark.parametrize(
    "argv", [["--help"], ["--version"], ["train", "--no-such-flag"], ["bogus"], ["train", "--help"]]
)
def test_help_version_and_argument_errors_import_no_heavy_library(argv):
    modules = imported_by_the_command(*argv)
    assert "usaf.cli" in modules
    assert not {"torch", "transformers", "datasets"} & modules


@pytest.mark.slow
def test_a_command_in_its_own_process_knows_every_builtin_plugin():
    """The API (and with it every built-in plug-in) is imported when the command runs, as `import usaf` does."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "usaf", "train", "--list-options"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = {line.split(" = ")[0]: line for line in done.stdout.splitlines()}
    assert "(one of uniform, routing, gradient, file)" in lines["select.strategy"]
    assert "(one of auto, random, magnitude, gradient)" in lines["select.selection"]
