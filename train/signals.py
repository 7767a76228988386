"""Preemption signals: SIGTERM or SIGUSR1 (SLURM preemption / time limit) or Ctrl-C (SIGINT) ask a run to
save and stop. A second Ctrl-C stops at once (KeyboardInterrupt: one line at the CLI, nothing saved).

    with StopSignals() as stop:              # handlers installed; the previous ones restored on exit
        for step in ...:
            ...                              # the step in flight finishes
            if stop.requested(accelerator):  # every rank agrees (a collective: call it on all ranks)
                save a checkpoint; break

The loop then prints `stopped by signal; state saved to DIR` and returns; the process exits with code 0,
so a requeued job resumes with `--resume auto`.
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

import torch

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopSignals:
    """Records a stop signal instead of dying on it, while the `with` block runs."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.signal == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C twice: the user does not want to wait for the step in flight
        self.signal = signum

    def __enter__(self) -> StopSignals:
        self._previous = {s: signal.signal(s, self._record) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def requested(self, accelerator: Any) -> bool:
        """Whether any rank received a stop signal (summed over ranks, so all of them stop at the same step)."""
        flag = torch.tensor([0 if self.signal is None else 1], device=accelerator.device)
        if accelerator.num_processes > 1:
            flag = accelerator.reduce(flag, reduction="sum")
        return int(flag) > 0
