"""A training process's view of its DataLoader workers, for test_data_safety.py, which runs
it in a process group of its own and signals the whole group, as a scheduler does:

    python tests/unit/data_workers_probe.py

Like a trainer that imported wandb (whose OpenTelemetry starts a thread in every forked child),
it starts a thread in each child at its fork. It reads a batch from a loader with 2 workers and
prints `ready`; it handles SIGTERM and SIGINT itself (as the trainer does), and once it has seen
both it reads 20 more batches (more than the workers had prefetched) and prints `batches <n>`.
It then waits to be killed.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path


def _start_a_thread() -> None:
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()


os.register_at_fork(after_in_child=_start_a_thread)  # before data's hook, as an earlier import's

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import data  # noqa: E402
from data.windows import RandomTokens  # noqa: E402

received: set[int] = set()


def main() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: received.add(signum))
    options = data.LoaderOptions(num_workers=2, prefetch_factor=2)
    loader = data.build_loader(
        RandomTokens(16, 0, 50257), 4, rank=0, world_size=1, seed=0, options=options
    )
    batches = iter(loader)
    next(batches)
    print("ready", flush=True)
    deadline = time.monotonic() + 30
    while len(received) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1)  # time for the workers to die, if the signals killed them
    count = sum(1 for _, _ in zip(range(20), batches, strict=False))
    print(f"batches {count}", flush=True)
    time.sleep(60)


if __name__ == "__main__":
    main()
