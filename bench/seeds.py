"""Where the seed enters a usaf run, on the man-page shift of bench/quality.py: the same `usaf train` at its
defaults with train.seed 0, 1, 2 (which moves the data order, the calibration draw, stochastic rounding), and with
the data order held (train.seed=0) while only the calibration draw moves (select.strategy=file with the first
selection each seed's run made). Each run is judged from its `usaf export --merged` folder in plain transformers
(held-out new- and old-domain loss, nats/byte), and the runs' selections are compared: the share of one run's
entries another run also trains, at the start and at the end (after reselection).

    .venv/bin/python bench/seeds.py run NAME SEED [--set KEY=VALUE ...]   # one run, appended to OUT/results.jsonl
    .venv/bin/python bench/seeds.py report [--out OUT]                     # bench/results/quality-seeds-<date>.md

A run at the defaults takes 1-3 minutes on this project's 2-core CPU. The full attribution (results committed in
bench/results/quality-seeds-2026-12-06.md) is nine `run`s of the defaults and of calibration_batches=32 at seeds
0 1 2, and four runs of the held data order with another seed's selection file.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent / "scripts"))
sys.path.insert(0, str(BENCH))
import make_shift_model as shift  # noqa: E402
from harness import run_commands  # noqa: E402
from quality import Evaluator, load_plain, usaf_commands, utf8_records  # noqa: E402

OUT = Path("/tmp/usaf-seeds")
STEPS, BATCH, SEQ = 150, 8, 128  # bench/quality.py's shift task in full mode


def prepared(out: Path) -> tuple[Path, dict]:
    domains = shift.domains()
    path = out / "train.jsonl"
    if not path.exists():
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in utf8_records(domains["new"]["train"], SEQ - 2))
        )
    evals = {
        n: shift.held_out_batches(shift.encode(domains[n]["held_out"]), SEQ, 32, 16) for n in ("old", "new")
    }
    return path, evals


def judge(folder: Path, evals: dict) -> dict:
    """bench/quality.py's judge of the shift task, on the exported folder loaded by plain transformers."""
    import torch

    torch.set_num_threads(1)
    return Evaluator("shift", evals, str(folder))(load_plain(folder))


def run(name: str, seed: int, sets: list[str], out: Path) -> dict:
    data, evals = prepared(out)
    run_dir = out / "runs" / f"{name}-s{seed}"  # its run/ and merged/
    job = {"model_dir": str(shift.build()), "records": str(data), "steps": STEPS, "batch": BATCH, "seq": SEQ}
    # bench/quality.py's command lines, but packed (usaf's default, what these runs measured) and a checkpoint at
    # the end (`selection` reads it)
    overrides = {"data.pack": "true", "checkpoint.every_steps": STEPS, **dict(s.split("=", 1) for s in sets)}
    train, export = usaf_commands({"set": overrides}, seed, job, run_dir)
    try:
        run_commands(
            [train, export], {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(BENCH.parent / "src")}
        )
    except RuntimeError as failed:
        raise SystemExit(str(failed)) from None
    result = {
        "name": name,
        "seed": seed,
        "sets": sets,
        **judge(run_dir / "merged", evals),
        "run": str(run_dir / "run"),
    }
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")
    return result


def selection(run_dir: str, final: bool) -> dict:
    """{tensor key: set of ids (flat indices, or line ids)}: the run's first selection (its selection.safetensors),
    or the one its last checkpoint trains (the checkpoint's own record of where each tensor's ids are)."""
    from safetensors.torch import load_file

    from usaf.selection.saved import load_selection
    from usaf.train import checkpoint

    if not final:
        return {
            k: set(c.indices.tolist()) for k, c in load_selection(f"{run_dir}/selection.safetensors").items()
        }
    last = checkpoint.latest(Path(run_dir))
    tensors = load_file(str(last / "trainable.safetensors"))
    return {  # as usaf.train.checkpoint reads them back
        name: set(
            tensors[kept["prefix"] + ("line_ids" if kept["kind"] == "lines" else "flat_indices")].tolist()
        )
        for name, kept in checkpoint.read_state(last)["selection"].items()
    }


def agreement(a: dict, b: dict) -> float:
    return sum(len(a[k] & b.get(k, set())) for k in a) / max(1, sum(len(v) for v in a.values()))


def report(out: Path) -> str:
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["name"], []).append(r)
    lines = [
        f"# Where the seed enters (bench/seeds.py, {datetime.date.today()})",
        "",
        "| runs | settings | seeds | new [per run] | old [per run] | spread new / old | entries shared, first / last |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, runs in groups.items():
        new, old = [r["new"] for r in runs], [r["old"] for r in runs]
        pairs = list(itertools.combinations(runs, 2))
        first = [agreement(selection(a["run"], False), selection(b["run"], False)) for a, b in pairs]
        last = [agreement(selection(a["run"], True), selection(b["run"], True)) for a, b in pairs]
        shared = f"{sum(first) / len(first):.2f} / {sum(last) / len(last):.2f}" if pairs else "–"
        lines.append(
            f"| {name} | {' '.join(runs[0]['sets']) or 'defaults'} | {' '.join(str(r['seed']) for r in runs)} | "
            f"{sum(new) / len(new):.3f} [{' / '.join(f'{v:.3f}' for v in new)}] | "
            f"{sum(old) / len(old):.3f} [{' / '.join(f'{v:.3f}' for v in old)}] | "
            f"{max(new) - min(new):.3f} / {max(old) - min(old):.3f} | {shared} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("run", help="one usaf train run, judged, appended to OUT/results.jsonl")
    one.add_argument("name")
    one.add_argument("seed", type=int)
    one.add_argument("--set", nargs="*", default=[], dest="sets", help="usaf train --set overrides")
    one.add_argument("--out", type=Path, default=OUT)
    rep = sub.add_parser("report", help="the table of OUT/results.jsonl")
    rep.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if args.command == "run":
        print(json.dumps(run(args.name, args.seed, args.sets, args.out)))
    else:
        print(report(args.out), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
