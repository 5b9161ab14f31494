"""`usaf train --set train.objective=grpo`: prompts read with their columns, reward functions by import path (one-line
errors), TRL's group-relative advantages and reward metrics, and a run on the bundled model that raises the mean
reward of its own completions (TRL's trainer itself: test_grpo_trl.py)."""

import json
import math
import random
from importlib import resources
from pathlib import Path

import pytest
import torch

from usaf.cli import main
from usaf.config import RunConfig
from usaf.errors import ConfigError, DataError
from usaf.registry import OBJECTIVES
from usaf.train.grpo import Scores, group_advantages, reward_function
from usaf.train.prompts import load_prompts
from usaf.train.tokenizer import char_tokenizer

DEMO_MODEL = Path(str(resources.files("usaf") / "demo_assets" / "model"))


def lowercase(prompts, completions, trainer_state, log_metric, **kwargs):
    """A reward from a test file: the share of a completion's characters that are lower-case letters; it names
    two of the arguments TRL passes, the trainer's state and log_metric, and logs a metric of its own."""
    log_metric("steps_done", trainer_state.global_step)
    return [sum(ch.islower() for ch in c) / max(len(c), 1) for c in completions]


def grpo(data: dict | None = None, **train) -> RunConfig:
    settings = {"objective": "grpo", "reward_functions": ["test_grpo:lowercase"], **train}
    overrides = [(f"train.{key}", value) for key, value in settings.items()]
    return RunConfig.load(None, overrides + [(f"data.{key}", value) for key, value in (data or {}).items()])


@pytest.mark.parametrize(
    "path, says",
    [
        ("lowercase", "is not module:function"),
        ("no_such_module_here:fn", "cannot import 'no_such_module_here'"),
        ("test_grpo:missing", "test_grpo has no function 'missing'"),
        ("test_grpo:DEMO_MODEL", "test_grpo has no function 'DEMO_MODEL'"),  # not callable
    ],
)
def test_a_bad_reward_path_is_one_line(path, says):
    with pytest.raises(ConfigError, match=says) as error:
        OBJECTIVES["grpo"].check(grpo(reward_functions=[path]).train)
    assert "\n" not in str(error.value)


def test_the_settings_grpo_cannot_run_with_are_refused():
    objective = OBJECTIVES["grpo"]
    with pytest.raises(ConfigError, match=r"needs train\.reward_functions"):
        objective.check(grpo(reward_functions=[]).train)
    with pytest.raises(ConfigError, match="2 weights for 1 reward functions"):
        objective.check(grpo(reward_weights=[1.0, 2.0]).train)
    assert reward_function("test_grpo:lowercase") is lowercase


def test_a_weight_that_is_no_number_is_one_line():
    with pytest.raises(ConfigError, match=r"train\.reward_weights: the weights must be numbers") as error:
        grpo(reward_weights=["heavy"])
    assert "\n" not in str(error.value)
    assert grpo(reward_weights=["-0.5"]).train.reward_weights == ["-0.5"]  # any sign, as TRL's


def test_advantages_are_relative_to_the_group():
    rewards = torch.tensor(
        [[1.0, 0.0], [0.0, 0.0], [2.0, 2.0], [2.0, math.nan], [math.nan, math.nan], [1.0, 1.0]]
    )
    advantages = group_advantages(rewards, torch.tensor([1.0, 0.5]), group=3)
    # group 1: totals 1, 0, 3 (mean 4/3, sample std 1.5275); group 2: 2, unscored, 1.5 (mean 1.75, std 0.3536)
    first = (torch.tensor([1.0, 0.0, 3.0]) - 4 / 3) / (torch.tensor([1.0, 0.0, 3.0]).std() + 1e-4)
    second = (torch.tensor([2.0, 1.5]) - 1.75) / (torch.tensor([2.0, 1.5]).std() + 1e-4)
    expected = torch.tensor([*first.tolist(), second[0], 0.0, second[1]])
    torch.testing.assert_close(advantages, expected)


def test_prompts_keep_their_columns_and_chats_get_the_template(tmp_path):
    data = tmp_path / "prompts.jsonl"
    chat = [{"role": "user", "content": "hi"}]
    data.write_text(
        json.dumps({"prompt": "copy ab ->", "answer": "ab"}) + "\n" + json.dumps({"prompt": chat}) + "\n"
    )
    tokenizer = char_tokenizer()
    rows, held_out, stats = load_prompts(grpo({"train": [str(data)]}).data, tokenizer)
    assert held_out is None and len(rows) == 2 and stats.records == 2
    assert rows.records[0] == {"prompt": "copy ab ->", "answer": "ab"}
    assert rows[0]["input_ids"].tolist() == tokenizer("copy ab ->")["input_ids"]
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert rows[1]["input_ids"].tolist() == tokenizer(rendered, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    "record, says", [({"completion": "x"}, "records with a 'prompt'"), ({"prompt": "x" * 60}, "no room")]
)
def test_records_grpo_cannot_use_are_named(tmp_path, record, says):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps(record) + "\n")
    with pytest.raises(DataError, match=f"prompts.jsonl:1: .*{says}"):
        load_prompts(grpo({"train": [str(data)], "max_seq_len": 48}).data, char_tokenizer())


def test_reward_metrics_are_trl_s():
    extras = [
        Scores(torch.tensor([[1.0, 2.0], [3.0, math.nan]]), ["a", "b"], torch.tensor([1.0, 0.5])),
        Scores(torch.tensor([[0.0, 4.0]]), ["a", "b"], torch.tensor([1.0, 0.5])),
    ]
    metrics = OBJECTIVES["grpo"].step_metrics(extras, 3, lambda *values: values)
    weighted = torch.tensor([2.0, 3.0, 2.0])
    assert metrics["reward"] == pytest.approx(float(weighted.mean()))
    assert metrics["reward_std"] == pytest.approx(float(weighted.std()))
    assert metrics["rewards/a/mean"] == pytest.approx(4 / 3)
    assert metrics["rewards/b/mean"] == pytest.approx(3.0)  # the None (NaN) left out
    assert metrics["rewards/b/std"] == pytest.approx(math.sqrt(2.0))


@pytest.mark.slow
def test_grpo_on_the_bundled_model_raises_the_mean_reward(tmp_path):
    rnd = random.Random(0)
    words = ["".join(rnd.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(5)) for _ in range(32)]
    data = tmp_path / "prompts.jsonl"
    # a skill the bundled model lacks: its completions of these mix in capitals (the reward's spread)
    data.write_text("".join(json.dumps({"prompt": f"shift: {w} -> "}) + "\n" for w in words))
    sets = [
        "train.objective=grpo",
        "train.reward_functions=[test_grpo:lowercase]",
        "train.num_generations=6",
        "train.max_completion_length=6",
        "data.batch_size=2",
        "select.density=0.02",
        "schedule.max_steps=3",
        "schedule.warmup_steps=0",
        "log.progress=false",
        "log.tensorboard=false",
    ]
    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                f"--model={DEMO_MODEL}",
                f"--data={data}",
                f"--out={run}",
                *(f"--set={s}" for s in sets),
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rewards = [row["reward"] for row in rows if "reward" in row]
    assert len(rewards) == 3 and all(f"rewards/lowercase/{k}" in rows[-1] for k in ("mean", "std"))
    assert [row["steps_done"] for row in rows if "reward" in row] == [
        0,
        1,
        2,
    ]  # TRL's trainer_state, log_metric
    assert rewards[-1] > rewards[0] + 0.1, rewards
