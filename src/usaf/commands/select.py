"""choose what to train from a task's data and save it (select.strategy=file reuses it)

Runs the selection of `usaf train` (strategy, selection, budget from the config) on calibration batches of the
data and writes OUT (.safetensors) plus OUT.json with a summary.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from usaf.commands import add_run_inputs, add_set_option
from usaf.commands.train import effective_config
from usaf.errors import ConfigError, UsafError


def add_arguments(parser) -> None:
    add_run_inputs(parser, model="model directory (model.path)")
    parser.add_argument("--out", required=True, help="selection file to write (.safetensors)")
    parser.add_argument("--force", action="store_true", help="replace an earlier selection file at --out")
    add_set_option(parser)
    parser.set_defaults(eval_data=None, skip_bad_records=False, resume=None)  # what effective_config reads


def run(args) -> int:
    from usaf.io.atomic import expect_at, identity
    from usaf.io.guard import SELECTION, check_output, check_placement
    from usaf.prepare import current_selection
    from usaf.selection.saved import save_selection
    from usaf.train import runtime
    from usaf.train.memory_plan import resolve_auto
    from usaf.train.session import (
        calibration_line,
        check_something_to_train,
        open_session,
        run_data,
        selection_summary,
        with_model_source,
    )

    config = effective_config(args)
    if not config.data.train or not config.model.path:
        raise ConfigError("usaf select needs --model and --data.")
    check_something_to_train(config)
    config = with_model_source(config)  # a store's own quant format, a hub id's snapshot; a run is refused
    out = Path(args.out)
    if out.suffix != ".safetensors":
        raise ConfigError(
            f"--out {out}: the selection file must end in .safetensors (a .json summary goes beside it)."
        )
    # the selection and its .json summary: never an input, a run's or a model's file, or another file
    inputs = [
        ("the model folder", config.model.path),
        *(("the data file", path) for path in [*config.data.train, *config.data.eval]),
        ("the config file", args.config),
        ("the selection file", config.select.file),
    ]
    check_output(out, SELECTION, flag="--out", force=args.force, inputs=inputs)
    summary_file = out.with_suffix(".json")
    check_placement(summary_file, "--out's summary", inputs)
    if not out.exists() and os.path.lexists(summary_file):
        raise UsafError(
            f"{summary_file} already exists (the selection's .json summary goes there); choose another --out."
        )
    expect_at(summary_file, identity(summary_file))
    device = runtime.resolve_device(config.model.device)
    config, auto_lines = resolve_auto(config, device, runtime.resolve_dtype(config.model.dtype, device))
    session = open_session(
        config,
        lambda config, tokenizer, pack: run_data(config, tokenizer, pack, held_out=False),
        recompute=False,  # nothing is trained here
    )
    model, config, stats = session.model, session.config, session.data_stats
    chosen = current_selection(model)
    summary = selection_summary(model, config, chosen)
    save_selection(out, chosen, summary)
    for line in auto_lines:  # said once it is done: a failing command says one line, its error
        print(line, file=sys.stderr)
    if (line := calibration_line(model, config.select)) is not None:
        print(line, file=sys.stderr)
    counts = summary["entries"]
    print(
        json.dumps(
            {
                "file": str(out),
                "tensors": len(counts),
                "entries": sum(counts.values()),
                "data": stats.summary(),
            }
        )
    )
    return 0
