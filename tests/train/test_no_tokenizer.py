"""Issue 12, item 1: a model folder without tokenizer files trains, evaluates and selects on pre-tokenized data
(ids checked against config.vocab_size); text data gets one sentence saying the folder has no tokenizer."""

import json
import os

import pytest
from helpers import make_model_dir

from usaf.cli import main

SETS = [
    "data.max_seq_len=32",
    "data.batch_size=4",
    "select.density=0.1",
    "log.progress=false",
    "log.tensorboard=false",
    "schedule.warmup_steps=1",
    "schedule.max_steps=2",
    "data.eval_fraction=0",
]


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """A model folder with config.json and weights only, pre-tokenized data and text data."""
    root = tmp_path_factory.mktemp("no-tokenizer")
    model = make_model_dir(root / "model")
    for name in os.listdir(model):
        if name not in ("config.json", "model.safetensors", "generation_config.json"):
            os.remove(model / name)
    with open(root / "ids.jsonl", "w") as f:
        for i in range(24):
            f.write(json.dumps({"input_ids": [1 + (i + j) % 100 for j in range(12)]}) + "\n")
    (root / "text.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    (root / "big.jsonl").write_text(json.dumps({"input_ids": [5, 6, 104]}) + "\n")
    return root


def _sets():
    return [f"--set={s}" for s in SETS]


@pytest.mark.slow
def test_pretokenized_data_trains_without_a_tokenizer(bare, tmp_path, capsys):
    run = tmp_path / "run"
    args = ["train", f"--model={bare / 'model'}", f"--data={bare / 'ids.jsonl'}", f"--out={run}", *_sets()]
    assert main(args) == 0, capsys.readouterr().err
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    capsys.readouterr()
    assert main(["eval", str(run), f"--data={bare / 'ids.jsonl'}"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] > 0
    assert main(["eval", str(bare / "model"), f"--data={bare / 'ids.jsonl'}"]) == 0
    capsys.readouterr()
    out = tmp_path / "sel.safetensors"
    args = ["select", f"--model={bare / 'model'}", f"--data={bare / 'ids.jsonl'}", f"--out={out}", *_sets()]
    assert main(args) == 0 and out.exists()


# text records without a tokenizer (train, eval, select): rows of tests/cli/test_faults_commands.py


def test_ids_beyond_the_models_vocabulary_are_named(bare, tmp_path, capsys):
    args = ["train", f"--model={bare / 'model'}", f"--data={bare / 'big.jsonl'}", f"--out={tmp_path / 'r'}"]
    assert main([*args, *_sets()]) == 2
    err = capsys.readouterr().err
    assert "big.jsonl:1: input_ids[2]=104 is outside the model's vocabulary of 104 (config.vocab_size)" in err
    assert not (tmp_path / "r").exists()
