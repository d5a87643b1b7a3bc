"""Map-style datasets of training windows: each item is `block_size + 1` token ids (inputs are
the first `block_size`, targets the last `block_size`).

Items are addressed by a global sample id `epoch * len(dataset) + i`, so that one seeded id
stream (see `data.sampler`) fixes the whole data order, across epochs, ranks and workers. Each
epoch shifts the window grid by a seeded offset, so windows start at new places every epoch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig
from torch.utils.data import Dataset

from base.errors import ConfigError
from data.prepare import DOC_SEPARATOR
from data.preprocess import preprocess
from data.tokenizer import EOT, gpt2_encoding


def _epoch_offset(seed: int, epoch: int, stride: int) -> int:
    return int(np.random.default_rng([seed, epoch, 0x5EED]).integers(stride))


def too_short(path: Path, holds: str, block_size: int) -> ConfigError:
    """The error for a split too short for windows at three places of its grid (the epochs'
    offsets need the room): the val split grows with data.val_fraction, the train split shrinks."""
    fraction = "raise data.val_fraction" if path.stem == "val" else "lower data.val_fraction"
    return ConfigError(
        f"{path} holds {holds}, too few for three windows of {block_size + 1} tokens: lower "
        f"model.block_size, {fraction} or give the corpus more text"
    )


class TokenWindows(Dataset):
    """Windows over a pre-tokenized uint16 file, read through a memmap (nanoGPT style). A window
    holding an id at or above `vocab_size` (a corrupted file) is refused: the model would index
    past its embedding, or train towards a padding row's infinite loss."""

    def __init__(
        self, path: Path, block_size: int, seed: int, num_tokens: int, vocab_size: int
    ) -> None:
        self.path, self.block_size, self.seed = path, block_size, seed
        self.vocab_size = vocab_size
        self.items_per_epoch = (num_tokens - 2 * block_size) // block_size
        if self.items_per_epoch < 1:
            raise too_short(path, f"{num_tokens} tokens", block_size)
        self._tokens: np.memmap | None = None  # opened lazily, once per worker process

    def __len__(self) -> int:
        return self.items_per_epoch

    def __getitem__(self, sample_id: int) -> torch.Tensor:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        epoch, i = divmod(sample_id, self.items_per_epoch)
        start = _epoch_offset(self.seed, epoch, self.block_size) + i * self.block_size
        window = self._tokens[start : start + self.block_size + 1]
        if window.max() >= self.vocab_size:
            at = start + int(np.argmax(window >= self.vocab_size))
            raise ValueError(
                f"{self.path} is corrupt: token {at} is {self._tokens[at]}, outside the model's "
                f"vocabulary [0, {self.vocab_size}): delete {self.path.parent} and run again: it "
                "is prepared automatically on first use"
            )
        return torch.from_numpy(window.astype(np.int64))


class TextWindows(Dataset):
    """Windows of raw UTF-8 text, preprocessed and tokenized when the item is read, i.e. in the
    DataLoader's workers (or in the training process when there are none)."""

    def __init__(
        self,
        path: Path,
        block_size: int,
        seed: int,
        num_bytes: int,
        bytes_per_token: float,
        preprocess_cfg: DictConfig,
    ) -> None:
        self.path, self.block_size, self.seed = path, block_size, seed
        self.preprocess_cfg = preprocess_cfg
        # Enough bytes for block_size + 1 tokens most of the time; a short window reads on.
        self.span = int((block_size + 1) * bytes_per_token * 1.25) + 1
        self.num_bytes = num_bytes
        self.items_per_epoch = (num_bytes - 2 * self.span) // self.span
        if self.items_per_epoch < 1:
            raise too_short(path, f"{num_bytes} bytes", block_size)
        self._bytes: np.memmap | None = None

    def __len__(self) -> int:
        return self.items_per_epoch

    def _tokens(self, start: int, rng: np.random.Generator) -> list[int]:
        raw = bytes(self._bytes[start : start + self.span]).decode("utf-8", errors="ignore")
        ids: list[int] = []
        for n, doc in enumerate(raw.split(DOC_SEPARATOR)):
            if n:
                ids.append(EOT)
            if self.preprocess_cfg.enabled:
                doc = preprocess(doc, self.preprocess_cfg, rng)
            ids.extend(gpt2_encoding().encode_ordinary(doc))
        return ids

    def __getitem__(self, sample_id: int) -> torch.Tensor:
        if self._bytes is None:
            self._bytes = np.memmap(self.path, dtype=np.uint8, mode="r")
        epoch, i = divmod(sample_id, self.items_per_epoch)
        rng = np.random.default_rng([self.seed, sample_id])  # the same words dropped on every run
        start = _epoch_offset(self.seed, epoch, self.span) + i * self.span
        ids: list[int] = []
        while len(ids) < self.block_size + 1:
            ids.extend(self._tokens(start, rng))
            start = (start + self.span) % (self.num_bytes - self.span)
        return torch.tensor(ids[: self.block_size + 1], dtype=torch.int64)


class RandomTokens(Dataset):
    """Uniformly random tokens: no preparation and no I/O, for measuring pure throughput."""

    def __init__(self, block_size: int, seed: int, vocab_size: int) -> None:
        self.block_size, self.seed, self.vocab_size = block_size, seed, vocab_size
        self.items_per_epoch = 1 << 20  # ids are only an address; any size would do

    def __len__(self) -> int:
        return self.items_per_epoch

    def __getitem__(self, sample_id: int) -> torch.Tensor:
        rng = np.random.default_rng([self.seed, sample_id])
        return torch.from_numpy(rng.integers(0, self.vocab_size, self.block_size + 1))
