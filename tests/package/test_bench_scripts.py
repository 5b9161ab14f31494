"""The GPU benchmark script's dry run (CPU, tiny shapes): it runs bench/compare.py --smoke,
bench/gpu_offload.py --dry-run and bench/scale.py --dry-run --correctness, so every code path of the three but the
device is exercised here."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import arith  # noqa: E402
import compare  # noqa: E402
import quality  # noqa: E402
import scale  # noqa: E402


def gpu_sh(out: Path, *flags: str) -> Path:
    """`bash bench/gpu.sh OUT FLAGS...`, which must succeed; OUT."""
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu.sh"), str(out), *flags],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    return gpu_sh(tmp_path_factory.mktemp("gpu-dry-run"), "--dry-run")


def only(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    assert len(found) == 1, (pattern, sorted(p.name for p in folder.iterdir()))
    return found[0]


@pytest.mark.slow
def test_compare_smoke_reports_every_method_on_both_models(dry_run):
    payload = json.loads(only(dry_run, "compare-smoke-*.json").read_text())
    markdown = only(dry_run, "compare-smoke-*.md").read_text()
    assert only(dry_run, "compare-smoke-*.png").stat().st_size > 10_000
    assert set(payload["models"]) == {"demo", "random"}
    for name, model in payload["models"].items():
        expected = {m.key for m in compare.METHODS if name == "demo" or not m.demo_only}
        assert model["errors"] == {}
        assert set(model["methods"]) == expected, name
        for key, row in model["methods"].items():
            assert compare.BY_KEY[key].label in markdown
            assert row["peak_bytes"] > 0 and row["forward"]["median_s"] > 0
            if compare.BY_KEY[key].trains:
                assert row["trainable_params"] > 0 and row["step"]["median_s"] > 0
                assert row["train_over_inference_memory"] > 0 and row["step_over_own_forward"] > 0
        assert all(r["accuracy"] is not None for r in model["methods"].values()) == (name == "demo")
    assert {t["target"] for t in payload["targets"]} >= {
        "usaf unquantized step <= 1.0x PEFT LoRA step",
        "usaf step <= 2.3x forward-only (inference) time",
        "usaf nf4 peak memory <= 0.5x PEFT LoRA's",
        "usaf nf4 train ÷ inference memory <= 1.3",
        "demo accuracy after N steps >= PEFT LoRA's",
    }
    assert "## Targets" in markdown and payload["machine"]["torch"]


def test_offload_dry_run_trains_with_streamed_experts(dry_run):
    result = json.loads(only(dry_run, "offload-dry-run-*.json").read_text())
    assert "error" not in result, result.get("error")
    assert result["tokens_per_s"] > 0 and result["bytes_streamed_per_step"] > 0
    assert 0 <= result["transfer_share"] <= 1
    assert result["trainable"]["expert_entries"] > 0
    assert all(loss == loss for loss in result["losses"])  # no NaN
    assert "tokens/s" in only(dry_run, "offload-dry-run-*.md").read_text()
    assert (dry_run / "gpu.log").exists()


def test_scale_dry_run_reports_peaks_against_the_planner_split_and_correctness(dry_run):
    result = json.loads(only(dry_run, "scale-dry-run-*.json").read_text())
    assert result["errors"] == [], result["errors"]
    for key in (
        "layers",
        "measured_peak_host_bytes",
        "planned_peak_host_bytes",
        "bytes_per_entry",
        "step_seconds",
    ):
        assert result[key] > 0, key
    assert [r["layers"] for r in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert set(row["split_s"]) == set(scale.CATEGORIES)
        assert row["split_s"]["matmuls"] > 0 and row["split_s"]["sampled gradients"] > 0
        assert row["split_s"]["dequantization"] > 0
        assert 0 <= row["bytes_streamed_per_step"] <= row["whole_layer_bytes_per_step"]
    assert result["rows"][-1]["bytes_streamed_per_step"] > 0  # two layers: each pass copies the other one
    # the fit of tiny timings can slope either way on a busy machine: only the counted bytes must extrapolate up
    assert math.isfinite(result["extrapolated"]["step_seconds"]["at_48"])
    assert result["extrapolated"]["bytes_streamed_per_step"]["at_48"] > 0
    assert result["correctness"]["ok"], result["correctness"]
    text = only(dry_run, "scale-dry-run-*.md").read_text()
    assert "planner error" in text and "python bench/scale.py" in text and "Correctness" in text
    assert len([p for p in dry_run.iterdir() if p.is_file()]) <= 8  # what a device call returns


@pytest.mark.slow
def test_quality_smoke_judges_usaf_train_from_its_export_against_the_frontiers(tmp_path):
    """bench/quality.py --smoke: both shifts; the usaf row is a `usaf train` + `usaf export` command line with only
    the task's shape set, judged from the exported folder; LoRA's and full fine-tuning's frontiers are reported."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "quality.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,  # ~90 s alone; a loaded machine (benchmarks beside the suite) took over 300
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    payload = json.loads(only(tmp_path, "quality-smoke-*.json").read_text())
    markdown = only(tmp_path, "quality-smoke-*.md").read_text()
    assert only(tmp_path, "quality-smoke-*.png").stat().st_size > 10_000
    assert set(payload["tasks"]) == {"shift", "arith"}
    for name, task in payload["tasks"].items():
        rows = task["methods"]
        assert task["errors"] == {}, name
        assert {r["kind"] for r in rows.values()} == {"inference", "lora", "full", "experts", "usaf"}
        full = next(r for r in rows.values() if r["kind"] == "full")
        assert all(0 < r["after"]["new"] < 10 and 0 < r["after"]["old"] < 10 for r in rows.values())
        for key, row in rows.items():
            assert row["label"] in markdown
            if row["kind"] == "inference":
                assert row["trainable_params"] == 0 and row["after"] == row["before"]
                continue
            assert row["trainable_params"] > 0 and row["step_ms"] > 0 and row["peak_mb"] > 0, key
            assert row["curve"][-1]["step"] == payload["steps"][name] and row["curve"][-1]["elapsed_s"] > 0
        usaf = rows["usaf:usaf default"]
        assert usaf["trainable_params"] < full["trainable_params"] / 4
        assert usaf["before"] == rows["inference"]["before"]  # step 0: the base, judged alike
        assert usaf["after"]["new"] < usaf["before"]["new"]  # the exported model learnt the new domain
        for run in usaf["runs"]:
            train, export = run["commands"]
            assert train.startswith("python -m usaf train --model ") and f"train.seed={run['seed']}" in train
            assert not any(k in train for k in ("optim.", "select.", "schedule.warmup")), (
                train
            )  # the defaults
            assert export.startswith("python -m usaf export ") and export.endswith(
                f"--merged {run['judged_from']}"
            )
            assert f"`{train}` then `{export}`" in markdown
        against = usaf["against_frontiers"]
        for kind in ("full", "lora"):
            assert len(against[kind]["frontier"]) == 2 and len(against[kind]["per_seed"]) == 1
            mean = against[kind]["mean"]
            assert (mean is None) == (against[kind]["old_at_same_new"] is None)
            if mean is not None:
                assert mean == pytest.approx(usaf["after"]["old"] - against[kind]["old_at_same_new"])
        assert against["spread"] == {"new": 0.0, "old": 0.0}  # one seed
        assert set(against["verdict"]) == {"past_full", "lora_dominated", "spread_within_limit"}
    assert markdown.count("### Against the frontiers") == 2 and "on/past full FT's frontier:" in markdown


