"""Data pipeline: file formats, record kinds and loss masks, bad input, truncation, packing, split, resume."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
import torch.nn.functional as F
from helpers import CHAT, supervised
from transformers import AutoTokenizer

from usaf.data import IGNORE_INDEX, Batches, collate, load_dataset
from usaf.errors import UsafError
from usaf.testing.tiny import tiny_model
from usaf.train.tokenizer import char_tokenizer

MIXED = [
    {"text": "Hello world."},
    {"prompt": "Q: sky? A: ", "completion": "blue"},
    {"messages": CHAT},
    {"input_ids": [1, 40, 41, 42, 2], "labels": [-100, -100, 41, 42, 2]},
]


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def write_jsonl(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def load_one(tok, tmp_path, records, max_seq_len=256, **kw):
    """Load `records` (no split, no packing) and return the rows as (input_ids, labels) lists."""
    train, _, stats = load_dataset(
        [write_jsonl(tmp_path / "d.jsonl", records)], tok, max_seq_len, pack=False, eval_fraction=0, **kw
    )
    rows = [(train[i]["input_ids"].tolist(), train[i]["labels"].tolist()) for i in range(len(train))]
    return rows, stats


def decode_all(tok, dataset) -> list[str]:
    return [tok.decode(dataset[i]["input_ids"], skip_special_tokens=True) for i in range(len(dataset))]


# ---------------------------------------------------------------------------------------------- tokenizer


def test_char_tokenizer_is_deterministic_and_round_trips(tok, tmp_path):
    assert len(tok) == 104 and (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    ids = tok("Hi\nyou é")["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 1 + len("Hi\nyou é")
    assert ids[-1] == tok.unk_token_id  # outside the alphabet
    assert tok.decode(ids, skip_special_tokens=True) == "Hi\nyou "
    assert char_tokenizer()("Hi\nyou é")["input_ids"] == ids  # same ids every time

    tok.save_pretrained(tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert loaded("Hi\nyou é")["input_ids"] == ids
    assert loaded.apply_chat_template(CHAT, tokenize=False) == tok.apply_chat_template(CHAT, tokenize=False)
    rendered = tok.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    assert rendered == "<bos><|system|>Be brief.<eos><|user|>2+2?<eos><|assistant|>"
    assert tok(rendered, add_special_tokens=False)["input_ids"][:3] == [1, 4, tok.convert_tokens_to_ids("B")]


# ---------------------------------------------------------------------------------------------- record kinds


def test_text_record_has_bos_eos_and_loss_on_all_but_first(tok, tmp_path):
    [(ids, labels)], _ = load_one(tok, tmp_path, [{"text": "abc"}])
    assert ids == [tok.bos_token_id, *tok("abc", add_special_tokens=False)["input_ids"], tok.eos_token_id]
    assert labels == [IGNORE_INDEX, *ids[1:]]


def test_prompt_completion_loss_on_completion_only(tok, tmp_path):
    [(ids, labels)], _ = load_one(tok, tmp_path, [{"prompt": "Q: sky? A: ", "completion": "blue"}])
    assert tok.decode(ids) == "<bos>Q: sky? A: blue<eos>"
    assert supervised(tok, ids, labels) == ["blue<eos>"]


def test_chat_loss_on_assistant_turns_only(tok, tmp_path):
    [(ids, labels)], _ = load_one(tok, tmp_path, [{"messages": CHAT}])
    assert tok.decode(ids) == tok.apply_chat_template(CHAT, tokenize=False)
    assert supervised(tok, ids, labels) == ["4<eos>", "6<eos>"]


def test_chat_mask_without_generation_markers(tmp_path):
    chatml = char_tokenizer()
    chatml.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    [(ids, labels)], _ = load_one(chatml, tmp_path, [{"messages": CHAT}])
    assert supervised(chatml, ids, labels) == ["4<|im_end|>\n", "6<|im_end|>\n"]


def test_chat_mask_with_a_template_that_rewrites_earlier_turns(tmp_path):
    # Like Qwen3: only assistant turns after the last user turn show a (here empty) reasoning block, so the
    # rendering up to an early assistant turn is not a prefix of the whole conversation.
    qwen_like = char_tokenizer()
    qwen_like.chat_template = (
        "{%- set ns = namespace(last_user=-1) -%}"
        "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
        "{%- endif -%}{%- endfor -%}"
        "{{ bos_token }}{%- for m in messages -%}<|{{ m.role }}|>"
        "{%- if m.role == 'assistant' and loop.index0 > ns.last_user -%}<think></think>{%- endif -%}"
        "{{ m.content }}{{ eos_token }}{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
    )
    [(ids, labels)], _ = load_one(qwen_like, tmp_path, [{"messages": CHAT}])
    assert supervised(qwen_like, ids, labels) == ["4<eos>", "<think></think>6<eos>"]


def test_pretokenized_records_are_used_as_given(tok, tmp_path):
    rows, _ = load_one(
        tok,
        tmp_path,
        [{"input_ids": [1, 40, 41, 42, 2], "labels": [-100, -100, 41, 42, 2]}, {"input_ids": [1, 9, 2]}],
    )
    assert rows == [([1, 40, 41, 42, 2], [-100, -100, 41, 42, 2]), ([1, 9, 2], [-100, 9, 2])]


def test_labels_are_aligned_with_inputs_for_the_models_own_shift(tok, tmp_path):
    # The known bug of pre-shifting labels trains position t on token t+2. Here: labels equal input_ids at
    # every supervised position, and the model's own loss (it shifts by one) is next-token cross entropy.
    [(ids, labels)], _ = load_one(tok, tmp_path, [{"prompt": "ab", "completion": "cde"}])
    supervised = [t for t, label in enumerate(labels) if label != IGNORE_INDEX]
    assert supervised and all(labels[t] == ids[t] for t in supervised)
    model = tiny_model("qwen3_moe", vocab_size=len(tok))
    input_ids, label_ids = torch.tensor([ids]), torch.tensor([labels])
    with torch.no_grad():
        out = model(input_ids=input_ids, labels=label_ids, use_cache=False)
    # target of position t is token t+1, for every t+1 that is supervised
    by_hand = F.cross_entropy(out.logits[0, [t - 1 for t in supervised]], input_ids[0, supervised])
    torch.testing.assert_close(out.loss, by_hand)
    assert tok.decode(input_ids[0, supervised]) == "cde<eos>"


def test_shifted_labels_are_rejected(tok, tmp_path):
    shifted = {"input_ids": [1, 40, 41, 42, 2], "labels": [40, 41, 42, 2, -100]}
    with pytest.raises(UsafError, match=r"d\.jsonl:1: labels\[0\]=40 but input_ids\[0\]=1.*not shifted"):
        load_one(tok, tmp_path, [shifted])


# ---------------------------------------------------------------------------------------------- file formats


def test_every_file_format_gives_the_same_rows(tok, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    files = {
        "jsonl": write_jsonl(tmp_path / "d.jsonl", MIXED),
        "json_list": tmp_path / "list.json",
        "json_data": tmp_path / "data.json",
        "parquet": tmp_path / "d.parquet",
    }
    files["json_list"].write_text(json.dumps(MIXED))
    files["json_data"].write_text(json.dumps({"data": MIXED}))
    columns = sorted({key for record in MIXED for key in record})  # mixed kinds: absent keys become nulls
    pq.write_table(pa.table({c: [r.get(c) for r in MIXED] for c in columns}), files["parquet"])

    def rows(path):
        train, _, stats = load_dataset([str(path)], tok, 256, pack=False, eval_fraction=0)
        assert stats.records == len(MIXED) and len(train) == len(MIXED)
        return [train[i]["input_ids"].tolist() + train[i]["labels"].tolist() for i in range(len(train))]

    expected = rows(files["jsonl"])
    for name in ("json_list", "json_data", "parquet"):
        assert rows(files[name]) == expected, name


def test_text_files_split_on_blank_lines(tok, tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("First doc,\nline two.\n\n  \n\nSecond doc.\n")
    train, _, _ = load_dataset([str(path)], tok, 256, pack=False, eval_fraction=0)
    assert decode_all(tok, train) == ["First doc,\nline two.", "Second doc."]
    path.write_text("One document\nwithout blank lines.")
    train, _, _ = load_dataset([str(path)], tok, 256, pack=False, eval_fraction=0)
    assert len(train) == 1


# ---------------------------------------------------------------------------------------------- bad input

BAD_RECORDS = [
    ('{"text": "ok"', "invalid JSON"),
    ('["text"]', "must be a JSON object"),
    ({"prompt": "x"}, r"missing key\(s\) \['completion'\]"),
    ({"conversations": [{"from": "alien", "value": "x"}]}, "from='alien'"),
    ({"txt": "x"}, "unknown record keys"),
    ({"text": 3}, "'text' must be a string, got int"),
    ({"text": ""}, "'text' is empty"),
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "role 'robot'"),
    ({"messages": [{"role": "user", "content": 5}]}, "content must be a string"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    ({"prompt": "x", "completion": ""}, "'completion' is empty"),
    ({"input_ids": [1, 500]}, "outside the tokenizer's vocabulary"),
    ({"input_ids": [1, 5, 6], "labels": [-100, -100, -100]}, "no supervised tokens"),
]


@pytest.mark.parametrize(("record", "problem"), BAD_RECORDS)
def test_bad_record_names_file_line_and_problem(tok, tmp_path, record, problem):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "fine"}, record])
    with pytest.raises(UsafError, match=rf"d\.jsonl:2: .*{problem}"):
        load_dataset([path], tok, 256, eval_fraction=0)


def test_bad_record_in_json_and_parquet_names_the_record_index(tok, tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"text": "fine"}, {"text": "fine"}, {"text": 7}]))
    with pytest.raises(UsafError, match=r"d\.json\[2\]: 'text' must be a string"):
        load_dataset([str(path)], tok, 256, eval_fraction=0)
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": " "}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    with pytest.raises(UsafError, match=r"d\.parquet:row 1: 'completion' is empty"):
        load_dataset([str(tmp_path / "d.parquet")], tok, 256, eval_fraction=0)


def test_skip_bad_records_skips_and_counts(tok, tmp_path):
    records = [{"text": "one"}, "{oops", {"text": "two"}, {"prompt": "p"}, {"text": "three"}]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    train, _, stats = load_dataset([path], tok, 256, pack=False, skip_bad_records=True, eval_fraction=0)
    assert (stats.records, stats.skipped_records, len(train)) == (5, 2, 3)
    assert stats.first_skipped[0].endswith(
        "d.jsonl:2: invalid JSON: Expecting property name enclosed in double quotes (column 2)"
    )
    assert stats.first_skipped[1].endswith(
        "d.jsonl:4: prompt/completion record is missing key(s) ['completion']"
    )
    assert "2 bad skipped" in stats.summary()


def test_whole_data_set_errors(tok, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(UsafError, match="data set is empty"):
        load_dataset([str(empty)], tok, 256)
    all_bad = write_jsonl(tmp_path / "bad.jsonl", ["{", "}"])
    with pytest.raises(UsafError, match=r"data set is empty.*2 bad records skipped"):
        load_dataset([all_bad], tok, 256, skip_bad_records=True)
    with pytest.raises(UsafError, match="not found"):
        load_dataset([str(tmp_path / "missing.jsonl")], tok, 256)
    (tmp_path / "d.docx").write_text("text\nx\n")
    with pytest.raises(UsafError, match=r"unknown data file type '\.docx'"):
        load_dataset([str(tmp_path / "d.docx")], tok, 256)
    (tmp_path / "corrupt.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(UsafError, match=r"corrupt\.parquet: cannot read Parquet"):
        load_dataset([str(tmp_path / "corrupt.parquet")], tok, 256)
    broken = tmp_path / "broken.json"
    broken.write_text('[{"text": "x"},\n  oops]')
    with pytest.raises(UsafError, match=r"broken\.json:2: invalid JSON"):
        load_dataset([str(broken)], tok, 256)


def test_chat_data_needs_a_chat_template_even_when_skipping(tmp_path):
    plain = char_tokenizer()
    plain.chat_template = None
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "fine"}, {"messages": CHAT}])
    with pytest.raises(UsafError, match=r"d\.jsonl:2: chat records .*need a tokenizer with a chat template"):
        load_dataset([path], plain, 256, skip_bad_records=True, eval_fraction=0)


# ---------------------------------------------------------------------------------------------- truncation


def test_truncation_is_counted(tok, tmp_path):
    rows, stats = load_one(
        tok,
        tmp_path,
        [{"text": "x" * 30}, {"text": "short"}, {"text": "y" * 25}],
        max_seq_len=20,
        long_documents="truncate",
    )
    assert [len(ids) for ids, _ in rows] == [20, 7, 20]
    # 32 and 27 tokens with BOS and EOS
    assert (stats.truncated_records, stats.truncated_tokens) == (2, 12 + 7)
    assert "2 truncated to 20 tokens (19 tokens cut)" in stats.summary()


@pytest.mark.parametrize("stride", [0, 1, 4])
def test_long_documents_become_windows_that_supervise_each_token_once(tok, tmp_path, stride):
    text = "".join(chr(ord("a") + i % 26) for i in range(30))
    full = [
        tok.bos_token_id,
        *tok(text, add_special_tokens=False)["input_ids"],
        tok.eos_token_id,
    ]  # 32 tokens
    rows, stats = load_one(tok, tmp_path, [{"text": text}], max_seq_len=20, stride=stride)
    overlap = max(stride, 1)  # a window's first token predicts nothing: at least one token of context
    assert [ids for ids, _ in rows] == [full[:20], full[20 - overlap :]]
    assert rows[1][1][:overlap] == [IGNORE_INDEX] * overlap
    supervised = [label for _, labels in rows for label in labels if label != IGNORE_INDEX]
    assert supervised == full[1:]  # every token but the first is a target, exactly once
    assert (stats.split_records, stats.windows, stats.truncated_records) == (1, 2, 0)
    assert "none truncated, 1 split into 2 windows" in stats.summary()


def test_long_chat_and_prompt_completion_records_are_truncated_not_split(tok, tmp_path):
    records = [
        {"prompt": "p" * 10, "completion": "c" * 30},
        {"messages": [CHAT[1], {**CHAT[2], "content": "4" * 40}]},
    ]
    rows, stats = load_one(tok, tmp_path, records, max_seq_len=20)
    assert [len(ids) for ids, _ in rows] == [20, 20]
    assert (stats.truncated_records, stats.split_records) == (2, 0)
    with pytest.raises(UsafError, match=r"data\.stride=19 must be in \[0, max_seq_len - 1\)"):
        load_one(tok, tmp_path, [{"text": "x"}], max_seq_len=20, stride=19)


def test_completion_truncated_away_is_an_error(tok, tmp_path):
    record = {"prompt": "p" * 30, "completion": "answer"}
    with pytest.raises(UsafError, match=r"d\.jsonl:1: .*no supervised tokens left after truncation"):
        load_one(tok, tmp_path, [record], max_seq_len=20)
    _, stats = load_one(tok, tmp_path, [record, {"text": "ok"}], max_seq_len=20, skip_bad_records=True)
    assert (stats.skipped_records, stats.truncated_records) == (1, 0)


# ---------------------------------------------------------------------------------------------- packing

TEXTS = ["the quick brown fox", "hello world", "abc", "xyz!", "jumps over", "a lazy dog", "0123456789"]


def test_packing_fills_rows_without_splitting_documents(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS])
    packed, _, stats = load_dataset([path], tok, 40, eval_fraction=0)
    again, _, _ = load_dataset([path], tok, 40, eval_fraction=0)
    assert packed.fingerprint() == again.fingerprint()  # deterministic
    assert len(packed) < len(TEXTS) and stats.train_sequences == len(packed) and stats.train_documents == 7
    documents = []
    for i in range(len(packed)):
        row = packed[i]
        assert len(row["input_ids"]) <= 40
        starts = [*(row["position_ids"] == 0).nonzero().flatten().tolist(), len(row["input_ids"])]
        for a, b in itertools.pairwise(starts):
            assert row["position_ids"][a:b].tolist() == list(range(b - a))
            assert row["labels"][a] == IGNORE_INDEX  # no target across the document boundary
            documents.append(tok.decode(row["input_ids"][a:b], skip_special_tokens=True))
    assert sorted(documents) == sorted(TEXTS)


def test_packed_rows_do_not_attend_across_documents(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS[:4]])
    packed, _, _ = load_dataset([path], tok, 40, eval_fraction=0)
    batch = next(Batches(packed, batch_size=len(packed), shuffle=False))
    assert (
        len(packed) == 2 and "attention_mask" not in batch
    )  # transformers derives the mask from position_ids
    assert (batch["input_ids"] == tok.pad_token_id).any()  # rows of unequal length: padding is exercised

    model = tiny_model("qwen3_moe", vocab_size=len(tok))
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
        checked = 0
        for r in range(len(packed)):
            row = packed[r]
            starts = [*(row["position_ids"] == 0).nonzero().flatten().tolist(), len(row["input_ids"])]
            for a, b in itertools.pairwise(starts):
                alone = model(input_ids=row["input_ids"][None, a:b], use_cache=False).logits[0]
                torch.testing.assert_close(logits[r, a:b], alone, atol=1e-5, rtol=1e-5)
                checked += 1
    assert checked == 4

    # The packed loss is the sum of the documents' own losses: no target crosses a boundary.
    labels = batch["labels"]
    packed_loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="sum")
    with torch.no_grad():
        separate = 0.0
        for text in TEXTS[:4]:
            ids = torch.tensor([[*tok(text)["input_ids"], tok.eos_token_id]])
            separate += F.cross_entropy(model(input_ids=ids).logits[0, :-1], ids[0, 1:], reduction="sum")
    torch.testing.assert_close(packed_loss, separate)


def test_collate_pads_right_with_ignored_labels(tok):
    rows = [
        {
            "input_ids": torch.tensor([1, 9, 2]),
            "labels": torch.tensor([-100, 9, 2]),
            "position_ids": torch.arange(3),
        },
        {
            "input_ids": torch.tensor([1, 9]),
            "labels": torch.tensor([-100, 9]),
            "position_ids": torch.arange(2),
        },
    ]
    batch = collate(rows, pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 9, 2], [1, 9, 0]]
    assert batch["labels"].tolist() == [[-100, 9, 2], [-100, 9, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 1, 0]]  # padding is a segment of its own


# ---------------------------------------------------------------------------------------------- split


def test_held_out_split_is_seeded_and_document_level(tok, tmp_path):
    texts = [f"document number {i}" for i in range(40)]
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])

    def split(seed):
        train, held, stats = load_dataset([path], tok, 64, pack=False, eval_fraction=0.1, seed=seed)
        return decode_all(tok, train), decode_all(tok, held), stats

    train, held, stats = split(0)
    assert len(held) == 4 and stats.eval_documents == 4 and stats.train_documents == 36
    assert sorted(train + held) == sorted(texts)
    assert split(0)[:2] == (train, held)
    assert split(1)[1] != held

    # packing happens after the split, whole documents on each side
    _, packed_held, _ = load_dataset([path], tok, 64, eval_fraction=0.1, seed=0)
    assert packed_held.num_documents == 4 and packed_held.supervised_tokens == sum(len(t) + 1 for t in held)

    one = write_jsonl(tmp_path / "one.jsonl", [{"text": "alone"}])
    with pytest.raises(UsafError, match="too small to hold out"):
        load_dataset([one], tok, 64, eval_fraction=0.05)
    train, held, _ = load_dataset([one], tok, 64, eval_fraction=0)
    assert held is None and len(train) == 1


def test_eval_file_replaces_the_split(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}, {"text": "b"}])
    held_path = write_jsonl(tmp_path / "e.jsonl", [{"text": "c"}])
    train, held, stats = load_dataset([path], tok, 64, eval_paths=[held_path])
    assert (train.num_documents, held.num_documents, stats.records) == (2, 1, 3)


# ---------------------------------------------------------------------------------------------- batches


@pytest.fixture
def dataset(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"sample {i}" + "!" * (i % 5)} for i in range(10)])
    return load_dataset([path], tok, 64, pack=False, eval_fraction=0)[0]


def take(batches, count):
    return [{k: v.clone() for k, v in next(batches).items()} for _ in range(count)]


def same(a, b):
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("stop_after", [2, 4, 5])  # mid-epoch, at the epoch's end, in the next epoch
def test_batches_resume_exactly(dataset, stop_after):
    straight = take(Batches(dataset, batch_size=3, seed=7), 10)  # 4 batches per epoch: crosses two boundaries
    first = Batches(dataset, batch_size=3, seed=7)
    head = take(first, stop_after)
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint file
    resumed = Batches(dataset, batch_size=3, seed=7)
    resumed.load_state_dict(state)
    assert same(head + take(resumed, 10 - stop_after), straight)


def test_batches_reshuffle_each_epoch_deterministically(dataset):
    batches = Batches(dataset, batch_size=3, seed=7)
    epochs = []
    for _ in range(2):
        order = []
        for _ in range(len(batches)):
            next(batches)
            order += batches.last_indices
        epochs.append(order)
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(10)) and epochs[0] != epochs[1]
    again = Batches(dataset, batch_size=3, seed=7)
    next(again)
    assert again.last_indices == epochs[0][:3]
    ordered = Batches(dataset, batch_size=4, shuffle=False, epochs=1)
    assert [len(b["input_ids"]) for b in ordered] == [4, 4, 2]


def test_batches_refuse_to_resume_on_other_data(dataset, tok, tmp_path):
    state = Batches(dataset, batch_size=3, seed=7).state_dict()
    with pytest.raises(UsafError, match="batch_size was 3"):
        Batches(dataset, batch_size=4, seed=7).load_state_dict(state)
    path = write_jsonl(tmp_path / "other.jsonl", [{"text": f"other {i}"} for i in range(10)])
    other = load_dataset([path], tok, 64, pack=False, eval_fraction=0)[0]
    with pytest.raises(UsafError, match="fingerprint"):
        Batches(other, batch_size=3, seed=7).load_state_dict(state)


def test_summary_is_one_line(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"doc {i}"} for i in range(20)])
    _, _, stats = load_dataset([path], tok, 64, eval_fraction=0.1)
    line = stats.summary()
    assert "\n" not in line and "20 records" in line and "train 18 docs" in line and "eval 2 docs" in line
