"""One-line errors, for every entry point (train.py, sample.py, the scripts):

    @errors.app(config_name="config")   # in place of @hydra.main(...)
    def main(cfg: DictConfig) -> None: ...

    errors.main(lambda: main(sys.argv[1:]))   # a program without Hydra's main

- A mistake the user can fix (a `UserError`: a bad setting, a missing or damaged file, a refused
  folder) ends the program with one line, `<program>: error: <what and how to fix it>`, exit 2.
- Hydra's own errors are the user's too (an unknown key, an unknown option of a group, an
  override it cannot parse): the same one line, exit 2.
- So is a path the system refuses to this user (a read-only folder: the run folder Hydra makes,
  a tool's `out=`): the same one line, exit 2.
- A run that stops itself (`Reported`, e.g. recipe/guard.py's NonFiniteSteps): its line, exit 1.
- Ctrl-C that reaches the program as KeyboardInterrupt: `<program>: interrupted`, exit 130.
- Anything else is a bug and keeps its traceback, as does everything under HYDRA_FULL_ERROR=1.

Only the recipe's own classes below count as the user's: a ValueError from deep inside torch is a
bug, not a setting to fix."""

from __future__ import annotations

import contextlib
import difflib
import errno
import functools
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
INTERRUPTED = 130  # a shell's status for a program ended by Ctrl-C (128 + SIGINT)


class Reported(Exception):
    """An error whose message says it all: printed as one line, exit status `status`."""

    status = 1


class UserError(Reported):
    """A mistake the user made and can fix: the message names the setting or file and what to do."""

    status = 2


class ConfigError(UserError, ValueError):
    """A setting that cannot work, or settings that cannot work together."""


class MissingFile(UserError, FileNotFoundError):
    """A file or folder the command names (or needs) is not there."""


class FileRefused(UserError, FileExistsError):
    """A folder or file the command would overwrite or mix with another run's."""


class Unusable(UserError, RuntimeError):
    """What the settings name or need, there but unusable: a damaged, unreadable or foreign file,
    a folder in use or on a full disk, a missing GPU or package."""


class ReportedExit(SystemExit):
    """How a reported error ends the program: exit status `code`, its printed line as `str()`."""

    def __init__(self, line: str, status: int) -> None:
        super().__init__(status)
        self.line = line

    def __str__(self) -> str:
        return self.line


def did_you_mean(key: str, known: Iterable[str]) -> str:
    """' (did you mean <closest>?)', or '' when nothing is close."""
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.7)
    return f" (did you mean {close[0]}?)" if close else ""


def app(
    config_name: str, config_path: str = str(CONF_DIR)
) -> Callable[[Callable[[Any], Any]], Any]:
    """`@hydra.main` for the recipe's programs (Hydra 1.3 semantics), with their errors and
    Hydra's reported as described at the top. conf/ by its absolute path: found alike from
    train.py, `python sample.py` and `python -m tools.<tool>` (a relative one would be read
    beside the file, or inside the package)."""

    def decorate(task: Callable[[Any], Any]) -> Any:
        program = Path(task.__code__.co_filename).name

        @functools.wraps(task)  # Hydra names the job after the task's module
        def reported(cfg: Any) -> Any:  # inside Hydra's job: ends it before Hydra reports it
            return _one_line(lambda: task(cfg), program)

        import hydra

        run = hydra.main(version_base="1.3", config_path=config_path, config_name=config_name)(
            reported
        )

        @functools.wraps(run)
        def entry(*args: Any) -> Any:  # Hydra's own errors: composing the config, overrides
            with _hydra_reports_to(lambda step: _one_line(step, program)):
                return run(*args)

        return entry

    return decorate


def main(entry: Callable[[], Any]) -> Any:
    """Runs a plain (not `@app`) program's entry point, its errors reported as described at the
    top; e.g. `errors.main(lambda: main(sys.argv[1:]))`."""
    program = Path(sys.argv[0]).name
    with _hydra_reports_to(lambda step: _one_line(step, program)):
        return _one_line(entry, program)


def _one_line(task: Callable[[], Any], program: str) -> Any:
    """Runs `task`; a user's error, a Hydra error or a refused path ends the program in one
    line."""
    try:
        return task()
    except KeyboardInterrupt as e:  # the user's Ctrl-C, not a bug: no traceback
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        line = f"{program}: interrupted{f' ({e})' if str(e) else ''}"
        print(line, file=sys.stderr)
        raise ReportedExit(line, INTERRUPTED) from None
    except Exception as e:
        full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"  # Hydra's switch: tracebacks
        refused = _refused_path(e)
        if full_error or not (isinstance(e, (Reported, *_hydra_errors())) or refused):
            raise
        status = e.status if isinstance(e, Reported) else UserError.status
        message = str(e) if isinstance(e, Reported) else refused or hydra_message(e)
        line = f"{program}: error: {' '.join(message.split())}"
        print(line, file=sys.stderr)
        raise ReportedExit(line, status) from None


