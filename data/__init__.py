"""The data pipeline: corpus -> (prepared files) -> windows dataset -> DataLoader -> device.

prepare(cfg.data)                          # once, on the main rank: tokens + text on disk
datasets = load_splits(cfg.data, block_size=T, seed=s)
loader = build_loader(datasets["train"], batch_size, rank=r, world_size=W, seed=s, options=o)
for inputs, targets in DeviceBatches(loader, device, o.non_blocking): ...
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, Dataset

from base.errors import ConfigError
from data.config import check_config
from data.identity import check_corpus, corpus_identity
from data.prepare import SPLITS, prepare, prepared_folder, read_meta, verify
from data.sampler import StepSampler
from data.tokenizer import VOCAB_SIZE
from data.windows import RandomTokens, TextWindows, TokenWindows
from data.workers import WorkerInit, loader_context

__all__ = [
    "DeviceBatches",
    "LoaderOptions",
    "StepSampler",
    "build_eval_loader",
    "build_loader",
    "check_config",
    "check_corpus",
    "corpus_identity",
    "load_splits",
    "prepare",
    "verify",
]


@dataclass
class LoaderOptions:
    """How batches reach the model. The baseline is the simplest: no workers, pageable memory,
    blocking copies. The `workers` and `non_blocking` stages change these."""

    num_workers: int = 0
    prefetch_factor: int | None = None
    pin_memory: bool = False
    non_blocking: bool = False


def load_splits(
    cfg: DictConfig, *, block_size: int, seed: int, vocab_size: int = VOCAB_SIZE
) -> dict[str, Dataset]:
    """The train and val window datasets of a prepared corpus, after checking its files.
    `vocab_size` is the model's: no window holds an id at or above it."""
    check_config(cfg)
    if cfg.source == "synthetic":
        return {s: RandomTokens(block_size, seed + n, cfg.vocab_size) for n, s in enumerate(SPLITS)}
    folder = prepared_folder(cfg)
    splits: dict[str, Dataset] = {}
    for split in SPLITS:
        if cfg.loader == "memmap":
            counts = read_meta(folder, split, "bin")
            splits[split] = TokenWindows(
                folder / f"{split}.bin", block_size, seed, counts["tokens"], vocab_size
            )
        else:
            counts = read_meta(folder, split, "txt")
            splits[split] = TextWindows(
                folder / f"{split}.txt",
                block_size,
                seed,
                counts["bytes"],
                bytes_per_token=counts["bytes"] / counts["tokens"],
                preprocess_cfg=cfg.preprocess,
            )
    return splits


def _loader_kwargs(options: LoaderOptions) -> dict:
    workers = options.num_workers
    return {
        "num_workers": workers,
        "prefetch_factor": options.prefetch_factor if workers else None,
        "persistent_workers": workers > 0,
        "pin_memory": options.pin_memory,
        # Workers ignore the process group's SIGTERM/SIGINT (the trainer decides when to stop,
        # and saves a checkpoint first) and die with the trainer: data.workers.
        "multiprocessing_context": loader_context() if workers else None,
        "worker_init_fn": WorkerInit() if workers else None,
    }


def build_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    rank: int,
    world_size: int,
    seed: int,
    options: LoaderOptions,
    start_sample: int = 0,
    num_steps: int | None = None,
) -> DataLoader:
    """A DataLoader yielding this rank's (batch_size, block_size + 1) batch for each step."""
    sampler = StepSampler(
        len(dataset),  # type: ignore[arg-type]  # our datasets have a length
        batch_size,
        rank=rank,
        world_size=world_size,
        seed=seed,
        start_sample=start_sample,
        num_steps=num_steps,
    )
    return DataLoader(dataset, batch_sampler=sampler, **_loader_kwargs(options))


def build_eval_loader(
    dataset: Dataset,
    num_sequences: int,
    batch_size: int,
    *,
    rank: int,
    world_size: int,
    seed: int,
    options: LoaderOptions,
) -> DataLoader:
    """A fixed validation set: the first `num_sequences` windows of the seeded order, the same
    whatever the batch size, the stages or the number of ranks (so val/loss is comparable
    across runs). Each rank evaluates every W-th one, all ranks the same number."""
    num_sequences -= num_sequences % world_size
    if num_sequences < 1:
        raise ConfigError(
            f"train.eval_sequences must be at least the number of ranks ({world_size})"
        )
    ids = StepSampler(len(dataset), num_sequences, seed=seed).batch_ids(0)  # type: ignore[arg-type]
    return DataLoader(
        dataset, sampler=ids[rank::world_size], batch_size=batch_size, **_loader_kwargs(options)
    )


class DeviceBatches:
    """The loader's batches on `device`, as (inputs, targets).

    Blocking (the baseline): each batch is copied when needed, from pageable memory. Such a copy
    waits until the GPU has drained its queue, so the CPU and the GPU take turns.
    Non-blocking: batches arrive pinned, and the next one is copied on a side stream while the
    current step computes; the compute stream waits only for that copy, never the CPU.
    `wait_s` adds up the host's wall-clock wait for the loader's batches (not for the copies,
    which in blocking mode wait for the GPU): the loop's `perf/data_wait_ms`, with no sync.
    """

    def __init__(self, loader: DataLoader, device: torch.device, non_blocking: bool) -> None:
        self.batches = iter(loader)
        self.device, self.non_blocking = device, non_blocking
        cuda = non_blocking and device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if cuda else None
        self.wait_s = 0.0
        self.ready = self._copy(self._next(None)) if non_blocking else None

    def _next(self, *default: None) -> torch.Tensor | None:
        """`next(self.batches, *default)`, its wait added to `wait_s`."""
        begin = time.perf_counter()
        try:
            return next(self.batches, *default)
        finally:
            self.wait_s += time.perf_counter() - begin

    def _copy(self, batch: torch.Tensor | None) -> torch.Tensor | None:
        if batch is None:  # the loader is exhausted (a finite validation loader)
            return None
        if self.copy_stream is None:
            return batch.to(self.device, non_blocking=self.non_blocking)
        with torch.cuda.stream(self.copy_stream):
            return batch.to(self.device, non_blocking=True)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.non_blocking:
            batch = self._copy(self._next())
        else:
            batch = self.ready
            if batch is None:
                raise StopIteration
            if self.copy_stream is not None:
                compute_stream = torch.cuda.current_stream(self.device)
                compute_stream.wait_stream(self.copy_stream)
                batch.record_stream(compute_stream)  # keep its memory until the step is done
            self.ready = self._copy(self._next(None))
        return batch[:, :-1], batch[:, 1:]
