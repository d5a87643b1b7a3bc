"""Checkpoints that survive preemption: everything needed to continue a run exactly, written
atomically, read back safely, and never from broken weights.

Two layouts, one interface (`save`, `read`, `restore`, `load_model`):
- `checkpoint.pt`, one file written by rank 0 (a single process, DDP): the full, unsharded model
  and optimizer state keyed by parameter name.
- `checkpoint.dcp/` under FSDP: torch.distributed.checkpoint (DCP) shards, each rank writing its
  own (nothing is gathered on one rank), in `step-<N>/`, with `LATEST` naming the complete one.
  DCP reshards on load, so a run resumes on another number of processes, or in one process
  without FSDP; `scripts/consolidate_checkpoint.py` turns it into one `checkpoint.pt`.
Both are replaced atomically: a save killed midway leaves the previous checkpoint readable.

Besides the weights: the AMP grad scaler, the step, the data position (samples consumed, so a
resume with another batch or GPU count continues the same data stream), every rank's RNG states,
and what rebuilds and continues the run without its command line: the resolved config, the
model's real shape (`model_config`, also for a pretrained start), the stages, the wandb run id.
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
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from recipe.distributed import Distributed

FILENAME = "checkpoint.pt"
SHARDED = "checkpoint.dcp"  # a folder: step-<N>/ (DCP shards + meta.pt) and LATEST
META = "meta.pt"


def _is_sharded(model: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def _weights_finite(model: torch.nn.Module, dist: Distributed) -> bool:
    """True on every rank if every rank's weights (or shards) are finite."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    # One sync, not one each; the flags gathered on the run's device, since +opt=offload keeps
    # some weights in host memory and others (those FSDP has just gathered) on the GPU.
    finite = torch.stack([torch.isfinite(t).all().to(dist.device) for t in local]).all()
    return not dist.any(not finite.item())


def _rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def _remove_stale_temporaries(folder: Path) -> None:
    """Deletes `*.tmp-<pid>` files left by processes that were killed while saving."""
    # `*.pt.tmp-<pid>`: write_atomically's; `checkpoint.tmp-<pid>`: earlier versions' name.
    for tmp in [*folder.glob("*.pt.tmp-*"), *folder.glob(f"{Path(FILENAME).stem}.tmp-*")]:
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


def write_atomically(path: Path, state: Any) -> None:
    """torch.save to `path` through a temporary file renamed over it (atomic on POSIX); on a
    failure the error names the cause and the free space, and `path` is left as it was."""
    _remove_stale_temporaries(path.parent)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        free = shutil.disk_usage(path.parent).free / 1e9
        raise RuntimeError(
            f"could not write {path} ({e}); {free:.1f} GB free on its disk. The previous "
            "checkpoint is unchanged; free some space or point hydra.run.dir elsewhere."
        ) from e
    finally:
        tmp.unlink(missing_ok=True)


def save(
    run_dir: Path,
    dist: Distributed,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    step: int,
    run_state: dict[str, Any],
) -> Path:
    """Writes the run's checkpoint (sharded under FSDP, else one file), with `run_state`
    (samples consumed, config, model_config, stages, wandb_id). A collective: every rank must
    call it. Weights that are not finite are never saved: the last good checkpoint stays."""
    if not _weights_finite(model, dist):
        kept = "there is none"
        if (run_dir / FILENAME).exists() or (run_dir / SHARDED / "LATEST").exists():
            kept = f"step {read(run_dir)['step']}'s is kept"
        raise RuntimeError(
            f"step {step}: the weights are not finite, so no checkpoint was written (the last "
            f"good one: {kept}). Try a lower train.lr or opt.amp.dtype=bfloat16."
        )
    meta = {"scaler": scaler.state_dict(), "step": step, "rng": dist.gather(_rng_state()),
            **run_state}  # fmt: skip
    if _is_sharded(model):
        path = _save_sharded(run_dir, dist, model, optimizer, step, meta)
    else:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, optim_state = get_state_dict(model, optimizer, options=options)
        path = run_dir / FILENAME
        if dist.is_main:
            write_atomically(path, {"model": model_state, "optimizer": optim_state, **meta})
    dist.barrier()
    return path


