"""ORPO, SimPO and KTO (`train.objective=orpo|simpo|kto`) against TRL's own trainers: the same tiny prepared model,
the same pairs and tokenizer, TRL's trainer on one side and usaf's objective with the same optimizer on the other;
the same tokens, the same loss at step 1 and after a few steps."""

import json

import pytest
import torch
from datasets import Dataset

import usaf
from usaf.config import RunConfig
from usaf.data import Batches, load_dataset
from usaf.engine.trl_preference import mismatched_rows
from usaf.registry import OBJECTIVES
from usaf.testing.tiny import tiny_model
from usaf.train.objectives import OBJECTIVES as REGISTERED  # the built-in objectives, registered
from usaf.train.tokenizer import char_tokenizer

trl = pytest.importorskip("trl")
suppress_experimental_warning = pytest.importorskip("trl.import_utils").suppress_experimental_warning
with suppress_experimental_warning():  # usaf imports them only when a run trains with them
    import trl.experimental.cpo
    import trl.experimental.orpo
assert REGISTERED is OBJECTIVES

PAIRS = [
    {"prompt": f"copy {w} ->", "chosen": f" {w}", "rejected": f" {w[::-1]}x"}
    for w in ["abc", "cab", "fed", "bead", "dab", "face", "ace", "bed"]
]
# KTO's unpaired records, in the order TRL unpairs PAIRS: every chosen answer, then every rejected one
UNPAIRED = [{"prompt": p["prompt"], "completion": p["chosen"], "label": True} for p in PAIRS] + [
    {"prompt": p["prompt"], "completion": p["rejected"], "label": False} for p in PAIRS
]
STEPS, LR = 3, 5e-2


def prepared(tokenizer):
    model = tiny_model("qwen3_moe", seed=0, vocab_size=len(tokenizer))
    # TRL's fused LM head (KTO) reads lm_head.weight directly: the output layer is not a target here
    config = usaf.UsafConfig(density=0.05, selection="random", targets=["experts", "attention", "embeddings"])
    return usaf.prepare_model(model, config)


COMMON = dict(
    per_device_train_batch_size=len(PAIRS),  # one batch of every record: the sampler's order cannot matter
    max_steps=STEPS,
    learning_rate=LR,
    lr_scheduler_type="constant",
    weight_decay=0.0,
    max_grad_norm=0.0,
    logging_steps=1,
    report_to=[],
    save_strategy="no",
    use_cpu=True,
    bf16=False,  # TRL's configs default to bf16 autocast; both sides compute in float32 here
    seed=0,
    data_seed=0,
    disable_tqdm=True,
)


def trl_run(name, tokenizer, out):
    """TRL's trainer for the objective: (its logged losses, its logs, its tokenized data set)."""
    model = prepared(tokenizer)
    data = Dataset.from_list(UNPAIRED if name == "kto" else PAIRS)
    if name == "orpo":
        args = trl.experimental.orpo.ORPOConfig(output_dir=str(out), beta=0.1, max_length=64, **COMMON)
        trainer = trl.experimental.orpo.ORPOTrainer(
            model=model, args=args, train_dataset=data, processing_class=tokenizer
        )
    elif name == "dpo":
        # DPO adds the MoE's load-balancing loss by default, which usaf's objectives do not
        args = trl.DPOConfig(output_dir=str(out), beta=0.1, max_length=64, router_aux_loss_coef=0.0, **COMMON)
        trainer = trl.DPOTrainer(
            model=model,
            ref_model=usaf.BaseReference(model),
            args=args,
            train_dataset=data,
            processing_class=tokenizer,
        )
    elif name == "simpo":
        args = trl.experimental.cpo.CPOConfig(
            output_dir=str(out),
            loss_type="simpo",
            beta=0.1,
            simpo_gamma=0.5,
            cpo_alpha=1.0,
            max_length=64,
            **COMMON,
        )
        trainer = trl.experimental.cpo.CPOTrainer(
            model=model, args=args, train_dataset=data, processing_class=tokenizer
        )
    else:
        # one batch of every row; KTO adds the MoE's load-balancing loss by default, which usaf's objectives do not
        rows = {**COMMON, "per_device_train_batch_size": 2 * len(PAIRS)}
        args = trl.KTOConfig(output_dir=str(out), beta=0.1, max_length=64, router_aux_loss_coef=0.0, **rows)
        trainer = trl.KTOTrainer(
            model=model,
            ref_model=usaf.BaseReference(model),
            args=args,
            train_dataset=data,
            processing_class=tokenizer,
        )
    trainer.train()
    logs = [row for row in trainer.state.log_history if "loss" in row]
    return [row["loss"] for row in logs], logs, trainer.train_dataset


