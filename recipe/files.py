"""Writing in a run folder so that a kill, a crash or a planted link cannot leave a file half
written or write elsewhere: small text files (the run folder's files, the checkpoints' checksums
and `LATEST`) through a rename, and no write through a symbolic link planted in place of one of
the trainer's files or folders."""

from __future__ import annotations

import os
from pathlib import Path

from recipe.errors import Unusable


def refuse_link(path: Path) -> None:
    """Refuses `path` if it is a symbolic link: one planted in a run folder would have the
    trainer write (or delete) elsewhere."""
    if path.is_symlink():
        raise Unusable(
            f"{path} is a symbolic link (to {os.readlink(path)}): the trainer writes its own files "
            "in a run folder, never through a link; remove it, or give the run a new hydra.run.dir"
        )


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
