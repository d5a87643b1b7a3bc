"""The run folder: one per launch, never shared, never clobbered.

- The default folder (`outputs/<date>/<time>-<id>`) is unique per launch: the time and id are
  those of the launching process (the torchrun agent, shared by its ranks; else this process),
  so runs started in the same second get different folders and the ranks of one launch agree.
- A folder that already holds a run is refused unless `train.resume=true`, and one run at a time
  holds it (a lock), so two runs can never interleave their metrics or checkpoints.
- On resume, `metrics.jsonl` is cut back to the checkpoint's step (a crash after the checkpoint
  logged steps that will run again).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

from recipe.checkpoint import FILENAME, SHARDED

RUN_FILES = (FILENAME, SHARDED, "metrics.jsonl", "summary.json")  # a folder with one holds a run


def _launcher() -> int:
    """The launching process: the torchrun agent (shared by its ranks), else this process."""
    return os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid()


def _start_ticks(pid: int) -> int:
    """When process `pid` started, in clock ticks since boot (Linux /proc)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def seconds_since_launch() -> float | None:
    """Seconds since the launching process started, None without /proc. On the kernel's boot
    clock, which /proc counts in: 10 ms ticks (the epoch-based `_start_time` is whole seconds)."""
    try:
        ticks = _start_ticks(_launcher())
    except (OSError, ValueError, IndexError):
        return None
    return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")


def _start_time(pid: int) -> float | None:
    """When process `pid` started (Linux /proc), in seconds since the epoch."""
    try:
        ticks = _start_ticks(pid)
        boot = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def launch_stamp() -> str:
    """`<date>/<time>-<pid>` of the launching process: the Hydra resolver `${launch:}`."""
    launcher = _launcher()
    started = _start_time(launcher) or time.time()
    return time.strftime("%Y-%m-%d/%H-%M-%S", time.localtime(started)) + f"-{launcher}"


class RunFolder:
    """Rank 0's hold on the run folder, for the life of the process."""

    def __init__(self, path: Path, resume: bool) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        self._lock = open(path / ".lock", "w")  # noqa: SIM115 (held until the process ends)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(
                f"another run is using {path} right now: give this one its own hydra.run.dir"
            ) from None
        existing = [name for name in RUN_FILES if (path / name).exists()]
        if existing and not resume:
            raise FileExistsError(
                f"{path} already holds a run ({', '.join(existing)}): continue it with "
                f"`python train.py hydra.run.dir={path} train.resume=true`, or pick another "
                "hydra.run.dir (the default is a new folder per launch)"
            )

    def cut_metrics(self, step: int) -> list[dict[str, Any]]:
        """Keeps the metrics logged up to `step` (and drops a torn last line); returns them."""
        path = self.path / "metrics.jsonl"
        if not path.exists():
            return []
        rows = []
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a kill
            if row.get("step", 0) <= step:
                rows.append(row)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
        os.replace(tmp, path)
        return rows
