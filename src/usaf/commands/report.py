"""draw a run's curves (report.png) and expert-load heatmaps (router_load.png)

Render RUN_DIR/metrics.jsonl to RUN_DIR/report.png (loss, learning rate, eval loss, tokens/s, router health) and
RUN_DIR/router_load.json to RUN_DIR/router_load.png (share of routed tokens per layer and expert, before and after
training), and print the final evaluation (and the first). Needs matplotlib (pip install usaf[report]).
"""

from __future__ import annotations


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a usaf run directory")


def run(args) -> int:
    from usaf.report import eval_lines, render_report

    for path in render_report(args.run_dir):
        print(f"wrote {path}")
    for line in eval_lines(args.run_dir):
        print(line)
    return 0
