"""`usaf report RUN_DIR`: curves and per-layer expert-load heatmaps of a run, as PNGs in the run directory."""

from __future__ import annotations


def add_command(subparsers) -> None:
    p = subparsers.add_parser(
        "report",
        help="draw a run's curves (report.png) and expert-load heatmaps (router_load.png)",
        description="Render RUN_DIR/metrics.jsonl to RUN_DIR/report.png (loss, learning rate, eval loss, "
        "tokens/s, router health) and RUN_DIR/router_load.json to RUN_DIR/router_load.png (share of routed "
        "tokens per layer and expert, before and after training). Needs matplotlib (pip install usaf[report]).",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a usaf run directory")
    p.set_defaults(func=run)


def run(args) -> int:
    from usaf.report import render_report

    for path in render_report(args.run_dir):
        print(f"wrote {path}")
    return 0