def _save_sharded(
    run_dir: Path,
    dist: Distributed,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    meta: dict[str, Any],
) -> Path:
    """Every rank writes its shards into `checkpoint.dcp/step-<N>/`; once all have, rank 0 adds
    the metadata and points `LATEST` at it (an atomic rename), then removes older steps."""
    root = run_dir / SHARDED
    target = root / f"step-{step:08d}"
    if dist.is_main:
        shutil.rmtree(target, ignore_errors=True)  # a half-written attempt at this step
        root.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=target)
    dist.barrier()  # every shard is on disk
    if dist.is_main:
        write_atomically(target / META, meta)
        latest = root / "LATEST"
        tmp = root / f"LATEST.tmp-{os.getpid()}"
        tmp.write_text(target.name)
        os.replace(tmp, latest)
        for old in root.glob("step-*"):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
    return target


def read(run_dir: Path) -> dict[str, Any]:
    """The run's checkpoint onto the CPU, accepting only tensors and plain containers: the whole
    state of a `checkpoint.pt`, or a sharded checkpoint's metadata plus `sharded`, its folder
    (the weights stay on disk until `restore` or `load_model` reads them into place)."""
    path, latest = run_dir / FILENAME, run_dir / SHARDED / "LATEST"
    if latest.exists() and (not path.exists() or path.stat().st_mtime < latest.stat().st_mtime):
        folder = run_dir / SHARDED / latest.read_text().strip()
        state = torch.load(folder / META, map_location="cpu", weights_only=True)
        return {**state, "sharded": folder}
    if not path.exists():
        raise FileNotFoundError(
            f"there is no checkpoint at {path}: point at the folder of a run that saved one "
            "(train.checkpoint_interval > 0, or a run that reached its end or was stopped)"
        )
    return torch.load(path, map_location="cpu", weights_only=True)


def load_model(run_dir: Path, device: torch.device | str = "cpu") -> tuple[Any, dict[str, Any]]:
    """A trained model from a run folder, rebuilt from its checkpoint alone (the model's saved
    shape, then its weights; a sharded checkpoint is read whole in this one process), and the
    run's saved config: for sampling, evaluation, export."""
    from model import GPT, GPTConfig

    state = read(run_dir)
    check_shape(state, None)
    model = GPT(GPTConfig(**state["model_config"]))
    if "sharded" in state:
        weights = {"model": model.state_dict()}
        dcp.load(weights, checkpoint_id=state["sharded"], no_dist=True)
        model.load_state_dict(weights["model"])
    else:
        model.load_state_dict(state["model"])
    return model.to(device), state["config"]


def check_shape(state: dict[str, Any], config: Any) -> None:
    """Refuses a checkpoint whose model shape differs from `config` (a GPTConfig; None: only
    checks that the checkpoint records its shape), naming the first setting that differs."""
    saved = state.get("model_config")
    if saved is None:
        raise ValueError(
            "this checkpoint was written by an older version of the recipe (it has no "
            "model_config): start a new run"
        )
    for key, value in (dataclasses.asdict(config) if config else {}).items():
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
    rank: int = 0,
) -> int:
    """Puts a checkpoint's state back, sharded as the model now is (a sharded checkpoint is
    resharded by DCP: another process count, or one process); returns its step. The stages may
    differ from the saved run's: a float16 scaler starts afresh when the run was saved without
    one, and a saved scale is dropped when this run needs none. Each rank takes its own saved
    RNG states (rank modulo the saved ranks, when there are now more)."""
    if "sharded" in state:
        model_state, optim_state = get_state_dict(model, optimizer)
        loaded: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
        dcp.load(loaded, checkpoint_id=state["sharded"])
        set_state_dict(
            model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"]
        )
    else:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=StateDictOptions(full_state_dict=True),
        )
    if state["scaler"] and scaler.is_enabled():
        scaler.load_state_dict(state["scaler"])
    rng = state["rng"][rank % len(state["rng"])]
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
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
