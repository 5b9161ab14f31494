"""Issue 38, data: hub ids downloaded by `datasets` when online and read from the local caches offline, mixing
weights across sources, alpaca records through the chat template."""

from __future__ import annotations

import copy
import itertools
import json
from collections import Counter

import datasets
import httpx2
import huggingface_hub
import pytest
import torch
from datasets.data_files import DataFilesDict
from datasets.packaged_modules.json.json import Json
from helpers import losses, make_model_dir, supervised
from huggingface_hub.utils._http import default_client_factory  # to put back the client the fake hub replaced

from usaf.cli import main
from usaf.config import RunConfig
from usaf.data import load_dataset
from usaf.data.stream import StreamBatches, StreamedRows, batches_for
from usaf.data.tokenize import Encoder
from usaf.errors import UsafError
from usaf.train.tokenizer import char_tokenizer

RECORDS = [{"prompt": f"copy {w} ->", "completion": f" {w}"} for w in ("abc", "fed", "bad", "cab")]


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    """The test's own datasets and hub caches, as HF_HOME would place them."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    return tmp_path / "hf" / "datasets"


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def rows_of(tok, paths, **kw):
    train, _, stats = load_dataset([str(p) for p in paths], tok, 256, pack=False, eval_fraction=0, **kw)
    return [(train[i]["input_ids"].tolist(), train[i]["labels"].tolist()) for i in range(len(train))], stats


def online(monkeypatch, fake_load=None):
    """The offline variables unset (datasets and huggingface_hub read them at import), and (fake_load) datasets'
    hub loader replaced."""
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    if fake_load is not None:
        monkeypatch.setattr(datasets, "load_dataset", fake_load)


class FakeHub:
    """The Hugging Face Hub at its lowest level, huggingface_hub's HTTP client (an httpx MockTransport through
    `huggingface_hub.set_client_factory`): one dataset repository of files, everything else 404, no network."""

    SHA = "a" * 40

    def __init__(self, repo: str, files: dict[str, bytes]):
        self.repo, self.files, self.requests = repo, files, []

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        path = request.url.path
        self.requests.append(f"{request.method} {request.url}")
        api = f"/api/datasets/{self.repo}"
        if path in (api, f"{api}/revision/main", f"{api}/revision/{self.SHA}"):
            siblings = [{"rfilename": name} for name in self.files]
            return httpx2.Response(200, json={"id": self.repo, "sha": self.SHA, "siblings": siblings})
        if path.startswith(f"{api}/tree/{self.SHA}"):
            return httpx2.Response(200, json=self._listing(path[len(f"{api}/tree/{self.SHA}") :].strip("/")))
        for name, body in self.files.items():
            if path in (f"/datasets/{self.repo}/resolve/{rev}/{name}" for rev in ("main", self.SHA)):
                headers = {"x-repo-commit": self.SHA, "etag": f'"{len(body)}-{hash(body)}"'}
                headers["content-length"] = str(len(body))
                return httpx2.Response(200, headers=headers, content=body if request.method == "GET" else b"")
        code = "EntryNotFound" if path.startswith(f"/datasets/{self.repo}/") else "RepoNotFound"
        return httpx2.Response(404, headers={"x-error-code": code, "x-repo-commit": self.SHA})

    def _listing(self, folder: str) -> list[dict]:
        entries = {}
        for name, body in self.files.items():
            if folder and not name.startswith(folder + "/"):
                continue
            child, _, deeper = name[len(folder) + 1 if folder else 0 :].partition("/")
            child = f"{folder}/{child}" if folder else child
            entries[child] = (
                {"type": "directory", "path": child, "oid": "0" * 40}
                if deeper
                else {"type": "file", "path": name, "size": len(body), "oid": "0" * 40}
            )
        return list(entries.values())


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """tatsu-lab/alpaca on a FakeHub (train and test splits as data/*.jsonl), online."""
    files = {
        "data/train.jsonl": "".join(json.dumps(r) + "\n" for r in RECORDS).encode(),
        "data/test.jsonl": (json.dumps(RECORDS[0]) + "\n").encode(),
    }
    fake = FakeHub("tatsu-lab/alpaca", files)
    online(monkeypatch)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    huggingface_hub.set_client_factory(lambda: httpx2.Client(transport=httpx2.MockTransport(fake)))
    yield fake
    huggingface_hub.set_client_factory(default_client_factory)


# ---------------------------------------------------------------------------------------------- hub ids


def cache_hub_dataset(cache, folder, records) -> str:
    """`someorg/tiny` as `datasets.load_dataset` leaves it in its cache: ORG___NAME/CONFIG/VERSION/HASH/*.arrow."""
    patterns = DataFilesDict.from_patterns({"train": [write_jsonl(folder / "hub.jsonl", records)]})
    Json(
        cache_dir=str(cache), dataset_name="tiny", hash="0123abcd", data_files=patterns
    ).download_and_prepare()
    [config] = (cache / "tiny").iterdir()
    (cache / "someorg___tiny").mkdir()
    config.rename(cache / "someorg___tiny" / "default")
    return "someorg/tiny"


def test_a_cached_hub_id_is_read_offline_without_a_download(tok, tmp_path, fresh_cache, monkeypatch):
    cache_hub_dataset(fresh_cache, tmp_path, RECORDS)
    write_jsonl(tmp_path / "a.jsonl", RECORDS)

    def no_download(*args, **kwargs):
        raise AssertionError("a cached dataset was downloaded")

    online(monkeypatch, no_download)  # online, but the cache answers first
    expected, _ = rows_of(tok, [tmp_path / "a.jsonl"])
    assert rows_of(tok, ["someorg/tiny"])[0] == expected


def test_offline_an_uncached_hub_id_is_one_line_naming_it_and_the_fix(tok, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(UsafError) as error:
        rows_of(tok, ["someorg/absent"])
    message = str(error.value)
    assert "\n" not in message and message.startswith(
        "someorg/absent is neither a local path nor a hub dataset"
    )
    assert "HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set: unset it to download it" in message
    assert "datasets.load_dataset('someorg/absent')" in message


def test_online_an_uncached_hub_id_is_fetched_by_datasets_in_one_line(tok, tmp_path, hub, capsys):
    expected, _ = rows_of(tok, [write_jsonl(tmp_path / "a.jsonl", RECORDS)])
    capsys.readouterr()
    assert rows_of(tok, ["tatsu-lab/alpaca"])[0] == expected
    cache = tmp_path / "hf" / "datasets"
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"data: fetched tatsu-lab/alpaca from the hub: split train, 4 rows (cached in {cache})"
    )
    assert (
        f"GET https://huggingface.co/datasets/tatsu-lab/alpaca/resolve/{hub.SHA}/data/train.jsonl"
        in hub.requests
    )
    hub.requests.clear()  # datasets' own cache has it now: read again without a request
    assert rows_of(tok, ["tatsu-lab/alpaca:test"])[0] == expected[:1] and hub.requests == []
    assert "data: fetched" not in capsys.readouterr().err
    with pytest.raises(UsafError, match=r"tatsu-lab/alpaca has no split 'dev'; its splits are train, test"):
        rows_of(tok, ["tatsu-lab/alpaca:dev"])


def test_online_a_missing_hub_id_is_one_line(tok, hub):
    with pytest.raises(UsafError, match=r"^someorg/absent: no such dataset on the hub \(or it is private"):
        rows_of(tok, ["someorg/absent"])


# ---------------------------------------------------------------------------------------------- mixing


def test_weights_mix_the_sources_in_their_proportions_seeded(tok, tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": f"a{i:03d}"} for i in range(300)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": f"b{i:03d}"} for i in range(300)])

    def sources(seed, weights=(0.8, 0.2), stopping="first_exhausted"):
        train, _, stats = load_dataset(
            [a, b],
            tok,
            64,
            pack=False,
            eval_fraction=0,
            seed=seed,
            weights=list(weights),
            mix_stopping=stopping,
        )
        texts = [tok.decode(train[i]["input_ids"].tolist()) for i in range(len(train))]
        return ["a" if "a" in text else "b" for text in texts], stats  # <bos> and <eos> have no "a"

    drawn, stats = sources(seed=0)
    counts = Counter(drawn)
    assert counts["a"] == 300  # the first source runs out first and ends the mix
    assert 0.75 < counts["a"] / len(drawn) < 0.85
    assert "data: mixed by data.weights 0.8/0.2 (first_exhausted, seed 0): records 300 of" in stats.summary()
    assert sources(seed=0)[0] == drawn and sources(seed=1)[0] != drawn
    even = Counter(sources(seed=0, weights=(1, 1))[0])
    assert max(even.values()) == 300 and min(even.values()) > 200
    every, _ = sources(seed=0, stopping="all_exhausted")
    assert set(Counter(every).values()) >= {300} and len(set(every)) == 2
    with pytest.raises(UsafError, match=r"data\.weights has 1 entries but the training data 2 sources"):
        sources(seed=0, weights=(1,))


def test_mixing_keeps_a_records_windows_together(tok, tmp_path):
    long = write_jsonl(tmp_path / "long.jsonl", [{"text": "x" * 50 + str(i)} for i in range(20)])
    short = write_jsonl(tmp_path / "short.jsonl", [{"text": f"s{i}"} for i in range(20)])
    train, _, stats = load_dataset(
        [long, short], tok, 20, pack=False, eval_fraction=0, weights=[0.5, 0.5], stride=2
    )
    assert stats.windows == 20 * 3
    texts = [tok.decode(train[i]["input_ids"].tolist()) for i in range(len(train))]
    for index, text in enumerate(texts):  # the three windows of a long record follow one another
        if text.startswith("<bos>x"):
            assert texts[index + 1].startswith("xx") and texts[index + 2].endswith("<eos>")


def test_weights_are_checked_when_the_config_is_read():
    assert RunConfig.from_dict({"data": {"weights": [0.7, 0.3]}}).data.weights == ["0.7", "0.3"]
    with pytest.raises(UsafError, match=r"data\.weights: the weights must be positive numbers"):
        RunConfig.from_dict({"data": {"weights": [0.7, 0]}})


# ---------------------------------------------------------------------------------------------- alpaca

ALPACA = {"instruction": "Add.", "input": "2+2", "output": "4", "system": "Be brief."}
AS_CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Add.\n2+2"},
    {"role": "assistant", "content": "4"},
]


def test_alpaca_goes_through_the_chat_template_when_the_tokenizer_has_one(tok, tmp_path):
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [ALPACA])
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": AS_CHAT}])
    [(ids, labels)], _ = rows_of(tok, [alpaca], alpaca_format="auto")
    assert [(ids, labels)] == rows_of(tok, [chat])[0]
    assert tok.decode(ids) == tok.apply_chat_template(AS_CHAT, tokenize=False)
    assert supervised(tok, ids, labels) == ["4<eos>"]  # the reply, and only it
    plain = {"prompt": "Be brief.\n\nAdd.\n\n2+2\n\n", "completion": "4"}
    assert (
        rows_of(tok, [alpaca], alpaca_format="plain")[0]
        == rows_of(tok, [write_jsonl(tmp_path / "plain.jsonl", [plain])])[0]
    )


def test_alpaca_without_a_chat_template_stays_plain_text(tmp_path):
    bare = copy.deepcopy(char_tokenizer())
    bare.chat_template = None
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [ALPACA])
    plain = write_jsonl(
        tmp_path / "plain.jsonl", [{"prompt": "Be brief.\n\nAdd.\n\n2+2\n\n", "completion": "4"}]
    )
    assert rows_of(bare, [alpaca], alpaca_format="auto")[0] == rows_of(bare, [plain])[0]
    with pytest.raises(
        UsafError, match=r"alpaca\.jsonl:1: chat records .* need a tokenizer with a chat template"
    ):
        rows_of(bare, [alpaca], alpaca_format="chat")


def test_a_run_saved_before_alpaca_format_resumes_with_plain_alpaca(tmp_path):
    saved = tmp_path / "config.yaml"
    saved.write_text(RunConfig().to_yaml().replace("  alpaca_format: auto\n", ""))
    assert "alpaca_format" not in saved.read_text()
    assert RunConfig.load_saved(str(saved)).data.alpaca_format == "plain"
    assert RunConfig().data.alpaca_format == "auto"


# ---------------------------------------------------------------------------------------------- streaming


def streamed(tok, paths, max_seq_len=256, **kw):
    train, held_out, stats = load_dataset(
        [str(p) for p in paths], tok, max_seq_len, pack=False, eval_fraction=0, streaming=True, **kw
    )
    assert isinstance(train, StreamedRows) and held_out is None
    return [(row["input_ids"].tolist(), row["labels"].tolist()) for row in train], stats


def test_a_stream_gives_the_rows_of_the_loaded_data_in_order(tok, tmp_path, fresh_cache):
    texts = write_jsonl(tmp_path / "t.jsonl", [{"text": "z" * 400}, {"text": "short"}])  # windows too
    pairs = tmp_path / "p.csv"
    pairs.write_text("prompt,completion\n" + "".join(f"{r['prompt']},{r['completion']}\n" for r in RECORDS))
    alpaca = write_jsonl(tmp_path / "a.jsonl", [ALPACA])
    datasets.Dataset.from_list(RECORDS[:2]).with_format("torch").save_to_disk(tmp_path / "saved")
    hub = cache_hub_dataset(fresh_cache, tmp_path, RECORDS[2:])
    paths = [texts, pairs, alpaca, tmp_path / "saved", hub]
    loaded, _ = rows_of(tok, paths, alpaca_format="auto")
    rows, stats = streamed(tok, paths, alpaca_format="auto")
    assert rows == loaded and len(rows) == 2 + 1 + 4 + 1 + 2 + 2  # two windows of the long text
    assert stats.summary().startswith("data: train streamed; data.streaming: ")
    assert "no eval: give data.eval" in stats.summary()


def test_an_uncached_hub_id_is_streamed_by_datasets_in_one_line(tok, tmp_path, hub, capsys):
    expected, _ = rows_of(tok, [write_jsonl(tmp_path / "a.jsonl", RECORDS)])
    capsys.readouterr()
    assert streamed(tok, ["tatsu-lab/alpaca:test"])[0] == expected[:1]
    assert "data: streaming tatsu-lab/alpaca from the hub: split test\n" in capsys.readouterr().err
    assert not (tmp_path / "hf" / "datasets" / "tatsu-lab___alpaca").exists()  # nothing cached
    with pytest.raises(UsafError, match=r"reads documents, not preference records \(train\.objective=dpo\)"):
        streamed(tok, ["tatsu-lab/alpaca"], pairs=True)


def test_a_stream_is_read_only_as_far_as_batches_are_taken(tok, tmp_path, monkeypatch):
    big = write_jsonl(tmp_path / "big.jsonl", [{"text": f"record {i}"} for i in range(5000)])
    encoded = []
    original = Encoder.__call__
    monkeypatch.setattr(
        Encoder,
        "__call__",
        lambda self, batch, indices: encoded.append(len(indices)) or original(self, batch, indices),
    )
    train, _, _ = load_dataset([big], tok, 64, eval_fraction=0, streaming=True)
    batches = StreamBatches(train, batch_size=4)
    first = [next(batches) for _ in range(3)]
    assert sum(encoded) <= 64  # one chunk of records tokenized for 12 rows, not 5000
    assert all(b["input_ids"].shape[0] == 4 for b in first)
    state = batches.state_dict()
    again = StreamBatches(train, batch_size=4)
    again.load_state_dict(state)
    assert torch.equal(next(again)["input_ids"], next(batches)["input_ids"])  # resumes at the same batch
    with pytest.raises(UsafError, match=r"data\.streaming: the number of rows is not known in advance"):
        len(batches)


def test_calibration_reads_a_stream_once_not_round_and_round(tok, tmp_path):
    # a run calibrates on one pass at most (select.calibration_tokens may ask for more than a small stream holds)
    small = write_jsonl(tmp_path / "small.jsonl", [{"text": f"record {i}"} for i in range(10)])
    train, _, _ = load_dataset([small], tok, 64, eval_fraction=0, streaming=True)
    once = itertools.islice(
        batches_for(train, 4, epochs=1), 10
    )  # bounded: a stream that goes round fails here
    assert [len(b["input_ids"]) for b in once] == [4, 4, 2]
    forever = batches_for(train, 4)
    assert [len(next(forever)["input_ids"]) for _ in range(4)] == [4, 4, 2, 4]  # training goes round


def test_weights_mix_a_stream_too(tok, tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": f"a{i:03d}"} for i in range(300)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": f"b{i:03d}"} for i in range(300)])
    rows, _ = streamed(tok, [a, b], weights=[0.8, 0.2], seed=3)
    drawn = Counter("a" if "a" in tok.decode(ids) else "b" for ids, _ in rows)
    assert drawn["a"] == 300 and 0.75 < drawn["a"] / len(rows) < 0.85


@pytest.mark.slow
def test_usaf_train_streams_and_resumes_exactly(tmp_path, capsys):
    model = make_model_dir(tmp_path / "model")
    data = write_jsonl(
        tmp_path / "d.jsonl", [{"text": f"copy {w} -> {w}"} for w in ("abc", "fed", "bad", "cab", "ace")]
    )
    sets = [
        "data.streaming=true",
        "data.max_seq_len=32",
        "data.batch_size=4",
        "select.density=0.1",
        "log.progress=false",
        "log.tensorboard=false",
        "schedule.warmup_steps=1",
        "checkpoint.every_steps=1",
        "schedule.name=constant_with_warmup",  # the same rates whatever max_steps: the stopped run resumes to 12
    ]
    args = [f"--model={model}", f"--data={data}", *(f"--set={s}" for s in sets)]
    assert main(["train", *args, f"--out={tmp_path / 'straight'}", "--set=schedule.max_steps=6"]) == 0
    assert main(["train", *args, f"--out={tmp_path / 'stopped'}", "--set=schedule.max_steps=3"]) == 0
    assert main(["train", f"--resume={tmp_path / 'stopped'}", "--set=schedule.max_steps=6"]) == 0
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "stopped")
    assert sorted(straight) == list(range(1, 7))  # 5 rows, 2 batches: the stream went round three times
    assert all(straight[s] == resumed[s] for s in range(1, 7)), (straight, resumed)
    capsys.readouterr()
    shown = []
    for streaming in ("false", "true"):  # `usaf data` reads a stream as far as it shows
        assert main(["data", *args[:2], "--show=3", "--json", f"--set=data.streaming={streaming}"]) == 0
        shown.append(capsys.readouterr().out.splitlines())
    assert shown[0] == shown[1] and len(shown[0]) == 3
    assert main(["train", *args, f"--out={tmp_path / 'epochs'}", "--set=schedule.epochs=1"]) == 2
    assert "set schedule.max_steps rather than schedule.epochs" in capsys.readouterr().err
