"""Writing in a run folder so that a kill, a crash or a planted link cannot leave a file half
written or write elsewhere: small text files (the run folder's files, the checkpoints' checksums
and `LATEST`) through a rename, and no write through a symbolic link planted in place of one of
the trainer's files or folders. And reading the JSON a script is given (a report to redraw): a
file that is not JSON, or not of the shape the script reads, is refused in one line naming it."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from base.errors import MissingFile, Unusable


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


def read_json(path: Path, shape: Any, fix: str) -> Any:
    """The JSON value in `path`, of `shape` (see `shape_problem`): a file that is missing, not
    JSON or of another shape is refused in one line naming it, what is wrong and `fix`."""
    if not path.is_file():
        raise MissingFile(f"{path}: no such file; {fix}")
    try:
        value = json.loads(path.read_bytes())
    except ValueError as e:  # not JSON, or not UTF-8 (a UnicodeDecodeError is a ValueError)
        raise Unusable(f"{path}: not JSON ({e}); {fix}") from None
    problem = shape_problem(value, shape)
    if problem:
        raise Unusable(f"{path}: {problem}; {fix}")
    return value


def shape_problem(value: Any, shape: Any, where: str = "") -> str | None:
    """What in `value` differs from `shape`, or None. A shape is a type (int and float take no
    bool; float takes an int); a tuple of shapes, any of them (None: null); `[shape]`, a list of
    such; a dict of its keys' shapes (a key ending in `?` may be missing; other keys may be there
    too); or `{KEYS: shape}`, an object of any keys (KEYS: `str`, or a pattern each key matches),
    each value of that shape. `where`: the path to `value`, for the message."""
    at = where or "the file"
    if shape is None or isinstance(shape, type):
        if _is_a(value, shape):
            return None
        return f"{at} is not {_a(shape)} ({json.dumps(value)[:40]})"
    if isinstance(shape, tuple):
        problems = [shape_problem(value, each, where) for each in shape]
        return None if None in problems else problems[0]
    if isinstance(shape, list):
        if not isinstance(value, list):
            return f"{at} is not a list"
        found = (shape_problem(v, shape[0], f"{where}[{i}]") for i, v in enumerate(value))
        return next((p for p in found if p), None)
    if not isinstance(value, dict):
        return f"{at} is not an object"
    inner = f"{where}." if where else ""
    (keys, each), *_ = shape.items()
    if keys is str or isinstance(keys, re.Pattern):
        for key, item in value.items():
            if isinstance(keys, re.Pattern) and not keys.fullmatch(key):
                return f"{at} has the key {key!r}, which does not match {keys.pattern}"
            if problem := shape_problem(item, each, f"{inner}{key}"):
                return problem
        return None
    for key, item_shape in shape.items():
        name = key.removesuffix("?")
        if name not in value:
            if key.endswith("?"):
                continue
            return f"{at} has no {name!r}"
        if problem := shape_problem(value[name], item_shape, f"{inner}{name}"):
            return problem
    return None


def _is_a(value: Any, kind: type | None) -> bool:
    if kind is None:
        return value is None
    if isinstance(value, bool):  # a bool is an int to Python, not a number in a report
        return kind in (bool, object)
    return isinstance(value, kind) or (kind is float and isinstance(value, int))


def _a(kind: type | None) -> str:
    names: dict[type | None, str] = {
        None: "null", dict: "an object", list: "a list", str: "a text", bool: "true or false",
        int: "a whole number", float: "a number",
    }  # fmt: skip
    return names.get(kind, kind.__name__ if kind else "null")
