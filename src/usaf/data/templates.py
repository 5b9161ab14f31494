"""Chat records: messages checked and normalized, rendered with the chat template, assistant turns supervised.

What is supervised: the text of each assistant turn that the model itself generates at inference, its end-of-turn
token included, and nothing else. A turn's span comes from the template's `{% generation %}` markers when it has
them, else from rendering the conversation's prefixes (`_assistant_char_spans`). Either way, the text that the
inference prompt (`add_generation_prompt=True`) already supplies (the role header, DeepSeek's
`<｜tool▁outputs▁end｜>`) is taken off the span's start: the model is given it, never asked to predict it.

`use_chat_template` picks the template: data.chat_template, else the tokenizer's own; one without generation
markers that TRL knows is replaced by TRL's training variant of it (markers, prefix-preserving rendering).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from usaf.data.records import BadRecord, TextLimit, text_limit
from usaf.data.render import RenderBounds, TemplateBoundError, rendering
from usaf.engine.loss import IGNORE_INDEX
from usaf.errors import DataError, first_line
from usaf.io.text import read_text

ROLES = ("system", "developer", "user", "assistant", "tool")
# one reasoning text under the names templates read: Qwen3, GLM and DeepSeek read reasoning_content, gpt-oss thinking
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
# what a message may carry; shapes drops other keys (and names them in a note)
MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", *REASONING_KEYS}
MAX_MESSAGES = 512
_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
_TEMPLATE_ALIASES = {"chatml": "qwen2_5"}  # TRL names ChatML after Qwen2.5, whose template it is
_MAX_TEMPLATE_BYTES = 1 << 20  # a chat template is a few KB; anything larger is not one
# A template without generation markers has its assistant turns located by rendering the conversation's prefixes,
# ~1.5 renders of the whole chat a turn: time grows as turns x length. That work is bounded per record (turns are
# not rendered incrementally: a template is a function of the whole conversation).
PREFIX_RENDER_CHARS = 16 << 20


# ---- messages ---------------------------------------------------------------------------------------------------


def _text_content(content, where: str) -> str:
    """A message's content as one string: a string, or a list of text parts (OpenAI's content parts), joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRecord(
            f"{where}.content must be a string or a list of text parts, got {type(content).__name__}"
        )
    pieces = []
    for index, part in enumerate(content):
        if isinstance(part, str):
            pieces.append(part)
        elif (
            isinstance(part, dict)
            and part.get("type", "text") == "text"
            and isinstance(part.get("text"), str)
        ):
            pieces.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadRecord(
                f"{where}.content[{index}] is a {kind!r} part; only text parts "
                '({"type": "text", "text": ...}) can be trained on'
            )
    return "".join(pieces)


