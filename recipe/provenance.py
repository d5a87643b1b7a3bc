"""Which code measured a number: the commit, for results files."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

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
