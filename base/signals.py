"""SIGTERM turned into an exception where a process has something to clean up: a scheduler, or
`timeout`, stops a process with SIGTERM, which by default ends it at once, skipping `finally`
clauses and context managers (a half-written folder, a process pool, a child process group that
would go on running on the GPU)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Inside the block, SIGTERM raises SystemExit(143) where it would otherwise kill the process
    outright, so that `finally` clauses and context managers clean up (a half-written folder, a
    process pool). A handler someone else installed (the trainer's) is left alone."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    received: list[int] = []
    owner = os.getpid()

    def _raise(signum: int, frame: object) -> None:
        if os.getpid() != owner:  # a process forked in the block, stopped (by its pool) before
            os._exit(128 + signum)  # it set its own handlers: it ends, as it would by default
        received.append(signum)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    except BaseException as e:
        if received and not isinstance(e, SystemExit):  # replaced on its way out (datasets'
            raise SystemExit(128 + received[0]) from e  # pool raises a TimeoutError instead)
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