def _tool_call(call, where: str) -> dict:
    """OpenAI's {"type": "function", "function": {"name", "arguments"}} (or the flat {"name", "arguments"}), with
    the arguments as a dict: what transformers documents and the templates' `| tojson` / `.items()` expect."""
    if not isinstance(call, dict):
        raise BadRecord(f"{where} must be an object with 'function': {{'name', 'arguments'}}")
    function = call.get("function", call)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise BadRecord(f"{where} needs a function name ('function': {{'name': ..., 'arguments': ...}})")
    arguments = function.get("arguments")
    if arguments is None or arguments == "":
        arguments = {}
    elif isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            raise BadRecord(
                f"{where}.arguments is not valid JSON: {error.msg} (column {error.colno})"
            ) from None
    if not isinstance(arguments, dict):
        raise BadRecord(f"{where}.arguments must be a JSON object, got {type(arguments).__name__}")
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def check_message(message, where: str) -> dict:
    if not isinstance(message, dict):
        raise BadRecord(f"{where} must be an object with 'role' and 'content'")
    # unknown keys are dropped, not refused: exports carry ids, timestamps, weights no template reads
    given = {key: value for key, value in message.items() if value is not None}
    role = given.get("role")
    if role not in ROLES:
        raise BadRecord(f"{where} has role {role!r}; allowed: {', '.join(ROLES)}")
    out = {"role": role}
    if "content" in given:
        out["content"] = _text_content(given["content"], where)
    reasoning = [given[key] for key in REASONING_KEYS if key in given]
    if reasoning:
        if role != "assistant":
            raise BadRecord(f"{where} is a {role} turn with reasoning; only assistant turns have it")
        if not all(isinstance(text, str) for text in reasoning) or len(set(reasoning)) > 1:
            raise BadRecord(
                f"{where}: reasoning must be one string (give reasoning_content or thinking, not both)"
            )
        out["reasoning_content"] = out["thinking"] = reasoning[0]
    if "tool_calls" in given:
        calls = given["tool_calls"]
        if role != "assistant" or not isinstance(calls, list):
            raise BadRecord(f"{where}.tool_calls must be a list, on an assistant turn")
        if calls:
            out["tool_calls"] = [_tool_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(calls)]
    for key in ("name", "tool_call_id"):
        if key in given:
            if not isinstance(given[key], str):
                raise BadRecord(f"{where}.{key} must be a string")
            out[key] = given[key]
    if "content" not in out:
        if "tool_calls" not in out and "reasoning_content" not in out:
            raise BadRecord(f"{where} is missing 'content'")
        out["content"] = ""  # templates concatenate it (DeepSeek, gpt-oss): '' renders as nothing
    return out


def check_messages(record: dict) -> tuple[list[dict], list | None]:
    """A chat record's messages normalized for the templates (see _check_message), and its tools."""
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise BadRecord("'messages' must be a non-empty list")
    if (
        len(messages) > MAX_MESSAGES
    ):  # locating turns renders the chat once per turn: time grows as turns squared
        raise BadRecord(
            f"'messages' has {len(messages):,} turns; usaf encodes at most {MAX_MESSAGES:,} a record: split the "
            "conversation into several records"
        )
    cleaned = [check_message(message, f"messages[{index}]") for index, message in enumerate(messages)]
    if not any(message["role"] == "assistant" for message in cleaned):
        raise BadRecord("'messages' has no assistant turn: nothing to learn")
    tools = record.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(tool, dict) for tool in tools)):
        raise BadRecord("'tools' must be a list of JSON schemas (objects)")
    return cleaned, tools or None


def _cut_message(message: dict, limit: TextLimit) -> dict:
    """A message's texts cut to `limit` (only the chat's first max_seq_len tokens are kept: see TextLimit)."""
    cut = {"content": limit.cut(message["content"])}
    if "reasoning_content" in message:  # one text under two names (_check_message): cut once
        cut["reasoning_content"] = cut["thinking"] = limit.cut(message["reasoning_content"])
    return {**message, **cut}


def _fit_roles(messages: list[dict], template: str) -> list[dict]:
    """The developer role where the template has no branch for it (most but gpt-oss's) becomes system: such
    templates would drop the turn silently or fail; OpenAI's developer role is what system was."""
    if "developer" in template or not any(message["role"] == "developer" for message in messages):
        return messages
    return [
        {**message, "role": "system"} if message["role"] == "developer" else message for message in messages
    ]


# ---- the template -------------------------------------------------------------------------------------------------


def _trl_templates() -> dict[str, Path]:
    """TRL's shipped templates by name (qwen3, qwen3_training, llama3, gptoss, ...)."""
    try:
        import trl
    except ImportError:  # a dependency, but a broken environment should not stop non-chat data
        return {}
    folder = Path(trl.__file__).parent / "chat_templates"
    return {path.stem: path for path in sorted(folder.glob("*.jinja"))}


def template_names() -> list[str]:
    """The names data.chat_template accepts besides a file: TRL's stock templates and the aliases."""
    names = [name for name in _trl_templates() if not name.endswith("_training")]
    return sorted([*names, *_TEMPLATE_ALIASES])


