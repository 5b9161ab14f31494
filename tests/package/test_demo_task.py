"""The bundled demo model and task: assets load with plain transformers, the model knows the pretraining skills
and not the new one, the data is deterministic with a held-out eval split, and accuracy is exact match."""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import usaf
from usaf.demo.task import (
    KINDS,
    NEW_SKILL,
    make_examples,
    read_jsonl,
    task_accuracy,
    write_demo_data,
)
from usaf.errors import UsafError
from usaf.train.tokenizer import char_tokenizer

ASSETS = Path(str(files("usaf") / "demo_assets"))
MODEL_DIR = ASSETS / "model"
DATA_DIR = ASSETS / "data"
FRESH_SEED = 987_654  # not a seed of the pretraining steps nor of the bundled data


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # A 0.5 M-parameter model gains nothing from a second thread, and on a busy machine the threads' barriers
    # make generation ~10x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(MODEL_DIR).eval()


def test_assets_are_a_small_plain_mixtral(model, tokenizer):
    config = model.config
    assert config.model_type == "mixtral"  # a Llama family: llama.cpp converts its character vocabulary
    assert config.num_local_experts == 8 and config.num_experts_per_tok == 2
    assert config.tie_word_embeddings is False
    assert config.vocab_size == len(tokenizer)
    assert model.dtype == torch.float32
    assert (MODEL_DIR / "model.safetensors").stat().st_size < 3 * 2**20
    assert (MODEL_DIR / "generation_config.json").is_file()
    # the shipped tokenizer is usaf's character tokenizer, ids and chat template included
    assert tokenizer.get_vocab() == char_tokenizer(llama_vocab=True).get_vocab()
    assert tokenizer.chat_template == char_tokenizer().chat_template
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)


def test_pretrained_model_knows_copy_and_upper_but_not_shift(model, tokenizer):
    assert task_accuracy(model, tokenizer, make_examples("copy", 50, FRESH_SEED)) >= 0.9
    assert task_accuracy(model, tokenizer, make_examples("upper", 50, FRESH_SEED)) >= 0.9
    assert task_accuracy(model, tokenizer, read_jsonl(DATA_DIR / "eval.jsonl")) <= 0.02


def test_examples_are_deterministic_and_well_formed():
    assert make_examples("shift", 20, 3) == make_examples("shift", 20, 3)
    assert make_examples("shift", 20, 3) != make_examples("shift", 20, 4)
    for record in make_examples("shift", 200, 5):
        word = record["prompt"].removeprefix("shift: ").removesuffix(" -> ")
        assert word.isalpha() and word.islower() and 3 <= len(word) <= 6
        assert record["completion"] == "".join("a" if c == "z" else chr(ord(c) + 1) for c in word)
    for kind, transform in (("copy", str), ("upper", str.upper)):
        for record in make_examples(kind, 20, 5):
            assert record["completion"] == transform(
                record["prompt"].removeprefix(f"{kind}: ").removesuffix(" -> ")
            )
    assert set(KINDS) == {"copy", "upper", "shift"}
    with pytest.raises(UsafError, match="Unknown demo task kind"):
        make_examples("reverse", 1, 0)


def test_bundled_data_is_what_write_demo_data_writes_and_eval_is_held_out(tmp_path):
    paths = write_demo_data(tmp_path)
    for split in ("train", "eval", "preference_train", "preference_eval"):
        assert paths[split].read_bytes() == (DATA_DIR / f"{split}.jsonl").read_bytes()
    pairs = read_jsonl(paths["preference_train"])
    assert len(pairs) == 500 and all(p["chosen"] != p["rejected"] for p in pairs)
    assert [p["prompt"] for p in pairs] == [r["prompt"] for r in read_jsonl(paths["train"])[:500]]
    train, evaluation = read_jsonl(paths["train"]), read_jsonl(paths["eval"])
    assert len(train) == 2000 and len(evaluation) == 200
    assert all(r["prompt"].startswith(f"{NEW_SKILL}: ") for r in train + evaluation)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evaluation}
    assert len({r["prompt"] for r in evaluation}) == len(evaluation)
    assert all(
        set(json.loads(line)) == {"prompt", "completion"} for line in paths["eval"].read_text().splitlines()
    )


def test_task_accuracy_is_exact_match(model, tokenizer):
    right = make_examples("copy", 4, FRESH_SEED)
    assert task_accuracy(model, tokenizer, right) == 1.0
    # a prefix or an extension of what the model says is not a match, nor is another case
    wrong = [
        {**right[0], "completion": right[0]["completion"][:-1]},
        {**right[1], "completion": right[1]["completion"] + "a"},
        {**right[2], "completion": right[2]["completion"].upper()},
        right[3],
    ]
    assert task_accuracy(model, tokenizer, wrong) == 0.25
    # too few new tokens to reach <eos>: the answer is cut, hence wrong
    assert task_accuracy(model, tokenizer, right, max_new_tokens=2) == 0.0
    with pytest.raises(UsafError):
        task_accuracy(model, tokenizer, [])


def test_demo_model_prepares_for_usaf_and_keeps_its_mode(tokenizer):
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    usaf.prepare_model(
        model,
        usaf.UsafConfig(
            density=0.05, granularity="element", selection="magnitude", targets=["experts", "routers"]
        ),
    )
    summary = usaf.trainable_summary(model)
    assert summary["other"] == 0 and summary["routers"] == 3 * 8 * 64
    model.train()
    assert task_accuracy(model, tokenizer, make_examples("copy", 8, FRESH_SEED)) >= 0.9
    assert model.training  # task_accuracy restores the mode it found
