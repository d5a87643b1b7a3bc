"""Worker-process hygiene, in one place for the DataLoader's workers and for the processes that
`datasets` starts while a corpus is prepared (`map(num_proc=...)`'s pool and its manager).

A scheduler (Slurm, Kubernetes, torchrun's agent) stops a job by signalling its whole process
group. If the workers obeyed, they would die before the trainer could save a checkpoint (the
trainer then fails with "DataLoader worker ... killed by signal"). So a hardened worker:

- ignores SIGTERM and SIGINT from anyone but its parent: the parent decides when to stop.
  Its own SIGTERM still works (how a DataLoader or a `multiprocess` pool ends its workers
  when joining them times out or the pool is terminated).
- dies with its parent: a trainer killed outright (SIGKILL, out of memory) leaves no orphaned
  worker holding gigabytes. Linux's `PR_SET_PDEATHSIG` does it at once, but it fires when the
  *thread* that forked the worker ends: a `multiprocess` pool replaces a dead worker from a
  thread of its own, which ends when the pool does, and the new worker, killed while it held the
  pool's task queue lock, left the pool's `terminate()` waiting forever. So only a worker forked
  by the main thread gets it; every hardened worker also checks once a second whether its parent
  is gone (it was then handed to another parent).

Telling the parent's signals from others' needs the sender's pid, which only `sigtimedwait` gives:
the worker blocks both signals and a thread waits for them. A signal sent to a process goes to
any of its threads that does not block it, and a thread started by a library's fork hook (as
OpenTelemetry's, which wandb imports, does) runs before a DataLoader's `worker_init_fn`: so a
hardened worker is forked with both signals already blocked, and every thread it ever has
inherits that. Processes that a worker itself starts inherit the blocked signals (the trainer's
workers start none). Where `sigtimedwait` is missing (macOS), a worker ignores Ctrl-C only and
does not die with its parent.

A forked process also never collects the garbage it inherits. The parent's cyclic garbage may
hold pinned batches (a test process that trained before, a notebook that prepares a corpus after
training); freeing one in a child, where CUDA cannot run, aborts the child, and with it the
preparation. So every forked child moves what it inherited out of its collector (`gc.freeze`)
before its own code runs, with the collector paused from the fork to that freeze. The parent's
collector is left as it was: a process may have frozen objects of its own before (on an H200
with torch 2.11, 375 were frozen before the first fork), and a freeze done only where none was
would then protect nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import multiprocessing.context
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
SCREENS_SIGNALS = hasattr(signal, "sigtimedwait")  # else a worker only ignores Ctrl-C
PARENT_CHECK_S = 1.0  # how often a worker checks that its parent lives
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def process_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this machine (a zombie counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def harden_worker(parent_pid: int) -> None:
    """Makes this process (a worker of `parent_pid`) die with its parent and obey stop signals
    from its parent only. Call it first thing in the worker; a second call does nothing."""
    global _hardened_pid
    if _hardened_pid == os.getpid():
        return
    _hardened_pid = os.getpid()
    if _forked_by_main_thread:
        _die_with_parent(parent_pid)
    if not SCREENS_SIGNALS:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return
    # Blocked before their default action returns: a stop signal from the group that arrives
    # while the worker sets up waits for the screen, where it would otherwise end the worker.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # threads started later inherit it
    for sig in STOP_SIGNALS:  # a signal from the parent does what it does by default: end us
        signal.signal(sig, signal.SIG_DFL)
    threading.Thread(
        target=_screen_stop_signals, args=(parent_pid,), name="stop-signals", daemon=True
    ).start()


def _die_with_parent(parent_pid: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if not process_alive(parent_pid):  # it died before the prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)


def _screen_stop_signals(parent_pid: int) -> None:
    """Drops SIGTERM/SIGINT unless the parent sent it; the parent's one ends the process, and so
    does the parent's end."""
    while True:
        info = signal.sigtimedwait(STOP_SIGNALS, PARENT_CHECK_S)
        if info is None:
            if os.getppid() != parent_pid:  # the parent is gone: this one was handed on
                os.kill(os.getpid(), signal.SIGKILL)
            continue
        if info.si_pid == parent_pid:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [info.si_signo])  # this thread only
            os.kill(os.getpid(), info.si_signo)  # delivered here at once: the default action
            os._exit(128 + info.si_signo)  # the parent asked us to end, whatever happened above


class WorkerInit:
    """A DataLoader `worker_init_fn` that hardens each worker (if `loader_context()` did not at
    its fork), then runs `then` (another worker_init_fn) if given. Built in the training
    process, which it records as the parent."""

    def __init__(self, then: Callable[[int], None] | None = None) -> None:
        self.parent_pid = os.getpid()
        self.then = then

    def __call__(self, worker_id: int) -> None:
        harden_worker(self.parent_pid)
        if self.then is not None:
            self.then(worker_id)


# Data preparation cannot hand `datasets` an initializer for the processes it starts (the map's
# pool, the manager serving its progress queue, load_dataset's builders): a fork hook hardens
# every process forked, by any thread, while `hardened_forks()` is active. (`datasets` forks:
# `multiprocess` uses the fork start method on Linux.)
_hardening = False
_hardened_pid = 0
_forking_pid = 0
_forked_by_main_thread = True  # what a worker started otherwise (spawn) assumes
# The forking thread's signal mask and collector state, restored after the fork (a child has
# only that thread, so it reads them too).
_forking_thread = threading.local()


def _before_fork() -> None:
    global _forking_pid, _forked_by_main_thread
    _forking_pid = os.getpid()
    _forked_by_main_thread = threading.current_thread() is threading.main_thread()
    # No collection in the child before it freezes what it inherits (another library's fork
    # hook may allocate first).
    _forking_thread.collecting = gc.isenabled()
    gc.disable()
    _forking_thread.mask = None
    if _hardening and SCREENS_SIGNALS:  # the child is born deaf: see the module's docstring
        _forking_thread.mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def _after_fork_in_parent() -> None:
    if _forking_thread.collecting:
        gc.enable()
    if _forking_thread.mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, _forking_thread.mask)


def _after_fork_in_child() -> None:
    gc.freeze()  # the parent's objects, its garbage too, are the parent's to free
    if _forking_thread.collecting:
        gc.enable()
    if _hardening:
        harden_worker(_forking_pid)


os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
)


def worker_died(e: BaseException) -> bool:
    """Whether `e` is how `datasets` reports that a process of its pool died (killed by the
    system, out of memory, or crashed) while mapping or loading."""
    return isinstance(e, RuntimeError) and "subprocesses has abruptly died" in str(e)


@contextlib.contextmanager
def hardened_forks() -> Iterator[None]:
    """Hardens the processes forked inside the block (see `harden_worker`)."""
    global _hardening
    previous, _hardening = _hardening, True
    try:
        yield
    finally:
        _hardening = previous


class _HardenedForkProcess(multiprocessing.context.ForkProcess):
    def start(self) -> None:
        with hardened_forks():
            super().start()


class _HardenedForkContext(multiprocessing.context.ForkContext):
    Process = _HardenedForkProcess


def loader_context() -> multiprocessing.context.BaseContext | None:
    """The DataLoader's `multiprocessing_context`: forks hardened workers where the system forks
    (None elsewhere: `WorkerInit` hardens them)."""
    if "fork" not in multiprocessing.get_all_start_methods() or not SCREENS_SIGNALS:
        return None
    return _HardenedForkContext()