def _read_setting(setting: str) -> str:
    templates = _trl_templates()
    name = _TEMPLATE_ALIASES.get(setting, setting)
    if name in templates:
        return read_text(templates[name])
    path = Path(os.path.expanduser(setting))
    if not path.is_file():
        looks_like_file = path.suffix or os.sep in setting or "/" in setting
        what = "no such file" if looks_like_file else "not a template name"
        raise DataError(
            f"data.chat_template={setting}: {what}; give a .jinja file or one of TRL's templates: "
            f"{', '.join(template_names())}."
        )
    if path.stat().st_size > _MAX_TEMPLATE_BYTES:
        raise DataError(f"data.chat_template={setting}: over 1 MB, not a chat template.")
    try:
        return read_text(path)
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"data.chat_template={setting}: cannot read it: {first_line(error)}.") from None


def _training_variant(tokenizer) -> str | None:
    """TRL's training variant of the tokenizer's template (TRL matches it against its stock templates), or None
    when TRL has none. TRL compares exactly, so a copy that differs only in surrounding whitespace (a trailing
    newline from a .jinja file) is matched here too; and TRL's own checks render the template, which a template
    of a family it does not know may refuse: that only means TRL has no variant."""
    try:
        from trl.chat_template_utils import get_training_chat_template

        variant = get_training_chat_template(tokenizer)
    except Exception:  # ValueError (unknown template), template errors of its probes
        variant = None
    if variant is None:
        template = tokenizer.chat_template
        template = template.get("default", "") if isinstance(template, dict) else template
        templates = _trl_templates()
        for name, path in templates.items():
            if f"{name}_training" in templates and read_text(path).strip() == template.strip():
                return read_text(templates[f"{name}_training"])
    return variant


def use_chat_template(tokenizer, setting: str = "") -> None:
    """Set on `tokenizer` the chat template that training renders 'messages' records with: `setting` (a .jinja
    file or a TRL template name; data.chat_template) or the tokenizer's own, replaced by TRL's training variant
    when it has no generation markers and TRL knows it. A template with markers is kept as it is."""
    if getattr(tokenizer, "missing", False) or not hasattr(tokenizer, "apply_chat_template"):
        return  # no tokenizer files: only pre-tokenized data, which needs no template
    if setting:
        text = _read_setting(setting)
        _check_compiles(tokenizer, text, setting)
        tokenizer.chat_template = text
    tokenizer.usaf_template_origin = (
        f"data.chat_template={setting}"
        if setting
        else f"of {getattr(tokenizer, 'name_or_path', '') or 'the tokenizer'}"
    )
    template = tokenizer.chat_template
    if not template or _GENERATION_MARKER.search(
        template["default"] if isinstance(template, dict) else template
    ):
        return
    with rendering(RenderBounds()):  # TRL's checks render the template
        variant = _training_variant(tokenizer)
    if variant is not None:
        tokenizer.chat_template = variant


def _check_compiles(tokenizer, text: str, setting: str) -> None:
    from jinja2 import TemplateSyntaxError

    try:  # transformers' own sandboxed environment, with its {% generation %} extension, bounded
        with rendering(RenderBounds()):
            tokenizer.apply_chat_template(
                [{"role": "user", "content": "x"}],
                chat_template=text,
                tokenize=False,
                add_generation_prompt=True,
            )
    except TemplateBoundError as error:
        raise DataError(f"data.chat_template={setting}: the template {error}; {_BOUND_HINT}.") from None
    except TemplateSyntaxError as error:
        raise DataError(
            f"data.chat_template={setting}: not a valid Jinja template: line {error.lineno}: {error.message}."
        ) from None
    except Exception:  # a template may refuse this probe (raise_exception); records will tell
        pass


# ---- rendering and spans ------------------------------------------------------------------------------------------


_BOUND_HINT = "a chat template renders a conversation well inside that: fix the template (or use another)"


def _input_chars(messages: list[dict], tools) -> int:
    """The size of what a template is given: its output may be a few times that (RenderBounds)."""
    texts = sum(
        len(str(message.get(key, ""))) for message in messages for key in ("content", "reasoning_content")
    )
    return texts + (len(json.dumps(tools, default=str)) if tools else 0)


