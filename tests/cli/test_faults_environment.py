"""The fault table of the environment and the caches (issue 35): HOME and the datasets cache unwritable, a file or
full; a cached file cut short; two runs at once on new data; standard output closed or its reader gone; Ctrl-C and
SIGTERM from the first instant; output names at the file system's limits or under a file; write errors without a
file name; absurd memory sizes. Each fails in one line or heals itself (one line saying so); none prints a
traceback.

Tests run as root, whom chmod does not stop: unwritable and full places are simulated with monkeypatched calls
raising EACCES / ENOSPC, as tests/cli/test_faults_commands.py does."""

from __future__ import annotations

import errno
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from faults import SET_ARGS, Row, T, table_test
from helpers import _env

from usaf.cli import main

LONG = "n" * 240  # with a suffix, an output name a little under the 255-byte limit
OVER = "o" * 256
DATA = ["data", "--model={ws.base}", "--data={ws.data}", "--show=1"]


# ---- faults a row sets up -----------------------------------------------------------------------------------------


def fresh_cache(ctx, monkeypatch):
    """A datasets cache of the row's own, so that the data is read and tokenized into it (not found cached)."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(ctx.tmp / "cache"))


def full_cache(ctx, monkeypatch):
    """The datasets cache's disk fills up while datasets writes it (pyarrow's error: no errno, the system's text)."""
    from datasets.arrow_writer import ArrowWriter

    fresh_cache(ctx, monkeypatch)

    def full(self, *args, **kwargs):
        raise OSError("Error writing bytes to file. Detail: [errno 28] No space left on device")

    monkeypatch.setattr(ArrowWriter, "write", full)
    monkeypatch.setattr(ArrowWriter, "write_batch", full)


def unnamed_disk_full_on_delta(ctx, monkeypatch):
    """A full disk reported without a file name (a write(2) failing, or safetensors' own error)."""
    import safetensors.torch

    def full(tensors, path, *args, **kwargs):
        Path(path).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)


def a_file(ctx, monkeypatch):
    (ctx.tmp / "file").write_text("a file, not a folder\n")


# ---- the table ----------------------------------------------------------------------------------------------------

ROWS = [
    # the datasets cache full: one line naming it and its variable (not "cannot read" the data file)
    Row("cache-full", DATA, 2, ["the datasets cache {tmp}/cache (from HF_DATASETS_CACHE) is full",
        "No space left on device", "free some space there, or set HF_DATASETS_CACHE"], setup=full_cache),
    # output names: any name the file system takes works (usaf's temporaries beside it stay short) ...
    Row("delta-name-near-the-limit", ["export", "{ws.finished}", f"--delta={{tmp}}/{LONG}.safetensors"], 0,
        [f"{LONG}.safetensors"]),
    Row("merged-name-near-the-limit", ["export", "{ws.finished}", f"--merged={{tmp}}/{LONG}"], 0, [LONG]),
    # ... and a name over it fails in one line before any work, for every output option
    Row("train-out-over-the-limit", T("--model={ws.base}", "--data={ws.data}", f"--out={{tmp}}/{OVER}"), 2,
        ["--out: the name oooo", "is 256 bytes, over the file system's limit of 255 bytes"]),
    Row("delta-over-the-limit", ["export", "{ws.finished}", f"--delta={{tmp}}/{OVER}.safetensors"], 2,
        ["--delta: the name", "is 268 bytes, over the file system's limit"]),
    Row("gguf-over-the-limit", ["export", "{ws.finished}", f"--gguf={{tmp}}/{OVER}.gguf"], 2,
        ["--gguf: the name", "over the file system's limit"]),
    Row("prepare-out-over-the-limit", ["prepare", "{ws.base}", "--quant=int8", f"--out={{tmp}}/{OVER}"], 2,
        ["--out: the name", "over the file system's limit"]),
    Row("apply-out-over-the-limit", ["apply", "{ws.base}", "{ws.delta}", f"{{tmp}}/{OVER}"], 2,
        ["OUT_DIR: the name", "over the file system's limit"]),
    Row("select-out-over-the-limit", ["select", "--model={ws.base}", "--data={ws.data}",
        f"--out={{tmp}}/{OVER}.safetensors"], 2, ["--out: the name", "over the file system's limit"]),
    # an output under a regular file: one line naming the file, before any work
    Row("train-out-under-a-file", T("--model={ws.base}", "--data={ws.data}", "--out={tmp}/file/run"), 2,
        ["--out {tmp}/file/run: {tmp}/file is a file, not a folder"], setup=a_file),
    Row("prepare-out-under-a-file", ["prepare", "{ws.base}", "--quant=int8", "--out={tmp}/file/store"], 2,
        ["{tmp}/file is a file, not a folder"], setup=a_file),
    Row("generate-out-under-a-file", ["generate", "{ws.finished}", "--prompts={ws.data}", "--out={tmp}/file/g.jsonl"],
        2, ["{tmp}/file is a file, not a folder"], setup=a_file),
    # a full disk whose error names no file: the line names the output
    Row("disk-full-names-the-output", ["export", "{ws.finished}", "--delta={tmp}/d.safetensors"], 2,
        ["{tmp}/d.safetensors: No space left on device; free some space"], setup=unnamed_disk_full_on_delta,
        absent=["{tmp}/d.safetensors"]),
    # absurd memory sizes
    Row("plan-vram-absurd", ["plan", "--model={ws.base}", "--vram=1000000TB"], 2,
        ["--vram 1000000TB is", "outside 1MB..100TB"]),
    Row("plan-vram-a-few-bytes", ["plan", "--model={ws.base}", "--vram=512KB"], 2, ["outside 1MB..100TB"]),
    Row("plan-ram-absurd", ["plan", "--model={ws.base}", "--ram=200TB"], 2, ["--ram 200TB is", "outside"]),
]  # fmt: skip

