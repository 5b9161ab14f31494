"""held-out loss and perplexity of a model or a run"""

from __future__ import annotations

import json
import sys

from usaf.commands import add_set_option


def add_arguments(parser) -> None:
    parser.add_argument(
        "target", help="model directory, or a run directory (its latest checkpoint is evaluated)"
    )
    parser.add_argument("--data", required=True, help="files to evaluate on, comma separated")
    add_set_option(parser)


def run(args) -> int:
    from usaf.config import split_paths
    from usaf.train.evaluate import evaluate_target

    result = evaluate_target(args.target, split_paths(args.data), args.set)
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0
