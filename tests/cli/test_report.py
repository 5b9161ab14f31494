"""`usaf report`: PNGs from a run directory's metrics.jsonl and router_load.json."""

import json
import math
import sys

import pytest
import torch

from usaf.cli import main
from usaf.errors import UsafError
from usaf.report import read_metrics, render_report, write_router_load

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _synthetic_run(run_dir, steps=40):
    with open(run_dir / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 0, "eval/loss": 3.0, "eval/perplexity": 20.1}) + "\n")
        for step in range(1, steps + 1):
            record = {
                "step": step,
                "loss": 3.0 * math.exp(-step / 15) + 0.5,
                "lr": 1e-3 * min(1.0, step / 5),
                "tokens_per_s": 1000 + 10 * step,
                "router/cv_max": 0.4 + 0.01 * step,
                "router/entropy_min": 0.95 - 0.005 * step,
                "router/dead": step // 20,
                "router/drift": 0.001 * step,
                "router/balance_loss": 1.1,
                "router/z_loss": 2.0,
                "router/layers": [{"layer": 0, "cv": 0.3}],  # detail: not drawn
            }
            if step % 10 == 0:
                record["eval/loss"] = 2.0 + 1.0 / step
            f.write(json.dumps(record) + "\n")
        f.write('{"step": 41, "loss": 0.')  # a run killed mid-write
    generator = torch.Generator().manual_seed(0)
    before = torch.rand(4, 8, generator=generator)
    after = torch.rand(4, 8, generator=generator) ** 3
    before, after = before / before.sum(1, keepdim=True), after / after.sum(1, keepdim=True)
    after[0] = float("nan")  # a layer not observed after training
    write_router_load(run_dir, before, after, layers=[1, 2, 3, 5])


def test_report_writes_readable_pngs(tmp_path):
    _synthetic_run(tmp_path)
    written = render_report(tmp_path)
    assert [p.name for p in written] == ["report.png", "router_load.png"]
    for path in written:
        data = path.read_bytes()
        assert data[:8] == PNG_MAGIC
        assert len(data) > 20_000, f"{path.name} is only {len(data)} bytes"


def test_router_load_json_round_trip(tmp_path):
    _synthetic_run(tmp_path)
    data = json.loads((tmp_path / "router_load.json").read_text())
    assert data["layers"] == [1, 2, 3, 5]
    assert len(data["before"]) == 4 and len(data["before"][0]) == 8
    assert data["after"][0] == [None] * 8  # NaN (unobserved) is stored as null
    assert sum(data["before"][1]) == pytest.approx(1.0)
    with pytest.raises(UsafError, match="must match"):
        write_router_load(tmp_path, [[0.5, 0.5]], [[0.5, 0.5]], layers=[0, 1])


def test_metrics_reader_keeps_last_record_of_a_repeated_step(tmp_path):
    lines = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}, {"step": 2, "loss": 3.5}, {"loss": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in records] == [(1, 5.0), (2, 3.5)]


def test_cli_report(tmp_path, capsys):
    _synthetic_run(tmp_path)
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "report.png" in out and "router_load.png" in out
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "neither metrics.jsonl nor router_load.json" in capsys.readouterr().err


def test_missing_matplotlib_names_the_extra(tmp_path, monkeypatch):
    _synthetic_run(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(UsafError, match=r"pip install usaf\[report\]"):
        render_report(tmp_path)
