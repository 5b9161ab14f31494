"""What a run counts (`TrainState`, saved in every checkpoint and restored on resume) and the summary it ends with."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class TrainState:
    """Everything the loop counts: saved in every checkpoint (the top level of its state.json) and restored whole
    on resume, so nothing a summary reports is lost across a stop."""

    step: int = 0
    bad_steps: int = 0  # skipped for a NaN/Inf loss or gradient
    overflow_steps: int = (
        0  # fp16 steps whose gradients overflowed: the loss scale is lowered, the step retried
    )
    loss_scale: dict = field(default_factory=dict)
    tokens: int = 0
    train_seconds: float = 0.0
    eval_before: dict | None = None
    first_loss: float | None = None
    last_loss: float | None = None
    prefix_cache_hits: int = 0
    best: dict | None = None  # the best evaluation during training (checkpoint.keep_best, early stopping)
    stop_reason: str | None = None  # why the training ended before schedule.max_steps (early stopping)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_checkpoint(cls, saved: dict) -> TrainState:
        """From a checkpoint's state; a field an older checkpoint lacks keeps its default."""
        return cls(**{f.name: saved[f.name] for f in fields(cls) if f.name in saved})

    def record_step(self, loss: float, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.train_seconds += seconds
        if self.first_loss is None:
            self.first_loss = loss
        self.last_loss = loss

    def summary(self, eval_after: dict | None, entries: dict, data_stats) -> dict:
        before = self.eval_before or {}
        return {
            "steps": self.step,
            "tokens": self.tokens,
            "train_seconds": round(self.train_seconds, 2),
            "first_loss": self.first_loss,
            "last_loss": self.last_loss,
            "eval_loss_before": before.get("loss"),
            "eval_loss_after": (eval_after or {}).get("loss"),
            "eval_perplexity_before": before.get("perplexity"),
            "eval_perplexity_after": (eval_after or {}).get("perplexity"),
            # preference pairs (train.objective=dpo): the reward margin and the share of pairs the chosen answer leads
            **{
                f"eval_{key}_{when}": side.get(key)
                for key in ("margin", "accuracy")
                for when, side in (("before", before), ("after", eval_after or {}))
                if key in side
            },
            "trained_expert_entries": entries["expert_entries"],
            "trained_router_weights": entries["routers"],
            "trained_entries_beyond_experts": target_entries(entries),
            "skipped_steps": self.bad_steps,
            "fp16_overflow_steps": self.overflow_steps,
            "prefix_cache_hits": self.prefix_cache_hits,
            **({"best_evaluation": self.best} if self.best else {}),
            **({"stop_reason": self.stop_reason} if self.stop_reason else {}),
            "data": data_stats.summary(),
        }


def target_entries(entries: dict) -> dict[str, int]:
    """{"attention_entries": n, ...} of `trainable_summary`: the entries of targets beyond the experts."""
    return {k: v for k, v in entries.items() if k.endswith("_entries") and k != "expert_entries"}


def stopped_exit_code(summary: dict) -> int | None:
    """The exit status of a run that stopped before its end (128 + the signal; 1 for a router-collapse stop), so
    that `usaf train ... && usaf export ...` does not go on with a half-trained run; None when it finished."""
    if not summary.get("stopped"):
        return None
    return 128 + summary["signal"] if summary.get("signal") else 1


def format_summary(summary: dict) -> str:
    rows = [
        ("steps", summary["steps"]),
        ("tokens", f"{summary['tokens']:,}"),
        ("time", f"{summary['train_seconds']:.1f} s"),
        ("train loss first → last", _pair(summary["first_loss"], summary["last_loss"])),
        ("eval loss before → after", _pair(summary["eval_loss_before"], summary["eval_loss_after"])),
        (
            "eval perplexity before → after",
            _pair(summary["eval_perplexity_before"], summary["eval_perplexity_after"]),
        ),
        *[
            (f"eval {key} before → after", _pair(summary[f"eval_{key}_before"], summary[f"eval_{key}_after"]))
            for key in ("margin", "accuracy")
            if f"eval_{key}_before" in summary and f"eval_{key}_after" in summary
        ],
        ("trained expert entries", f"{summary['trained_expert_entries']:,}"),
        *[
            (f"trained {target.replace('_', ' ')}", f"{n:,}")
            for target, n in (summary.get("trained_entries_beyond_experts") or {}).items()
        ],
        ("trained router weights", f"{summary['trained_router_weights']:,}"),
        ("skipped steps", summary["skipped_steps"]),
    ]
    if best := summary.get("best_evaluation"):
        kept = f" ({best['checkpoint']})" if best.get("checkpoint") else ""
        rows.append((f"best {best['metric']}", f"{best['value']:.4f} at step {best['step']}{kept}"))
    if summary.get("stop_reason"):
        rows.append(("stopped", summary["stop_reason"]))
    if summary.get("fp16_overflow_steps"):
        rows.append(("fp16 overflow steps (loss scale lowered)", summary["fp16_overflow_steps"]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _pair(a, b) -> str:
    fmt = lambda x: "-" if x is None else f"{x:.4f}"  # noqa: E731
    return f"{fmt(a)} → {fmt(b)}"
