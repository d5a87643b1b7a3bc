"""Where a run's checkpoints lie in its folder, and the `LATEST` files that name the complete
ones: each written by an atomic rename, each followed only to a `step-<N>` folder beside it."""

from __future__ import annotations

import re
from pathlib import Path

from base.errors import Unusable
from base.files import write_text_atomically
from checkpointing.checksums import damaged

FILENAME = "checkpoint.pt"
SHARDED = "checkpoint.dcp"  # a folder: step-<N>/ (DCP shards + meta.pt + sha256.json) and LATEST
META = "meta.pt"
STEP_FOLDER = re.compile(r"step-\d+")  # what LATEST may name
HISTORY = "checkpoints"  # keep_checkpoints > 1, single file: step-<N>/ each, hard links
BEST = "best"  # keep_best: step-<N>/ (a run-folder-like checkpoint) + LATEST, best.json in it
BEST_RECORD = "best.json"  # {"step": N, "val_loss": x, "measured": {"eval_sequences": n}}


def step_of(folder: Path) -> int:
    return int(folder.name.split("-", 1)[1])


def point(root: Path, name: str) -> None:
    """Writes `root/LATEST` naming `name` (an atomic rename)."""
    write_text_atomically(root / "LATEST", name)


def latest_folder(root: Path) -> Path:
    """The step folder `LATEST` names: only a `step-<N>` folder in `root` itself, so that a
    copied or crafted `LATEST` cannot lead elsewhere."""
    name = (root / "LATEST").read_text().strip()
    folder = root / name
    if not STEP_FOLDER.fullmatch(name) or folder.is_symlink():
        raise Unusable(
            f"{root / 'LATEST'} names {name!r}, not a step-<N> folder in {root}: refusing to "
            "follow it (a checkpoint this recipe wrote names its own step folder)"
        )
    if not folder.is_dir():
        raise damaged(folder, f"it is missing, and {root / 'LATEST'} names it")
    return folder


def complete_step(folder: Path) -> bool:
    """Whether a kept step folder was written whole: a DCP step's `meta.pt` is written last,
    after every shard (a save killed before it leaves a folder that is no checkpoint);
    `checkpoints/` folders are renamed into place complete."""
    return folder.is_dir() and (folder.parent.name != SHARDED or (folder / META).is_file())
