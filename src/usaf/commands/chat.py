"""chat with a fine-tune in the terminal (streamed; /reset clears the history, /exit leaves)

An interactive chat with MODEL_OR_RUN through its chat template: each answer streams as it is generated and the
conversation is kept; /reset starts over, /exit (or end of input) leaves. The model's context bounds it: when
the conversation no longer leaves room to answer, its oldest turns are dropped (the system message stays), with a
line; a message that alone is over the context, or a line that is not UTF-8, is refused in a line and the chat
goes on.
"""

from __future__ import annotations

import sys

from usaf.commands.generate import add_target, sampling


def add_arguments(parser) -> None:
    add_target(parser)
    parser.add_argument("--system", default=None, help="a system message at the start of the conversation")


def run(args) -> int:
    from transformers import TextStreamer

    from usaf.errors import DataError
    from usaf.generate.generation import (
        context_positions,
        cut_line,
        generate_ids,
        has_chat_template,
        tokenizer_for_generation,
    )
    from usaf.generate.target import open_target

    settings = sampling(args)
    target = open_target(args.target, args.delta, None, args.set, unchecked_base=args.unchecked_base)
    tokenizer = target.tokenizer
    tokenizer_for_generation(tokenizer, target.chat_template)
    if not has_chat_template(tokenizer):
        raise DataError(
            f"{args.target} has no chat template; give one with --set data.chat_template=FILE.jinja, or use "
            "usaf generate with plain prompts."
        )
    model = target.tuned()
    positions = context_positions(model)
    start = [{"role": "system", "content": args.system}] if args.system else []
    history = list(start)
    said_cut = False
    _undecodable_lines_kept(sys.stdin)
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
        if (problem := _not_utf8(line)) is not None:
            print(f"usaf: that line is not UTF-8 text ({problem}); type it again.", flush=True)
            continue
        history.append({"role": "user", "content": line})
        ids, dropped = _fitted(tokenizer, history, len(start), positions)
        if ids is None:
            history.pop()
            continue
        if dropped:
            print(
                f"(the conversation is over the model's context of {positions} positions: its {dropped} oldest "
                "messages are dropped)",
                flush=True,
            )
        if not said_cut and (cut := cut_line(settings, [len(ids)], positions)) is not None:
            print(cut, flush=True)
            said_cut = True
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        new = generate_ids(model, ids, settings, tokenizer, target.device, streamer=streamer)
        sys.stdout.flush()
        history.append({"role": "assistant", "content": tokenizer.decode(new, skip_special_tokens=True)})


def _fitted(tokenizer, history: list[dict], kept: int, positions):
    """(the conversation's tokens, messages dropped): the oldest turns after the first `kept` (the system
    message) are dropped from `history` until the conversation leaves the model room to answer; (None, 0), with
    a line, when the last message alone does not fit."""
    from usaf.data.records import TextLimit
    from usaf.generate.generation import OverContext, prompt_ids
    from usaf.generate.prompts import Prompt

    dropped = 0
    limit = TextLimit.of(tokenizer, positions) if positions is not None else None
    while True:
        try:
            return prompt_ids(
                tokenizer, Prompt(0, messages=tuple(history)), "the conversation", positions, limit
            ), dropped
        except OverContext:
            if len(history) - kept <= 1:  # the new message alone
                print(
                    f"usaf: that message is longer than the model's context of {positions} positions "
                    "(max_position_embeddings); say it shorter.",
                    flush=True,
                )
                return None, 0
            del history[kept : kept + 2]  # the oldest user turn and its answer
            dropped += 2


def _undecodable_lines_kept(stdin) -> None:
    """Bytes that are not UTF-8 kept as surrogate escapes (see _not_utf8) instead of a UnicodeDecodeError."""
    if callable(reconfigure := getattr(stdin, "reconfigure", None)):
        reconfigure(errors="surrogateescape")


def _not_utf8(line: str) -> str | None:
    """What is not UTF-8 in a line read with surrogateescape (the first such byte), or None."""
    bad = next((i for i, c in enumerate(line) if "\udc80" <= c <= "\udcff"), None)
    return None if bad is None else f"byte 0x{ord(line[bad]) - 0xDC00:02x} at character {bad + 1}"
