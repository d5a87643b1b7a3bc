"""Checkpoints that survive preemption: everything needed to continue a run exactly, written
atomically, read back safely, and never from broken weights.

Contents: model and optimizer state (full, unsharded, keyed by parameter name, so that a run may
resume with another number of GPUs or another set of stages), the AMP grad scaler, the step, the
RNG states, the data position (the step: the sampler derives the order from it), and what is
needed to rebuild and continue the run without its command line: the resolved config, the
model's real shape (`model_config`, also for a pretrained start), the stages and the wandb run id.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from recipe.distributed import Distributed

FILENAME = "checkpoint.pt"


def _weights_finite(model: torch.nn.Module, dist: Distributed) -> bool:
    """True on every rank if every rank's weights (or shards) are finite."""
    finite = all(
        torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all()
        for p in model.parameters()
    )
    return not dist.any(not finite)


def _remove_stale_temporaries(folder: Path) -> None:
    """Deletes `checkpoint.tmp-<pid>` files left by processes that were killed while saving."""
    for tmp in folder.glob(f"{Path(FILENAME).stem}.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def save(
    run_dir: Path,
    dist: Distributed,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    step: int,
    run_state: dict[str, Any],
) -> Path:
    """Writes `checkpoint.pt` in the run folder, with `run_state` (config, model_config, stages,
    wandb_id). A collective: every rank must call it (sharded state is gathered); rank 0 writes.
    The file is replaced atomically: a save killed midway leaves the previous checkpoint intact,
    and weights that are not finite are never saved (the last good checkpoint stays)."""
    path = run_dir / FILENAME
    if not _weights_finite(model, dist):
        kept = f"step {read(run_dir)['step']}'s is kept" if path.exists() else "there is none"
        raise RuntimeError(
            f"step {step}: the weights are not finite, so no checkpoint was written (the last "
            f"good one: {kept}). Try a lower train.lr or opt.amp.dtype=bfloat16."
        )
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
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
            **run_state,
        }
        _remove_stale_temporaries(run_dir)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # atomic on POSIX
        except (OSError, RuntimeError) as e:
            free = shutil.disk_usage(run_dir).free / 1e9
            raise RuntimeError(
                f"could not write {path} ({e}); {free:.1f} GB free on its disk. The previous "
                "checkpoint is unchanged; free some space or point hydra.run.dir elsewhere."
            ) from e
        finally:
            tmp.unlink(missing_ok=True)
    dist.barrier()
    return path


def read(run_dir: Path) -> dict[str, Any]:
    """Loads the run's checkpoint onto the CPU, accepting only tensors and plain containers."""
    path = run_dir / FILENAME
    if not path.exists():
        raise FileNotFoundError(
            f"there is no checkpoint at {path}: point at the folder of a run that saved one "
            "(train.checkpoint_interval > 0, or a run that reached its end or was stopped)"
        )
    return torch.load(path, map_location="cpu", weights_only=True)


def load_model(run_dir: Path, device: torch.device | str = "cpu") -> tuple[Any, dict[str, Any]]:
    """A trained model from a run folder, rebuilt from its checkpoint alone (the model's saved
    shape, then its weights), and the run's saved config: for sampling, evaluation, export."""
    from model import GPT, GPTConfig

    state = read(run_dir)
    if "model_config" not in state:
        check_shape(state, None)  # explains that the checkpoint is too old
    model = GPT(GPTConfig(**state["model_config"]))
    model.load_state_dict(state["model"])
    return model.to(device), state["config"]


def check_shape(state: dict[str, Any], config: Any) -> None:
    """Refuses a checkpoint whose model shape differs from `config` (a GPTConfig), naming the
    first setting that differs and both values."""
    saved = state.get("model_config")
    if saved is None:
        raise ValueError(
            "this checkpoint was written by an older version of the recipe (it has no "
            "model_config): start a new run"
        )
    for key, value in dataclasses.asdict(config).items():
        if key in saved and saved[key] != value and key != "dropout":
            raise ValueError(
                f"the checkpoint's model has {key}={saved[key]!r}, this run's has {value!r}: "
                f"set model.{key}={saved[key]!r} (or start a new run folder)"
            )


def restore(
    state: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
) -> int:
    """Puts a checkpoint's state back (sharding it as the model is sharded); returns its step.
    The stages may differ from the saved run's: a float16 scaler starts afresh when the run was
    saved without one, and a saved scale is dropped when this run needs none."""
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=StateDictOptions(full_state_dict=True),
    )
    if state["scaler"] and scaler.is_enabled():
        scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return state["step"]


class StopSignal:
    """Turns SIGTERM (cluster preemption) and SIGINT (Ctrl-C) into a request to checkpoint and
    exit at the end of the current step. A second Ctrl-C quits at once, unless it comes within
    `echo_s` of the first: torchrun forwards the signal it receives to its workers, so one Ctrl-C
    in a terminal (which reaches the whole process group) arrives twice."""

    echo_s = 2.0

    def __init__(self) -> None:
        self.requested = False
        self._first: float | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self._first is not None:
            if signum == signal.SIGINT and now - self._first > self.echo_s:
                raise KeyboardInterrupt  # a deliberate second Ctrl-C
            return  # SIGTERM again, or the same Ctrl-C forwarded by torchrun
        self._first = now
        self.requested = True
        name = signal.Signals(signum).name
        print(f"\n[train] {name}: saving a checkpoint after this step, then exiting", flush=True)

    def __enter__(self) -> StopSignal:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
