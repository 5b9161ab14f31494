"""Issue 35, "the context window bounds everything", "data that teaches nothing" and the generation options and
text decoding of "tracebacks" and "inconsistent": data.max_seq_len above the model's positions is clamped with
one line for every objective and command (DPO at the defaults trains); generation stops at the context; a
preference pair that teaches nothing is a bad record naming file:LINE and the key; sampling options out of range,
bytes that are not UTF-8 on chat's input and a byte-order mark are each one line (or read); no tokenizer call
takes a 4 MB record whole. The machinery and the workspace `ws` are in tests/faults.py; the tiny model there has
64 positions."""

from __future__ import annotations

import io
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from faults import Row, table_test

from usaf.cli import main
from usaf.data import load_dataset, records
from usaf.errors import UsafError
from usaf.files import CONFIG_FILE, METRICS_FILE
from usaf.generate.generation import prompt_ids
from usaf.generate.prompts import Prompt
from usaf.train.tokenizer import char_tokenizer

DEMO = Path(__file__).resolve().parents[2] / "src" / "usaf" / "demo_assets"
CLAMPED = "data.max_seq_len=512 is above the model's 64 positions"
BOM = b"\xef\xbb\xbf"

# ---- files a row writes into its own folder ({tmp}) -----------------------------------------------------------------


def writes(name: str, content: bytes | str | list):
    """A setup that writes {tmp}/NAME: bytes, text, or a list of records (one JSON line each)."""

    def setup(ctx, monkeypatch):
        data = content
        if isinstance(data, list):
            data = "".join(json.dumps(record) + "\n" for record in data)
        if isinstance(data, str):
            data = data.encode()
        (ctx.tmp / name).write_bytes(data)

    return setup


def stdin(raw: bytes, then=None):
    """A setup that gives chat `raw` on its standard input (a UTF-8 text stream, as a terminal or pipe is)."""

    def setup(ctx, monkeypatch):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8"))
        if then is not None:
            then(ctx, monkeypatch)

    return setup


PROMPT = [{"prompt": "copy abc ->"}]
GOOD_PAIR = {"prompt": "copy ab ->", "chosen": " ab", "rejected": " ba"}
LONG = "x" * 80  # past the 64 positions
GEN = ["generate", "{ws.base}", "--prompts={tmp}/p.jsonl", "--out={tmp}/o.jsonl"]
PAIRS = ["data", "--model={ws.base}", "--data={tmp}/pairs.jsonl", "--set=train.objective=dpo"]
CHAT = ["chat", "{ws.base}", "--max-new-tokens=8"]


def sample(*options: str) -> Row:
    """A generate row with sampling options out of range: refused before anything loads."""
    return Row(
        f"generate {' '.join(options)}",
        [*GEN, "--do-sample", *options],
        2,
        [options[0].split("=")[0]],
        setup=writes("p.jsonl", PROMPT),
        absent=["{tmp}/o.jsonl"],
    )


ANSWER = {"role": "assistant", "content": "yo"}


def chat_pair(chosen: list, rejected: list) -> dict:
    """A preference pair of conversations after one user turn."""
    return {"prompt": [{"role": "user", "content": "hi"}], "chosen": chosen, "rejected": rejected}


