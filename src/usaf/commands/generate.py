"""`usaf generate` (prompts in, one JSONL row of continuations per prompt out) and `usaf chat` (a terminal chat
with streamed tokens): trying a fine-tune without exporting it."""

from __future__ import annotations

import json
import shutil
import sys
import textwrap

from usaf.commands import add_set_option


def _add_target(p) -> None:
    p.add_argument(
        "target",
        metavar="MODEL_OR_RUN",
        help="a usaf run folder (its latest checkpoint), a merged export or model folder, or a base with --delta",
    )
    p.add_argument(
        "--delta", metavar="DELTA", help="a delta file (usaf export --delta) written into the base"
    )
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--do-sample", action="store_true", help="sample (default: greedy)")
    p.add_argument("--temperature", type=float, default=1.0, help="with --do-sample (default 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --do-sample (default 1.0)")
    p.add_argument("--top-k", type=int, default=50, help="with --do-sample; 0 is off (default 50)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="with --do-sample (default 1.0)")
    p.add_argument(
        "--seed", type=int, default=0, help="with --do-sample: the seed of each prompt (default 0)"
    )
    add_set_option(p, "override a setting, e.g. model.quant=nf4 for a quantized base, model.device=cpu")


def add_command(sub) -> None:
    g = sub.add_parser(
        "generate",
        help="continue a file of prompts with a fine-tune (and its base, side by side)",
        description='Read PROMPTS (JSONL: {"prompt": text} or {"messages": [chat]}), generate a continuation '
        "of each with MODEL_OR_RUN (a chat through the model's chat template), write one JSONL row per prompt to "
        "--out and print them; with --compare-base also the base's, side by side.",
    )
    _add_target(g)
    g.add_argument("--prompts", required=True, metavar="FILE", help="JSONL prompts")
    g.add_argument("--out", required=True, metavar="OUT.jsonl", help="where the rows are written")
    g.add_argument("--compare-base", action="store_true", help="also generate with the base model")
    g.add_argument("--base", metavar="BASE_DIR", help="the base of a merged export, for --compare-base")
    g.add_argument("--force", action="store_true", help="replace an earlier --out of usaf generate")
    g.set_defaults(func=run_generate)
    c = sub.add_parser(
        "chat",
        help="chat with a fine-tune in the terminal (streamed; /reset clears the history, /exit leaves)",
        description="An interactive chat with MODEL_OR_RUN through its chat template: each answer streams as it "
        "is generated and the conversation is kept; /reset starts over, /exit (or end of input) leaves.",
    )
    _add_target(c)
    c.add_argument("--system", default=None, help="a system message at the start of the conversation")
    c.set_defaults(func=run_chat)


def _sampling(args):
    from usaf.generate.generation import Sampling

    return Sampling(
        args.max_new_tokens,
        args.do_sample,
        args.temperature,
        args.top_p,
        args.top_k,
        args.repetition_penalty,
        args.seed,
    ).check()


def run_generate(args) -> int:
    from usaf.errors import UsafError
    from usaf.generate.generation import decode, generate_ids, prompt_ids, tokenizer_for_generation
    from usaf.generate.prompts import read_prompts
    from usaf.generate.target import open_target
    from usaf.io.atomic import atomic_file
    from usaf.io.guard import GENERATIONS, check_output

    sampling = _sampling(args)
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
    target = open_target(args.target, args.delta, args.base, args.set)
    if args.compare_base and (missing := target.can_compare()) is not None:
        raise UsafError(f"--compare-base: {missing}.")
    tokenizer = target.tokenizer
    tokenizer_for_generation(tokenizer, target.config.data.chat_template)
    encoded = [prompt_ids(tokenizer, p, f"{args.prompts}:{p.line}") for p in prompts]
    print(f"usaf generate: {len(prompts)} prompts with {target.label}", flush=True)

    def run_all(model) -> list[list[int]]:
        return [generate_ids(model, ids, sampling, tokenizer, target.device) for ids in encoded]

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


def run_chat(args) -> int:
    from transformers import TextStreamer

    from usaf.errors import UsafError
    from usaf.generate.generation import generate_ids, has_chat_template, prompt_ids, tokenizer_for_generation
    from usaf.generate.prompts import Prompt
    from usaf.generate.target import open_target

    sampling = _sampling(args)
    target = open_target(args.target, args.delta, None, args.set)
    tokenizer = target.tokenizer
    tokenizer_for_generation(tokenizer, target.config.data.chat_template)
    if not has_chat_template(tokenizer):
        raise UsafError(
            f"{args.target} has no chat template; give one with --set data.chat_template=FILE.jinja, or use "
            "usaf generate with plain prompts."
        )
    model = target.tuned()
    start = [{"role": "system", "content": args.system}] if args.system else []
    history = list(start)
    print(f"usaf chat with {target.label}: /reset clears the conversation, /exit leaves.", flush=True)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        command = line.strip()
        if command in ("/exit", "/quit"):
            return 0
        if command == "/reset":
            history = list(start)
            print("(conversation cleared)", flush=True)
            continue
        if not command:
            continue
        history.append({"role": "user", "content": line})
        ids = prompt_ids(tokenizer, Prompt(0, messages=tuple(history)), "the conversation")
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        new = generate_ids(model, ids, sampling, tokenizer, target.device, streamer=streamer)
        sys.stdout.flush()
        history.append({"role": "assistant", "content": tokenizer.decode(new, skip_special_tokens=True)})
