"""What a long run keeps besides its latest checkpoint: the last N (`train.keep_checkpoints`;
older single files as hard links in `checkpoints/step-<N>/`, older DCP steps left in
`checkpoint.dcp/`, the two counted together after a resume that changed the layout) and the best
by validation loss (`train.keep_best`: `best/step-<N>/`, named by `best/LATEST`, its loss and step
in `best.json`), each a folder that `read` reads like a run's. Older ones go only once the new
one is complete; a save that writes one layout removes the other's latest."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from base.distributed import log
from checkpointing.checksums import checksums_of, write_json_atomically
from checkpointing.folder import (
    BEST,
    BEST_RECORD,
    FILENAME,
    SHARDED,
    STEP_FOLDER,
    latest_folder,
    point,
    step_of,
)


def retire_other_layout(run_dir: Path, written: Path) -> None:
    """Once a checkpoint is complete, the other layout's latest (left by the run before it added
    or dropped FSDP) goes, so that the folder holds one latest checkpoint. Its kept steps stay,
    read like this layout's (`checkpoint=<step>`), until rotation removes them."""
    if written.name == FILENAME:
        stale = run_dir / SHARDED / "LATEST"
        if not stale.exists():
            return
        stale.unlink()
    else:
        stale = run_dir / FILENAME
        if not stale.exists():
            return
        stale.unlink()
        checksums_of(stale).unlink(missing_ok=True)
    kept = FILENAME if written.name == FILENAME else SHARDED
    log(
        f"[checkpoint] removed {stale}, an older layout's latest: this run saves {kept}; the "
        "older layout's kept steps stay until train.keep_checkpoints rotates them out"
    )


def remove_older(roots: list[Path], keep: int, latest: Path | None = None) -> None:
    """Removes all but the newest `keep` step-<N> folders in `roots` together (never `latest`);
    a root left with no step folder and no LATEST (no checkpoint any more) goes too."""
    folders = sorted((p for root in roots for p in root.glob("step-*")
                      if STEP_FOLDER.fullmatch(p.name)), key=step_of)  # fmt: skip
    kept = set(folders[max(0, len(folders) - keep) :] if keep else []) | {latest}
    for old in folders:
        if old not in kept:
            shutil.rmtree(old, ignore_errors=True)
    for root in roots:
        emptied = not any(root.glob("step-*")) and not (root / "LATEST").exists()
        if root.is_dir() and not root.is_symlink() and emptied:
            shutil.rmtree(root)


def _link(source: Path, target: Path) -> None:
    """`target` the same file as `source`: a hard link (no space, no time), else a copy."""
    try:
        os.link(source, target)
    except OSError:  # a file system without hard links
        shutil.copy2(source, target)


def link_checkpoint(written: Path, folder: Path) -> None:
    """`folder` a run-folder-like copy of the checkpoint `written` (a `checkpoint.pt` or a DCP
    step folder) that `read` reads, made beside it and renamed into place when complete."""
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if written.name == FILENAME:
        tmp.mkdir(parents=True)
        for path in (written, checksums_of(written)):
            _link(path, tmp / path.name)
    else:
        (tmp / SHARDED / written.name).mkdir(parents=True)
        for path in written.iterdir():
            _link(path, tmp / SHARDED / written.name / path.name)
        point(tmp / SHARDED, written.name)
    shutil.rmtree(folder, ignore_errors=True)  # an earlier attempt at this step
    os.replace(tmp, folder)


def best_record(run_dir: Path) -> dict[str, Any] | None:
    """The best checkpoint's {"step", "val_loss", "measured"} (train.keep_best), or None if there
    is none."""
    if not (run_dir / BEST / "LATEST").exists():
        return None
    return json.loads((latest_folder(run_dir / BEST) / BEST_RECORD).read_text())


def keep_if_best(
    root: Path, written: Path, step: int, val_loss: float, measured: dict[str, Any]
) -> None:
    """Makes `written` the best checkpoint (`root/step-<N>/`, named by `root/LATEST`) if its
    validation loss is lower than the best so far, measured alike (a resume may change
    train.eval_sequences: losses over other sequences do not compare, and the comparison
    restarts, saying so); the previous best goes once it is."""
    best = best_record(root.parent)
    if best is not None and best.get("measured") != measured:
        log(
            f"[checkpoint] the best so far (step {best['step']}, val/loss {best['val_loss']:.4f}) "
            f"was measured with {best.get('measured') or 'settings it did not record'}, this "
            f"run's losses with {measured}: the comparison restarts from step {step}"
        )
        best = None
    if best is not None and best["val_loss"] <= val_loss:
        return
    folder = root / f"step-{step:08d}"
    link_checkpoint(written, folder)
    record = {"step": step, "val_loss": val_loss, "measured": measured}
    write_json_atomically(folder / BEST_RECORD, record)
    point(root, folder.name)
    remove_older([root], 0, latest=folder)
    log(f"[checkpoint] step {step} is the best so far (val/loss {val_loss:.4f}): {folder}")
