"""Each checkpoint file's sha256, saved with it and checked on every read: a single file's in
`checkpoint.pt.sha256.json` beside it, a DCP step folder's in its `sha256.json` ({file name:
[data/integrity.py's record, ...]}). A checkpoint written before checksums has none and is read
unchecked. A file that fails its check is refused in one line naming it (`damaged`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from base.errors import Unusable
from base.files import write_text_atomically
from data import integrity

CHECKSUMS = "sha256.json"  # in a step folder: {file name: [record]} of every file in it


def checksums_of(path: Path) -> Path:
    """The checksum file of a single-file checkpoint: `checkpoint.pt.sha256.json`."""
    return path.with_name(f"{path.name}.sha256.json")


def write_json_atomically(path: Path, content: Any) -> None:
    write_text_atomically(path, json.dumps(content, indent=1) + "\n")


def replace_with_checksum(tmp: Path, path: Path) -> None:
    """Renames `tmp` over `path` and records its checksum. Two renames cannot be one, so until
    the file's is done the checksums accept the old file's record too: a kill at any moment
    leaves a file that its checksums accept."""
    sums, new = checksums_of(path), integrity.file_record(tmp)
    old = []
    if path.exists():
        old = _listed(sums).get(path.name, [])[:1] or [integrity.file_record(path)]
    write_json_atomically(sums, {path.name: [new, *old]})
    os.replace(tmp, path)
    write_json_atomically(sums, {path.name: [new]})


def record_folder(folder: Path) -> None:
    """Writes `sha256.json` in a DCP step folder: the checksum of every file in it."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != CHECKSUMS)
    write_json_atomically(
        folder / CHECKSUMS, {name: [integrity.file_record(folder / name)] for name in names}
    )


def plain_name(name: Any) -> bool:
    """A file name with no folder in it: what a checkpoint's own files are called."""
    return isinstance(name, str) and name not in ("", ".", "..") and not {"/", "\\"} & set(name)


def _listed(sums: Path) -> dict[str, list[dict[str, Any]]]:
    """A checksum file's {file name: [records]} ({} if there is none); refused if malformed."""
    if not sums.is_file():
        return {}
    try:
        listed = json.loads(sums.read_text())
    except ValueError as e:  # not JSON (a UnicodeDecodeError is one too)
        raise damaged(sums, f"it is not JSON: {e}") from None
    if not isinstance(listed, dict) or not all(
        plain_name(name) and isinstance(records, list) for name, records in listed.items()
    ):
        raise damaged(sums, "it is not a checksum file this recipe wrote")
    return listed


def damaged(path: Path, why: str) -> Unusable:
    return Unusable(
        f"{path} is damaged ({why}): the checkpoint cannot be used; copy the run folder again "
        "if it came from elsewhere, else resume from a backup or start a new run folder"
    )


def check_checksums(sums: Path, *, full: bool = False) -> None:
    """Refuses a checkpoint file that differs from each record `sums` lists for it, naming the
    file. Files up to 512 MiB are hashed whole, larger ones by sampled blocks unless `full`
    (data/integrity.py). No `sums`: a checkpoint from before checksums, read unchecked."""
    for name, records in _listed(sums).items():
        path = sums.parent / name
        if not path.is_file():
            raise damaged(path, f"it is missing, and {sums.name} lists it")
        try:
            ok = any(integrity.matches(path, record, full=full) for record in records)
        except (KeyError, TypeError):  # a record without its fields
            raise damaged(sums, f"its record of {name} is malformed") from None
        if not ok:
            raise damaged(path, "its sha256 differs from the one saved with it")
