"""Writing a small text file so that a kill, a crash or a planted link cannot leave it half
written or write elsewhere: the run folder's files, the checkpoints' checksums and `LATEST`."""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomically(path: Path, text: str) -> None:
    """Writes `text` to `path` through a new temporary file, flushed to disk and renamed over it:
    a kill leaves the old or the new file whole, and a symbolic link at `path` is replaced, never
    followed."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)  # a killed write's leftover (a link there: removed, not followed)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
