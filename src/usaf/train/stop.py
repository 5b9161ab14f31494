"""A stop request (SIGINT/SIGTERM): the loop checkpoints and stops after the current step, on every rank."""

from __future__ import annotations

import contextlib
import signal

import torch
import torch.distributed as dist

from usaf.selection.across_ranks import active, comm_device


class StopRequest:
    """SIGINT/SIGTERM ask the loop to checkpoint and stop after the current step."""

    def __init__(self):
        self.requested, self.signal_name, self.signal_number = False, "", 0
        self.previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread: no handler
                self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.requested:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.requested, self.signal_name, self.signal_number = True, signal.Signals(signum).name, signum

    def agreed(self) -> bool:
        """Whether any rank was asked to stop; every rank then stops after the same step ([usaf.distributed])."""
        if not active():
            return self.requested
        flag = torch.tensor([int(self.requested)], device=comm_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and not self.requested:
            self.requested, self.signal_name, self.signal_number = (
                True,
                "SIGTERM (another rank)",
                signal.SIGTERM,
            )
        return bool(flag.item())

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
