"""An Ollama Modelfile beside a GGUF (OUT.gguf's is OUT.Modelfile, so that several GGUFs share a folder): FROM the
file, the model's chat template as a Go template, its stop tokens.

Ollama's TEMPLATE is a Go template over `.Messages` (each with `.Role` and `.Content`), not Jinja, and arbitrary Jinja
cannot be translated faithfully. Most chat templates, though, wrap each message in a fixed prefix and suffix by role
and end with a fixed generation prompt; those wrappers are read off the model's own template (rendered by
transformers) and the result is checked against it on a multi-turn conversation. A template that is not of that
shape gets ChatML where the tokenizer has ChatML's tokens, else a plain `role: content` layout, and the Modelfile's
comment says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from usaf.io.atomic import atomic_file
from usaf.model.hf import load_tokenizer

ROLES = ("system", "user", "assistant")
# a marker no template writes itself, and none of it whitespace: a template that trims the content (Llama 3's
# `| trim`) keeps it whole (Python's str.strip, which Jinja's trim is, strips \x1c-\x1f too)
CONTENT = "usaf-Content-7f3a"
CHECK = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "first question"},
    {"role": "assistant", "content": "first answer"},
    {"role": "user", "content": "second question"},
]


@dataclass
class Turns:
    """A chat layout as Ollama renders it: per message its role's prefix, content and suffix (no suffix for a last
    assistant message, which the model continues), then `prompt` after a last non-assistant message."""

    prefix: dict[str, str]
    suffix: dict[str, str]
    prompt: str

    def render(self, messages: list[dict]) -> str:
        text = ""
        for index, message in enumerate(messages):
            last, role = index == len(messages) - 1, message["role"]
            text += (
                self.prefix[role]
                + message["content"]
                + ("" if last and role == "assistant" else self.suffix[role])
            )
            if last and role != "assistant":
                text += self.prompt
        return text

    def go_template(self) -> str:
        branches = "".join(
            f'{"if" if i == 0 else "else if"} eq .Role "{role}" }}}}{self.prefix[role]}{{{{ .Content }}}}'
            + (
                f"{{{{ if not $last }}}}{self.suffix[role]}{{{{ end }}}}{{{{ "
                if role == "assistant"
                else f"{self.suffix[role]}{{{{ "
            )
            for i, role in enumerate(ROLES)
        )
        return (
            f"{{{{ range $i, $_ := .Messages }}}}{{{{ $last := eq (len (slice $.Messages $i)) 1 }}}}"
            f'{{{{ {branches}end }}}}{{{{ if and $last (ne .Role "assistant") }}}}{self.prompt}{{{{ end }}}}'
            "{{ end }}"
        )


def _render(tokenizer, messages: list[dict], prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)


def _one_message(tokenizer, role: str) -> tuple[str, str]:
    """What the template writes before and after one message of `role` (a conversation of it alone)."""
    before, _, after = _render(tokenizer, [{"role": role, "content": CONTENT}], False).partition(CONTENT)
    return before, after


def read_turns(tokenizer) -> Turns | None:
    """The model's chat template as per-role wrappers, or None where it is not of that shape (checked)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        wrapped = {role: _one_message(tokenizer, role) for role in ROLES}
        alone = _render(tokenizer, [{"role": "user", "content": CONTENT}], False)
        prompt = _render(tokenizer, [{"role": "user", "content": CONTENT}], True).removeprefix(alone)
        expected = _render(tokenizer, CHECK, True)
    except Exception:  # any template error (a role it refuses, an alternation check): not this shape
        return None
    # the BOS before the first message: llama.cpp adds it itself (the GGUF's add_bos_token)
    bos = tokenizer.bos_token or ""
    if not all(before.startswith(bos) for before, _ in wrapped.values()):
        bos = ""
    turns = Turns(
        {role: before.removeprefix(bos) for role, (before, _) in wrapped.items()},
        {role: after for role, (_, after) in wrapped.items()},
        prompt,
    )
    return turns if bos + turns.render(CHECK) == expected else None


def chatml(tokenizer) -> Turns | None:
    """ChatML (Qwen and many others) where the tokenizer has its two tokens."""
    vocab = tokenizer.get_vocab()
    if "<|im_start|>" not in vocab or "<|im_end|>" not in vocab:
        return None
    return Turns(
        {role: f"<|im_start|>{role}\n" for role in ROLES},
        dict.fromkeys(ROLES, "<|im_end|>\n"),
        "<|im_start|>assistant\n",
    )


def stop_tokens(model_dir: Path, tokenizer, turns: Turns) -> list[str]:
    """The tokens that end a reply: generation_config's eos_token_id(s), the tokenizer's EOS, and the assistant
    turn's closing token where that is one special token."""
    ids = []
    config = model_dir / "generation_config.json"
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids = eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
    found = [tokenizer.convert_ids_to_tokens(i) for i in ids] + [tokenizer.eos_token]
    closing = turns.suffix["assistant"].strip()
    if closing in tokenizer.all_special_tokens:
        found.append(closing)
    return list(dict.fromkeys(token for token in found if token))


def modelfile(model_dir: Path, gguf: Path) -> str:
    """The Modelfile's text for `gguf`, converted from the model in `model_dir`."""
    tokenizer = load_tokenizer(str(model_dir))
    turns = read_turns(tokenizer)
    if turns is not None:
        note = "TEMPLATE: the model's chat template, translated to Go template syntax (checked on a multi-turn chat)"
    elif (turns := chatml(tokenizer)) is not None:
        note = (
            "TEMPLATE: ChatML from the tokenizer's <|im_start|>/<|im_end|> tokens; the model's chat template could not "
            "be translated to Go template syntax faithfully: check it against the model's tokenizer_config.json"
        )
    else:
        turns = Turns({role: f"{role}: " for role in ROLES}, dict.fromkeys(ROLES, "\n"), "assistant: ")
        note = (
            "TEMPLATE: a generic `role: content` layout, NOT the model's own: its chat template could not be "
            "translated to Go template syntax and the tokenizer has no ChatML tokens; write the TEMPLATE by hand"
        )
    lines = [
        f"# written by usaf export for {gguf.name}: ollama create NAME -f {modelfile_path(gguf).name}",
        f"# {note}",
        f"FROM ./{gguf.name}",
        f'TEMPLATE """{turns.go_template()}"""',
        *(f"PARAMETER stop {json.dumps(token)}" for token in stop_tokens(model_dir, tokenizer, turns)),
    ]
    return "\n".join(lines) + "\n"


def modelfile_path(gguf: Path) -> Path:
    return Path(gguf).with_suffix(".Modelfile")


def write_modelfile(model_dir: Path, gguf: Path) -> Path:
    """The Modelfile beside `gguf`, written whole or not at all."""
    path = modelfile_path(gguf)
    text = modelfile(Path(model_dir), gguf)
    atomic_file(path, lambda tmp: tmp.write_text(text))
    return path
