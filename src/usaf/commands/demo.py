"""fine-tune the bundled small MoE on the bundled task"""

from __future__ import annotations

from usaf.commands import add_set_option


def add_arguments(parser) -> None:
    parser.add_argument("--out", default=None, help="output directory (default: ./demo-run)")
    add_set_option(parser, "override a demo setting")


def run(args) -> int:
    from usaf.demo.run import run_demo

    return run_demo(args)
