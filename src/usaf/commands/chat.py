"""chat with a fine-tune in the terminal (streamed; /reset clears the history, /exit leaves)

An interactive chat with MODEL_OR_RUN through its chat template: each answer streams as it is generated and the
conversation is kept; /reset starts over, /exit (or end of input) leaves.
"""

from __future__ import annotations

import sys

from usaf.commands.generate import add_target, sampling


def add_arguments(parser) -> None:
    add_target(parser)
    parser.add_argument("--system", default=None, help="a system message at the start of the conversation")


def run(args) -> int:
    from transformers import TextStreamer

    from usaf.errors import UsafError
    from usaf.generate.generation import generate_ids, has_chat_template, prompt_ids, tokenizer_for_generation
    from usaf.generate.prompts import Prompt
    from usaf.generate.target import open_target

    settings = sampling(args)
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
        new = generate_ids(model, ids, settings, tokenizer, target.device, streamer=streamer)
        sys.stdout.flush()
        history.append({"role": "assistant", "content": tokenizer.decode(new, skip_special_tokens=True)})
