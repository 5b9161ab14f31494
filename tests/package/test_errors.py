"""Each stage raises its own kind of UsafError (usaf.errors), for library callers who handle one kind; all are still
UsafErrors, so the command line's one line and exit code stay as they were."""

import pytest

from usaf.cli import main
from usaf.data.sources import open_source
from usaf.errors import ConfigError, DataError, ModelError, RunStateError, UsafError
from usaf.export.delta import delta_from_run, read_delta
from usaf.generate.prompts import read_prompts
from usaf.io.source import check_model_files
from usaf.kernels import use
from usaf.quant import get_format


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


CASES = [
    (_bad_json, DataError, r"bad\.json:2: invalid JSON"),
    (_bad_prompts, DataError, "'prompt' must be non-empty text"),
    (_no_config_json, ModelError, "has no config.json"),
    (_not_a_delta, ModelError, "is corrupted: its safetensors header"),
    (_no_run, RunStateError, "does not exist; pass the --out folder"),
    (lambda tmp_path: lambda: get_format("fp3"), ConfigError, "Unknown quantization format 'fp3'"),
    (lambda tmp_path: lambda: use("fastest"), ConfigError, "train.kernels must be one of"),
]


@pytest.mark.parametrize(("make", "kind", "says"), CASES, ids=[kind.__name__ for _, kind, _ in CASES])
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
