"""Each stage raises its own kind of UsafError (usaf.errors), for library callers who handle one kind; all are still
UsafErrors, so the command line's one line and exit code stay as they were."""

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import usaf
from usaf.cli import main
from usaf.commands.plan import memory_size
from usaf.config import RunConfig
from usaf.data.sources import open_source
from usaf.demo.task import task_accuracy
from usaf.errors import ConfigError, DataError, ModelError, RunStateError, UsafError
from usaf.export.delta import delta_from_run, read_delta
from usaf.files import STATE_FILE, STATE_SUM_FILE
from usaf.generate.prompts import read_prompts
from usaf.io.source import check_model_files
from usaf.kernels import use
from usaf.planner.shape import load_model_config
from usaf.quant import get_format
from usaf.registry import OBJECTIVES
from usaf.report import render_report
from usaf.selection.saved import load_selection
from usaf.train import checkpoint
from usaf.train.run_dir import check_resume_folder
from usaf.train.runtime import resolve_device
from usaf.train.session import check_model_path


def _bad_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[{"text": "x"},\n  oops]')
    return lambda: open_source(str(path))


def _bad_prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": ""}\n')
    return lambda: read_prompts(path)


def _no_config_json(tmp_path):
    return lambda: check_model_files(str(tmp_path))


def _not_a_delta(tmp_path):
    path = tmp_path / "delta.safetensors"
    path.write_bytes(b"\x00" * 16)
    return lambda: read_delta(path)


def _no_run(tmp_path):
    return lambda: delta_from_run(tmp_path / "no-run")


def _resume_not_a_run(tmp_path):
    return lambda: check_resume_folder(tmp_path)


def _damaged_checkpoint(tmp_path):
    (tmp_path / STATE_FILE).write_text("{}")
    (tmp_path / STATE_SUM_FILE).write_text("not a digest")
    return lambda: checkpoint.read_state(tmp_path)


def _no_metrics(tmp_path):
    return lambda: render_report(tmp_path)


def _bad_selection(tmp_path):
    return lambda: load_selection(tmp_path / "chosen.safetensors")


CASES = [
    (_bad_json, DataError, r"bad\.json:2: invalid JSON"),
    (_bad_prompts, DataError, "'prompt' must be non-empty text"),
    (_no_config_json, ModelError, "has no config.json"),
    (_not_a_delta, ModelError, "is corrupted: its safetensors header"),
    (_no_run, RunStateError, "does not exist; pass the --out folder"),
    (lambda tmp_path: lambda: get_format("fp3"), ConfigError, "Unknown quantization format 'fp3'"),
    (lambda tmp_path: lambda: use("fastest"), ConfigError, "train.kernels must be one of"),
    # run folders: not a run, a damaged checkpoint, a folder without the files a run writes
    (_resume_not_a_run, RunStateError, "no config.yaml there; is it a usaf run directory"),
    (_damaged_checkpoint, RunStateError, r"state\.sha256 is damaged \(not a sha256\)"),
    (_no_metrics, RunStateError, "has neither metrics.jsonl nor router_load.json"),
    # settings: a --set, a command's option, a plug-in's name, a device
    (lambda p: lambda: RunConfig.load(None, [("optim.lr", "fast")]), ConfigError, "optim.lr"),
    (lambda p: lambda: memory_size("12", "--ram"), ConfigError, "--ram 12 has no unit"),
    (lambda p: lambda: OBJECTIVES["ppo"], ConfigError, "No objective named 'ppo'"),
    (lambda p: lambda: OBJECTIVES.register(object()), ConfigError, "is not an objective: it lacks name"),
    (lambda p: lambda: resolve_device("abacus"), ConfigError, "is not a device torch knows"),
    # models: a missing folder, an unknown model to plan, a selection file that does not read
    (lambda p: lambda: check_model_path(str(p / "nope")), ModelError, "no such model directory"),
    (lambda p: lambda: load_model_config("no-such-moe"), ModelError, "Unknown model 'no-such-moe'"),
    (_bad_selection, ModelError, "Cannot read the selection file"),
    # records
    (lambda p: lambda: task_accuracy(None, None, []), DataError, "needs at least one record"),
]


@pytest.mark.parametrize(
    ("make", "kind", "says"), CASES, ids=[f"{kind.__name__}-{says[:24]}" for _, kind, says in CASES]
)
def test_each_stage_raises_its_kind(tmp_path, make, kind, says):
    with pytest.raises(kind, match=says) as raised:
        make(tmp_path)()
    assert isinstance(raised.value, UsafError)
    assert sum(isinstance(raised.value, k) for k in (ConfigError, DataError, ModelError, RunStateError)) == 1


def test_the_command_line_says_one_line_as_before(tmp_path, capsys):
    """A subclass reaches the user as every UsafError does: `usaf: error: ...`, exit code 2."""
    run = tmp_path / "no-run"
    assert main(["export", str(run), f"--delta={tmp_path / 'out.safetensors'}"]) == 2
    assert capsys.readouterr().err == (
        f"usaf: error: Run directory {run} does not exist; pass the --out folder of `usaf train`.\n"
    )


