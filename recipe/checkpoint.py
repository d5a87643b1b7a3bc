"""Checkpoints that survive preemption: everything needed to continue a run exactly, written
atomically, read back safely.

Contents: model and optimizer state (full, unsharded, keyed by parameter name, so that a run may
resume with another number of GPUs or another set of stages), the AMP grad scaler, the step, the
RNG states, and the data position (the step: the sampler derives the order from it).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from recipe.distributed import Distributed

FILENAME = "checkpoint.pt"


def save(
    run_dir: Path,
    dist: Distributed,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    step: int,
) -> Path:
    """Writes `checkpoint.pt` in the run folder. A collective: every rank must call it (sharded
    state is gathered); rank 0 writes. The file is replaced atomically: a save killed midway
    leaves the previous checkpoint intact."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    path = run_dir / FILENAME
    if dist.is_main:
        state = {
            "model": model_state,
            "optimizer": optim_state,
            "scaler": scaler.state_dict(),
            "step": step,
            "rng": {
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            },
        }
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # atomic on POSIX
        finally:
            tmp.unlink(missing_ok=True)
    dist.barrier()
    return path


def read(run_dir: Path) -> dict[str, Any]:
    """Loads the run's checkpoint onto the CPU, accepting only tensors and plain containers."""
    path = run_dir / FILENAME
    if not path.exists():
        raise FileNotFoundError(
            f"train.resume=true, but there is no checkpoint at {path}. Point hydra.run.dir at "
            "the folder of the run to continue, or drop train.resume to start afresh."
        )
    return torch.load(path, map_location="cpu", weights_only=True)


def restore(
    state: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
) -> int:
    """Puts a checkpoint's state back (sharding it as the model is sharded); returns its step."""
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=StateDictOptions(full_state_dict=True),
    )
    scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return state["step"]


class StopSignal:
    """Turns SIGTERM (cluster preemption) and SIGINT (Ctrl-C) into a request to checkpoint and
    exit at the end of the current step. A second Ctrl-C quits at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True
        name = signal.Signals(signum).name
        print(f"\n[train] {name}: saving a checkpoint after this step, then exiting", flush=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C quits now

    def __enter__(self) -> StopSignal:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
