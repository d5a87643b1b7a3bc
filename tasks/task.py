"""What a zero-shot task is, and the one loop that scores its items over the ranks.

A task scores items (passages, questions) with the model: `score` turns a batch of items into
one row of numbers per item (correct counts, log-likelihoods), `summarise` turns their sums over
every item into the task's metrics. `Task.evaluate` splits the items over the data-parallel
ranks (item i on rank i % dp_size), scores each rank's share a batch per forward, and adds the
ranks' sums up.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed

from base.distributed import Distributed

Score = Callable[[torch.nn.Module, list[dict], int, torch.device], torch.Tensor]


@dataclass(frozen=True)
class Task:
    name: str  # `task=<name>` of tools/evaluate.py, and its metrics' prefix
    # The items of a local jsonl (None: the hub's split, cached in the data cache folder), the
    # first `limit` if given; `key` is the setting that named the file, for its errors.
    load_items: Callable[[str | None, str, int | None, str], list[dict]]
    # Per item of a batch, the numbers its metrics sum (float64, one row per item).
    score: Score
    summarise: Callable[[list[float], int], dict[str, float]]  # the sums, the item count
    items_per_forward: int  # items scored in one forward

    def sums(
        self,
        model: torch.nn.Module,
        items: list[dict],
        *,
        block_size: int,
        device: torch.device,
        rank: int = 0,
        world_size: int = 1,
        autocast: contextlib.AbstractContextManager | None = None,
    ) -> torch.Tensor:
        """The sums of this rank's items (i % world_size == rank). Every rank runs the same number
        of forwards (a rank short of items scores the first again, uncounted): under FSDP each
        forward gathers the weights from all ranks. Eager (evaluation's shapes vary: compiling
        them would recompile every batch) and in eval mode."""
        mine = items[rank::world_size]
        most = -(-len(items) // world_size)  # the items of the busiest rank
        rounds = -(-most // self.items_per_forward)
        total: torch.Tensor | None = None
        was_training = model.training
        model.eval()
        eager = torch.compiler.set_stance("force_eager")
        with torch.no_grad(), eager, autocast or contextlib.nullcontext():
            for n in range(rounds):
                batch = mine[n * self.items_per_forward : (n + 1) * self.items_per_forward]
                rows = self.score(model, batch or items[:1], block_size, device)
                counted = rows[: len(batch)].sum(0)
                total = counted if total is None else total + counted
        model.train(was_training)
        assert total is not None, "every rank scores at least one batch"
        return total

    def evaluate(
        self,
        model: torch.nn.Module,
        items: list[dict],
        *,
        block_size: int,
        dist: Distributed,
        autocast: contextlib.AbstractContextManager | None = None,
    ) -> dict[str, Any]:
        """The task's metrics over `items` (split over the data-parallel ranks) and the item
        count; every rank must call it. The ranks of a tensor-parallel group score the same
        items together: their sums are counted once."""
        total = self.sums(
            model, items, block_size=block_size, device=dist.device, rank=dist.dp_rank,
            world_size=dist.dp_size, autocast=autocast,
        ).to(dist.device)  # fmt: skip
        if dist.enabled:
            torch.distributed.all_reduce(total)  # a sum
            total = total / (dist.world_size // dist.dp_size)  # each tp group's, from each rank
        return self.summarise(total.tolist(), len(items)) | {"items": len(items)}
