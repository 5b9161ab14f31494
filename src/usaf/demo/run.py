"""`usaf demo`: fine-tune the bundled small MoE on a skill it does not have, and show that it learned it.

The model (scripts/make_demo_model.py) was pretrained to copy and upper-case words; the new skill is a Caesar
shift (`shift: kqzm -> lran`). usaf trains a few percent of the experts' own entries plus the routers, then the
trained model is exported as a plain transformers checkpoint and its accuracy measured from that export.
"""

from __future__ import annotations

import json
import shutil
import time
from importlib import resources
from pathlib import Path

from usaf.config import RunConfig
from usaf.demo.task import NEW_SKILL, read_jsonl, task_accuracy
from usaf.errors import UsafError
from usaf.export.merged import export_merged
from usaf.files import DEMO_MARKER
from usaf.io.guard import DEMO, check_output
from usaf.model.hf import load_causal_lm, load_tokenizer
from usaf.train.loop import train
from usaf.train.state import format_summary, stopped_exit_code

MARKER = DEMO_MARKER
# Chosen on this project's 2-core CPU: the shift skill goes from ~0 % to most words right in a few minutes.
DEMO_SETTINGS = [  # usaf's defaults for what to train and how fast; only the steps and the data differ
    "schedule.max_steps=500",
    "data.batch_size=16",
    "data.max_seq_len=64",
    "checkpoint.every_steps=250",
    "log.tensorboard=false",
]


def assets() -> Path:
    return Path(str(resources.files("usaf") / "demo_assets"))


def run_demo(args) -> int:
    root = assets()
    model_dir, data_dir = root / "model", root / "data"
    out = Path(args.out or "demo-run")
    # a previous demo run is replaced; never the demo's own files, a run, a model or a folder of the user's
    check_output(out, DEMO, flag="--out", force=True, inputs=[("the demo's assets", root)])
    if out.exists():
        if not (out / MARKER).exists():
            raise UsafError(f"{out} exists and is not a previous demo run; choose another --out.")
        shutil.rmtree(out)  # a previous demo run: start over
    out.mkdir(parents=True)
    (out / MARKER).write_text(json.dumps({"model": str(model_dir)}))

    eval_records = read_jsonl(data_dir / "eval.jsonl")
    tokenizer = load_tokenizer(model_dir)
    base = load_causal_lm(model_dir)
    print(
        f"usaf demo: teach a small pretrained MoE ({sum(p.numel() for p in base.parameters()) / 1e6:.1f} M "
        f"parameters, 8 experts per layer) a new skill, '{NEW_SKILL}', e.g. "
        f"{eval_records[0]['prompt']!r} -> {eval_records[0]['completion']!r}"
    )
    started = time.perf_counter()
    before = task_accuracy(base, tokenizer, eval_records)
    print(f"accuracy on {len(eval_records)} held-out words before training: {before:.1%}")

    config = RunConfig.load(
        None,
        [
            ("model.path", str(model_dir)),
            ("data.train", str(data_dir / "train.jsonl")),
            ("data.eval", str(data_dir / "eval.jsonl")),
            *DEMO_SETTINGS,
            *args.set,
        ],
    )
    summary = train(config, out / "run")
    if (code := stopped_exit_code(summary)) is not None:  # a signal or the router guard: nothing to export
        why = summary.get("reason") or f"signal {summary.get('signal')}"
        print(
            f"usaf demo: training stopped at step {summary['step']} ({why}); nothing exported. The run is in "
            f"{out / 'run'} (usaf train --resume {out / 'run'} continues it)."
        )
        return code
    merged = export_merged(out / "run", out / "model")
    trained = load_causal_lm(merged)  # plain transformers: the result is the model
    after = task_accuracy(trained, tokenizer, eval_records)

    print()
    print(format_summary(summary))
    print(f"{'task accuracy before → after':<30}  {before:.1%} → {after:.1%}")
    print(f"{'total time':<30}  {time.perf_counter() - started:.0f} s")
    print(f"\nexported model: {merged} (load it with AutoModelForCausalLM.from_pretrained; no usaf needed)")
    (out / MARKER).write_text(
        json.dumps(
            {"model": str(model_dir), "accuracy_before": before, "accuracy_after": after, **summary}, indent=2
        )
    )
    return 0