def _template_failed(tokenizer, error: Exception) -> BadRecord:
    if isinstance(error, TemplateBoundError):
        origin = getattr(tokenizer, "usaf_template_origin", "of the tokenizer")
        return BadRecord(f"the chat template ({origin}) {error}; {_BOUND_HINT}")
    return BadRecord(f"the chat template failed: {first_line(error)}")


def bounded_render(tokenizer, messages: list[dict], tools, add_generation_prompt: bool = False) -> str:
    """The chat rendered as text, within RenderBounds (usaf.data.render)."""
    with rendering(RenderBounds(_input_chars(messages, tools))):
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )


def _render(tokenizer, messages: list[dict], tools, add_generation_prompt: bool = False) -> str:
    try:
        return bounded_render(tokenizer, messages, tools, add_generation_prompt)
    except Exception as error:  # jinja errors, raise_exception() in templates, a bound met, ...
        raise _template_failed(tokenizer, error) from None


def _check_prefix_cost(messages: list[dict], full: str, turns: int) -> None:
    """Locating `turns` turns renders ~1.5 whole chats each: refused up front past PREFIX_RENDER_CHARS."""
    cost = 3 * turns * len(full) // 2
    if cost > PREFIX_RENDER_CHARS:
        raise BadRecord(
            f"locating its {turns} assistant turns would render ~{cost:,} characters (the chat template has no "
            f"{{% generation %}} markers, so each turn renders the conversation before it; at most "
            f"{PREFIX_RENDER_CHARS:,} a record): split the conversation into shorter records, or set "
            "data.chat_template to a template with {% generation %} markers"
        )


def _common_prefix(a: str, b: str) -> int:
    size = min(len(a), len(b))
    if a[:size] == b[:size]:
        return size
    low, high = 0, size  # a[:low] == b[:low] and a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low


def _prompt_end(tokenizer, messages: list[dict], tools, index: int, full: str) -> int:
    """Where, in `full`, the text that the inference prompt for turn `index` supplies ends: the common prefix of
    `full` and the conversation before the turn rendered with add_generation_prompt=True. A common prefix that
    ends inside a piece of plain text (the prompt's `<think>\\n` against content that begins with '<') is cut
    back to the end of the last special token in it, so no content character is taken by coincidence."""
    prompt = _render(tokenizer, messages[:index], tools, add_generation_prompt=True)
    end = _common_prefix(prompt, full)
    if end == len(prompt):
        return end
    specials = [token for token in tokenizer.get_added_vocab() if token]
    head = full[:end]
    if any(head.endswith(token) for token in specials):
        return end
    window = max(0, end - 512)  # a role header is short: look back no further
    ends = [head.rfind(token, window) + len(token) for token in specials if token in head[window:]]
    return max(ends, default=0)


