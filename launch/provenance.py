"""Which code and machine measured a number: the commit and the environment, for results files."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """GPT2_RECIPE_COMMIT when set (a tree copied to a GPU machine: its git metadata, if any,
    is not the copied work tree's), else the checkout's commit, marked when files differ."""
    if os.environ.get("GPT2_RECIPE_COMMIT"):
        return os.environ["GPT2_RECIPE_COMMIT"]

    def git(*args: str) -> str:
        command = ["git", "-C", str(ROOT), *args]
        return subprocess.run(command, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short=12", "HEAD")
    if not commit:
        return "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return commit + (" (with uncommitted changes)" if dirty else "")


def environment(command: list[str]) -> dict[str, Any]:
    """What the numbers were measured with: `command` (argv, joined for the shell), the commit,
    the date, the device, the library versions, and on a GPU its driver and count."""
    env = {
        "command": shlex.join(command),
        "git_commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    if torch.cuda.is_available():
        query = ["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"]
        smi = subprocess.run(query, capture_output=True, text=True).stdout.strip().splitlines()
        env["driver"] = smi[0] if smi else None
        env["gpus"] = torch.cuda.device_count()
    return env


def device_name() -> str:
    """The first GPU's name, or the CPU's architecture."""
    return (
        torch.cuda.get_device_name(0)
        if torch.cuda.is_available()
        else f"CPU ({platform.machine()})"
    )
