"""continue a file of prompts with a fine-tune (and its base, side by side)

Read PROMPTS (JSONL: {"prompt": text} or {"messages": [chat]}), generate a continuation of each with MODEL_OR_RUN
(a chat through the model's chat template), write one JSONL row per prompt to --out and print them; with
--compare-base also the base's, side by side.
"""

from __future__ import annotations

import json
import shutil
import textwrap

from usaf.commands import add_set_option

# Trying a fine-tune without exporting it: `usaf generate`, and `usaf chat` (usaf.commands.chat), which takes the
# same MODEL_OR_RUN and sampling options (add_target, sampling).

# the options of usaf.generate.generation.Sampling, one per field, named as it names them; each help ends with the
# field's default (a flag's says what its absence means), which is also the option's default
SAMPLING_HELP = {
    "max_new_tokens": "tokens to generate at most",
    "do_sample": "sample (default: greedy)",
    "temperature": "with --do-sample",
    "top_p": "with --do-sample",
    "top_k": "with --do-sample; 0 is off",
    "repetition_penalty": "with --do-sample",
    "seed": "with --do-sample: the seed of each prompt",
}


def add_target(parser) -> None:
    """MODEL_OR_RUN, --delta, the sampling options and --set: what generate and chat take alike."""
    from dataclasses import fields

    from usaf.generate.generation import Sampling

    parser.add_argument(
        "target",
        metavar="MODEL_OR_RUN",
        help="a usaf run folder (its latest checkpoint), a merged export or model folder, or a base with --delta",
    )
    parser.add_argument(
        "--delta", metavar="DELTA", help="a delta file (usaf export --delta) written into the base"
    )
    parser.add_argument(
        "--unchecked-base",
        action="store_true",
        help="use a --delta that has no record of its base (the base cannot be checked), as usaf apply takes it",
    )
    for field in fields(Sampling):
        option, what = "--" + field.name.replace("_", "-"), SAMPLING_HELP[field.name]
        if isinstance(field.default, bool):
            parser.add_argument(option, action="store_true", help=what)
        else:
            parser.add_argument(
                option,
                type=type(field.default),
                default=field.default,
                help=f"{what} (default {field.default})",
            )
    add_set_option(parser, "override a setting, e.g. model.quant=nf4 for a quantized base, model.device=cpu")


def add_arguments(parser) -> None:
    add_target(parser)
    parser.add_argument("--prompts", required=True, metavar="FILE", help="JSONL prompts")
    parser.add_argument("--out", required=True, metavar="OUT.jsonl", help="where the rows are written")
    parser.add_argument("--compare-base", action="store_true", help="also generate with the base model")
    parser.add_argument("--base", metavar="BASE_DIR", help="the base of a merged export, for --compare-base")
    parser.add_argument("--force", action="store_true", help="replace an earlier --out of usaf generate")


def sampling(args):
    """The Sampling the options of `add_target` give, checked."""
    from usaf.generate.generation import Sampling

    return Sampling(**{name: getattr(args, name) for name in SAMPLING_HELP}).check()


def run(args) -> int:
    from usaf.data.records import TextLimit
    from usaf.errors import ModelError
    from usaf.generate.generation import (
        context_positions,
        cut_line,
        decode,
        generate_ids,
        prompt_ids,
        tokenizer_for_generation,
    )
    from usaf.generate.prompts import read_prompts
    from usaf.generate.target import open_target
    from usaf.io.atomic import atomic_file
    from usaf.io.guard import GENERATIONS, check_output

    settings = sampling(args)
    out = check_output(
        args.out,
        GENERATIONS,
        flag="--out",
        force=args.force,
        inputs=[
            ("MODEL_OR_RUN", args.target),
            ("--prompts", args.prompts),
            ("--delta", args.delta),
            ("--base", args.base),
        ],
    )
    prompts = read_prompts(args.prompts)
    target = open_target(args.target, args.delta, args.base, args.set, unchecked_base=args.unchecked_base)
    if args.compare_base and (missing := target.can_compare()) is not None:
        raise ModelError(f"--compare-base: {missing}.")
    tokenizer = target.tokenizer
    tokenizer_for_generation(tokenizer, target.chat_template)
    positions = context_positions(target.model)  # a prompt and its new tokens fit the model's context
    limit = TextLimit.of(tokenizer, positions) if positions is not None else None
    encoded = [prompt_ids(tokenizer, p, f"{args.prompts}:{p.line}", positions, limit) for p in prompts]
    print(f"usaf generate: {len(prompts)} prompts with {target.label}", flush=True)
    if (cut := cut_line(settings, [len(ids) for ids in encoded], positions)) is not None:
        print(cut, flush=True)

    def run_all(model) -> list[list[int]]:
        return [generate_ids(model, ids, settings, tokenizer, target.device) for ids in encoded]

    base = None
    if args.compare_base:  # first: a plain base with a delta is the base until the delta is written in
        with target.base() as model:
            base = run_all(model)
    tuned = run_all(target.tuned())
    rows = []
    for index, prompt in enumerate(prompts):
        row = {"line": prompt.line, "prompt": prompt.as_json(), "completion": decode(tokenizer, tuned[index])}
        if base is not None:
            row["base_completion"] = decode(tokenizer, base[index])
        row["new_tokens"] = len(tuned[index])
        rows.append(row)

    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)

    atomic_file(out, write)
    print(side_by_side(rows), end="")
    print(f"wrote {len(rows)} rows to {out}")
    return 0


def side_by_side(rows: list[dict], width: int | None = None) -> str:
    """Each prompt, then its completions in columns (tuned | base) wrapped to the terminal's width."""
    width = width or shutil.get_terminal_size((100, 24)).columns
    lines = []
    for row in rows:
        prompt = row["prompt"] if isinstance(row["prompt"], str) else row["prompt"][-1]["content"]
        lines.append(f"[{row['line']}] {_one_line(prompt)}")
        columns = [("tuned", row["completion"])]
        if "base_completion" in row:
            columns.append(("base", row["base_completion"]))
        column = max(20, (width - 3 * len(columns)) // len(columns))
        wrapped = [
            textwrap.wrap(f"{name}: {_one_line(text)}", column) or [f"{name}:"] for name, text in columns
        ]
        for parts in zip(*[w + [""] * (max(map(len, wrapped)) - len(w)) for w in wrapped], strict=True):
            lines.append("   " + " | ".join(p.ljust(column) for p in parts).rstrip())
    return "\n".join(lines) + "\n"


def _one_line(text: str) -> str:
    return text.replace("\r", "\\r").replace("\n", "\\n")
