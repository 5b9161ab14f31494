"""The best evaluation of a run (checkpoint.keep_best) and the evaluations since it (early stopping), with the
meanings of transformers' Trainer: `metric_for_best_model` / `greater_is_better` rank the evaluations, and
EarlyStoppingCallback stops once `early_stopping_patience` evaluations in a row failed to beat the best by more
than `early_stopping_threshold`.

Only the evaluations taken during training (every log.eval_every_steps) count: the one before training is the
base's, which no checkpoint holds, and the final one repeats the last step's when that step is an evaluation's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from usaf.config import RunConfig
from usaf.errors import ConfigError
from usaf.train.metrics import EVAL_PREFIX


def check_evaluations(config: RunConfig) -> None:
    """checkpoint.keep_best and schedule.early_stopping_patience rank evaluations taken during training: refused,
    naming the settings, when there are none."""
    users = [
        name
        for name, used in (
            ("checkpoint.keep_best=true", config.checkpoint.keep_best),
            (
                f"schedule.early_stopping_patience={config.schedule.early_stopping_patience}",
                bool(config.schedule.early_stopping_patience),
            ),
        )
        if used
    ]
    if not users:
        return
    if not config.log.eval_every_steps:
        raise ConfigError(
            f"{' and '.join(users)} need evaluations during training: set log.eval_every_steps=N (an evaluation "
            "every N steps; 0, the default, evaluates only before and after training)."
        )
    if not config.data.eval and not config.data.eval_fraction:
        raise ConfigError(
            f"{' and '.join(users)} need held-out data: give data.eval (--eval-data) or data.eval_fraction above 0."
        )
    if not config.data.eval and config.data.streaming:  # a stream is never split: nothing would be evaluated
        raise ConfigError(
            f"{' and '.join(users)} need held-out data, and data.streaming holds none out of a stream: give "
            "data.eval (--eval-data)."
        )


def greater_is_better(section) -> bool:
    """checkpoint.greater_is_better, with auto read as the Trainer does, perplexity added: lower is better for a
    loss or a perplexity, higher for anything else."""
    if section.greater_is_better != "auto":
        return bool(section.greater_is_better)
    return not section.best_metric.removeprefix(EVAL_PREFIX).endswith(("loss", "perplexity"))


@dataclass
class BestEvaluation:
    """The best evaluation so far of `metric` (`step`, `value`; None before the first) and `since`: the evaluations
    after the last that improved on the best by more than `threshold` (early stopping's count)."""

    metric: str
    greater_is_better: bool
    threshold: float = 0.0
    step: int | None = None
    value: float | None = None
    since: int = 0

    @classmethod
    def for_config(cls, config: RunConfig) -> BestEvaluation:
        return cls(
            config.checkpoint.best_metric.removeprefix(EVAL_PREFIX),
            greater_is_better(config.checkpoint),
            config.schedule.early_stopping_threshold,
        )

    def observe(self, step: int, record: dict) -> bool:
        """An evaluation's row (metrics.jsonl's eval/ keys): whether it is the new best. As the Trainer does, the
        best is any strictly better value, while the patience count restarts only past the threshold."""
        key = EVAL_PREFIX + self.metric
        if key not in record:
            known = ", ".join(k.removeprefix(EVAL_PREFIX) for k in record if k.startswith(EVAL_PREFIX))
            raise ConfigError(
                f"checkpoint.best_metric={self.metric!r} is not a number the evaluation gives ({known}); "
                "choose one of those."
            )
        value = float(record[key])
        better = self.value is None or (value > self.value if self.greater_is_better else value < self.value)
        if self.value is None or (better and abs(value - self.value) > self.threshold):
            self.since = 0
        else:
            self.since += 1
        if better:
            self.step, self.value = step, value
        return better

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, saved: dict | None) -> None:
        """A checkpoint's record; one of another metric or direction (changed on resume) starts afresh."""
        if not saved or (saved["metric"], saved["greater_is_better"]) != (
            self.metric,
            self.greater_is_better,
        ):
            return
        self.step, self.value, self.since = saved["step"], saved["value"], saved["since"]
