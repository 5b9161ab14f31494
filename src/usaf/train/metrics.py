"""What a run shows and keeps: a live progress bar, metrics.jsonl, and the trackers of log.report_to."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tqdm.auto import tqdm

from usaf.files import METRICS_FILE
from usaf.io.atomic import open_unfollowed
from usaf.train.trackers import Trackers


class MetricsLog:
    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        start_step: int,
        progress: bool,
        report_to: list[str] = (),
        run_config: dict | None = None,
    ):
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


def _open_for_append(path: Path):
    """The run's own metrics file, appended to; a symbolic link in its place is refused, never written through."""
    return os.fdopen(open_unfollowed(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a", encoding="utf-8")
