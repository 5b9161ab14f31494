"""`usaf select`: calibrate on a task's data and save the selection, to inspect it or reuse it in runs."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UsafError
from . import add_set_option
from .train import effective_config


def add_command(sub) -> None:
    p = sub.add_parser(
        "select",
        help="choose what to train from a task's data and save it (select.strategy=file reuses it)",
        description="Runs the selection of `usaf train` (strategy, selection, budget from the config) on "
        "calibration batches of the data and writes OUT (.safetensors) plus OUT.json with a summary.",
    )
    p.add_argument("--model", help="model directory (model.path)")
    p.add_argument("--data", help="data files, comma separated (data.train)")
    p.add_argument("--config", help="YAML run configuration")
    p.add_argument("--out", required=True, help="selection file to write (.safetensors)")
    add_set_option(p)
    p.set_defaults(func=run_select, eval_data=None, skip_bad_records=False, resume=None)


def run_select(args) -> int:
    from .. import runtime
    from ..data import Batches, load_dataset
    from ..select import save_selection
    from ..train import current_selection, load_model, load_tokenizer, selection_summary

    config = effective_config(args)
    if not config.data.train or not config.model.path:
        raise UsafError("usaf select needs --model and --data.")
    out = Path(args.out)
    if out.suffix != ".safetensors":
        raise UsafError(
            f"--out {out}: the selection file must end in .safetensors (a .json summary goes beside it)."
        )
    device = runtime.resolve_device(config.model.device)
    dtype = runtime.resolve_dtype(config.model.dtype, device)
    tokenizer = load_tokenizer(config.model.path)
    data, _, stats = load_dataset(
        config.data.train, tokenizer, config.data.max_seq_len, pack=config.data.pack, eval_fraction=0.0
    )
    batches = Batches(data, config.data.batch_size, seed=config.train.seed + 1)
    config.train.recompute = False  # nothing is trained here
    model = load_model(config, device, dtype, calibration_batches=batches)
    summary = selection_summary(model, config)
    save_selection(out, current_selection(model), summary)
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
