"""Record shapes: the layouts people write data in (alpaca, sharegpt, OpenAI messages, prompt/completion,
preference pairs, text, token ids) brought to usaf's record kinds, with the keys they leave unused.

normalize(record) -> (kind, record, ignored, shape); the kinds are the encoders'
(usaf.data.tokenize.ENCODERS):
  text                {"text"}
  messages            {"messages", ["tools"]}
  prompt/completion   {"prompt", "completion"}, both strings
  chat completion     {"prompt", "completion", ["tools"]}, both lists of messages: only the completion's
                      assistant turns are supervised
  input_ids           {"input_ids", ["labels"]}
`ignored` names what the record carried that usaf does not use: top-level keys ("id"), message keys
("messages[].weight") and, for preference pairs, "rejected".
"""

from __future__ import annotations

import json

from usaf.data.records import BadRecord, answer_named
from usaf.data.templates import MESSAGE_KEYS

# A shape is recognised by any of its trigger keys; then its required keys must all be there.
SHAPES = [  # (shape, trigger keys, required keys, optional keys)
    ("input_ids", {"input_ids"}, {"input_ids"}, {"labels"}),
    ("messages", {"messages", "conversations"}, set(), {"tools", "system"}),
    ("preference", {"chosen", "rejected"}, {"chosen", "rejected"}, {"prompt", "tools"}),
    ("prompt/completion", {"prompt", "completion"}, {"prompt", "completion"}, {"tools"}),
    ("alpaca", {"instruction", "output"}, {"instruction", "output"}, {"input", "system"}),
    ("text", {"text"}, {"text"}, set()),
]
# and KTO's "label" (normalize_unpaired), which the other objectives leave unused
RECORD_KEYS = set().union(*(triggers | required | optional for _, triggers, required, optional in SHAPES)) | {
    "label"
}
EXPECTED = (
    "expected text, messages (OpenAI or sharegpt), prompt/completion, prompt/chosen/rejected, "
    "instruction/input/output (alpaca) or input_ids records; map other column names with data.columns, "
    "e.g. data.columns={prompt: question, completion: answer}"
)

# sharegpt speakers -> OpenAI roles
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "function_response": "tool",
    "function_call": "assistant",
}


