"""Checksums of the prepared files: recorded in `meta.json` when a corpus is prepared, checked
each time it is loaded, so that a corrupted file is refused instead of trained on.

A file up to `FULL_CHECK_BYTES` (the bundled corpus is a few MB) is hashed whole on every load:
any corruption is caught, even one that keeps the size. A larger one (OpenWebText's train.bin is
17 GB) is checked by its size and the hash of a few fixed blocks, a fraction of a second;
`python scripts/prepare_data.py data=... --verify` hashes every file whole.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from base.errors import MissingFile, Unusable

FULL_CHECK_BYTES = 512 * 2**20  # hash files up to this size whole on every load
SAMPLE_BLOCKS = 16  # above it, hash this many blocks, evenly spaced from the first to the last
SAMPLE_BLOCK_BYTES = 2**20
_READ_BYTES = 8 * 2**20


def _sha256(path: Path, size: int, *, sampled: bool) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if not sampled:
            while chunk := f.read(_READ_BYTES):
                digest.update(chunk)
            return digest.hexdigest()
        digest.update(size.to_bytes(8, "little"))
        last = max(size - SAMPLE_BLOCK_BYTES, 0)
        for offset in sorted({last * i // (SAMPLE_BLOCKS - 1) for i in range(SAMPLE_BLOCKS)}):
            f.seek(offset)
            digest.update(f.read(SAMPLE_BLOCK_BYTES))
    return digest.hexdigest()


def file_record(path: Path) -> dict:
    """What `meta.json` records of a prepared file: its size, the sha256 of its content and
    the sha256 of its sampled blocks."""
    size = path.stat().st_size
    return {
        "bytes": size,
        "sha256": _sha256(path, size, sampled=False),
        "sampled_sha256": _sha256(path, size, sampled=True),
    }


def check_file(path: Path, record: dict, fix: str, *, full: bool = False) -> None:
    """Refuses a file that differs from its `record`, with `fix` saying what to do: whole-file
    hash up to FULL_CHECK_BYTES (or with `full`), sampled blocks above."""
    if not path.is_file():
        raise MissingFile(f"prepared file {path} is missing: {fix}")
    size = path.stat().st_size
    if size != record["bytes"]:
        raise Unusable(
            f"{path} is corrupt: {size} bytes where meta.json says {record['bytes']}: {fix}"
        )
    if not matches(path, record, full=full):
        whole = full or size <= FULL_CHECK_BYTES
        what = "its content differs" if whole else f"{SAMPLE_BLOCKS} sampled blocks differ"
        raise Unusable(f"{path} is corrupt: {what} from what meta.json records: {fix}")


def matches(path: Path, record: dict, *, full: bool = False) -> bool:
    """Whether `path` has the size and hash of its `record` (file_record's): whole-file hash up
    to FULL_CHECK_BYTES (or with `full`), sampled blocks above."""
    size = path.stat().st_size
    if size != record["bytes"]:
        return False
    whole = full or size <= FULL_CHECK_BYTES
    key = "sha256" if whole else "sampled_sha256"
    return _sha256(path, size, sampled=not whole) == record[key]


def content_sha256(path: Path) -> str:
    """A source file's identity: the sha256 of its content up to FULL_CHECK_BYTES, of its size
    and sampled blocks above (a corpus of many GB is identified in a fraction of a second)."""
    size = path.stat().st_size
    return _sha256(path, size, sampled=size > FULL_CHECK_BYTES)