ROWS = [
    # A. the context window: one rule for every command (failed before: data said nothing, eval/select refused,
    # generate ran past the context)
    Row(
        "data at the default max_seq_len is clamped to the context",
        ["data", "--model={ws.base}", "--data={ws.long}", "--show=1"],
        0,
        [CLAMPED, "using 64"],
    ),
    Row(
        "eval at the default max_seq_len is clamped", ["eval", "{ws.base}", "--data={ws.long}"], 0, [CLAMPED]
    ),
    Row(
        "select at the default max_seq_len is clamped",
        ["select", "--model={ws.base}", "--data={ws.long}", "--out={tmp}/s.safetensors"],
        0,
        [CLAMPED],
    ),
    Row(
        "generate --max-new-tokens 65536 is cut to the context",
        [*GEN, "--max-new-tokens=65536"],
        0,
        ["--max-new-tokens 65,536 is cut to at most", "context of 64 positions"],
        setup=writes("p.jsonl", PROMPT),
    ),
    Row(
        "generate: a prompt over the context",
        GEN,
        2,
        ["{tmp}/p.jsonl:2", "64 positions"],
        setup=writes("p.jsonl", [*PROMPT, {"prompt": LONG}]),
        absent=["{tmp}/o.jsonl"],
    ),
    Row(
        "chat: history over the context drops its oldest turns",
        CHAT,
        0,
        ["oldest messages are dropped"],
        setup=stdin(b"abcdefghijklmnop\nqrstuvwxyzabcdef\nghijklmnopqrstuv\n/exit\n"),
    ),
    Row(
        "chat: a message over the context is refused, the chat goes on",
        CHAT,
        0,
        ["that message is longer than the model's context of 64 positions"],
        setup=stdin(LONG.encode() + b"\nhi\n/exit\n"),
    ),
    # B. data that teaches nothing (failed before: accepted, or 'completion' named)
    Row(
        "pair: chosen and rejected the same",
        PAIRS,
        2,
        ["{tmp}/pairs.jsonl:2", "'chosen' and 'rejected' are the same", "teaches nothing"],
        setup=writes("pairs.jsonl", [GOOD_PAIR, {**GOOD_PAIR, "rejected": " ab"}]),
    ),
    Row(
        "pair: the same once truncated",
        PAIRS,
        2,
        ["{tmp}/pairs.jsonl:1", "the same after truncation to max_seq_len=64"],
        setup=writes(
            "pairs.jsonl",
            [{"prompt": "x" * 40, "chosen": " " + "a" * 30 + "1", "rejected": " " + "a" * 30 + "2"}],
        ),
    ),
    Row(
        "pair: chosen the same as rejected, chats",
        PAIRS,
        2,
        ["{tmp}/pairs.jsonl:1", "the same"],
        setup=writes(
            "pairs.jsonl",
            [chat_pair([ANSWER], [ANSWER])],
        ),
    ),
    Row(
        "pair: empty rejected named",
        PAIRS,
        2,
        ["{tmp}/pairs.jsonl:1", "'rejected' is empty"],
        setup=writes("pairs.jsonl", [{**GOOD_PAIR, "rejected": ""}]),
    ),
    Row(
        "pair: empty chosen conversation named",
        PAIRS,
        2,
        ["{tmp}/pairs.jsonl:1", "'chosen' must be a non-empty"],
        setup=writes(
            "pairs.jsonl",
            [chat_pair([], [ANSWER])],
        ),
    ),
    Row(
        "pair: a rejected of the wrong type named",
        PAIRS,
        2,
        ["{tmp}/pairs.jsonl:1", "'rejected' must be a string"],
        setup=writes("pairs.jsonl", [{**GOOD_PAIR, "rejected": 5}]),
    ),
    Row(
        "pair that teaches nothing skipped and counted",
        [*PAIRS, "--skip-bad-records"],
        0,
        ["1 bad skipped", "pairs.jsonl:2: 'chosen' and 'rejected' are the same"],
        setup=writes("pairs.jsonl", [GOOD_PAIR, {**GOOD_PAIR, "chosen": " ba"}]),
    ),
    # C. sampling options: each one line naming the option and its range (failed before: tracebacks, or accepted)
    sample("--temperature=1e-300"),
    sample("--temperature=inf"),
    sample("--seed=100000000000000000000000"),
    sample("--seed=-1"),
    # (these were already one line before: kept as the rest of the class)
    sample("--temperature=0"),
    sample("--temperature=-1"),
    sample("--temperature=nan"),
    sample("--top-p=0"),
    sample("--top-p=1.5"),
    sample("--top-k=-1"),
    sample("--seed=1e23"),
    # text decoding (failed before: a traceback on chat's input; a BOM refused in prompts and JSON data, read as
    # a character in text data)
    Row(
        "chat: standard input that is not UTF-8",
        CHAT,
        0,
        ["that line is not UTF-8 text (byte 0xff"],
        setup=stdin(b"hi \xff there\nhi\n/exit\n"),
    ),
    Row(
        "generate: prompts file with a byte-order mark",
        [*GEN, "--max-new-tokens=2"],
        0,
        ["wrote 1 rows"],
        setup=writes("p.jsonl", BOM + json.dumps(PROMPT[0]).encode() + b"\n"),
    ),
    Row(
        "data: JSON lines with a byte-order mark",
        ["data", "--model={ws.base}", "--data={tmp}/d.jsonl"],
        0,
        ["data: 1 records"],
        setup=writes("d.jsonl", BOM + b'{"text": "hello"}\n'),
    ),
    Row(
        "data: a text file with a byte-order mark",
        ["data", "--model={ws.base}", "--data={tmp}/d.txt"],
        0,
        ["[[hello"],
        setup=writes("d.txt", BOM + b"hello\n"),
    ),
    Row(
        "generate: a prompts file that is not UTF-8",
        GEN,
        2,
        ["{tmp}/p.jsonl:2: not UTF-8"],  # (as before)
        setup=writes("p.jsonl", json.dumps(PROMPT[0]).encode() + b'\n{"prompt": "\xff"}\n'),
    ),
]

test_fault = table_test(ROWS)