def drop_none(value):
    """The record as its author wrote it: Arrow gives every struct the union of its fields, so a key missing
    from one message comes back as None (and a chat template would render "None")."""
    if isinstance(value, dict):
        return {key: drop_none(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [drop_none(item) for item in value]
    return value


def rename(record: dict, columns: dict[str, str]) -> dict:
    """data.columns: {usaf key: source column}."""
    if not columns:
        return record
    renamed = {key: value for key, value in record.items() if key not in columns.values()}
    for key, column in columns.items():
        if column in record:
            renamed[key] = record[column]
    return renamed


def possible_shapes(keys: set) -> list[str]:
    """The shapes a table with these columns can hold (its null cells count as absent keys, row by row)."""
    return [shape for shape, triggers, required, _ in SHAPES if keys & triggers and required <= keys]


def shape_of(keys: set) -> tuple[str, set, set]:
    for shape, triggers, required, optional in SHAPES:
        if keys & triggers:
            missing = required - keys
            if missing:
                raise BadRecord(f"{shape} record is missing key(s) {sorted(missing)}")
            return shape, required | triggers, optional
    raise BadRecord(f"unknown record keys {sorted(keys)}; {EXPECTED}")


def chat_messages(value, where: str, ignored: set) -> list:
    """OpenAI messages as given, or sharegpt turns ({"from", "value"}) turned into them."""
    if not isinstance(value, list) or not value:
        raise BadRecord(f"'{where}' must be a non-empty list")
    messages = []
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise BadRecord(f"{where}[{index}] must be an object with 'role' and 'content'")
        if "from" in message and "role" not in message:  # sharegpt
            role = SHAREGPT_ROLES.get(str(message["from"]).lower())
            if role is None:
                raise BadRecord(
                    f"{where}[{index}] has from={message['from']!r}; allowed: {', '.join(SHAREGPT_ROLES)}"
                )
            message = {"role": role, "content": message.get("value", ""), **message}
            del message["from"]
            message.pop("value", None)
        unknown = set(message) - MESSAGE_KEYS
        ignored.update(f"{where}[].{key}" for key in unknown)
        messages.append({key: item for key, item in message.items() if key in MESSAGE_KEYS})
    return messages


def _tools(record: dict) -> dict:
    """{"tools": [...]} when the record has tools; tables often hold them as one JSON string."""
    if "tools" not in record:
        return {}
    tools = record["tools"]
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as error:
            raise BadRecord(f"'tools' is a string but not JSON: {error.msg}") from None
    return {"tools": tools}


def normalize_pair(
    record: object, columns: dict[str, str] | None = None, objective: str = "dpo"
) -> tuple[str, dict, dict, list[str], str]:
    """A preference pair (train.objective=dpo, orpo, simpo, kto): (kind, the chosen record, the rejected record,
    keys not used, shape), both prompt/completion records of one kind with the same prompt. Without a 'prompt',
    chosen and rejected conversations that share all turns but their last have it implicitly."""
    if not isinstance(record, dict):
        raise BadRecord(f"a record must be a JSON object, got {type(record).__name__}")
    record = rename(drop_none(record), columns or {})
    shape, used, optional = shape_of(set(record))
    if shape != "preference":
        raise BadRecord(
            f"train.objective={objective} trains on preference pairs (prompt/chosen/rejected), not {shape} records"
        )
    prompt, chosen, rejected = record.get("prompt"), record["chosen"], record["rejected"]
    if prompt is None and isinstance(chosen, list) and isinstance(rejected, list):
        if len(chosen) < 2 or len(rejected) < 2 or chosen[:-1] != rejected[:-1]:
            raise BadRecord(
                "without a 'prompt', 'chosen' and 'rejected' must be conversations that differ only in their last turn"
            )
        prompt, chosen, rejected = chosen[:-1], chosen[-1:], rejected[-1:]
    if prompt is None:
        raise BadRecord("a preference pair of texts needs its 'prompt'")
    tools = {"tools": record["tools"]} if "tools" in record else {}
    pieces = []
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        if isinstance(answer, str) and not answer.strip():
            raise BadRecord(f"'{name}' is empty: a preference pair compares two answers")
        with answer_named(name):
            pieces.append(normalize({"prompt": prompt, "completion": answer, **tools}))
    if pieces[0][1] == pieces[1][1]:
        raise BadRecord(
            "'chosen' and 'rejected' are the same answer: the pair teaches nothing (its DPO loss is ln 2 with no "
            "gradient); drop it or give the answer to prefer against"
        )
    if pieces[0][0] != pieces[1][0]:
        raise BadRecord("'chosen' and 'rejected' must both be text or both conversations")
    ignored = {key for key in record if key not in used | optional} | set(pieces[0][2]) | set(pieces[1][2])
    return pieces[0][0], pieces[0][1], pieces[1][1], sorted(ignored), shape


def normalize_unpaired(
    record: object, columns: dict[str, str] | None = None
) -> tuple[str, list[tuple[dict, bool]], list[str], str]:
    """KTO's records (train.objective=kto), TRL's unpaired preference format: (kind, [(prompt/completion record,
    desirable)], keys not used, shape). {prompt, completion, label: bool} is one; a preference pair is unpaired as
    TRL unpairs it, its chosen answer desirable and its rejected one not."""
    if not isinstance(record, dict):
        raise BadRecord(f"a record must be a JSON object, got {type(record).__name__}")
    renamed = rename(drop_none(record), columns or {})
    if {"chosen", "rejected"} & set(renamed):
        kind, chosen, rejected, ignored, shape = normalize_pair(renamed, objective="kto")
        return kind, [(chosen, True), (rejected, False)], ignored, shape
    if "label" not in renamed:
        raise BadRecord(
            "train.objective=kto trains on {prompt, completion, label: true|false} records (or prompt/chosen/"
            "rejected pairs); this record has no 'label'"
        )
    label = renamed.pop("label")
    if not isinstance(label, bool):
        raise BadRecord(f"'label' must be true (a desirable completion) or false, got {label!r}")
    kind, out, ignored, shape = normalize(renamed)
    if shape != "prompt/completion":
        raise BadRecord(f"train.objective=kto labels prompt/completion records, not {shape} records")
    return kind, [(out, label)], ignored, shape


def normalize(
    record: object, columns: dict[str, str] | None = None, alpaca: str = "plain"
) -> tuple[str, dict, list[str], str]:
    """(kind, record in usaf's keys, keys not used, the shape it came in); raises BadRecord. alpaca: how alpaca
    records are rendered, "plain" or "chat" (data.alpaca_format resolved)."""
    if not isinstance(record, dict):
        raise BadRecord(f"a record must be a JSON object, got {type(record).__name__}")
    record = rename(drop_none(record), columns or {})
    shape, used, optional = shape_of(set(record))
    ignored = {key for key in record if key not in used | optional}
    kind, out = shape, record
    if shape == "input_ids":
        out = {key: record[key] for key in ("input_ids", "labels") if key in record}
    elif shape == "messages":
        key = "messages" if "messages" in record else "conversations"
        ignored |= {"conversations"} if key == "messages" and "conversations" in record else set()
        messages = chat_messages(record[key], key, ignored)
        system = record.get("system")
        if isinstance(system, str) and system.strip() and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system})
        out = {"messages": messages, **_tools(record)}
    elif shape in ("preference", "prompt/completion"):
        answer = "chosen" if shape == "preference" else "completion"
        ignored |= {"rejected"} if shape == "preference" else set()
        prompt, completion = record.get("prompt"), record[answer]
        if isinstance(completion, list) or isinstance(prompt, list):
            if not isinstance(completion, list) or (prompt is not None and not isinstance(prompt, list)):
                raise BadRecord(f"'prompt' and '{answer}' must both be strings or both lists of messages")
            kind, out = (
                "chat completion",
                {
                    "prompt": chat_messages(prompt, "prompt", ignored) if prompt is not None else [],
                    "completion": chat_messages(completion, answer, ignored),
                    **_tools(record),
                },
            )
        elif prompt is None:  # a preference pair with the prompt inside chosen
            kind, out = "text", {"text": completion}
        else:
            kind, out = "prompt/completion", {"prompt": prompt, "completion": completion}
        if "tools" in record and kind != "chat completion":
            ignored.add("tools")
    elif shape == "alpaca":
        kind, out = _alpaca(record, alpaca)
    return kind, out, sorted(ignored), shape


def _alpaca(record: dict, alpaca: str) -> tuple[str, dict]:
    """alpaca_format=chat: a user turn (the instruction, then the input on the next line, as LLaMA-Factory joins
    them) answered by the output, through the chat template; plain: text with no template, the parts and the
    answer apart by a blank line each."""
    system, instruction, given = record.get("system"), record["instruction"], record.get("input")
    if not all(isinstance(part, str) for part in (system, instruction, given) if part is not None):
        raise BadRecord("alpaca 'system', 'instruction' and 'input' must be strings")
    if alpaca == "chat":
        if not isinstance(record["output"], str):
            raise BadRecord(f"'output' must be a string, got {type(record['output']).__name__}")
        question = "\n".join(part for part in (instruction, given) if part and part.strip())
        messages = [{"role": "system", "content": system}] if system and system.strip() else []
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": record["output"]},
        ]
        return "messages", {"messages": messages}
    prompt = "\n\n".join(part for part in (system, instruction, given) if part and part.strip()) + "\n\n"
    return "prompt/completion", {"prompt": prompt, "completion": record["output"]}
