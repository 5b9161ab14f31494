"""GRPO (`train.objective=grpo`), as TRL's GRPOTrainer computes it with its defaults (loss_type "dapo", rewards
scaled per group, each generation trained on once), generating with the model being trained (no vLLM).

Each step: the `Rollouts` part turns the step's prompt batches (`usaf.train.prompts`) into rows of prompt +
completion, `train.num_generations` sampled completions a prompt, scored by `train.reward_functions` and given
their group-relative advantages; then the `GroupRelative` objective's loss over the completions' tokens, summed
here and divided by the loop by the step's completion tokens (all ranks): DAPO's normalization.

TRL computes its loss inside `GRPOTrainer._compute_loss` and its advantages inside
`_generate_and_score_completions`, methods of a trainer that no function outside it can call: the few lines of the
default path are written here (checked against the trainer by tests/train/test_grpo_trl.py), with TRL's own
`nanstd` for the groups' spread.
"""

from __future__ import annotations

import importlib
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from usaf.data import collate
from usaf.engine.base_weights import base_weights
from usaf.engine.loss import IGNORE_INDEX
from usaf.engine.preference import token_logps
from usaf.errors import ConfigError, UsafError
from usaf.model.hf import max_positions
from usaf.train.evaluate import supervised_units
from usaf.train.objectives import (  # after the built-ins: the choices list them first
    NEXT_TOKEN_LR,
    OBJECTIVES,
)
from usaf.train.parts import LOOP_PARTS, Part
from usaf.train.prompts import PromptRows

# TRL's epsilon added to a group's reward spread before dividing by it
_SPREAD_EPSILON = 1e-4


def reward_function(path: str) -> Callable:
    """The function `module:function` names (user code the configuration asks for), or one line saying why not."""
    module_name, _, attribute = str(path).partition(":")
    if not module_name or not attribute:
        raise ConfigError(
            f"train.reward_functions: {path!r} is not module:function (e.g. my_rewards:length)."
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(
            f"train.reward_functions: cannot import {module_name!r} for {path!r}: {err}"
        ) from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ConfigError(f"train.reward_functions: {module_name} has no function {attribute!r} ({path!r}).")
    return function


def reward_names(train) -> list[str]:
    """Each reward function's name in the metrics, as TRL names it (the function's own name)."""
    return [str(path).partition(":")[2] for path in train.reward_functions]


def reward_weights(train) -> torch.Tensor:
    return torch.tensor([float(w) for w in train.reward_weights or [1.0] * len(train.reward_functions)])


def group_advantages(rewards: torch.Tensor, weights: torch.Tensor, group: int) -> torch.Tensor:
    """Each completion's advantage from its [completions, functions] rewards (NaN: a function that returned
    None), as TRL's default: the weighted sum, less its group's mean, over its group's spread (+1e-4); a completion
    no function scored gets 0."""
    from trl.trainer.utils import nanstd  # TRL's import takes seconds: only a GRPO run pays it

    unscored = torch.isnan(rewards).all(dim=1)
    total = (rewards * weights.to(rewards.device).unsqueeze(0)).nansum(dim=1)
    total[unscored] = torch.nan
    grouped = total.view(-1, group)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group)
    spread = nanstd(grouped, dim=1).repeat_interleave(group)
    return torch.nan_to_num((total - mean) / (spread + _SPREAD_EPSILON), nan=0.0)