test_fault = table_test(ROWS)


# ---- the datasets cache: heals, with one line ---------------------------------------------------------------------


def _data(ws) -> list[str]:
    return ["data", f"--model={ws.base}", f"--data={ws.data}", "--show=1"]


def _heals(ws, capsys, says: str) -> str:
    assert main(_data(ws)) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "[[" in out, (out, err)
    assert err.count(says) == 1, err
    return err


def test_a_datasets_cache_that_is_a_file_costs_the_cache_not_the_run(ws, tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "file"))
    err = _heals(ws, capsys, "usaf: warning: cannot write the datasets cache")
    assert f"{tmp_path / 'file'} (from HF_DATASETS_CACHE)" in err and "set HF_DATASETS_CACHE" in err
    assert (tmp_path / "file").read_text() == ""


def test_an_unwritable_datasets_cache_costs_the_cache_not_the_run(ws, tmp_path, monkeypatch, capsys):
    cache, real = tmp_path / "read-only", os.open
    cache.mkdir()

    def refuse(path, *args, **kwargs):
        if str(path).startswith(str(cache)):
            raise OSError(errno.EACCES, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(os, "open", refuse)
    err = _heals(ws, capsys, "usaf: warning: cannot write the datasets cache")
    assert "Permission denied" in err and list(cache.iterdir()) == []


def test_home_a_file_costs_the_cache_not_the_run(ws, tmp_path, monkeypatch, capsys):
    """HOME places the cache when no HF_* variable does (datasets read them at import: its default is patched)."""
    import datasets

    home = tmp_path / "home"
    home.write_text("")
    for variable in ("HF_DATASETS_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / ".cache" / "huggingface" / "datasets")
    err = _heals(ws, capsys, "usaf: warning: cannot write the datasets cache")
    assert "(from HOME): Not a directory" in err


def test_a_cached_file_cut_short_is_rebuilt_with_one_line(ws, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    assert main(_data(ws)) == 0
    first = capsys.readouterr().out
    cached = sorted(cache.rglob("*.arrow"))  # the raw records' and the tokenized rows'
    assert [p.parent.name for p in cached] == ["0.0.0", "usaf_tokenized"], cached
    for path in cached:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        assert main(_data(ws)) == 0
        out, err = capsys.readouterr()
        assert out == first and err.count("was cut short; rebuilding it") == 1, err
        assert str(path) in err and "Traceback" not in err
    assert main(_data(ws)) == 0  # rebuilt: read from the cache, without a word
    assert "cut short" not in capsys.readouterr().err


_SLOW_BUILD = """
import os, sys, time
from pathlib import Path
import usaf.data.sources as sources
marker = Path(os.environ["SECOND_STARTED"])
def until_second_is_at_the_cache():
    print("building", file=sys.stderr, flush=True)
    waited = time.monotonic() + 120  # never for ever, should the second never start
    while not marker.exists() and time.monotonic() < waited:
        time.sleep(0.1)
    time.sleep(5)  # the second process reads its config and tokenizer, then meets this entry
if sys.argv.pop(1) == "first":
    rows = sources._raw_rows
    def raw_rows(*args, **kwargs):
        for i, row in enumerate(rows(*args, **kwargs)):
            if i == 1:  # the entry's Arrow file is open, half written
                until_second_is_at_the_cache()
            yield row
    sources._raw_rows = raw_rows
else:
    marker.touch()
from usaf.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_two_runs_at_once_on_new_data_wait_for_one_builder(ws, tmp_path):
    """A sweep started in parallel on the same new file: the second process meets the first's half-written cache
    entry. It must neither take it for a torn one (and remove it under its writer) nor read it half written."""
    env = _env(HF_DATASETS_CACHE=str(tmp_path / "cache"), SECOND_STARTED=str(tmp_path / "second"))
    first = subprocess.Popen([sys.executable, "-c", _SLOW_BUILD, "first", *_data(ws)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    assert first.stderr.readline() == "building\n"
    second = subprocess.run([sys.executable, "-c", _SLOW_BUILD, "second", *_data(ws)], capture_output=True,
                            text=True, env=env)  # fmt: skip
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0 and "Traceback" not in err, err
    assert second.returncode == 0 and "Traceback" not in second.stderr, second.stderr
    assert "cut short" not in err + second.stderr
    assert second.stdout == out and "[[" in out


# ---- standard output gone -----------------------------------------------------------------------------------------


class GoneReader(io.StringIO):
    """A standard output whose reader goes away after `lines` lines."""

    def __init__(self, lines: int):
        super().__init__()
        self.left = lines

    def write(self, text: str) -> int:
        if self.left <= 0:
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")
        self.left -= text.count("\n")
        return super().write(text)


@pytest.mark.slow
def test_a_run_whose_reader_goes_away_still_trains_to_its_checkpoints(ws, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdout", GoneReader(1))
    run = tmp_path / "run"
    rc = main(["train", f"--model={ws.base}", f"--data={ws.data}", f"--out={run}", *SET_ARGS,
               "--set=schedule.max_steps=2"])  # fmt: skip
    monkeypatch.undo()
    assert rc == 0 and "Traceback" not in capsys.readouterr().err
    assert (run / "checkpoints" / "step-00000002").is_dir() and (run / "summary.json").is_file()


def test_a_listing_whose_reader_goes_away_ends_quietly_as_sigpipe(ws, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdout", GoneReader(0))
    rc = main(["data", f"--model={ws.base}", f"--data={ws.data}", "--show=100"])
    monkeypatch.undo()
    assert rc == 128 + signal.SIGPIPE and capsys.readouterr().err == ""


# ---- in its own process: the first instant, a closed standard output, SIGTERM mid-work ----------------------------


def _usaf(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "usaf", *args], text=True, env=_env(), **kwargs)


def _catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for `signum` (/proc's SigCgt mask)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(mask >> (signum - 1) & 1)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_starting_ends_in_one_line(ws, tmp_path, signum):
    """While Python still imports torch: the handlers are usaf's from the first instant (SIGTERM caught is the
    sign, Python catches only SIGINT), then the signal."""
    proc = _usaf("train", f"--model={ws.base}", f"--data={ws.data}", f"--out={tmp_path}/run",
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    deadline = time.monotonic() + 2
    while not _catches(proc.pid, signal.SIGTERM) and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, err
    name = "" if signum == signal.SIGINT else " (SIGTERM)"
    assert err == f"usaf: interrupted{name} while starting; nothing was written\n"
    assert not (tmp_path / "run").exists()


# SIGTERM while the data is tokenized (a slow encoder): the command's own handlers, one line, 143
_SLOW_DATA = """
import sys, time
import usaf.data.tokenize as tokenize
def slow(*args, **kwargs):
    print("tokenizing", file=sys.stderr, flush=True)
    time.sleep(60)
tokenize.tokenize_source = slow
from usaf.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_sigterm_while_the_data_is_read_ends_in_one_line(ws, tmp_path):
    args = ["train", f"--model={ws.base}", f"--data={ws.data}", f"--out={tmp_path}/run", *SET_ARGS]
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_DATA, *args], stderr=subprocess.PIPE, text=True,
                            stdout=subprocess.DEVNULL, env=_env())  # fmt: skip
    assert proc.stderr.readline() == "tokenizing\n"
    proc.send_signal(signal.SIGTERM)
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM, err
    assert err.startswith("usaf: interrupted (SIGTERM);") and err.count("\n") == 1, err


