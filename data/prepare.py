"""Turns a source's documents into the files the loaders read, once, in a cache folder.

For each split (`train`, `val`) it writes
- `<split>.bin`: the GPT-2 tokens as uint16, every document followed by <|endoftext|>
  (the memmap loader's input), and
- `<split>.txt`: the same documents as UTF-8, each followed by the record separator `\\x1e`
  (the on-the-fly loader's input),
plus `meta.json`, written last, which marks the folder complete and records what is in it.

The split is by position: the last `val_fraction` of the corpus's characters, in document
order, is the validation split (the document where the cut falls is cut at a line break), so
a corpus of one file splits as well as one of millions of documents.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import datasets
import numpy as np
from omegaconf import DictConfig, OmegaConf

from data.sources import expand_files, load_documents, shakespeare_files
from data.tokenizer import EOT, gpt2_encoding

SPLITS = ("train", "val")
DOC_SEPARATOR = "\x1e"  # ASCII record separator: ends each document in the .txt files
FORMAT_VERSION = 1


def cache_folder(cfg: DictConfig) -> Path:
    """The folder for this corpus; its name changes whenever what would be written changes."""
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


def split_documents(docs: datasets.Dataset, val_fraction: float) -> dict[str, datasets.Dataset]:
    """Cuts the corpus so that the last `val_fraction` of its characters form the val split."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
    lengths = np.asarray(docs.map(lambda b: {"n": [len(t) for t in b["text"]]}, batched=True)["n"])
    ends = np.cumsum(lengths)
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
    return {
        "train": datasets.concatenate_datasets([before, part([text[:offset]])]),
        "val": datasets.concatenate_datasets([part([text[offset:]]), after]),
    }


def _encode(batch: dict[str, list[str]]) -> dict[str, list]:
    ids = gpt2_encoding().encode_ordinary_batch(batch["text"])
    for doc in ids:
        doc.append(EOT)
    return {"ids": ids, "n": [len(doc) for doc in ids]}


def _write_split(docs: datasets.Dataset, folder: Path, split: str, num_proc: int) -> dict:
    """Writes `<split>.bin` and `<split>.txt`; returns their token and byte counts."""
    tokens = docs.map(_encode, batched=True, num_proc=num_proc, desc=f"tokenizing {split}")
    total = int(np.sum(tokens["n"], dtype=np.int64))
    out = np.memmap(folder / f"{split}.bin", dtype=np.uint16, mode="w+", shape=(total,))
    pos = 0
    for batch in tokens.iter(batch_size=1024):
        chunk = np.concatenate([np.asarray(doc, dtype=np.uint16) for doc in batch["ids"]])
        out[pos : pos + len(chunk)] = chunk
        pos += len(chunk)
    out.flush()
    del out
    with open(folder / f"{split}.txt", "w", encoding="utf-8") as f:
        for batch in docs.iter(batch_size=1024):
            f.writelines(text + DOC_SEPARATOR for text in batch["text"])
    n_bytes = (folder / f"{split}.txt").stat().st_size
    return {"tokens": total, "bytes": n_bytes, "documents": len(docs)}


def prepare(cfg: DictConfig) -> Path | None:
    """Prepares the corpus into its cache folder, unless it is already there (synthetic tokens
    need no preparation)."""
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
    splits = split_documents(load_documents(cfg, num_proc), cfg.val_fraction)
    # Write beside the final folder and rename, so an interrupted or concurrent preparation
    # never leaves a half-written folder under the final name.
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    counts = {split: _write_split(splits[split], tmp, split, num_proc) for split in SPLITS}
    meta = {"name": cfg.name, "tokenizer": "gpt2", "dtype": "uint16", "splits": counts}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    try:
        tmp.rename(folder)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"[data] prepared {cfg.name} in {time.time() - t0:.1f}s: {counts}", flush=True)
    return folder


def read_meta(folder: Path, split: str, suffix: str) -> dict:
    """The split's counts from `meta.json`, after checking that its file is whole."""
    how = f"delete {folder} and run again: it is prepared automatically on first use"
    meta_path = folder / "meta.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"{folder} holds no prepared corpus (no meta.json): {how}")
    counts = json.loads(meta_path.read_text())["splits"][split]
    path = folder / f"{split}.{suffix}"
    expected = counts["tokens"] * 2 if suffix == "bin" else counts["bytes"]
    if not path.exists():
        raise FileNotFoundError(f"token file {path} is missing: {how}")
    if path.stat().st_size != expected:
        raise RuntimeError(
            f"{path} is corrupt: {path.stat().st_size} bytes where meta.json says {expected}: {how}"
        )
    return counts
