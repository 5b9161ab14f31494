"""The fault table's machinery (issue 12, extended by class in issue 23): a shared workspace of models, data,
runs and deltas; a `Row` (one command line, its exit code, what it must say, what it must keep and not leave);
and `check_row`, which runs one row through `usaf.cli.main` in-process and asserts that the one line names the
file or field and what to do, that no traceback is printed, that nothing was lost (folders it must not touch are
byte for byte the same) and that nothing was half-written. The tables are the `tests/cli/test_faults_*.py` files,
one per class of fault."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import FAST_RUN, make_model_dir, write_copy_task
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from usaf.cli import main
from usaf.export.delta import _payload_digest

SETS = [*FAST_RUN, "checkpoint.every_steps=1", "checkpoint.keep_last=0"]
SET_ARGS = [f"--set={s}" for s in SETS]


def snapshot(folder: Path) -> dict[str, bytes]:
    if folder.is_file():
        return {"": folder.read_bytes()}
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def build_workspace(root: Path) -> SimpleNamespace:
    """Models, data files, a finished run, an unfinished one and a delta: made once, copied by rows that change
    them."""
    w = SimpleNamespace(root=root)
    w.base = make_model_dir(root / "base")
    w.data = write_copy_task(root / "train.jsonl", 60)
    w.finished = root / "finished"
    assert main(["train", f"--model={w.base}", f"--data={w.data}", f"--out={w.finished}", *SET_ARGS,
                 "--set=schedule.max_steps=3"]) == 0  # fmt: skip
    w.unfinished = root / "unfinished"  # stopped after step 2 of 3 (e.g. killed)
    shutil.copytree(w.finished, w.unfinished)
    shutil.rmtree(w.unfinished / "checkpoints" / "step-00000003")
    (w.unfinished / "summary.json").unlink()
    w.delta = root / "delta.safetensors"
    assert main(["export", str(w.finished), f"--delta={w.delta}"]) == 0

    w.trunc = root / "trunc"  # model.safetensors cut short
    shutil.copytree(w.base, w.trunc)
    blob = (w.trunc / "model.safetensors").read_bytes()
    (w.trunc / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    w.unknown = root / "unknown"  # a model_type transformers does not know
    shutil.copytree(w.base, w.unknown)
    config = json.loads((w.unknown / "config.json").read_text())
    (w.unknown / "config.json").write_text(json.dumps({**config, "model_type": "qwen9_moe"}))
    w.bare = root / "bare"  # no tokenizer files
    shutil.copytree(w.base, w.bare)
    for name in os.listdir(w.bare):
        if name not in ("config.json", "model.safetensors", "generation_config.json"):
            os.remove(w.bare / name)
    w.olmoe = make_model_dir(root / "olmoe", "olmoe")
    w.altered = root / "altered"  # same architecture, other weights
    shutil.copytree(w.base, w.altered)
    tensors = load_file(str(w.altered / "model.safetensors"))
    save_file(
        {k: v + 0.01 for k, v in tensors.items()}, str(w.altered / "model.safetensors"), {"format": "pt"}
    )

    w.data_dir = root / "data-folder"
    w.data_dir.mkdir()
    shutil.copy(w.data, w.data_dir / "part1.jsonl")
    w.xlsx = root / "train.xlsx"
    w.xlsx.write_text("prompt,completion\n")
    w.bad_json = root / "bad.jsonl"
    w.bad_json.write_text('{"text": "fine"}\n{"text": "broken\n')
    w.bad_keys = root / "keys.jsonl"
    w.bad_keys.write_text('{"txt": "typo"}\n')
    w.long = root / "long.jsonl"  # documents longer than the model's 64 positions
    w.long.write_text("".join(json.dumps({"text": "abcdefgh" * 12}) + "\n" for _ in range(8)))
    w.text = root / "text.jsonl"
    w.text.write_text(json.dumps({"text": "hello there"}) + "\n")
    w.yaml_list = root / "list.yaml"
    w.yaml_list.write_text("- optim\n- lr: 3\n")
    w.not_delta = w.base / "model.safetensors"
    w.trunc_delta = root / "trunc-delta.safetensors"
    w.trunc_delta.write_bytes(w.delta.read_bytes()[:-100])
    w.user_dir = root / "mine"  # someone's folder, not a run
    w.user_dir.mkdir()
    (w.user_dir / "config.yaml").write_text("my: settings\n")
    w.empty = root / "empty-dir"
    w.empty.mkdir()
    w.prequantized = root / "prequantized"  # config.json says the weights are already quantized
    shutil.copytree(w.base, w.prequantized)
    config = json.loads((w.prequantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}  # published MXFP4/FP8 are read
    (w.prequantized / "config.json").write_text(json.dumps(config))
    w.pickles = root / "pickles"  # weights only as pytorch_model.bin
    shutil.copytree(w.base, w.pickles)
    (w.pickles / "model.safetensors").unlink()
    (w.pickles / "pytorch_model.bin").write_bytes(b"not read")
    w.bad_config = root / "bad-config"  # config.json cut short
    shutil.copytree(w.base, w.bad_config)
    (w.bad_config / "config.json").write_text('{"model_type": ')
    w.store = root / "store"
    assert main(["prepare", str(w.base), "--quant=int8", f"--out={w.store}"]) == 0
    w.torn_report = root / "torn-report"  # a run folder whose router_load.json was cut short
    w.torn_report.mkdir()
    (w.torn_report / "router_load.json").write_text('{"layers": [0, 1], "bef')
    return w


@dataclass
class Row:
    id: str
    argv: list[str]  # formatted with ws (the workspace), tmp (the row's folder) and run (its copy of a run)
    rc: int
    says: list[str]  # formatted the same; all must be in stderr (stdout when rc == 0)
    run: str | None = None  # "finished" or "unfinished": the row gets its own copy, at {run}
    setup: object = None
    keeps: list[str] = field(default_factory=lambda: ["{ws.finished}", "{ws.base}"])  # byte for byte the same
    absent: list[str] = field(default_factory=list)  # must not exist afterwards


def T(*args: str) -> list[str]:
    return ["train", *args, *SET_ARGS, "--set=schedule.max_steps=2"]


NEW = ["--model={ws.base}", "--data={ws.data}", "--out={tmp}/run"]


def train_args(ws, out: Path, *options: str) -> list[str]:
    """`usaf train` on the workspace's base and data into `out`, with further options (`--set=...`)."""
    return ["train", f"--model={ws.base}", f"--data={ws.data}", f"--out={out}", *options]


