"""Issue 21 item 2: data through Hugging Face datasets. Every source (files of each format, compressed,
save_to_disk folders, cached hub ids) and every record shape (alpaca, sharegpt, messages, prompt/completion,
preference pairs, text, token ids) gives the exact rows expected, and trains two steps through `usaf train`;
tokenization is cached; bad records are named, and skipped one by one."""

from __future__ import annotations

import gzip
import json
import sys
import time

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import CHAT, make_model_dir, supervised

import usaf.data.tokenize as tokenize
from usaf.cli import main
from usaf.data import IGNORE_INDEX, load_dataset
from usaf.errors import UsafError
from usaf.train.tokenizer import char_tokenizer

PAIRS = [{"prompt": f"copy {w} ->", "completion": f" {w}"} for w in ("abc", "fed", "bad", "cab")]


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    """A datasets cache of the test's own: a cache hit from another test would hide what this one checks."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    return tmp_path / "hf-cache"


def write_jsonl(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def rows_of(tok, paths, max_seq_len=256, **kw):
    train, _, stats = load_dataset(
        [str(p) for p in paths], tok, max_seq_len, pack=False, eval_fraction=0, **kw
    )
    return [(train[i]["input_ids"].tolist(), train[i]["labels"].tolist()) for i in range(len(train))], stats


def cache_hub_dataset(cache, repo_id: str, splits: dict) -> None:
    """Put `repo_id` into the datasets cache as `datasets.load_dataset(repo_id)` would leave it (the layout of
    the cache builder: ORG___NAME/CONFIG/VERSION/HASH/NAME-SPLIT.arrow), from local JSON lines files."""
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.json.json import Json

    org, name = repo_id.split("/")
    patterns = DataFilesDict.from_patterns({split: [str(path)] for split, path in splits.items()})
    Json(cache_dir=str(cache), dataset_name=name, hash="0123abcd", data_files=patterns).download_and_prepare()
    [config] = (cache / name).iterdir()
    (cache / f"{org}___{name}").mkdir()
    config.rename(cache / f"{org}___{name}" / "default")


# ---------------------------------------------------------------------------------------------- sources


def write_source(kind: str, folder, records: list[dict], cache):
    """`records` (flat ones: every format holds them) as a data source of `kind`; returns what --data names."""
    table = pa.Table.from_pylist(records)
    if kind == "jsonl":
        return write_jsonl(folder / "d.jsonl", records)
    if kind == "jsonl.gz":
        (folder / "d.jsonl.gz").write_bytes(
            gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode())
        )
        return folder / "d.jsonl.gz"
    if kind == "json":
        (folder / "d.json").write_text(json.dumps(records))
        return folder / "d.json"
    if kind in ("csv", "tsv"):
        table.to_pandas().to_csv(folder / f"d.{kind}", index=False, sep="," if kind == "csv" else "\t")
        return folder / f"d.{kind}"
    if kind == "parquet":
        pq.write_table(table, folder / "d.parquet")
        return folder / "d.parquet"
    if kind == "arrow":
        with pa.ipc.new_stream(folder / "d.arrow", table.schema) as writer:
            writer.write_table(table)
        return folder / "d.arrow"
    if kind == "save_to_disk":
        datasets.Dataset.from_list(records).save_to_disk(folder / "saved")
        return folder / "saved"
    if kind == "save_to_disk:test":  # a DatasetDict, its split named after the folder
        other = datasets.Dataset.from_list([{"prompt": "x", "completion": "y"}])
        datasets.DatasetDict({"train": other, "test": datasets.Dataset.from_list(records)}).save_to_disk(
            folder / "dict"
        )
        return f"{folder / 'dict'}:test"
    if kind == "hub":
        cache_hub_dataset(cache, "someorg/tiny", {"train": write_jsonl(folder / "hub.jsonl", records)})
        return "someorg/tiny"
    raise AssertionError(kind)


SOURCES = ["jsonl.gz", "json", "csv", "tsv", "parquet", "arrow", "save_to_disk", "save_to_disk:test", "hub"]


@pytest.mark.parametrize("kind", SOURCES)
def test_every_source_gives_the_rows_of_its_records(tok, tmp_path, fresh_cache, kind):
    expected, _ = rows_of(tok, [write_source("jsonl", tmp_path, PAIRS, fresh_cache)])
    assert [supervised(tok, ids, labels) for ids, labels in expected] == [
        [f" {w}<eos>"] for w in ("abc", "fed", "bad", "cab")
    ]
    rows, stats = rows_of(tok, [write_source(kind, tmp_path, PAIRS, fresh_cache)])
    assert rows == expected and stats.records == len(PAIRS)


def test_text_files_and_long_documents_become_windows(tok, tmp_path):
    book = tmp_path / "book.md"
    book.write_text("x" * 100 + "\n\nshort one\n")
    rows, stats = rows_of(tok, [book], max_seq_len=40, stride=8)
    assert [len(ids) for ids, _ in rows] == [40, 40, 38, 11]  # 102 tokens: windows at 0, 32, 64
    assert sum(label != IGNORE_INDEX for _, labels in rows[:3] for label in labels) == 101
    assert (stats.split_records, stats.windows) == (1, 3)
    rows, stats = rows_of(tok, [book], max_seq_len=40, long_documents="truncate")
    assert [len(ids) for ids, _ in rows] == [40, 11] and stats.truncated_tokens == 62


def test_csv_cells_are_read_as_written(tok, tmp_path):
    (tmp_path / "d.csv").write_text('prompt,completion,text\n2+2=,4,\nsay None,None,\n,,"NA, 007"\n')
    rows, _ = rows_of(tok, [tmp_path / "d.csv"])
    assert [supervised(tok, ids, labels) for ids, labels in rows] == [
        ["4<eos>"],
        ["None<eos>"],
        ["NA, 007<eos>"],
    ]


def test_a_saved_dataset_in_torch_format_with_extra_columns(tok, tmp_path):
    saved = datasets.Dataset.from_list([{**r, "id": i, "score": [0.5] * 3} for i, r in enumerate(PAIRS)])
    saved.with_format("torch").save_to_disk(tmp_path / "saved")
    expected, _ = rows_of(tok, [write_jsonl(tmp_path / "d.jsonl", PAIRS)])
    rows, stats = rows_of(tok, [tmp_path / "saved"])
    assert rows == expected
    assert "data: ignored columns id, score (not used by prompt/completion records)" in stats.summary()
    # a mapped column replaces the one of the same name, which is then ignored too
    datasets.Dataset.from_list([{**PAIRS[0], "answer": " zz"}]).save_to_disk(tmp_path / "clash")
    [(ids, labels)], stats = rows_of(tok, [tmp_path / "clash"], columns={"completion": "answer"})
    assert supervised(tok, ids, labels) == [" zz<eos>"]
    assert "ignored columns completion (not used by prompt/completion records)" in stats.summary()


def test_the_windows_of_one_record_stay_on_one_side_of_the_eval_split(tok, tmp_path):
    records = [{"text": "w" * 100}, *({"text": f"short {i}"} for i in range(3))]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    sides = set()
    for seed in range(10):  # seed 8 holds out the first record
        train, held, stats = load_dataset([path], tok, 40, pack=False, eval_fraction=0.25, seed=seed)
        assert stats.windows == 3
        sides.add((train.num_documents, held.num_documents))
    assert sides == {(5, 1), (3, 3)}  # a short record held out, or the three windows of the long one


def test_a_hub_id_not_in_the_cache_fails_at_once_in_one_line(tok, tmp_path):
    start = time.monotonic()
    with pytest.raises(UsafError) as error:
        rows_of(tok, ["someorg/absent"])
    message = str(error.value)
    assert "\n" not in message and time.monotonic() - start < 10
    assert message.startswith("someorg/absent is neither a local path nor a hub dataset in the local caches")
    assert "datasets.load_dataset('someorg/absent')" in message


def test_a_missing_relative_file_is_not_taken_for_a_hub_id(tok, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsafError, match=r"^data/train\.jsonl: data file not found\.$"):
        rows_of(tok, ["data/train.jsonl"])
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(b'{"text": "x"}\n')[:-6])  # truncated
    with pytest.raises(UsafError, match=r"d\.jsonl\.gz: cannot read: "):
        rows_of(tok, ["d.jsonl.gz"])


def test_a_hub_id_downloaded_as_files_is_read_from_the_hub_cache(tok, tmp_path, fresh_cache, monkeypatch):
    # the hub cache's layout: datasets--ORG--NAME/{refs/main, snapshots/REVISION/FILES}
    repo = tmp_path / "hub" / "datasets--someorg--files"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40) / "data").mkdir(parents=True)
    write_jsonl(repo / "snapshots" / ("0" * 40) / "data" / "train.jsonl", PAIRS)
    write_jsonl(repo / "snapshots" / ("0" * 40) / "data" / "test.jsonl", PAIRS[:1])
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    expected, _ = rows_of(tok, [write_jsonl(tmp_path / "d.jsonl", PAIRS)])
    assert rows_of(tok, ["someorg/files"])[0] == expected
    assert rows_of(tok, ["someorg/files:test"])[0] == expected[:1]


def test_a_runs_config_keeps_hub_ids_and_makes_paths_absolute(tmp_path, monkeypatch):
    from usaf.data.sources import absolute_name, is_missing

    monkeypatch.chdir(tmp_path)
    (tmp_path / "saved").mkdir()
    assert (
        absolute_name("someorg/tiny") == "someorg/tiny"
        and absolute_name("someorg/tiny:test") == "someorg/tiny:test"
    )
    assert absolute_name("data/train.jsonl") == str(tmp_path / "data" / "train.jsonl")
    assert absolute_name("saved:test") == f"{tmp_path / 'saved'}:test"
    assert not is_missing("someorg/tiny") and not is_missing(f"{tmp_path / 'saved'}:test")
    assert is_missing(str(tmp_path / "data" / "train.jsonl"))


def test_a_wrong_split_lists_the_splits(tok, tmp_path, fresh_cache):
    cache_hub_dataset(
        fresh_cache,
        "someorg/tiny",
        {"train": write_jsonl(tmp_path / "a.jsonl", PAIRS), "validation": tmp_path / "a.jsonl"},
    )
    with pytest.raises(
        UsafError, match=r"someorg/tiny has no split 'test'; its splits are train, validation"
    ):
        rows_of(tok, ["someorg/tiny"], split="test")
    rows, _ = rows_of(tok, ["someorg/tiny:validation"])
    assert len(rows) == len(PAIRS)


def test_columns_map_other_names_and_a_missing_column_is_named(tok, tmp_path, fresh_cache):
    renamed = [{"question": r["prompt"], "answer": r["completion"], "id": i} for i, r in enumerate(PAIRS)]
    expected, _ = rows_of(tok, [write_source("jsonl", tmp_path, PAIRS, fresh_cache)])
    columns = {"prompt": "question", "completion": "answer"}
    for kind in ("csv", "jsonl"):
        source = write_source(kind, tmp_path, renamed, fresh_cache)
        rows, stats = rows_of(tok, [source], columns=columns)
        assert rows == expected, kind
        assert "data: ignored columns id (not used by prompt/completion records)" in stats.summary()
    with pytest.raises(
        UsafError, match=r"d\.csv has no column\(s\) query \(data\.columns\); its columns are "
    ):
        rows_of(tok, [tmp_path / "d.csv"], columns={"prompt": "query", "completion": "answer"})
    with pytest.raises(UsafError, match=r"d\.csv: unknown record columns .*data\.columns"):
        rows_of(tok, [tmp_path / "d.csv"])
    with pytest.raises(UsafError, match=r"data\.columns must map usaf record keys to column names"):
        rows_of(tok, [tmp_path / "d.csv"], columns=["question"])


# ---------------------------------------------------------------------------------------------- shapes

SHAPES = {
    # shape: (records, the canonical record they equal)
    "alpaca": (
        [{"instruction": "Name a colour.", "input": "", "output": "blue", "text": "prebuilt"}],
        {"prompt": "Name a colour.\n\n", "completion": "blue"},
    ),
    "alpaca with input and system": (
        [{"system": "Be brief.", "instruction": "Add.", "input": "2+2", "output": "4"}],
        {"prompt": "Be brief.\n\nAdd.\n\n2+2\n\n", "completion": "4"},
    ),
    "sharegpt": (
        [
            {
                "system": "Be brief.",
                "conversations": [
                    {"from": "human", "value": "2+2?"},
                    {"from": "gpt", "value": "4"},
                    {"from": "user", "value": "and 3+3?"},
                    {"from": "model", "value": "6"},
                ],
            }
        ],
        {"messages": CHAT},
    ),
    "messages with extra columns and message keys": (
        [{"id": 7, "source": "web", "messages": [{**m, "weight": 1} for m in CHAT]}],
        {"messages": CHAT},
    ),
    "conversational prompt/completion": (
        [{"prompt": CHAT[:4], "completion": CHAT[4:]}],
        None,  # checked below: only the completion's turn is supervised
    ),
    "preference, plain": (
        [{"prompt": "Q: sky? A: ", "chosen": "blue", "rejected": "green"}],
        {"prompt": "Q: sky? A: ", "completion": "blue"},
    ),
    "preference, conversational": (
        [{"prompt": CHAT[:2], "chosen": [CHAT[2]], "rejected": [{"role": "assistant", "content": "5"}]}],
        {"messages": CHAT[:3]},
    ),
    "pre-tokenized with attention_mask": (
        [{"input_ids": [1, 40, 41, 2], "attention_mask": [1, 1, 1, 1]}],
        {"input_ids": [1, 40, 41, 2]},
    ),
}
NOTES = {
    "alpaca": "data: ignored columns text (not used by alpaca records)",
    "messages with extra columns and message keys": "data: ignored columns id, source (not used by messages "
    "records); data: ignored message keys weight (not used by chat templates)",
    "preference, plain": "the rejected answers are not used by supervised fine-tuning",
    "pre-tokenized with attention_mask": "data: ignored columns attention_mask (not used by input_ids records)",
}


@pytest.mark.parametrize("shape", SHAPES)
def test_every_record_shape_gives_the_rows_of_its_usaf_record(tok, tmp_path, shape):
    records, canonical = SHAPES[shape]
    rows, stats = rows_of(tok, [write_jsonl(tmp_path / "shape.jsonl", records)])
    if canonical is None:
        [(ids, labels)] = rows
        assert tok.decode(ids) == tok.apply_chat_template(CHAT, tokenize=False)
        assert supervised(tok, ids, labels) == ["6<eos>"]  # the prompt's assistant turn is context
    else:
        assert rows == rows_of(tok, [write_jsonl(tmp_path / "canonical.jsonl", [canonical])])[0]
    if shape in NOTES:
        assert NOTES[shape] in stats.summary()


def test_a_conversational_prompt_is_normalized_like_messages(tok, tmp_path):
    """The prompt is rendered from the same normalized messages as the whole conversation: a developer turn and
    an assistant example with content parts are context, not a template error or a refused record."""
    prompt = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": [{"type": "text", "text": "4"}]},
        {"role": "user", "content": "and 3+3?"},
    ]
    rows, _ = rows_of(tok, [write_jsonl(tmp_path / "d.jsonl", [{"prompt": prompt, "completion": CHAT[4:]}])])
    [(ids, labels)] = rows
    assert tok.decode(ids) == tok.apply_chat_template(CHAT, tokenize=False)
    assert supervised(tok, ids, labels) == ["6<eos>"]


def test_reasoning_under_any_of_its_names_reaches_the_template(tok, tmp_path):
    turns = [CHAT[1], {"role": "assistant", "reasoning": "add", "content": "4"}]
    rows, stats = rows_of(tok, [write_jsonl(tmp_path / "d.jsonl", [{"messages": turns}])])
    as_content = [CHAT[1], {"role": "assistant", "reasoning_content": "add", "content": "4"}]
    assert rows == rows_of(tok, [write_jsonl(tmp_path / "c.jsonl", [{"messages": as_content}])])[0]
    assert "ignored message keys" not in stats.summary()


BAD_SHAPES = [
    (
        {"prompt": "q", "completion": [CHAT[2]]},
        "'prompt' and 'completion' must both be strings or both lists",
    ),
    ({"instruction": "x"}, r"alpaca record is missing key\(s\) \['output'\]"),
    ({"chosen": "a"}, r"preference record is missing key\(s\) \['rejected'\]"),
    ({"messages": CHAT, "tools": "{oops"}, "'tools' is a string but not JSON"),
    ({"question": "q", "answer": "a"}, r"unknown record keys \['answer', 'question'\].*data\.columns"),
]


@pytest.mark.parametrize(("record", "problem"), BAD_SHAPES)
def test_a_bad_shape_is_named_with_its_line(tok, tmp_path, record, problem):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "fine"}, record])
    with pytest.raises(UsafError, match=rf"d\.jsonl:2: .*{problem}"):
        rows_of(tok, [path])


def test_arrow_none_fields_are_dropped_and_mixed_json_types_load(tok, tmp_path):
    # Arrow gives every message the union of the keys: "name" becomes None where it was absent
    named = [{**CHAT[0], "name": "rules"}, *CHAT[1:]]
    pq.write_table(pa.Table.from_pylist([{"messages": named}, {"messages": CHAT}]), tmp_path / "chat.parquet")
    rows, _ = rows_of(tok, [tmp_path / "chat.parquet"])
    plain, _ = rows_of(tok, [write_jsonl(tmp_path / "chat.jsonl", [{"messages": named}, {"messages": CHAT}])])
    assert rows == plain and "None" not in tok.decode(rows[1][0])
    # one key a string in one record, a list in the next: Arrow could not hold the column; usaf reads it
    mixed = [{"text": "one", "meta": "a"}, {"text": "two", "meta": ["a", 1]}]
    for path in (write_jsonl(tmp_path / "mixed.jsonl", mixed), tmp_path / "mixed.json"):
        (tmp_path / "mixed.json").write_text(json.dumps(mixed))
        rows, stats = rows_of(tok, [path])
        assert len(rows) == 2 and "ignored columns meta" in stats.summary()


def test_records_reach_the_encoder_as_written(tok, tmp_path, monkeypatch):
    seen = []
    monkeypatch.setitem(
        tokenize.ENCODERS, "messages", lambda record, t: seen.append(record) or ([1, 9, 2], [-100, 9, 2])
    )
    parts = [{"type": "text", "text": "2+2?"}]  # content a string in one record, a list of parts in the next
    records = [
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
        {
            "messages": [
                {"role": "user", "content": parts},
                {"role": "assistant", "content": "4", "name": "bot"},
            ]
        },
    ]
    rows_of(tok, [write_jsonl(tmp_path / "d.jsonl", records)])
    assert seen == records
    seen.clear()  # tools held as a JSON string (as tables often do) reach the template as a list
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    rows_of(tok, [write_jsonl(tmp_path / "t.jsonl", [{**records[0], "tools": json.dumps(tools)}])])
    assert seen == [{**records[0], "tools": tools}]
    seen.clear()  # a table: the first record's assistant turn gets name=None from Arrow, dropped again
    flat = [records[0], {"messages": [records[0]["messages"][0], records[1]["messages"][1]]}]
    pq.write_table(pa.Table.from_pylist(flat), tmp_path / "d.parquet")
    rows_of(tok, [tmp_path / "d.parquet"])
    assert seen == flat


# ---------------------------------------------------------------------------------------------- cache


def test_a_second_load_reads_the_cache_and_encodes_nothing(tok, tmp_path, fresh_cache, monkeypatch):
    calls = []
    encode = tokenize.ENCODERS["prompt/completion"]
    monkeypatch.setitem(
        tokenize.ENCODERS, "prompt/completion", lambda record, t: calls.append(1) or encode(record, t)
    )
    path = write_jsonl(tmp_path / "d.jsonl", PAIRS)
    first, _ = rows_of(tok, [path])
    assert len(calls) == len(PAIRS)
    assert len(list((fresh_cache / "usaf_tokenized").glob("*.arrow"))) == 1  # in HF_DATASETS_CACHE
    again, stats = rows_of(tok, [path])
    assert again == first and len(calls) == len(PAIRS) and stats.records == len(PAIRS)  # nothing encoded
    other = char_tokenizer()
    other.chat_template = "{{ messages }}"  # another tokenizer setting: tokenized anew
    rows_of(other, [path])
    assert len(calls) == 2 * len(PAIRS)
    rows_of(tok, [path], max_seq_len=128)  # another data setting
    assert len(calls) == 3 * len(PAIRS)
    write_jsonl(tmp_path / "d.jsonl", PAIRS[:2])  # other content at the same path
    rows, _ = rows_of(tok, [path])
    assert len(rows) == 2 and len(calls) == 3 * len(PAIRS) + 2


def test_num_proc_tokenizes_in_processes_and_gives_the_same_rows(tok, tmp_path, fresh_cache):
    path = write_jsonl(tmp_path / "d.jsonl", PAIRS * 10)
    alone, _ = rows_of(tok, [path])
    (fresh_cache / "usaf_tokenized").rename(tmp_path / "first")
    shared, _ = rows_of(tok, [path], num_proc=2)
    assert shared == alone
    assert sorted(p.name[-21:] for p in (fresh_cache / "usaf_tokenized").iterdir()) == [
        "_00000_of_00002.arrow",
        "_00001_of_00002.arrow",
    ]


def test_a_progress_bar_on_a_terminal_only(tok, tmp_path, capsys, monkeypatch):
    rows_of(tok, [write_jsonl(tmp_path / "d.jsonl", PAIRS)])
    assert "tokenizing" not in capsys.readouterr().err  # a log file or a pipe: no bar
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    rows_of(tok, [write_jsonl(tmp_path / "e.jsonl", PAIRS)])
    assert f"tokenizing {tmp_path / 'e.jsonl'}" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- bad records


def test_skip_bad_records_skips_only_the_bad_ones(tok, tmp_path):
    rows = [
        {"prompt": "a", "completion": "b"},
        {"prompt": "a", "completion": " "},
        {"prompt": "c", "completion": "d"},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    with pytest.raises(UsafError, match=r"d\.parquet:row 1: 'completion' is empty.*--skip-bad-records"):
        rows_of(tok, [tmp_path / "d.parquet"])
    kept, stats = rows_of(tok, [tmp_path / "d.parquet"], skip_bad_records=True)
    assert len(kept) == 2 and (stats.records, stats.skipped_records) == (3, 1)
    assert stats.first_skipped == [f"{tmp_path / 'd.parquet'}:row 1: 'completion' is empty: nothing to learn"]
    # a source whose every record is bad is named, not silently dropped beside good ones
    (tmp_path / "bad.csv").write_text("prompt,completion\nq, \nr, \n")
    with pytest.raises(
        UsafError,
        match=r"bad\.csv: no usable records \(2 bad records skipped; the first: \S*bad\.csv:row 0: ",
    ):
        rows_of(tok, [tmp_path / "d.parquet", tmp_path / "bad.csv"], skip_bad_records=True)


def test_a_very_long_text_is_tokenized_in_pieces_with_the_same_ids(tok, monkeypatch):
    import usaf.data.records as records

    text = " ".join(f"word{i}" for i in range(2000))  # 12,889 characters
    whole = records.token_ids(tok, text, add_special_tokens=True)
    monkeypatch.setattr(records, "LONG_TEXT_CHARS", 1000)
    monkeypatch.setattr(records, "_PIECE_CHARS", 300)
    assert len(records._pieces(text)) > 40 and "".join(records._pieces(text)) == text
    assert all(piece.startswith(" ") for piece in records._pieces(text)[1:])  # cut before a space
    assert records.token_ids(tok, text, add_special_tokens=True) == whole  # one token a character: exact
    assert records.token_ids(tok, text, add_special_tokens=False) == whole[1:]


def test_a_long_single_line_record_is_windowed(tok, tmp_path):
    path = write_jsonl(tmp_path / "big.jsonl", [{"text": "ab" * 1_000_000}])  # 2 MB on one line: in pieces
    start = time.monotonic()
    train, _, stats = load_dataset([path], tok, 4096, eval_fraction=0)
    assert stats.windows == -(-(2_000_002 - 1) // 4095) and train.supervised_tokens == 2_000_001
    assert time.monotonic() - start < 60


# ---------------------------------------------------------------------------------------------- usaf train


FAST = [
    "--set=data.max_seq_len=64",
    "--set=data.batch_size=4",
    "--set=select.density=0.1",
    "--set=log.progress=false",
    "--set=log.tensorboard=false",
    "--set=schedule.warmup_steps=1",
    "--set=schedule.max_steps=2",
    "--set=data.eval_fraction=0",
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("sources") / "model")


def test_every_record_shape_trains_two_steps(model, tmp_path, capsys):
    files = []
    for index, (records, _) in enumerate(SHAPES.values()):
        files.append(write_jsonl(tmp_path / f"shape{index}.jsonl", records))
    files.append(write_jsonl(tmp_path / "text.jsonl", [{"text": "z" * 150}]))  # windows
    files.append(write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}]))
    run = tmp_path / "run"
    assert main(["train", f"--model={model}", f"--data={','.join(files)}", f"--out={run}", *FAST]) == 0
    out = capsys.readouterr().out
    assert "split into 3 windows" in out and "ignored columns id, source" in out
    assert "rejected answers are not used" in out
    assert json.loads((run / "summary.json").read_text())["steps"] == 2


def test_every_source_trains_two_steps_and_eval_reads_the_cache(
    model, tmp_path, fresh_cache, monkeypatch, capsys
):
    folder = tmp_path / "sources"
    folder.mkdir()
    names = []
    for kind in SOURCES:
        sub = folder / kind.replace(":", "_")
        sub.mkdir()
        names.append(str(write_source(kind, sub, PAIRS, fresh_cache)))
    (folder / "notes.txt").write_text("first note\n\nsecond note\n")
    names.append(str(folder / "notes.txt"))
    run = tmp_path / "run"
    assert main(["train", f"--model={model}", f"--data={','.join(names)}", f"--out={run}", *FAST]) == 0
    assert f"data: {len(SOURCES) * len(PAIRS) + 2} records" in capsys.readouterr().out
    calls = []
    monkeypatch.setattr(tokenize, "fit", lambda *a, _fit=tokenize.fit: calls.append(1) or _fit(*a))
    assert main(["eval", str(run), f"--data={','.join(names)}"]) == 0
    assert calls == []  # the same data, settings and tokenizer: read from the cache