def _refused_path(e: Exception) -> str:
    """The line for a path the system refuses to this user (no permission, a read-only file
    system), wherever it was met; '' for any other error."""
    refusals = (errno.EACCES, errno.EPERM, errno.EROFS)
    if not isinstance(e, OSError) or e.errno not in refusals or not e.filename:
        return ""
    return (
        f"{Path(e.filename).absolute()}: {e.strerror}: give a folder this user can write (a run's: "
        "hydra.run.dir=<folder>, or start it from a writable folder; a tool's: out=<path>)"
    )


def _hydra_errors() -> tuple[type[Exception], ...]:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return HydraException, OmegaConfBaseException


@contextlib.contextmanager
def _hydra_reports_to(report: Callable[[Callable[[], Any]], Any]) -> Iterator[None]:
    """Hydra runs its steps (composing the config, the job) in `run_and_report`, which prints a
    multi-line message or a trimmed traceback; with `report` around each step, the user's errors
    and Hydra's own reach `report` first (anything else goes on to Hydra's printing)."""
    import hydra._internal.utils as hydra_utils

    original = hydra_utils.run_and_report
    hydra_utils.run_and_report = lambda func: original(lambda: report(func))
    try:
        yield
    finally:
        hydra_utils.run_and_report = original


def hydra_message(e: Exception) -> str:
    """One line for Hydra's errors, saying what to do: an unknown key (with the closest known
    one), an unknown option of a group (with the options), an override it cannot parse."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    if isinstance(e, OverrideParseException):
        key, _, value = e.override.partition("=")
        closed = _closed(value)
        if closed != value:  # quoting it would make a list a string: an option no group has
            return (
                f"cannot parse the override {e.override!r}: close its list, inside the shell's "
                f"quotes: '{key}={closed}'"
            )
        return (
            f"cannot parse the override {e.override!r}: quote the value for Hydra, inside the "
            f"shell's quotes: '{key}=\"{value}\"'"
        )
    if isinstance(e, MissingConfigException) and e.missing_cfg_file and e.options is not None:
        group, _, option = e.missing_cfg_file.rpartition("/")
        group_key = group.replace("/", ".")
        where = f" (conf/{group}/)" if (CONF_DIR / group).is_dir() else ""
        return (
            f"{group_key}={option}: no such option{did_you_mean(option, e.options)}; choose one "
            f"of {', '.join(sorted(e.options))}{where}"
        )
    cause = e.__cause__
    if isinstance(cause, ConfigKeyError | ConfigAttributeError) and cause.full_key:
        overridden = re.match(r"Could not override '([^']+)'", str(e))  # the whole key
        return unknown_key(overridden[1] if overridden else str(cause.full_key), _siblings(cause))
    first = str(e).strip().splitlines()
    if first and first[0].startswith("Could not append to config."):
        return f"{first[0]} Drop the + to change its value."
    return first[0] if first else type(e).__name__


def _closed(value: str) -> str:
    """`value` with the lists and dicts it leaves open closed (`[amp,compile`: `[amp,compile]`);
    brackets inside quotes do not count."""
    pairs, opened, quote = {"[": "]", "{": "}"}, [], ""
    for char in value:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in pairs:
            opened.append(pairs[char])
        elif opened and char == opened[-1]:
            opened.pop()
    return value + "".join(reversed(opened))


def unknown_key(key: str, known: Iterable[str]) -> str:
    """The line for a key that the config does not have: the closest known key, or the stage
    (or other group option) to select first when the key lies under one."""
    known = list(known)
    group, _, rest = key.partition(".")
    option = rest.partition(".")[0]
    selected = any(k.startswith(f"{group}.{option}.") for k in known)
    if option and (CONF_DIR / group / f"{option}.yaml").is_file() and not selected:
        hint = f": select it first with +{group}={option}"
    else:
        hint = did_you_mean(key, known) + ": `--help` lists every key"
    return f"{key} is not a setting{hint}"


def _siblings(cause: Any) -> list[str]:
    """The full keys beside an unknown one (those of the node it was missing from)."""
    parent, prefix = cause.parent_node, str(cause.full_key).rpartition(".")[0]
    names = list(parent.keys()) if hasattr(parent, "keys") else []
    return [f"{prefix}.{name}" if prefix else str(name) for name in names]