def table_test(rows: list[Row]):
    """The test of a table: one case per row, named by its id (`test_fault = table_test(ROWS)` in a module)."""

    @pytest.mark.parametrize("row", rows, ids=[row.id for row in rows])
    def test_fault(row: Row, ws, tmp_path, monkeypatch, capsys):
        check_row(row, ws, tmp_path, monkeypatch, capsys)

    return test_fault


def check_row(row: Row, ws, tmp_path: Path, monkeypatch, capsys) -> None:
    """Run one row in-process and assert what every row promises."""
    ctx = SimpleNamespace(ws=ws, tmp=tmp_path, run=tmp_path / "the-run")
    if row.run:
        shutil.copytree(getattr(ws, row.run), ctx.run)

    def fill(text: str) -> str:
        return text.format(ws=ws, tmp=tmp_path, run=ctx.run)

    if row.setup is not None:
        row.setup(ctx, monkeypatch)
    kept = {fill(p): snapshot(Path(fill(p))) for p in row.keeps}
    capsys.readouterr()
    rc = main([fill(a) for a in row.argv])
    monkeypatch.undo()
    out, err = capsys.readouterr()
    assert rc == row.rc, (out, err)
    assert "Traceback" not in out + err
    shown = out if rc == 0 else err
    for fragment in row.says:
        assert fill(fragment) in shown, shown
    if rc == 2:
        assert err.startswith("usaf: error: ") and err.count("\n") == 1, err
    for path, before in kept.items():
        assert snapshot(Path(path)) == before, f"{path} changed"
    for path in row.absent:
        assert not Path(fill(path)).exists(), f"{fill(path)} was left behind"
    # nothing half-written beside the outputs: no temporaries of usaf's left in the row's folder
    leftovers = [p for p in tmp_path.rglob("*") if "usaf-tmp" in p.name or p.name.startswith(".tmp-")]
    assert not leftovers, leftovers


def delta_parts(path: Path) -> tuple[dict, dict]:
    """A delta file's tensors and its usaf metadata."""
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    return load_file(str(path)), json.loads(metadata["usaf"])


def write_delta(path: Path, tensors: dict, info: dict) -> None:
    """A delta file of `tensors` and `info`, its payload checksum recomputed (so only what a row changed is bad)."""
    info = {**info, "payload_sha256": _payload_digest(tensors)}
    save_file(tensors, str(path), {"format": "usaf-delta", "format_version": "1", "usaf": json.dumps(info)})
