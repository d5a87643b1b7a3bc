"""Data that fails safely: workers that outlive the process group's stop signals but not their
parent."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conftest import ROOT, python
from data.workers import WorkerInit, hardened_forks

LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, PR_SET_PDEATHSIG")


# ---- 6. workers: deaf to the group's stop signals, dead with their parent


def _state(pid: int) -> str:
    """A process's state letter from /proc (Z: a zombie, dead), or 'gone'."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def _children(pid: int) -> list[int]:
    """The live processes whose parent is `pid`, found in /proc."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            children.append(int(stat.parent.name))
    return children


def _wait(condition: Callable[[], object], timeout: float) -> object:
    deadline = time.monotonic() + timeout
    while not (result := condition()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return result


def _dead(pids: list[int]) -> bool:
    return all(_state(pid) in ("Z", "gone") for pid in pids)


def _kill(pids: list[int]) -> None:
    for pid in pids:
        if not _dead([pid]):
            os.kill(pid, signal.SIGKILL)


@LINUX
def test_loader_workers_survive_the_groups_stop_signals_and_die_with_their_parent() -> None:
    probe = subprocess.Popen(
        [python(), "tests/data_workers_probe.py"], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    workers: list[int] = []
    try:
        assert probe.stdout.readline().strip() == "ready", probe.stderr.read()
        workers = _children(probe.pid)
        assert len(workers) == 2
        os.killpg(probe.pid, signal.SIGTERM)  # what a scheduler does
        os.killpg(probe.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        line = probe.stdout.readline().strip()
        assert line == "batches 20", probe.stderr.read() if probe.poll() is not None else line
        probe.kill()  # the trainer dies outright: its workers follow
        probe.wait()
        assert _wait(lambda: _dead(workers), timeout=2), {w: _state(w) for w in workers}
    finally:
        probe.kill()
        probe.wait()
        _kill(workers)


def _sleep() -> None:
    time.sleep(60)


@LINUX
def test_a_hardened_worker_obeys_only_its_parents_stop_signal() -> None:
    with hardened_forks():
        worker = multiprocessing.get_context("fork").Process(target=_sleep, daemon=True)
        worker.start()
    try:
        time.sleep(0.5)  # the worker is set up right after the fork: give it time to start
        for sig in (signal.SIGTERM, signal.SIGINT):  # from another process: ignored
            kill = f"import os; os.kill({worker.pid}, {int(sig)})"
            subprocess.run([python(), "-c", kill], check=True)
        worker.join(0.5)
        assert worker.is_alive()
        worker.terminate()  # from its parent (how pools and loaders end their workers): obeyed
        worker.join(5)
        assert worker.exitcode == -signal.SIGTERM
    finally:
        worker.kill()


def test_worker_init_composes_with_another_one(tmp_path) -> None:
    def mark(worker_id: int) -> None:
        (tmp_path / f"worker-{worker_id}").write_text(str(os.getpid()))

    loader = torch.utils.data.DataLoader(
        list(range(4)), batch_size=1, num_workers=2, worker_init_fn=WorkerInit(then=mark)
    )
    assert sorted(int(b) for b in loader) == [0, 1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker-0", "worker-1"]