# The raises of a bare UsafError that stay (module: function -> why no kind fits); every other raises its kind.
PLAIN = {
    # an output path the user gave: it exists, is a file, holds or lies inside an input, a link, too long
    "usaf.base.writer:_check_output": "the prepared store's --out",
    "usaf.commands.export:run": "--delta inside --merged: two outputs the user gave",
    "usaf.commands.export:_gguf_tools": "the Modelfile beside --gguf exists",
    "usaf.commands.select:run": "the selection's .json summary exists already",
    "usaf.demo.run:run_demo": "the demo's --out exists and is not a demo run",
    "usaf.io.atomic:refuse_link": "an output that is a symbolic link",
    "usaf.io.atomic:_appeared": "an output another process wrote meanwhile",
    "usaf.io.atomic:check_destination": "an output path the file system cannot hold",
    "usaf.io.guard:check_placement": "an output that would replace or hold an input",
    "usaf.io.guard:check_output": "an output that exists and is not one of its kind",
    "usaf.train.run_dir:check_new_run": "--out that is a file or a folder of other files",
    "usaf.train.run_dir:RunLock.__enter__": "--out usaf cannot write into",
    # the file system: full, read-only
    "usaf.data.cache:full_cache": "the datasets cache's disk is full",
    "usaf.io.atomic:output_error": "a write the file system refused (disk full, read-only)",
    # a name read from any tool's metadata (checkpoint, store, delta): the caller's kind is not known there
    "usaf.io.guard:inside": "a damaged name in metadata",
    # a missing or failing external tool or package
    "usaf.export.gguf:find_converter": "llama.cpp's converter not found",
    "usaf.export.gguf:convert.write": "llama.cpp's converter wrote no GGUF",
    "usaf.export.gguf:convert": "a k-quant asked of convert() without llama-quantize",
    "usaf.export.gguf:find_quantize": "llama.cpp's llama-quantize not found",
    "usaf.export.gguf:_run": "llama.cpp's converter or llama-quantize failed",
    "usaf.train.grpo:score": "a user's reward function that returned the wrong number of rewards",
    "usaf.report:_pyplot": "matplotlib not installed",
    "usaf.train.optim:build_optimizer": "bitsandbytes without kernels for the device",
    "usaf.train.trackers:MLflow.check": "SQLAlchemy and Alembic not installed",
    "usaf.train.trackers:chosen_trackers": "a tracker's package not installed",
    "usaf.train.trackers:_probe": "a tracker's server that does not answer",
    "usaf.train.trackers:_started": "a tracker's library failed to start",
    # how the processes were launched (torchrun, the process group), and a library caller's order of calls
    "usaf.selection.across_ranks:check_joined": "prepare_model before the process group started",
    "usaf.train.distributed:init": "WORLD_SIZE without torchrun's other variables",
    "usaf.commands.train:_train_in_job": "another rank of the torchrun job died or stopped answering",
    "usaf.train.router_health:RouterHealth.measure_drift": "measure_drift called before record_base",
    "usaf.report:write_router_load": "a caller's rows and layer numbers that differ",
    # a run that diverged: its settings or its data, which the loop cannot tell apart
    "usaf.train.loop:TrainingRun.optimizer_step": "train.max_bad_steps NaN/Inf steps",
}


def plain_raises(source: str, module: str) -> set[str]:
    """'module:function' of each call of UsafError itself (raised or returned) in `source`."""
    found = set()

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                visit(child, [*scope, child.name])
                continue
            if (
                isinstance(child, ast.Call)
                and isinstance(child.func, ast.Name)
                and child.func.id == "UsafError"
            ):
                found.add(f"{module}:{'.'.join(scope)}")
            visit(child, scope)

    visit(ast.parse(source), [])
    return found


def test_only_the_listed_sites_raise_a_bare_usaf_error():
    """Every module imports, and raises a kind of UsafError, except where PLAIN says why none fits."""
    found = set()
    for info in pkgutil.walk_packages(usaf.__path__, "usaf."):
        if info.name == "usaf.__main__":  # runs the command line when imported
            continue
        module = importlib.import_module(info.name)
        found |= plain_raises(Path(module.__file__).read_text(), info.name)
    assert sorted(found - PLAIN.keys()) == [], "raise the kind that fits (usaf.errors), or list it in PLAIN"
    assert sorted(PLAIN.keys() - found) == [], "PLAIN lists sites that no longer raise a bare UsafError"


def test_the_scan_finds_a_bare_usaf_error():
    source = "class Run:\n    def go(self):\n        if x:\n            raise UsafError('no')\n"
    assert plain_raises(source, "m") == {"m:Run.go"}
    assert plain_raises("raise ConfigError('no')\n", "m") == set()
