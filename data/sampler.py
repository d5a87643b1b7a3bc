"""The data order: which sample ids each rank reads at each optimizer step.

One seeded stream of sample ids (each epoch a fresh permutation of the dataset) is read in order.
With G = batch_size x world_size, the global batch of a run's k-th step is positions
[start + k·G, start + (k+1)·G) of that stream, where `start` is the number of samples consumed
before this run started (0, or what a checkpoint recorded); rank r reads the r-th contiguous
slice of it. So the order depends only on the seed, never on the number of ranks or the batch:
the ranks' batches of a step, put together, are the one-process batch of size G, and a resume
with another number of GPUs or another batch continues the same stream where it stopped.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from torch.utils.data import Sampler


class StepSampler(Sampler[list[int]]):
    def __init__(
        self,
        num_items: int,
        batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        start_sample: int = 0,
        num_steps: int | None = None,
    ) -> None:
        self.num_items, self.batch_size = num_items, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.start_sample, self.num_steps = start_sample, num_steps
        self._epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_items)
        return self._perm

    def batch_ids(self, step: int) -> list[int]:
        """This rank's sample ids at this run's optimizer step `step` (0: its first)."""
        first = self.start_sample + (step * self.world_size + self.rank) * self.batch_size
        ids = []
        for position in range(first, first + self.batch_size):
            epoch, i = divmod(position, self.num_items)
            ids.append(epoch * self.num_items + int(self._permutation(epoch)[i]))
        return ids

    def __iter__(self) -> Iterator[list[int]]:
        step = 0
        while self.num_steps is None or step < self.num_steps:
            yield self.batch_ids(step)
            step += 1

    def __len__(self) -> int:
        if self.num_steps is None:
            raise TypeError("the training sampler is endless; it has no length")
        return self.num_steps
