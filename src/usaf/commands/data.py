"""show records as training sees them, supervised text marked

Reads the data as `usaf train` does (same tokenizer, chat template, max_seq_len, skip_bad_records; no eval split,
no packing) and prints the first N records with the supervised text marked ([[like this]]; green on a terminal),
then the one-line data summary. --json prints one {"input_ids": [...], "labels": [...]} per line (labels -100
where not supervised), the summary on stderr.
"""

from __future__ import annotations

import json
import os
import sys

from usaf.commands import add_run_inputs, add_set_option
from usaf.commands.train import effective_config
from usaf.errors import ConfigError

_GREEN, _RESET = "\033[32m", "\033[0m"
_OPEN, _CLOSE = "[[", "]]"


def add_arguments(parser) -> None:
    add_run_inputs(parser, model="model directory or hub id (model.path); only its tokenizer is read")
    parser.add_argument(
        "--show", type=int, default=3, metavar="N", help="records to print (default 3; 0: summary only)"
    )
    parser.add_argument(
        "--json", action="store_true", help="one JSON object per record: input_ids and labels"
    )
    parser.add_argument(
        "--skip-bad-records", action="store_true", help="skip malformed records and count them"
    )
    add_set_option(parser)
    parser.set_defaults(eval_data=None, resume=None)  # what effective_config reads


def marked_text(tokenizer, ids: list[int], labels: list[int], color: bool) -> str:
    """The record's text with each run of supervised tokens marked (decoded run by run, special tokens kept)."""
    opening, closing = (_GREEN, _RESET) if color else (_OPEN, _CLOSE)
    missing = getattr(tokenizer, "missing", False)  # no tokenizer files: show the ids

    def text(run: list[int]) -> str:
        return " ".join(map(str, run)) + " " if missing else tokenizer.decode(run)

    pieces, run, supervised = [], [], None
    for token, label in zip(ids, labels, strict=True):
        keep = label != -100
        if run and keep != supervised:
            pieces.append(f"{opening}{text(run)}{closing}" if supervised else text(run))
            run = []
        run.append(token)
        supervised = keep
    if run:
        pieces.append(f"{opening}{text(run)}{closing}" if supervised else text(run))
    return "".join(pieces)


def run(args) -> int:
    from usaf.data import load_run_data
    from usaf.data.stream import first_rows
    from usaf.train.session import load_tokenizer

    if args.show < 0:
        raise ConfigError(f"usaf data: --show {args.show}: give a number of records, 0 or more.")
    config = effective_config(args)
    if not config.data.train or not config.model.path:
        raise ConfigError(
            "usaf data needs --model and --data (or a --config that sets model.path and data.train)."
        )
    tokenizer = load_tokenizer(config.model.path)
    data, _, stats = load_run_data(
        config.data, config.model, config.train, tokenizer, pack=False, held_out=False
    )
    color = not args.json and sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    for index, row in enumerate(first_rows(data, args.show)):  # a stream (data.streaming) is read this far
        ids, labels = row["input_ids"].tolist(), row["labels"].tolist()
        if args.json:
            print(json.dumps({"input_ids": ids, "labels": labels}))
            continue
        supervised = sum(label != -100 for label in labels)
        print(f"--- record {index + 1}: {len(ids)} tokens, {supervised} supervised")
        print(marked_text(tokenizer, ids, labels, color))
    summary = sys.stderr if args.json else sys.stdout
    print(stats.summary(), file=summary)
    for problem in stats.first_skipped:  # what --skip-bad-records skipped, the first few
        print(f"  skipped {problem}", file=summary)
    return 0