def _assistant_char_spans(tokenizer, messages: list[dict], tools, full: str) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in `full`, for a template without generation markers.

    A turn starts where the inference prompt before it ends (_prompt_end). It ends where the rendering of the
    conversation through it ends, when that rendering is a prefix of `full`. Templates that render a turn
    differently once later turns follow (Qwen3 drops the empty reasoning block of earlier turns) are matched by
    the turn's tail: the longest end of its last-turn rendering found in `full` just after the start, which must
    hold the turn's own text (content, tool names) and so ends with its end-of-turn text. A template that closes a turn
    only with the next message's opening (GLM's `<|user|>`) gets that opening token supervised in
    `_stop_tokens`, as the model stops by emitting it.
    """
    spans = []
    _check_prefix_cost(messages, full, sum(message["role"] == "assistant" for message in messages))
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if index == 0:
            raise BadRecord(
                "the conversation starts with an assistant turn; this needs a chat template with "
                "{% generation %} markers, or a user/system turn first"
            )
        before = _render(tokenizer, messages[:index], tools)
        if not full.startswith(before):
            raise BadRecord(
                f"cannot locate assistant turn messages[{index}]: the chat template renders the conversation "
                "before it differently once more turns follow; set data.chat_template to a template with "
                "{% generation %} markers"
            )
        start = max(len(before), _prompt_end(tokenizer, messages, tools, index, full))
        through = _render(tokenizer, messages[: index + 1], tools)
        if full.startswith(through):
            spans.append((start, len(through)))
            continue
        turn = through[_common_prefix(through, before) :]
        # the longest end of `turn` found in full right after the start (a shorter end always is); the window
        # keeps a later turn with the same text from being taken for this one
        window = start + len(turn) + 256
        low, high = 0, len(turn)
        while low < high:
            middle = (low + high + 1) // 2
            if full.find(turn[-middle:], start, window) >= 0:
                low = middle
            else:
                high = middle - 1
        found = full.find(turn[len(turn) - low :], start, window) if low else -1
        # the turn's own text must be in what was found (its reasoning need not: templates drop earlier ones)
        own = [message.get("content", "").strip()]
        own += [call["function"]["name"] for call in message.get("tool_calls", [])]
        if found < 0 or not all(piece in full[found : found + low] for piece in own if piece):
            raise BadRecord(
                f"cannot locate assistant turn messages[{index}] in the rendered chat: the template renders it "
                "differently once more turns follow; set data.chat_template to a template with "
                "{% generation %} markers"
            )
        end = found + low
        spans.append((start, end))
    return spans


def _marked_char_spans(
    tokenizer, messages: list[dict], tools, full: str
) -> tuple[list[tuple[int, int]], dict]:
    """The character spans of a template's {% generation %} blocks, one per assistant turn, their starts moved
    past what the inference prompt supplies (DeepSeek's and gpt-oss's training templates mark the role header);
    and the tokenized chat (input_ids, offset_mapping) they were found in."""
    try:
        with rendering(RenderBounds(_input_chars(messages, tools))):
            out = tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
                tokenizer_kwargs={"return_offsets_mapping": True},
            )
    except Exception as error:  # jinja errors, raise_exception() in templates, a bound met
        raise _template_failed(tokenizer, error) from None
    runs, current = [], None
    for (start, end), marked in zip(out["offset_mapping"], out["assistant_masks"], strict=True):
        if marked and current is not None and start <= current[1]:
            current[1] = end
        elif marked:
            current = [start, end]
            runs.append(current)
        else:
            current = None
    turns = [index for index, message in enumerate(messages) if message["role"] == "assistant" and index > 0]
    if (
        turns
    ):  # most templates (Qwen, Llama, GLM) mark from just after the assistant header: no prompt to take off
        before = _render(tokenizer, messages[: turns[0]], tools)
        header = _render(tokenizer, messages[: turns[0]], tools, add_generation_prompt=True)[len(before) :]
        if header.strip() and all(full[:start].endswith(header) for start, _ in runs):
            return [(start, end) for start, end in runs], out
    # a run is one turn's; the prompt of that turn is the last one to end by the run's end
    _check_prefix_cost(messages, full, len(turns))
    prompt_ends = [_prompt_end(tokenizer, messages, tools, index, full) for index in turns]
    spans = []
    for start, end in runs:
        floor = max([start, *[prompt_end for prompt_end in prompt_ends if prompt_end <= end][-1:]])
        spans.append((floor, end))
    return spans, out


def _stop_tokens(tokenizer, messages, tools, full: str, spans, offsets) -> set[int]:
    """Tokens to supervise after the turns of a template that writes no end-of-turn text of its own (GLM): the
    special token that opens the next message (<|user|>, <|observation|>) is what the model emits to stop. A turn
    ends by itself when its text ends with the eos token; and a next-message token that also opens the assistant
    header (ChatML's <|im_start|>, Llama 3's <|start_header_id|>) opens any message, so it is no stop signal."""
    specials = {token for token in tokenizer.get_added_vocab() if token}
    first = next((index for index, message in enumerate(messages) if message["role"] == "assistant"), 0)
    before = _render(tokenizer, messages[:first], tools) if first else ""
    header = (
        _render(tokenizer, messages[:first], tools, add_generation_prompt=True)[len(before) :]
        if first
        else ""
    )
    eos = tokenizer.eos_token
    extra = set()
    for _, end in spans:
        if eos and full[:end].rstrip().endswith(eos):
            continue
        after = next((t for t, (s, e) in enumerate(offsets) if s >= end and e > s), None)
        if after is None or full[end : offsets[after][0]].strip():
            continue
        token = full[offsets[after][0] : offsets[after][1]]
        if token in specials and not header.lstrip().startswith(token):
            extra.add(after)
    return extra


def _string_arguments(messages: list[dict]) -> list[dict]:
    """Tool-call arguments as JSON strings, for templates that concatenate them (DeepSeek-V3's own)."""
    out = []
    for message in messages:
        if "tool_calls" in message:
            calls = [
                {
                    **call,
                    "function": {**call["function"], "arguments": json.dumps(call["function"]["arguments"])},
                }
                for call in message["tool_calls"]
            ]
            message = {**message, "tool_calls": calls}
        out.append(message)
    return out


def _supervised(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Whether each token overlaps a span (as transformers masks generation blocks); one pass, both in order."""
    spans = sorted(span for span in spans if span[0] < span[1])
    mask, index = [], 0
    for start, end in offsets:
        while index < len(spans) and spans[index][1] <= start:
            index += 1
        mask.append(index < len(spans) and end > spans[index][0])
    return mask


def _encode(
    tokenizer, messages: list[dict], tools, template: str, context: int = 0
) -> tuple[list[int], list[int]]:
    full = _render(tokenizer, messages, tools)
    marked = bool(_GENERATION_MARKER.search(template))
    if marked:
        spans, encoded = _marked_char_spans(tokenizer, messages, tools, full)
    else:
        spans = _assistant_char_spans(tokenizer, messages, tools, full)
        encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoded["input_ids"]), [tuple(pair) for pair in encoded["offset_mapping"]]
    mask = _supervised(offsets, spans)
    if not marked:
        for token in _stop_tokens(tokenizer, messages, tools, full, spans, offsets):
            mask[token] = True
    if context:  # the first `context` messages are the prompt: their assistant turns (few-shot examples) too
        before = _render(tokenizer, messages[:context], tools, add_generation_prompt=True)
        if not full.startswith(before):
            raise BadRecord(
                "cannot tell the prompt's tokens from the completion's: the chat template renders the prompt "
                "differently once the completion follows"
            )
        mask = [keep and start >= len(before) for keep, (start, _) in zip(mask, offsets, strict=True)]
    return ids, [token if keep else IGNORE_INDEX for token, keep in zip(ids, mask, strict=True)]


def encode_messages(record: dict, tokenizer, context: int = 0) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of a chat record: the assistant turns after the first `context` messages supervised;
    under a TextLimit (a truncated record: usaf.data.records.limited), each message's text cut to it before the
    chat is rendered."""
    messages, tools = check_messages(record)
    if (limit := text_limit()) is not None:
        messages = [_cut_message(message, limit) for message in messages]
    try:
        template = tokenizer.get_chat_template(tools=tools)
    except Exception as error:  # no template, or no variant for tools
        raise BadRecord(f"the chat template failed: {first_line(error)}") from None
    messages = _fit_roles(messages, template)
    try:
        return _encode(tokenizer, messages, tools, template, context)
    except BadRecord:
        if not any("tool_calls" in message for message in messages):
            raise
        failed = sys.exc_info()[1]
    try:  # dict arguments are what transformers documents, but some templates only concatenate strings
        return _encode(tokenizer, _string_arguments(messages), tools, template, context)
    except BadRecord:
        raise failed from None


def check_chat_support(tokenizer, where: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"{where}: chat records ('messages') need a tokenizer with a chat template, and this one has "
            "none; set data.chat_template (a .jinja file or a name such as chatml) or use "
            "{'prompt', 'completion'} records."
        )
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"{where}: chat records need a fast (tokenizers-backed) tokenizer for token offsets.")
