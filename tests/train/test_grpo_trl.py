"""train.objective=grpo against TRL's GRPOTrainer on the same prepared tiny model and prompts: the same completion
tokens counted, rewards, losses at step 1 and after it, and trained values.

Sampling cannot be matched across the two (TRL generates every prompt of a step in one padded call, usaf one
prompt's group at a time), so both models' `generate` is replaced by the same script: a prompt's k-th completion
in a call is a fixed text, one of them cut short without its end-of-sequence token. The optimizer is the same plain
SGD on both sides (usaf's own is not TRL's): what is compared is the objective, from the completions on."""

import collections
import json

import pytest
import torch
from datasets import Dataset
from helpers import make_model_dir
from transformers import AutoModelForCausalLM

import usaf
from usaf.config import RunConfig
from usaf.engine.installed import sparse_modules
from usaf.train.grpo import GroupRelative, Rollouts, Sampler
from usaf.train.prompts import load_prompts
from usaf.train.tokenizer import char_tokenizer

trl = pytest.importorskip("trl")

pytestmark = pytest.mark.slow  # TRL's import and trainer take seconds

PROMPTS = [{"prompt": "copy abc ->", "word": "abc"}, {"prompt": "copy cab ->", "word": "cab"}]
GENERATIONS, LONGEST, STEPS, TEMPERATURE = 4, 6, 3, 0.7
# each prompt's completions in a call, by their order in it (the last one is cut at LONGEST, without an EOS)
SCRIPT = [" abc", " a", " cba", " abcabc"]


def a_share(prompts, completions, word, **kwargs):
    """How much of a completion is the letter 'a' (word: a record's own column, as TRL passes it)."""
    assert len(word) == len(completions)
    return [c.count("a") / max(len(c), 1) for c in completions]


def length(prompts, completions, completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def scripted_generate(tokenizer):
    """A `generate` giving SCRIPT, by each prompt's order in the call (left padding ignored)."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id

    def generate(input_ids, attention_mask=None, **kwargs):
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        seen, rows = collections.Counter(), []
        for ids, keep in zip(input_ids.tolist(), mask.tolist(), strict=True):
            prompt = tuple(i for i, k in zip(ids, keep, strict=True) if k)
            text = SCRIPT[seen[prompt] % len(SCRIPT)]
            seen[prompt] += 1
            row = tokenizer(text, add_special_tokens=False)["input_ids"][:LONGEST]
            rows.append([*row, eos] if len(row) < LONGEST else row)
        width = max(map(len, rows))
        tail = torch.tensor([row + [pad] * (width - len(row)) for row in rows], device=input_ids.device)
        return torch.cat([input_ids, tail], dim=1)

    return generate


def prepared(folder, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(folder)
    # TRL's fused output head reads lm_head.weight directly: the output layer is not a target here
    config = usaf.UsafConfig(density=0.05, selection="random", targets=["experts", "attention", "embeddings"])
    model = usaf.prepare_model(model, config)
    model.generate = scripted_generate(tokenizer)
    return model


def trained_values(model) -> list[torch.Tensor]:
    return [e.values.detach().clone() for _, s in sparse_modules(model) for e in s.values()]


def sgd(model):
    # linear in the gradient: Adam would blow the float noise of entries whose gradient is ~0 up to lr-sized steps
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)


def with_trl(folder, tokenizer, beta, out):
    model = prepared(folder, tokenizer)
    optimizer = sgd(model)
    args = trl.GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=len(PROMPTS) * GENERATIONS,
        num_generations=GENERATIONS,
        max_completion_length=LONGEST,
        temperature=TEMPERATURE,
        beta=beta,
        reward_weights=[1.0, 0.5],
        max_steps=STEPS,
        max_grad_norm=0.0,
        router_aux_loss_coef=0.0,  # the routers' balancing loss is a loop part of usaf's, not the objective's
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=False,  # TRL's default autocasts to bf16; usaf's side runs in float32
        seed=0,
        disable_tqdm=True,
    )
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=[a_share, length],
        args=args,
        train_dataset=Dataset.from_list(PROMPTS),
        processing_class=tokenizer,
        optimizers=(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)),
    )
    losses, tokens = [], []
    compute_loss = trainer.compute_loss

    def recorded(model, inputs, *args, **kwargs):
        loss = compute_loss(model, inputs, *args, **kwargs)
        losses.append(loss.item())
        tokens.append(int(inputs["num_items_in_batch"]))
        return loss

    trainer.compute_loss = recorded
    trainer.train()
    rewards = [row["reward"] for row in trainer.state.log_history if "reward" in row]
    return losses, tokens, rewards, trained_values(model)


def with_usaf(folder, tokenizer, beta, data):
    model = prepared(folder, tokenizer)
    config = RunConfig.load(
        None,
        [
            ("data.train", [str(data)]),
            ("train.objective", "grpo"),
            ("train.reward_functions", ["test_grpo_trl:a_share", "test_grpo_trl:length"]),
            ("train.reward_weights", [1.0, 0.5]),
            ("train.num_generations", GENERATIONS),
            ("train.max_completion_length", LONGEST),
            ("train.temperature", TEMPERATURE),
            ("train.grpo_beta", beta),
        ],
    )
    train, objective = config.train, GroupRelative()
    objective.check(train)
    prompts, _, _ = load_prompts(config.data, tokenizer)
    rollouts = Rollouts(prompts, Sampler(model, tokenizer, GENERATIONS, LONGEST, TEMPERATURE), train, STEPS)
    optimizer = sgd(model)
    model.train()
    losses, tokens, rewards = [], [], []
    for _ in range(STEPS):
        [(batch, _)] = rollouts.step_batches([({}, [0, 1])])
        supervised = objective.supervised_units(batch)
        loss_sum, scores = objective.loss_sum(model, batch, train)
        (loss_sum / supervised).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss_sum.item() / supervised)
        tokens.append(supervised)
        rewards.append(objective.step_metrics([scores], supervised, lambda *v: v)["reward"])
    return losses, tokens, rewards, trained_values(model)


@pytest.mark.parametrize("beta", [0.0, 0.2])
def test_grpo_equals_trl_grpo_trainer(beta, tmp_path):
    tokenizer = char_tokenizer()
    folder = make_model_dir(tmp_path / "model")
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    start = trained_values(prepared(folder, tokenizer))
    trl_losses, trl_tokens, trl_rewards, trl_values = with_trl(folder, tokenizer, beta, tmp_path / "trl")
    losses, tokens, rewards, values = with_usaf(folder, tokenizer, beta, data)
    assert (
        tokens == trl_tokens == [2 * (5 + 3 + 5 + 6)] * STEPS
    )  # completion tokens: EOS in, none in the cut one
    assert rewards == pytest.approx(trl_rewards, abs=1e-6)
    assert losses == pytest.approx(trl_losses, abs=1e-6)
    if beta:  # the KL term grows as the policy leaves the base: the later losses depend on the trained values
        assert losses[-1] != pytest.approx(losses[0], abs=1e-6)
    for mine, theirs in zip(values, trl_values, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    assert not all(torch.equal(v, s) for v, s in zip(values, start, strict=True))  # it trained