def test_quality_frontier_distance_interpolates_and_refuses_to_extrapolate():
    points = [(1.0, 2.0), (2.0, 1.0)]  # (new, old), lower is better
    assert quality.distance(points, 1.5, 1.4, higher_is_better=False) == pytest.approx(-0.1)  # past it
    assert quality.distance(points, 1.5, 1.6, higher_is_better=False) == pytest.approx(0.1)  # behind it
    assert quality.distance(points, 2.5, 0.0, higher_is_better=False) is None  # outside its range
    assert quality.distance(points, 1.5, 1.6, higher_is_better=True) == pytest.approx(-0.1)  # accuracies


def test_quality_a_row_beyond_a_frontiers_better_end_is_past_it_only_when_better_on_both_axes():
    """The arithmetic shift's case: usaf adapts more than every LoRA rate, so LoRA's frontier gives no distance;
    it dominates LoRA where it also forgets less than each LoRA point, and not otherwise."""
    lora = {
        f"lora@{lr}": {"kind": "lora", "after": {"new": n, "old": o}}
        for lr, n, o in ((1, 1.74, 2.3), (2, 1.68, 6.3))
    }
    full = {
        f"full@{lr}": {"kind": "full", "after": {"new": n, "old": o}}
        for lr, n, o in ((1, 1.79, 1.65), (2, 1.59, 3.9))
    }

    def row(new, old):
        return {"after": {"new": new, "old": old}, "per_seed_after": [{"new": new, "old": old}]}

    ahead = quality.against_frontiers(row(1.64, 1.85), {**lora, **full}, higher_is_better=False)
    assert ahead["lora"]["mean"] is None and ahead["verdict"]["lora_dominated"] is True
    assert ahead["full"]["mean"] < 0 and ahead["verdict"]["past_full"] is True
    assert "yes (better than each of its points on both axes)" in quality._verdict(
        ahead, "lora", "lora_dominated"
    )
    forgets_more = quality.against_frontiers(row(1.64, 2.5), {**lora, **full}, higher_is_better=False)
    assert forgets_more["lora"]["mean"] is None and forgets_more["verdict"]["lora_dominated"] is None
    assert quality._verdict(forgets_more, "lora", "lora_dominated") == "outside"
    accuracies = {  # higher is better: beyond the better end is a higher new accuracy
        "lora@1": {"kind": "lora", "after": {"new": 0.9, "old": 0.5}},
        "full@1": {"kind": "full", "after": {"new": 0.97, "old": 0.4}},
    }
    better = quality.against_frontiers(row(0.95, 0.6), accuracies, higher_is_better=True)
    assert better["verdict"]["lora_dominated"] is True and better["verdict"]["past_full"] is None


