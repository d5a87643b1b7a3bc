"""The run folder: one per launch, never shared, never clobbered.

- The default folder (`outputs/<date>/<time>-<id>`) is unique per launch: the time and id are
  those of the launching process (the torchrun agent, shared by its ranks; else this process),
  so runs started in the same second get different folders and the ranks of one launch agree.
- A folder that already holds a run is refused unless `train.resume=true`, and one run at a time
  holds it (a lock), so two runs can never interleave their metrics or checkpoints.
- A folder holds a run when it has a checkpoint, a summary or logged metrics: a launch that failed
  before logging anything leaves none, and its folder is removed (or, if it was not empty when
  the launch began, reused by the next launch).
- A folder that holds no run and that no launch has taken (it has no lock file) may hold only
  Hydra's `.hydra/` and the ablation harness's console capture (`output*.txt`): anything else
  is the user's (a project's own config.yaml), which the trainer would overwrite or mix with,
  and is refused before anything is written.
- The trainer's files in it are never symbolic links (one planted there would have the run write
  elsewhere): the lock is opened without following one, the others are refused, and rewritten
  files are replaced by a rename.
- On resume, `metrics.jsonl` is cut back to the checkpoint's step (a crash after the checkpoint
  logged steps that will run again); a line torn by a kill at its end is dropped, any other bad
  line is refused naming it.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import os
import shlex
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from base.distributed import launcher
from base.errors import FileRefused, MissingFile, Unusable
from base.files import refuse_link, write_text_atomically
from checkpointing import BEST, FILENAME, HISTORY, SHARDED

METRICS, SUMMARY, LOCK = "metrics.jsonl", "summary.json", ".lock"
# Every file the trainer writes in a run folder (config.yaml and overrides.yaml: recipe/config.py's
# CONFIG_FILE and OVERRIDES_FILE; samples.txt: train.py's; wandb/: wandb's, recipe/metrics.py),
# none of which may be a symbolic link.
OWN_FILES = (LOCK, "config.yaml", "overrides.yaml", METRICS, SUMMARY, "samples.txt", FILENAME,
             SHARDED, HISTORY, BEST, "wandb")  # fmt: skip
# What a folder that no launch has taken may hold: Hydra's `.hydra/` (hydra.output_subdir), and
# the console that scripts/ablate.py captures from the launch it starts there.
LAUNCH_FILES = (".hydra", "output.txt", "output-node*.txt")
_held: set[Path] = set()  # the run folders whose lock this process took (RunFolder)


def run_files(path: Path) -> list[str]:
    """What makes `path` a run's folder: its checkpoint, its summary, its logged metrics. A folder
    with none of them (only a config, an empty metrics.jsonl) holds no run."""
    found = [name for name in (FILENAME, SHARDED, SUMMARY) if (path / name).exists()]
    metrics = path / METRICS
    if metrics.is_file() and metrics.read_bytes().strip():
        found.append(METRICS)
    return found


def _has_checkpoint(path: Path) -> bool:
    return (path / FILENAME).exists() or (path / SHARDED).is_dir()


def command(*words: str) -> str:
    """A command line to print, each word quoted for the shell (a folder with a space)."""
    return shlex.join(words)


def resume_command(path: Path, *overrides: str) -> str:
    """The command that continues the run in `path`, launched as this one was (torchrun with its
    process count for a multi-process run: a one-process resume of a DDP/FSDP run is refused)."""
    return command(
        *launcher(), "train.py", f"hydra.run.dir={path}", "train.resume=true", *overrides
    )


@contextlib.contextmanager
def removed_on_failure(path: Path) -> Iterator[None]:
    """Removes the run folder `path` if the launch fails leaving no run in it (`run_files`) and it
    was empty when the launch began (Hydra made it for this launch): no empty folders under
    outputs/. Only rank 0 (env RANK) removes it, and only if no other process holds it (a second
    launch into the same new folder, refused by its lock, leaves the first one's alone)."""
    fresh = os.environ.get("RANK", "0") == "0" and path.is_dir() and not any(path.iterdir())
    try:
        yield
    except BaseException:
        ours = path.resolve() in _held or not (path / LOCK).exists()
        if fresh and ours and not run_files(path):
            shutil.rmtree(path, ignore_errors=True)
        raise


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
        _refuse_links(path)
        _refuse_foreign_files(path)  # before the lock file marks the folder as a launch's
        self._lock = _open_lock(path / LOCK)  # held (open) until the process ends
        if not _locked(self._lock) and path.resolve() in _held:
            # This process took it: a run that died of an exception (a test's crash, a
            # notebook's interrupted cell) and was never released, its lock freed only when the
            # collector breaks the cycles through its traceback. Collect now and try again.
            gc.collect()
        if not _locked(self._lock):
            raise Unusable(
                f"another run is using {path} right now: give this one its own hydra.run.dir"
            )
        _held.add(path.resolve())
        existing = run_files(path)
        if existing and not resume:
            if not _has_checkpoint(path):
                raise FileRefused(
                    f"{path} holds a run that saved no checkpoint ({', '.join(existing)}), so "
                    "it cannot be continued: move or delete that folder to start again in it, "
                    "or pick another hydra.run.dir"
                )
            raise FileRefused(
                f"{path} already holds a run ({', '.join(existing)}): continue it with "
                f"`{resume_command(path)}`, or pick another hydra.run.dir (the default is a new "
                "folder per launch)"
            )
        if resume and not _has_checkpoint(path):
            raise MissingFile(
                f"train.resume=true, but {path} holds no checkpoint: its run stopped before "
                "saving one, so there is nothing to continue; "
                + ("move or delete that folder to start again in it" if existing
                   else "drop train.resume to start the run again in it")
            )  # fmt: skip

    def release(self) -> None:
        """Gives the folder up once the run is over, so that another run of this process (a
        resume, a test, a notebook) may take it without waiting for the collector to close
        this one's lock."""
        if not self._lock.closed:
            self._lock.close()  # closing the file drops its flock
        _held.discard(self.path.resolve())

    def cut_metrics(self, step: int) -> list[dict[str, Any]]:
        """Keeps the metrics logged up to `step` (and drops a torn last line); returns them."""
        path = self.path / METRICS
        if not path.exists():
            return []
        rows = [row for row in read_metrics(path) if row["step"] <= step]
        write_text_atomically(path, "".join(json.dumps(row) + "\n" for row in rows))
        return rows


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl. Its last line may be torn by a kill (a JSON object cut
    short): dropped. Any other line that is not a row (a JSON object with an integer step) is
    refused naming the file and the line: dropping it silently would lose what it logged."""
    lines = path.read_bytes().splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            if number == len(lines) and line.lstrip().startswith(b"{"):
                break  # torn by a kill while it was written
            raise Unusable(_bad_line(path, number, f"not JSON text ({e})")) from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise Unusable(_bad_line(path, number, f"not a row with a step ({line[:40]!r})"))
        rows.append(row)
    return rows


def _bad_line(path: Path, number: int, problem: str) -> str:
    return (
        f"{path}, line {number}: {problem}; each line must be one JSON object with its step: "
        "repair or delete that line, then run again"
    )


def _locked(lock: Any) -> bool:
    """Takes the run folder's lock without waiting; False when another holds it."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _open_lock(path: Path) -> Any:
    """The run folder's lock file, opened without following a symbolic link (one planted there
    would have the run truncate or lock its target)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    except OSError as e:
        refuse_link(path)
        raise Unusable(f"cannot open {path} ({e}): give the run a writable hydra.run.dir") from e
    return os.fdopen(fd, "w")


def _refuse_foreign_files(folder: Path) -> None:
    """Refuses a folder that holds files of someone else's: one that holds no run and that no
    launch has taken (no lock file), with anything but LAUNCH_FILES in it."""
    if (folder / LOCK).exists() or run_files(folder):
        return
    foreign = sorted(
        p.name for p in folder.iterdir() if not any(p.match(name) for name in LAUNCH_FILES)
    )
    if foreign:
        raise FileRefused(
            f"{folder} holds files that are not a run's ({', '.join(foreign[:5])}"
            f"{', ...' if len(foreign) > 5 else ''}), which the trainer would overwrite or mix "
            "with: give the run a new or empty hydra.run.dir (the default is a new folder per "
            "launch), or move those files out of it"
        )


def _refuse_links(folder: Path) -> None:
    """Refuses a run folder where one of the trainer's files is a symbolic link."""
    for name in OWN_FILES:
        refuse_link(folder / name)
