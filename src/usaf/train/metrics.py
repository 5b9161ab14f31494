"""What a run shows and keeps: a live progress bar, metrics.jsonl, and the trackers of log.report_to."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from tqdm.auto import tqdm

from usaf.files import METRICS_FILE
from usaf.io.atomic import atomic_file, open_unfollowed
from usaf.train.distributed import is_main
from usaf.train.trackers import Trackers, print_warning, report_to

# metrics.jsonl's row of an evaluation: its numbers under eval/ (eval/loss, eval/perplexity; DPO's eval/loss,
# eval/margin, eval/accuracy), in the row of the step it was taken at; the one after training also says "final": true
EVAL_PREFIX, FINAL_KEY = "eval/", "final"


def eval_record(result: dict, final: bool = False) -> dict:
    """An evaluation's numbers as metrics.jsonl's row has them (and, `final`, marked as the run's last)."""
    return {**{f"{EVAL_PREFIX}{k}": v for k, v in result.items()}, **({FINAL_KEY: True} if final else {})}


def open_metrics(run_dir: Path, section, total_steps: int, start_step: int, resumed: bool, run_config: dict):
    """The run's log from `start_step` on: rank 0's MetricsLog with the trackers of log.report_to (a resume first
    drops the rows after its checkpoint), a NullLog on the other ranks, which write nothing."""
    if not is_main():
        return NullLog(section.every_steps)
    if resumed:
        truncate_metrics(Path(run_dir) / METRICS_FILE, start_step, total_steps)
    return MetricsLog(
        run_dir,
        total_steps,
        start_step,
        section.progress,
        report_to(section),
        run_config,
        section.every_steps,
    )


class MetricsLog:
    """metrics.jsonl and the trackers, a row every `every_steps` (and every evaluation's); shown as a live progress
    bar on a terminal, else (stdout not a terminal, or `progress` off) as a plain line a row, the Trainer's
    `logging_steps` lines: a log file gets whole lines, no carriage returns."""

    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        start_step: int,
        progress: bool,
        report_to: list[str] = (),
        run_config: dict | None = None,
        every_steps: int = 1,
    ):
        self.every_steps = every_steps  # 0: no step rows; evaluations are still written
        self.path = Path(run_dir) / METRICS_FILE
        # first: a tracker that cannot start is an error before the log is opened
        self.trackers = Trackers(list(report_to), Path(run_dir), run_config or {}, start_step, self.warn)
        try:  # the file lives as long as the run; a resumed run continues the same log
            self.file = _open_for_append(self.path)
        except BaseException:
            self.trackers.close()
            raise
        self.bar = (
            tqdm(
                total=total_steps,
                initial=start_step,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
            )
            if progress and sys.stderr.isatty()
            else None
        )
        self.total_steps = total_steps
        self.plain = self.bar is None or not sys.stdout.isatty()

    def should_log(self, step: int, record: dict) -> bool:
        """Whether step `step`'s row is due: every `log.every_steps`, and whenever it holds an evaluation."""
        every = self.every_steps
        return bool(every and step % every == 0) or any(k.startswith(EVAL_PREFIX) for k in record)

    def log(self, step: int, record: dict, show: dict | None = None) -> None:
        self.file.write(json.dumps({"step": step, **record}) + "\n")
        self.file.flush()
        self.trackers.log(step, record)
        if self.bar is not None and show is not None:
            self.bar.set_postfix(show, refresh=False)
        if self.plain:
            self.message(plain_line(step, self.total_steps, record, show))

    def advance(self, steps: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(steps)

    def message(self, text: str) -> None:
        """A line on stdout, flushed while the bar (on stderr) is cleared: the two never share a line, in a
        terminal or in one log file for both streams."""
        if self.bar is None:
            print(text, flush=True)
            return
        with tqdm.external_write_mode(file=sys.stdout):
            print(text, flush=True)

    def warn(self, text: str) -> None:
        """A warning line on stderr, drawn clear of the bar."""
        bar = getattr(self, "bar", None)  # None also while the trackers start, before the bar
        with tqdm.external_write_mode(file=sys.stderr) if bar is not None else contextlib.nullcontext():
            print_warning(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.trackers.close()
        self.file.close()


class NullLog(MetricsLog):
    """MetricsLog's interface for ranks other than 0: nothing written, nothing shown."""

    def __init__(self, every_steps: int = 1):
        self.every_steps = every_steps

    def log(self, *args, **kwargs) -> None:
        pass

    def message(self, *args, **kwargs) -> None:
        pass

    def advance(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


def plain_line(step: int, total_steps: int, record: dict, show: dict | None) -> str:
    """A row as one line: the progress bar's fields (loss, lr, tok/s, mem, ...) and any evaluation's numbers."""
    shown = dict(show or {})
    if "grad_norm" in record:
        shown["grad_norm"] = f"{record['grad_norm']:.3g}"
    for key, value in record.items():
        if key.startswith(EVAL_PREFIX) and isinstance(value, float):
            shown[key] = f"{value:.4f}"
    final = " (final evaluation)" if record.get(FINAL_KEY) else ""
    return f"step {step}/{total_steps}{final}: " + ", ".join(f"{k} {v}" for k, v in shown.items())


def truncate_metrics(path: Path, step: int, max_steps: int) -> None:
    """A resume continues the log from its checkpoint: rows a killed process wrote after it (steps the resume
    trains again) are dropped, and so is a torn last line. The final evaluation's row is the resumed run's to
    write: one at `max_steps` (written before the process died) is dropped, an earlier one (the run is extended)
    stays as an evaluation at its step, no longer marked final."""
    if not path.exists():
        return
    kept, changed = [], False
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
            row_step = int(row["step"])
        except (ValueError, KeyError, TypeError):
            row, row_step = None, step + 1
        if row_step > step or (row.get(FINAL_KEY) and row_step >= max_steps):
            changed = True
        elif row.get(FINAL_KEY):
            kept.append(json.dumps({k: v for k, v in row.items() if k != FINAL_KEY}))
            changed = True
        else:
            kept.append(line)
    if changed:
        atomic_file(path, lambda tmp: tmp.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8"))


def _open_for_append(path: Path):
    """The run's own metrics file, appended to; a symbolic link in its place is refused, never written through."""
    return os.fdopen(open_unfollowed(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a", encoding="utf-8")
