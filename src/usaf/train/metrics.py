"""What a run shows and keeps: a live progress bar, metrics.jsonl, and the trackers of log.report_to."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tqdm.auto import tqdm

from usaf.files import METRICS_FILE
from usaf.io.atomic import atomic_file, open_unfollowed
from usaf.train.distributed import is_main
from usaf.train.trackers import Trackers, report_to


def open_metrics(run_dir: Path, section, total_steps: int, start_step: int, resumed: bool, run_config: dict):
    """The run's log from `start_step` on: rank 0's MetricsLog with the trackers of log.report_to (a resume first
    drops the rows after its checkpoint), a NullLog on the other ranks, which write nothing."""
    if not is_main():
        return NullLog(section.every_steps)
    if resumed:
        truncate_metrics(Path(run_dir) / METRICS_FILE, start_step)
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
        self.file = _open_for_append(
            self.path
        )  # lives as long as the run; a resumed run continues the same log
        self.bar = (
            tqdm(
                total=total_steps,
                initial=start_step,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
            )
            if progress
            else None
        )
        self.trackers = Trackers(list(report_to), Path(run_dir), run_config or {}, start_step)

    def should_log(self, step: int, record: dict) -> bool:
        """Whether step `step`'s row is due: every `log.every_steps`, and whenever it holds an evaluation."""
        every = self.every_steps
        return bool(every and step % every == 0) or any(k.startswith("eval/") for k in record)

    def log(self, step: int, record: dict, show: dict | None = None) -> None:
        self.file.write(json.dumps({"step": step, **record}) + "\n")
        self.file.flush()
        self.trackers.log(step, record)
        if self.bar is not None and show is not None:
            self.bar.set_postfix(show, refresh=False)

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


def truncate_metrics(path: Path, step: int) -> None:
    """A resume continues the log from its checkpoint: rows a killed process wrote after it (steps the resume
    trains again) are dropped, and so is a torn last line."""
    if not path.exists():
        return
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
            keep = int(row["step"]) <= step
        except (ValueError, KeyError, TypeError):
            keep = False
        if keep:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        atomic_file(path, lambda tmp: tmp.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8"))


def _open_for_append(path: Path):
    """The run's own metrics file, appended to; a symbolic link in its place is refused, never written through."""
    return os.fdopen(open_unfollowed(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a", encoding="utf-8")
