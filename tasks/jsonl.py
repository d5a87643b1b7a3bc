"""A task's items: a local jsonl checked line by line, or the hub's split saved as one."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from base.errors import ConfigError, MissingFile, Unusable
from base.files import write_text_atomically

Check = Callable[[str, str], dict]  # (line, where) -> the item, or a one-line ConfigError


def read_task_file(task_file: str, key: str, task: str, check: Check) -> list[dict]:
    """The items of a local jsonl, each line checked by `check(line, where)`; refused in one line
    naming `key` when the file is missing or holds no item."""
    path = Path(str(task_file)).expanduser()
    if not path.is_file():
        raise MissingFile(f"{key}={task_file}: no such file; give a {task} jsonl")
    items = read_jsonl(path, check)
    if not items:
        raise ConfigError(f"{key}={task_file}: no items in it; give a {task} jsonl")
    return items


def hub_split_file(
    path: Path, hub: tuple[str, str | None, str], fields: tuple[str, ...], hint: str
) -> Path:
    """`path`, first written as a jsonl of the `fields` of the hub dataset's (path, config,
    split) when it is not there yet; refused in one line saying to pass `hint` when the hub
    cannot be reached."""
    if path.is_file():
        return path
    try:
        import datasets

        rows = datasets.load_dataset(hub[0], hub[1], split=hub[2])
    except Exception as e:  # datasets raises many types for "offline"/"not found"
        raise Unusable(
            f"could not load {hub[0]} from the Hugging Face hub ({type(e).__name__}): pass {hint}"
        ) from e
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(
        path, "".join(json.dumps({k: row[k] for k in fields}) + "\n" for row in rows)
    )
    return path


def read_jsonl(path: Path, check: Check) -> list[dict]:
    """The items of a jsonl, blank lines skipped, each checked naming its line."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        bad_line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}:{bad_line}: not UTF-8 text ({e.reason}); give a jsonl in UTF-8"
        ) from None
    lines = enumerate(text.splitlines(), 1)
    return [check(line, f"{path}:{n}") for n, line in lines if line.strip()]