@pytest.mark.slow
def test_a_run_with_standard_output_closed_trains_to_its_checkpoints(ws, tmp_path):
    """`usaf train ... >&-`: the lines go nowhere, as asked; the run is whole."""
    run = tmp_path / "run"
    args = ["train", f"--model={ws.base}", f"--data={ws.data}", f"--out={run}", *SET_ARGS,
            "--set=schedule.max_steps=2"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "usaf", *args], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, env=_env(), close_fds=True,
                          preexec_fn=lambda: os.close(1))  # fmt: skip
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert (run / "checkpoints" / "step-00000002").is_dir() and (run / "summary.json").is_file()


def test_a_signal_after_the_error_line_adds_no_second_line(monkeypatch, capsys):
    """torchrun stops a failed job's other ranks with SIGTERM, which may come while a rank says its own error: the
    rank ends with that one line and its status."""
    import usaf.commands.data as data_command
    from usaf.errors import DataError

    class Said(DataError):
        def __str__(self):
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while the error is said
            return "the data is gone"

    def fails(args):
        raise Said()

    monkeypatch.setattr(data_command, "run", fails)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["data", "--model", "m", "--data", "d.jsonl"]) == 2
    assert capsys.readouterr().err.splitlines() == ["usaf: error: the data is gone"]
    assert signal.getsignal(signal.SIGTERM) == before  # put back: a later signal is not ignored
