"""One process per GPU (launched by `torchrun`) or a single process; the device each one uses."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEVICES = ("auto", "cpu", "cuda")


def log(message: str) -> None:
    """Prints on the main process only (RANK 0, or a single process)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, flush=True)


def resolve_device(choice: str, local_rank: int = 0) -> torch.device:
    """`auto` picks this process's GPU when there is one, else the CPU."""
    if choice not in DEVICES:
        raise ValueError(f"device={choice!r}: choose one of {', '.join(DEVICES)}")
    has_cuda = torch.cuda.is_available()
    if choice == "cuda" and not has_cuda:
        built = (
            f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        )
        raise RuntimeError(
            f"device=cuda, but no CUDA GPU is visible (torch {torch.__version__} is {built}). "
            "Use device=auto or device=cpu, or check CUDA_VISIBLE_DEVICES and the driver."
        )
    if choice == "cpu" or not has_cuda:
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


@dataclass(frozen=True)
class Distributed:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of `value` over all ranks (a collective: every rank must call it)."""
        if self.enabled:
            value = value.clone()
            dist.all_reduce(value, op=dist.ReduceOp.AVG if value.is_cuda else dist.ReduceOp.SUM)
            if not value.is_cuda:  # gloo has no AVG
                value /= self.world_size
        return value

    def any(self, flag: bool) -> bool:
        """True on every rank if `flag` is true on any (over a CPU group: no GPU sync)."""
        if not self.enabled:
            return flag
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_cpu_group())
        return bool(t.item())


_CPU_GROUP: dist.ProcessGroup | None = None


def _cpu_group() -> dist.ProcessGroup:
    global _CPU_GROUP
    if _CPU_GROUP is None:
        _CPU_GROUP = dist.new_group(backend="gloo")
    return _CPU_GROUP


def init(device_choice: str) -> Distributed:
    """Joins the process group when launched by torchrun; otherwise a world of one."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = resolve_device(device_choice, local_rank)
    if world_size > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group(backend="nccl", device_id=device)
        else:
            dist.init_process_group(backend="gloo")
        _cpu_group()  # created now, collectively, before anything can be unequal between ranks
    return Distributed(rank, local_rank, world_size, device)


def shutdown() -> None:
    global _CPU_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _CPU_GROUP = None