def score(
    functions: list[Callable],
    names: list[str],
    prompts,
    completions,
    completion_ids,
    records,
    **given,
) -> torch.Tensor:
    """[completions, functions] rewards, each function called as TRL calls it: prompts, completions and their
    token ids, every other column of the records as keyword arguments (one value a completion), and `given`
    (`Rollouts` gives TRL's trainer_state, log_extra and log_metric)."""
    columns = {
        key for record in records for key in record if key not in ("prompt", "completion", "completion_ids")
    }
    kwargs = {key: [record.get(key) for record in records] for key in sorted(columns)} | given
    rewards = torch.zeros(len(prompts), len(functions))
    for index, (function, name) in enumerate(zip(functions, names, strict=True)):
        out = function(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
        if len(out) != len(prompts):
            raise UsafError(
                f"reward function {name} returned {len(out)} rewards for {len(prompts)} completions (one each)."
            )
        rewards[:, index] = torch.tensor([math.nan if r is None else float(r) for r in out])
    return rewards


def until_eos(ids: list[int], eos: set[int]) -> list[int]:
    """A completion up to its first end-of-sequence token, which it keeps (and trains on), as TRL cuts it."""
    for index, token in enumerate(ids):
        if token in eos:
            return ids[: index + 1]
    return ids


@dataclass
class Sampler:
    """Sampling `count` completions of a prompt with the model being trained (TRL's generation settings: top_k
    and top_p off), at most `max_new` tokens and never past the model's context."""

    model: torch.nn.Module
    tokenizer: object
    count: int
    max_new: int
    temperature: float

    @torch.no_grad()
    def __call__(self, prompt: list[int]) -> list[list[int]]:
        device = next(self.model.parameters()).device
        inputs = torch.tensor([prompt] * self.count, device=device)
        positions = max_positions(self.model.config)
        room = self.max_new if positions is None else max(1, min(self.max_new, positions - len(prompt)))
        eos = self.tokenizer.eos_token_id
        training = self.model.training
        self.model.eval()  # dropout off while sampling, as TRL's default disable_dropout
        try:
            out = self.model.generate(
                input_ids=inputs,
                attention_mask=torch.ones_like(inputs),
                do_sample=True,
                temperature=self.temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=room,
                pad_token_id=self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos,
                eos_token_id=eos,
            )
        finally:
            self.model.train(training)
        return [until_eos(row, {eos}) for row in out[:, len(prompt) :].tolist()]


class Rollouts(Part):
    """The step's prompt batches become rows of prompt + completion (`step_batches`): each prompt's group of
    completions sampled, decoded as TRL hands them to the reward functions (a chat's completion as an assistant
    message), scored and given its advantages. A batch carries `advantages` [rows] and `rewards` [rows,
    functions] beside its input_ids / labels (completion tokens) / position_ids."""

    name = "rollouts"
    every = 1  # its after_step logs what the reward functions logged (log_metric)

    def __init__(self, prompts: PromptRows, sampler: Sampler, train, max_steps: int):
        self.prompts, self.sample, self.train = prompts, sampler, train
        self.functions = [reward_function(path) for path in train.reward_functions]
        # what TRL hands a reward function of its trainer's state: the steps done and to do
        self.state = SimpleNamespace(global_step=0, max_steps=max_steps)
        self.logged: dict[str, list[float]] = defaultdict(list)

    def start_step(self, step: int) -> None:
        # the steps done, as TRL's TrainerState counts them while it generates
        self.state.global_step = step - 1

    def log_metric(self, name: str, value: float) -> None:
        """TRL's log_metric: a scalar a reward function logs, averaged over the step into its metrics row."""
        self.logged[name].append(float(value))

    @staticmethod
    def log_extra(column: str, values: list) -> None:
        """TRL's log_extra: a column for TRL's completions table, which usaf does not keep (accepted, unused)."""

    def after_step(self, done) -> dict:
        logged = {name: sum(values) / len(values) for name, values in self.logged.items()}
        self.logged.clear()
        return logged

    @classmethod
    def build(cls, run) -> Rollouts | None:
        train = run.config.train
        if train.objective != GroupRelative.name:
            return None
        sampler = Sampler(
            run.model,
            run.session.tokenizer,
            train.num_generations,
            train.max_completion_length,
            train.temperature,
        )
        return cls(run.session.train_data, sampler, train, run.config.schedule.max_steps)

    def step_batches(self, micro: list[tuple[dict, list[int]]]) -> list[tuple[dict, list[int]]]:
        return [(self.rollout(rows), rows) for _, rows in micro]

    def rollout(self, rows: list[int]) -> dict[str, torch.Tensor]:
        tokenizer, group = self.sample.tokenizer, self.sample.count
        records, prompts, completion_ids, sequences = [], [], [], []
        for row in rows:
            prompt_ids = self.prompts[row]["input_ids"].tolist()
            record = self.prompts.records[row]
            for completion in self.sample(prompt_ids):
                records.append(record)
                prompts.append(record["prompt"])
                completion_ids.append(completion)
                ids = torch.tensor(prompt_ids + completion)
                labels = torch.tensor([IGNORE_INDEX] * len(prompt_ids) + completion)
                sequences.append({"input_ids": ids, "labels": labels, "position_ids": torch.arange(len(ids))})
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        completions = [
            text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]
            for prompt, text in zip(prompts, texts, strict=True)
        ]
        names = reward_names(self.train)
        rewards = score(
            self.functions,
            names,
            prompts,
            completions,
            completion_ids,
            records,
            trainer_state=self.state,
            log_extra=self.log_extra,
            log_metric=self.log_metric,
        )
        batch = collate(sequences, self.prompts.pad_id)
        batch["rewards"] = rewards
        batch["advantages"] = group_advantages(rewards, reward_weights(self.train), group)
        return batch


