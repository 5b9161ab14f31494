"""Chat records: messages checked, rendered with the tokenizer's chat template, assistant turns supervised."""

from __future__ import annotations

import re

from usaf.data.records import BadRecord
from usaf.engine.loss import IGNORE_INDEX
from usaf.errors import UsafError

ROLES = ("system", "user", "assistant", "tool")
MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"}
_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _check_messages(record: dict) -> tuple[list[dict], object]:
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise BadRecord("'messages' must be a non-empty list")
    cleaned = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise BadRecord(f"{where} must be an object with 'role' and 'content'")
        message = {key: value for key, value in message.items() if value is not None}
        unknown = set(message) - MESSAGE_KEYS
        if unknown:
            raise BadRecord(f"{where} has unknown key(s) {sorted(unknown)}; allowed: {sorted(MESSAGE_KEYS)}")
        role = message.get("role")
        if role not in ROLES:
            raise BadRecord(f"{where} has role {role!r}; allowed: {', '.join(ROLES)}")
        if "content" not in message and "tool_calls" not in message:
            raise BadRecord(f"{where} is missing 'content'")
        if "content" in message and not isinstance(message["content"], str):
            raise BadRecord(f"{where}.content must be a string, got {type(message['content']).__name__}")
        cleaned.append(message)
    if not any(message["role"] == "assistant" for message in cleaned):
        raise BadRecord("'messages' has no assistant turn: nothing to learn")
    tools = record.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRecord("'tools' must be a list")
    return cleaned, tools


def _render(tokenizer, messages: list[dict], tools, add_generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as error:  # jinja errors, raise_exception() in templates, ...
        raise BadRecord(f"the chat template failed: {error}") from None


def _assistant_char_spans(tokenizer, messages: list[dict], tools, full: str) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in `full`, found by rendering the conversation's prefixes.

    A turn starts where the rendering of the earlier messages plus the generation prompt ends. It ends where
    the rendering up to and including it ends; templates that render a turn differently once later turns
    follow (e.g. dropping reasoning) fall back to finding its content plus the template's end-of-turn text.
    """
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if index == 0:
            raise BadRecord(
                "the conversation starts with an assistant turn; this needs a chat template with "
                "{% generation %} markers, or a user/system turn first"
            )
        before = _render(tokenizer, messages[:index], tools, add_generation_prompt=True)
        if not full.startswith(before):
            raise BadRecord(
                "cannot locate assistant turn: the chat template renders the conversation's start "
                "differently once more turns follow (use a template with {% generation %} markers)"
            )
        start = len(before)
        through = _render(tokenizer, messages[: index + 1], tools)
        if full.startswith(through):
            spans.append((start, len(through)))
            continue
        content = message.get("content", "")
        found = full.find(content, start) if content else -1
        if found < 0 or content not in through:
            raise BadRecord(
                f"cannot locate assistant turn messages[{index}] in the rendered chat (use a template with "
                "{% generation %} markers)"
            )
        end = found + len(content)
        closing = through[through.rfind(content) + len(content) :]
        if closing and full.startswith(closing, end):
            end += len(closing)
        spans.append((start, end))
    return spans


def encode_messages(record: dict, tokenizer) -> tuple[list[int], list[int]]:
    messages, tools = _check_messages(record)
    template = tokenizer.get_chat_template(tools=tools)
    if _GENERATION_MARKER.search(template):
        try:
            out = tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
        except Exception as error:
            raise BadRecord(f"the chat template failed: {error}") from None
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    else:
        full = _render(tokenizer, messages, tools)
        spans = _assistant_char_spans(tokenizer, messages, tools, full)
        encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(encoded["input_ids"])
        # A token is supervised when it overlaps an assistant span (as transformers does with generation
        # markers).
        mask = [any(s < end and e > start for start, end in spans) for s, e in encoded["offset_mapping"]]
    return ids, [token if keep else IGNORE_INDEX for token, keep in zip(ids, mask, strict=True)]


def check_chat_support(tokenizer, where: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise UsafError(
            f"{where}: chat records ('messages') need a tokenizer with a chat template, and this one has "
            "none; set tokenizer.chat_template or use {'prompt', 'completion'} records."
        )
    if not getattr(tokenizer, "is_fast", False):
        raise UsafError(f"{where}: chat records need a fast (tokenizers-backed) tokenizer for token offsets.")
