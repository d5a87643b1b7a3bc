"""Stopping on a signal: SIGTERM (a cluster's preemption) and Ctrl-C become a checkpoint at the
end of the current step, then a clean exit."""

from __future__ import annotations

import signal
import time
from typing import Any

from base.distributed import launcher_died


class StopSignal:
    """Turns SIGTERM (cluster preemption, or the kernel's word that the torchrun agent died) and
    SIGINT (Ctrl-C) into a request to checkpoint and exit at the end of the current step. A
    second Ctrl-C quits at once, unless it comes within `echo_s` of the first: torchrun forwards
    the signal it receives to its workers, so one Ctrl-C in a terminal (which reaches the whole
    process group) arrives twice."""

    echo_s = 2.0

    def __init__(self) -> None:
        self.requested = False
        self.signal: str | None = None  # the name of the signal that requested the stop
        self._first: float | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self._first is not None:
            if signum == signal.SIGINT and now - self._first > self.echo_s:
                raise KeyboardInterrupt(  # a deliberate second Ctrl-C
                    "a second Ctrl-C: quit without waiting for the checkpoint; the last one "
                    "completed is kept"
                )
            return  # SIGTERM again, or the same Ctrl-C forwarded by torchrun
        self._first = now
        self.requested = True
        name = self.signal = signal.Signals(signum).name
        # The kernel's SIGTERM when the torchrun agent died (distributed.die_with_launcher): no
        # launcher waits for this trainer any more, and the user should know why it stopped.
        died = signum == signal.SIGTERM and launcher_died()  # the kernel's signal is SIGTERM
        why = " (the torchrun agent that launched this trainer died)" if died else ""
        print(f"\n[train] {name}{why}: saving a checkpoint after this step, then exiting",
              flush=True)  # fmt: skip

    def __enter__(self) -> StopSignal:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
