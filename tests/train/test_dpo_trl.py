"""TRL's DPOTrainer on a prepared model with the base as its own reference (`usaf.base_reference`): the same losses
and trained values as with an explicit reference copy, and no copy of the weights."""

import copy

import pytest
import torch
from datasets import Dataset

import usaf
from usaf.engine.installed import sparse_modules
from usaf.testing.tiny import tiny_model
from usaf.train.tokenizer import char_tokenizer

trl = pytest.importorskip("trl")

PAIRS = [
    {"prompt": f"copy {w} ->", "chosen": f" {w}", "rejected": f" {w[::-1]}x"}
    for w in ["abc", "cab", "fed", "bead", "dab", "face", "ace", "bed"]
]


def prepared(tokenizer):
    model = tiny_model("qwen3_moe", seed=0, vocab_size=len(tokenizer))
    # TRL's fused LM head reads lm_head.weight directly: the output layer is not a target here
    config = usaf.UsafConfig(density=0.05, selection="random", targets=["experts", "attention", "embeddings"])
    return usaf.prepare_model(model, config)


def dpo(model, ref_model, tokenizer, out) -> tuple[list[float], list[torch.Tensor]]:
    args = trl.DPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=4,
        max_steps=4,
        learning_rate=5e-2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        data_seed=0,
        disable_tqdm=True,
    )
    trainer = trl.DPOTrainer(
        model=model,
        ref_model=ref_model,
        args=args,
        train_dataset=Dataset.from_list(PAIRS),
        processing_class=tokenizer,
    )
    trainer.train()
    logs = [row for row in trainer.state.log_history if "loss" in row]
    values = [e.values.detach().clone() for _, s in sparse_modules(model) for e in s.values()]
    return logs, values


def test_dpo_with_the_base_as_reference_equals_an_explicit_reference_copy(tmp_path):
    tokenizer = char_tokenizer()
    policy = prepared(tokenizer)
    start = [e.values.detach().clone() for _, s in sparse_modules(policy) for e in s.values()]
    own, own_values = dpo(policy, usaf.BaseReference(policy), tokenizer, tmp_path / "a")
    other = prepared(tokenizer)
    copied = copy.deepcopy(other).eval().requires_grad_(False)
    ref, ref_values = dpo(other, copied, tokenizer, tmp_path / "b")
    assert [r["loss"] for r in own] == [r["loss"] for r in ref]
    assert [r["rewards/margins"] for r in own] == [r["rewards/margins"] for r in ref]
    assert own[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # at step 1 the policy is the reference
    assert all(torch.equal(a, b) for a, b in zip(own_values, ref_values, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(own_values, start, strict=True))  # it trained
    assert own[-1]["rewards/margins"] > 0  # the preferred answers moved ahead