def usaf_run(name, tokenizer, tmp_path):
    """usaf's objective on its own reading of the pairs, with the optimizer TRL's trainer uses: (losses, batch)."""
    path = tmp_path / "records.jsonl"
    records = UNPAIRED if name == "kto" else PAIRS
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    objective = OBJECTIVES[name]
    rows, _, _ = load_dataset(
        [str(path)], tokenizer, 64, eval_fraction=0.0, pairs=objective.pairs, objective=name
    )
    batch = next(iter(Batches(rows, len(rows), shuffle=False)))
    model = prepared(tokenizer).train()  # as the Trainer (and usaf's loop) train it
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    train = RunConfig().train
    losses = []
    for _ in range(STEPS):
        loss_sum, _ = objective.loss_sum(model, batch, train)
        loss = loss_sum / objective.supervised_units(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, batch


def rows_of(batch) -> list[list[int]]:
    """Each row's tokens, padding left out (a row ends with its answer's EOS)."""
    ends = [int((labels != -100).nonzero().max()) + 1 for labels in batch["labels"]]
    return [ids[:end].tolist() for ids, end in zip(batch["input_ids"], ends, strict=True)]


@pytest.mark.slow  # TRL's trainer and ours, 3 steps each: 10-30 s on a 2-core CPU
@pytest.mark.parametrize("name", ["orpo", "simpo"])
def test_orpo_and_simpo_equal_trls_trainers(name, tmp_path):
    tokenizer = char_tokenizer()
    theirs, _, tokenized = trl_run(name, tokenizer, tmp_path / "trl")
    ours, batch = usaf_run(name, tokenizer, tmp_path)
    chosen = [r["prompt_input_ids"] + r["chosen_input_ids"][len(r["prompt_input_ids"]) :] for r in tokenized]
    assert [r["chosen_input_ids"] for r in tokenized] == rows_of(batch)[: len(PAIRS)]
    assert [r["rejected_input_ids"] for r in tokenized] == rows_of(batch)[len(PAIRS) :]
    assert chosen == rows_of(batch)[: len(PAIRS)]
    assert ours == pytest.approx(theirs, rel=1e-5)
    assert ours[-1] < ours[0]  # it trained


@pytest.mark.slow
def test_dpo_equals_trls_trainer(tmp_path):
    """usaf's own DPO loss (TRL 1.16 has none to call) against DPOTrainer with the base as reference."""
    tokenizer = char_tokenizer()
    theirs, _, tokenized = trl_run("dpo", tokenizer, tmp_path / "trl")
    ours, batch = usaf_run("dpo", tokenizer, tmp_path)
    assert [r["prompt_ids"] + r["chosen_ids"] for r in tokenized] == rows_of(batch)[: len(PAIRS)]
    assert [r["prompt_ids"] + r["rejected_ids"] for r in tokenized] == rows_of(batch)[len(PAIRS) :]
    assert ours == pytest.approx(theirs, rel=1e-5)
    assert ours[-1] < ours[0]


@pytest.mark.slow
def test_kto_equals_trls_trainer(tmp_path):
    tokenizer = char_tokenizer()
    theirs, logs, tokenized = trl_run("kto", tokenizer, tmp_path / "trl")
    ours, batch = usaf_run("kto", tokenizer, tmp_path)
    assert [r["prompt_ids"] + r["completion_ids"] for r in tokenized] == rows_of(batch)
    # the KL term's mismatched rows: each prompt with the answer before it, as TRL pairs them
    assert [r["prompt_ids"] + r["KL_completion_ids"] for r in tokenized] == rows_of(mismatched_rows(batch))
    assert [bool(r["label"]) for r in tokenized] == batch["label"].tolist() == [r["label"] for r in UNPAIRED]
    assert [row["num_tokens"] for row in logs] == [
        sum(map(len, rows_of(batch))) * (s + 1) for s in range(STEPS)
    ]
    assert ours == pytest.approx(theirs, rel=1e-5)
    assert ours[-1] < ours[0]