def test_quality_records_never_split_a_character_and_fit_a_row():
    text = "naïve café — ünïcødé " * 20
    pieces = quality.utf8_records(text.encode(), 7)
    assert all(0 < len(p.encode()) <= 7 for p in pieces) and "".join(pieces) == text
    assert quality.utf8_records(b"abc" + b" " * 8, 4) == ["abc "]  # blank pieces are left out


def test_arith_domain_is_seeded_true_arithmetic():
    assert arith.text(0, 2000) == arith.text(0, 2000) != arith.text(1, 2000)
    lines = arith.text(0, 20_000).decode().splitlines()
    for line in lines:
        left, right = line.split(" = ")
        a, op, b = left.split(" ")
        assert int(right) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op], line
    assert {len(line.split(" ")[0]) for line in lines} == {1, 2, 3, 4}
    assert {line.split(" ")[1] for line in lines} == {"+", "-", "*"}


@pytest.mark.distributed
@pytest.mark.slow
def test_multi_gpu_dry_run_counts_usafs_all_reduce_against_ddp(tmp_path):
    """bench/gpu.sh --multi-gpu --dry-run: bench/distributed.py on 2 gloo processes. usaf's step moves exactly
    4 B a trained value plus a presence flag a trained tensor; LoRA and full fine-tuning move what DDP hands its hook,
    all of their gradients."""
    gpu_sh(tmp_path, "--multi-gpu", "--dry-run")
    payload = json.loads(only(tmp_path, "distributed-*.json").read_text())
    two = payload["worlds"]["2"]
    assert two["usaf"]["bytes_per_step"] == 4 * (two["usaf"]["trainable"] + two["usaf"]["tensors"])
    for method in ("lora", "full"):
        assert two[method]["bytes_per_step"] == 4 * two[method]["trainable"], method
    assert all(row["bytes_per_step"] == 0 for row in payload["worlds"]["1"].values())
    assert (tmp_path / "gpu.log").stat().st_size > 0


@pytest.mark.slow
def test_launches_dry_run_counts_per_layer_and_times_the_baselines(tmp_path):
    """bench/gpu.sh --launches --dry-run: bench/launches.py --quick --speed on the CPU (E=8, tiny shapes), the
    Python its CUDA run calls: counts per layer-step, the issue's targets with verdicts, and tokens/s of the usaf
    step against the inference forward and PEFT LoRA."""
    gpu_sh(tmp_path, "--launches", "--dry-run")
    payload = json.loads(only(tmp_path, "launches-*.json").read_text())
    rows = payload["rows"]
    assert {(r["dtype"], r["quant"]) for r in rows} == {
        ("fp32", "none"),
        ("bf16", "none"),
        ("fp32", "nf4"),
        ("bf16", "nf4"),
    }
    assert all("error" not in r and r["ops_per_layer"] > 0 for r in rows), rows
    assert {v["met"] for v in payload["verdicts"]} <= {True, False} and payload["verdicts"]
    assert [s.get("tokens_per_s", 0) > 0 for s in payload["speed"]] == [True] * 3, payload["speed"]
    assert "| target | value | verdict |" in only(tmp_path, "launches-*.md").read_text()
    assert len([p for p in tmp_path.iterdir() if p.is_file()]) <= 8


@pytest.mark.slow
def test_preference_smoke_judges_every_method_from_its_saved_folder(tmp_path):
    """bench/preference.py --smoke: usaf DPO through `usaf train` + `usaf export`, PEFT LoRA and full DPO through
    TRL, each judged from its folder; the frontier verdicts are computed."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "preference.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    payload = json.loads(only(tmp_path, "preference-smoke-*.json").read_text())
    assert only(tmp_path, "preference-smoke-*.png").stat().st_size > 10_000
    rows = payload["methods"]
    assert payload["errors"] == {} and {r["kind"] for r in rows.values()} == {"usaf", "lora", "full"}
    for key, row in rows.items():
        for run in row["runs"]:
            assert Path(run["folder"]).name == "merged" and run["steps"] == 2, key
            assert 0 <= run["accuracy"] <= 1 and run["kl"] >= 0 and run["sft_loss"] > 0, key
    usaf_train, usaf_export = payload["usaf_commands"]
    assert usaf_train.startswith("python -m usaf train") and "train.objective=dpo" in usaf_train
    assert usaf_export.startswith("python -m usaf export") and "--merged=" in usaf_export
    # the judge gives the base itself zero reward and zero KL
    assert payload["base"]["kl"] == 0 and payload["base"]["accuracy"] == 0
    full_kl = payload["frontiers"]["usaf"]["full:accuracy:kl"]
    assert len(full_kl["points"]) == 2 and "on_or_past" in full_kl and len(full_kl["per_seed"]) == 1