@dataclass
class Scores:
    """A micro-batch's rewards [completions, functions] and what the metrics name and weigh them by."""

    rewards: torch.Tensor
    names: list[str]
    weights: torch.Tensor


class GroupRelative:
    """grpo: the policy-gradient loss of each completion token, its completion's advantage times the token's
    probability ratio (1 in value: each generation is trained on once, so TRL's clipping never acts), plus, with
    train.grpo_beta > 0, beta times the k3 estimate of the KL divergence from the base (the reference: the same
    model with its trained entries switched off, one more forward without gradients). Its extra: the `Scores`."""

    name, pairs, reference_forward, default_lr = "grpo", False, False, NEXT_TOKEN_LR

    def check(self, train) -> None:
        if not train.reward_functions:
            raise ConfigError(
                "train.objective=grpo needs train.reward_functions (module:function, one or more)."
            )
        if train.reward_weights and len(train.reward_weights) != len(train.reward_functions):
            raise ConfigError(
                f"train.reward_weights has {len(train.reward_weights)} weights for "
                f"{len(train.reward_functions)} reward functions; give one each, or none."
            )
        if train.prefix_cache != "off":
            raise ConfigError(
                "train.prefix_cache caches one forward per data row; train.objective=grpo needs it off."
            )
        for path in train.reward_functions:
            reward_function(path)  # a bad path is said before anything loads

    def loss_sum(self, model, batch: dict, train) -> tuple[torch.Tensor, Scores]:
        inputs = (
            model,
            batch["input_ids"],
            batch["labels"],
            batch["position_ids"],
            train.logits_chunk_tokens,
        )
        reference = None
        if train.grpo_beta:
            with torch.no_grad(), base_weights(model):
                reference, _, _ = token_logps(*inputs, temperature=train.temperature)
        policy, rows, _ = token_logps(*inputs, temperature=train.temperature)
        ratio = torch.exp(policy - policy.detach())  # 1 in value, the policy's gradient
        per_token = -ratio * batch["advantages"][rows]
        if reference is not None:
            gap = reference - policy
            # TRL's use_bias_correction_kl (its default): the KL estimate weighted by the ratio too
            per_token = per_token + train.grpo_beta * (torch.exp(gap) - gap - 1) * ratio
        return per_token.sum(), Scores(batch["rewards"], reward_names(train), reward_weights(train))

    def supervised_units(self, batch: dict) -> int:
        """The completion tokens (the step's, over all ranks, divide its summed loss: DAPO)."""
        return supervised_units(batch, pairs=False)

    def step_metrics(self, extras: list[Scores], supervised: int, total: Callable) -> dict:
        """TRL's reward metrics over the step's completions on all ranks: `reward` and `reward_std` of the weighted
        sum, `rewards/NAME/mean` and `/std` of each function (NaN rewards left out)."""
        first = extras[0]
        rewards = torch.cat([e.rewards for e in extras]).double()
        weighted = (rewards * first.weights.double()).nansum(dim=1)
        weighted[torch.isnan(rewards).all(dim=1)] = math.nan
        mean, std = _mean_std(weighted, total)
        metrics = {"reward": mean, "reward_std": std}
        for index, name in enumerate(first.names):
            mean, std = _mean_std(rewards[:, index], total)
            metrics |= {f"rewards/{name}/mean": mean, f"rewards/{name}/std": std}
        return metrics


def _mean_std(values: torch.Tensor, total: Callable) -> tuple[float, float]:
    """Mean and (Bessel-corrected) spread over the ranks of `values`, NaN left out."""
    kept = values[~torch.isnan(values)]
    count, sum_, squares = total(int(kept.numel()), float(kept.sum()), float((kept**2).sum()))
    if count == 0:
        return math.nan, math.nan
    mean = sum_ / count
    spread = math.sqrt(max(squares - count * mean * mean, 0.0) / (count - 1)) if count > 1 else math.nan
    return mean, spread


OBJECTIVES.register(GroupRelative())
LOOP_PARTS.register(Rollouts)