@pytest.mark.slow
def test_dpo_at_every_default_trains_and_resumes_the_same(tmp_path, capsys):
    """The bundled model (64 positions) and preference data at data.max_seq_len's default: trains with finite
    losses (a traceback before); config.yaml records the effective 64, which a resume reads without a word."""
    run = tmp_path / "run"
    quiet = ["--set=log.progress=false", "--set=log.tensorboard=false"]
    assert (
        main(
            [
                "train",
                f"--model={DEMO / 'model'}",
                f"--data={DEMO / 'data' / 'preference_train.jsonl'}",
                f"--out={run}",
                "--set=train.objective=dpo",
                "--set=schedule.max_steps=2",
                *quiet,
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.count(CLAMPED) == 1, out
    losses = [
        row["loss"] for row in map(json.loads, (run / METRICS_FILE).read_text().splitlines()) if "loss" in row
    ]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses), losses
    assert yaml.safe_load((run / CONFIG_FILE).read_text())["data"]["max_seq_len"] == 64
    assert main(["train", f"--resume={run}", "--set=schedule.max_steps=3", *quiet]) == 0
    out = capsys.readouterr().out
    assert "is above the model's" not in out and "data.max_seq_len" not in out, out


def test_generation_without_eos_stops_at_the_context(ws, tmp_path, capsys):
    """A model that never ends (no end-of-sequence token) asked for 65,536 tokens stops where its 64 positions
    end (before: it generated until killed)."""
    model = Path(shutil.copytree(ws.base, tmp_path / "m"))
    for name in ("config.json", "generation_config.json"):
        path = model / name
        if path.exists():
            settings = json.loads(path.read_text())
            settings["eos_token_id"] = None
            path.write_text(json.dumps(settings))
    (tmp_path / "p.jsonl").write_text(json.dumps(PROMPT[0]) + "\n")
    out = tmp_path / "o.jsonl"
    assert (
        main(
            [
                "generate",
                str(model),
                f"--prompts={tmp_path / 'p.jsonl'}",
                f"--out={out}",
                "--max-new-tokens=65536",
            ]
        )
        == 0
    )
    assert "is cut to at most" in capsys.readouterr().out
    prompt_tokens = len(char_tokenizer()(PROMPT[0]["prompt"])["input_ids"])
    assert json.loads(out.read_text())["new_tokens"] == 64 - prompt_tokens


class _Backend:
    """A tokenizer's backend (the Rust tokenizer every encoding goes through), recording the longest text given."""

    def __init__(self, backend):
        self.backend, self.longest = backend, 0

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def encode_batch(self, inputs, *args, **kwargs):
        texts = [t for item in inputs for t in (item if isinstance(item, (tuple, list)) else [item])]
        self.longest = max([self.longest, *(len(t) for t in texts if isinstance(t, str))])
        return self.backend.encode_batch(inputs, *args, **kwargs)


def _spied():
    """(the char tokenizer, its spy)."""
    tokenizer = char_tokenizer()
    tokenizer._tokenizer = spy = _Backend(tokenizer._tokenizer)
    return tokenizer, spy


BIG = "ab cd " * 700_000  # 4.2 MB
CALL_CHARS = 1 << 16  # the most a tokenizer call may take: ~13 MB at ~200 bytes a character
FOUR_MB_RECORDS = {
    "text": ({"text": BIG}, False),
    "prompt/completion": ({"prompt": "q", "completion": BIG}, False),
    "messages": (
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": BIG}]},
        False,
    ),
    "preference pair": ({"prompt": "q", "chosen": BIG, "rejected": "no"}, True),
}


@pytest.mark.parametrize("long_documents", ["split", "truncate"])
@pytest.mark.parametrize("shape", sorted(FOUR_MB_RECORDS))
def test_a_4mb_record_never_goes_to_the_tokenizer_whole(shape, long_documents, tmp_path):
    """No tokenizer call gets more than CALL_CHARS characters of a 4 MB record, whatever its shape
    (memory of the order of 200 bytes a character given); truncated ones much less (cut before tokenizing).
    Failed before for text split into windows (250,000 characters a call)."""
    record, pairs = FOUR_MB_RECORDS[shape]
    path = tmp_path / "big.jsonl"
    path.write_text(json.dumps(record) + "\n")
    tokenizer, spy = _spied()
    load_dataset([str(path)], tokenizer, 64, eval_fraction=0.0, long_documents=long_documents, pairs=pairs)
    assert 0 < spy.longest <= CALL_CHARS, spy.longest
    if shape != "text" or long_documents == "truncate":  # a chat's template adds a few characters
        assert spy.longest <= records.TextLimit.of(tokenizer, 64).chars + 64, spy.longest


def test_a_4mb_prompt_is_refused_before_it_is_tokenized():
    """A prompt far over the context is refused without tokenizing it."""
    tokenizer, spy = _spied()
    with pytest.raises(UsafError, match="longer than the model's context of 64 positions"):
        prompt_ids(tokenizer, Prompt(1, text=BIG), "p.jsonl:1", positions=64)
    assert spy.longest == 0
