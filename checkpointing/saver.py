"""Writing checkpoints that survive preemption: everything needed to continue a run exactly,
written atomically, and never from broken weights (weights that are not finite are refused, and
the last good checkpoint stays).

One file, `checkpoint.pt`, written by rank 0 (a single process, DDP): the full, unsharded model
and optimizer state keyed by parameter name; under FSDP (or +opt=pp) DCP's shards in
`checkpoint.dcp/step-<N>/`, each rank writing its own (nothing is gathered on one rank), with
`LATEST` naming the complete one. Both are replaced atomically: a save killed midway leaves the
previous checkpoint readable. `train.async_save`: the state is copied to host memory during the
step and written by a background thread (DCP: its `async_save`).

Besides the weights: the AMP grad scaler, the step, every rank's RNG states, and the run's state
(recipe/runstate.py's `RunState.saved`): the data position (samples consumed, so a resume with
another batch or GPU count continues the same data stream), and what rebuilds and continues the
run without its command line: the resolved config, the model's real shape (`model_config`, also
for a pretrained start), the stages, the wandb run id."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from base.distributed import Distributed
from base.errors import ConfigError, Reported, Unusable
from base.files import refuse_link
from checkpointing.checksums import record_folder, replace_with_checksum
from checkpointing.folder import BEST, FILENAME, HISTORY, META, SHARDED, point
from checkpointing.reader import read
from checkpointing.rotation import (
    keep_if_best,
    link_checkpoint,
    remove_older,
    retire_other_layout,
)
from checkpointing.state_layout import StateLayout, optimizer_options, tied_parameters


def save(
    run_dir: Path,
    dist: Distributed,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    step: int,
    run_state: dict[str, Any],
    layouts: Sequence[StateLayout] = (),
) -> Path:
    """Writes the run's checkpoint (sharded under FSDP, else one file), with `run_state`
    (`RunState.saved`: samples consumed, config, model_config, stages, ...), and returns once
    it is on disk. A collective: every rank must call it. Weights that are not finite are never
    saved: the last good checkpoint stays. (A run keeps several, or saves in the background:
    `Saver`.)"""
    saver = Saver(run_dir, dist, layouts=layouts)
    path = saver.save(model, optimizer, scaler, step, run_state)
    saver.close()
    return path


class Saver:
    """A run's checkpoints: the latest (where `read` looks), the last `keep` of them, the best by
    validation loss (`keep_best`), each written whole before an older one is removed. With
    `async_save`, `save` returns once the state is in host memory and the files are written in
    the background: the next `save` (and `close`, at the run's end) waits for them, and raises
    their failure if they failed. `due` says which steps save: every `every` steps and the last
    (`max_steps`), or a step where the run stops."""

    def __init__(
        self,
        run_dir: Path,
        dist: Distributed,
        *,
        keep: int = 1,
        keep_best: bool = False,
        async_save: bool = False,
        every: int = 0,
        max_steps: int | None = None,
        measured: dict[str, Any] | None = None,
        layouts: Sequence[StateLayout] = (),
    ) -> None:
        self.run_dir, self.dist = run_dir, dist
        self.layouts = layouts  # the selected stages' checkpoint layouts
        self.keep, self.keep_best, self.async_save = keep, keep_best, async_save
        self.measured = measured or {}  # what the val losses are over: keep_best compares alike
        self.every, self.max_steps = every, max_steps  # train.checkpoint_interval (0: none)
        self.held_s = 0.0  # how long the last `save` held the caller (perf.checkpoint_time)
        self._writing: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._group: Any = None  # async DCP's process group, made at its first save
        # Host copies of the state (async), reused from save to save: {size: [storages]}.
        self._buffers: dict[int, list[torch.UntypedStorage]] = {}

    @classmethod
    def for_run(
        cls,
        run_dir: Path,
        dist: Distributed,
        train: DictConfig,
        layouts: Sequence[StateLayout] = (),
    ) -> Saver:
        """The saver that `train` (the config's train.*) asks for: its checkpoint_interval,
        keep_checkpoints, keep_best and async_save; its last step (max_steps) saves too. Its val
        losses are over the first train.eval_sequences validation sequences. `layouts`: the
        selected stages' checkpoint layouts."""
        return cls(
            run_dir, dist, keep=train.keep_checkpoints, keep_best=train.keep_best,
            async_save=train.async_save, every=train.checkpoint_interval,
            max_steps=train.max_steps, measured={"eval_sequences": train.eval_sequences},
            layouts=layouts,
        )  # fmt: skip

    def save(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        step: int,
        run_state: dict[str, Any],
        val_loss: float | None = None,
    ) -> Path:
        """Saves step `step` (`val_loss`: its validation loss, if evaluated at this step: a
        candidate for the best); returns the checkpoint's path. A collective."""
        started = time.perf_counter()
        self.wait()
        run_dir, dist = self.run_dir, self.dist
        _reshard(model)
        if not _weights_finite(model, dist):
            kept = "there is none"
            if (run_dir / FILENAME).exists() or (run_dir / SHARDED / "LATEST").exists():
                kept = f"step {read(run_dir)['step']}'s is kept"
            # The user's settings made these weights: a learning rate that overflows them with
            # finite gradients, or a start (model.pretrained, the data) that was not finite.
            raise ConfigError(
                f"step {step}: the weights are not finite, so no checkpoint was written (the "
                f"last good one: {kept}). Lower train.lr (or use opt.amp.dtype=bfloat16), and "
                "check the data and the weights the run started from (model.pretrained)"
            )
        self._refuse_links(step)
        meta = {"scaler": scaler.state_dict(), "step": step, "rng": dist.gather(_rng_state()),
                **run_state}  # fmt: skip
        if _is_sharded(model) or _pipelined(dist):
            if self.async_save and self._group is None:
                self._group = _background_group() or True
            background = self._group if self.async_save else False
            path, write = _save_sharded(
                run_dir, dist, model, optimizer, step, meta, self.layouts, background
            )
        else:
            path, write = self._save_file(model, optimizer, meta)
        dist.barrier()  # every rank has its state in hand (sync: on disk)

        def finish() -> None:
            write()
            if dist.is_main:
                self._rotate(path, step, val_loss)

        self._run(finish)
        self.held_s = time.perf_counter() - started
        return path

    def _refuse_links(self, step: int) -> None:
        """Refuses, on every rank alike and before anything is written, a save into a folder
        that is a symbolic link (the latest's, the kept steps', the best's): the save would
        write, and its rotation delete, elsewhere. The last good checkpoint stays as it was."""
        name = f"step-{step:08d}"
        roots = [self.run_dir / SHARDED, self.run_dir / HISTORY, self.run_dir / BEST]
        planted = [path for root in roots for path in (root, root / name) if path.is_symlink()]
        if not self.dist.any(bool(planted)):
            return
        for path in planted:
            refuse_link(path)
        raise Unusable(
            f"step {step}: another process found a symbolic link in place of a checkpoint folder "
            f"in {self.run_dir}, so none was written: remove it and resume"
        )

    def due(self, step: int, stopping: bool) -> bool:
        """Whether step `step` saves: every `every` steps and at `max_steps` (unless `every` is
        0), and whenever the run stops early."""
        periodic = self.every > 0 and (step % self.every == 0 or step == self.max_steps)
        return periodic or stopping

    def _save_file(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: dict[str, Any]
    ) -> tuple[Path, Callable[[], None]]:
        """The single file: the full state gathered to rank 0's host memory (async: into
        buffers of its own, so that the next steps may change the weights), and its write."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=not self.async_save)
        model_state, optim_state = get_state_dict(model, optimizer, options=options)
        path = self.run_dir / FILENAME
        if not self.dist.is_main:
            return path, lambda: None
        state = {"model": model_state, "optimizer": optim_state, **meta}
        if self.async_save:
            state = snapshot(state, self._buffers)
        return path, lambda: write_atomically(path, state, checksum=True)

    def _run(self, job: Callable[[], None]) -> None:
        """Runs `job` now, or (async) in a background thread whose failure is kept for `wait`."""
        if not self.async_save:
            job()
            return

        def background() -> None:
            try:
                job()
            except BaseException as e:  # noqa: BLE001 (kept, raised by wait())
                self._failure = e

        # Not a daemon: a run that ends (or fails) midway still finishes writing its checkpoint.
        self._writing = threading.Thread(target=background, name="checkpoint-save")
        self._writing.start()

    def wait(self) -> None:
        """Waits for a background save; raises its failure, if it failed."""
        if self._writing is not None:
            self._writing.join()
            self._writing = None
        failure, self._failure = self._failure, None
        if isinstance(failure, Reported):  # e.g. a full disk: its line, as a save in the loop's
            raise failure
        if failure is not None:
            raise RuntimeError(f"the background checkpoint save failed: {failure}") from failure

    def close(self) -> None:
        """The run's end: the last save is on disk (or its failure raised)."""
        self.wait()

    def _rotate(self, written: Path, step: int, val_loss: float | None) -> None:
        """Once `written` is complete: the other layout's latest goes, the last `keep` stay
        (whichever layout wrote them), and it becomes the best if its validation loss is the
        lowest so far."""
        retire_other_layout(self.run_dir, written)
        steps = [self.run_dir / HISTORY, self.run_dir / SHARDED]  # both layouts' kept steps
        if written.name == FILENAME:
            if self.keep > 1:
                link_checkpoint(written, self.run_dir / HISTORY / f"step-{step:08d}")
            remove_older(steps, self.keep if self.keep > 1 else 0)
        else:
            remove_older(steps, self.keep, latest=written)
        if self.keep_best and val_loss is not None:
            keep_if_best(self.run_dir / BEST, written, step, val_loss, self.measured)


def snapshot(tree: Any, buffers: dict[int, list[torch.UntypedStorage]] | None = None) -> Any:
    """`tree`'s tensors copied into host memory (pinned when they are on a GPU), tensors that
    share storage (tied weights) sharing their copy, as torch.save writes them: the same bytes
    as saving `tree` itself. `buffers` ({storage size: host storage}) are reused when they fit,
    so that a run's saves do not allocate pinned memory each time."""
    copies: dict[tuple[torch.device, int], torch.UntypedStorage] = {}
    free = {size: list(hosts) for size, hosts in (buffers or {}).items()}
    used: dict[int, list[torch.UntypedStorage]] = {}

    def copy(t: torch.Tensor) -> torch.Tensor:
        if type(t) is not torch.Tensor:  # a tensor subclass: its own copy
            return t.detach().to("cpu", copy=True)
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        if key not in copies:
            size = storage.nbytes()
            host = free[size].pop() if free.get(size) else None
            if host is None:
                pin = t.device.type == "cuda"
                host = torch.empty(size, dtype=torch.uint8, pin_memory=pin).untyped_storage()
            used.setdefault(size, []).append(host)
            source = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            torch.empty(0, dtype=torch.uint8).set_(host).copy_(source, non_blocking=True)
            copies[key] = host
        return torch.empty(0, dtype=t.dtype).set_(
            copies[key], t.storage_offset(), t.size(), t.stride()
        )

    def walk(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            return copy(node)
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list | tuple):
            return type(node)(walk(v) for v in node)
        return node

    copied = walk(tree)
    if buffers is not None:
        buffers.clear()
        buffers.update(used)
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the non-blocking copies are done before the step goes on
    return copied


def _save_sharded(
    run_dir: Path,
    dist: Distributed,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    meta: dict[str, Any],
    layouts: Sequence[StateLayout],
    background: Any = False,
) -> tuple[Path, Callable[[], None]]:
    """Every rank writes its shards into `checkpoint.dcp/step-<N>/`; once all have, rank 0 adds
    the metadata and points `LATEST` at it (an atomic rename). Returns the folder and what
    completes the save: `background`, DCP's async_save has copied the state to host memory
    and writes it meanwhile (its collectives in the process group `background`, or True: none),
    and the completion waits for it."""
    root = run_dir / SHARDED
    target = root / f"step-{step:08d}"
    if dist.is_main:
        shutil.rmtree(target, ignore_errors=True)  # a half-written attempt at this step
        root.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    flat = _pipelined(dist)
    model_state, optim_state = get_state_dict(model, optimizer, options=optimizer_options(flat))
    meta = {**meta, "flat_optimizer": flat}  # how restore asks for it back
    tied = tied_parameters(model)  # saved once, under the name they are tied to
    model_state = {k: v for k, v in model_state.items() if k not in tied}
    states: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    for layout in layouts:
        states = layout.saved(states)
    if background:
        group = None if background is True else background
        written = dcp.async_save(states, checkpoint_id=target, process_group=group)
    else:
        dcp.save(states, checkpoint_id=target)

    def finish() -> None:
        if background:
            written.result()  # every rank's shards and the metadata are on disk
        if dist.is_main:
            write_atomically(target / META, meta)
            record_folder(target)
            point(root, target.name)

    return target, finish


def _background_group() -> Any:
    """A gloo group for async_save's collectives, apart from the training's (as DCP advises);
    None in a process without one. A collective: made by every rank."""
    import torch.distributed as torch_dist

    return torch_dist.new_group(backend="gloo") if torch_dist.is_initialized() else None


def _reshard(model: torch.nn.Module) -> None:
    """Puts FSDP's shards back in place. FSDP keeps its root and last unit gathered after a
    forward (backward starts with them); after an evaluation's forward no backward frees them,
    and the parameters would read as whole tensors: the weights checked and the layout chosen
    (sharded or one file) must come from the shards."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


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


def _is_sharded(model: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def _pipelined(dist: Distributed) -> bool:
    """+opt=pp: each rank holds other parameters (its stages), under the full model's names."""
    return dist.parallel.pp_enabled


def write_atomically(path: Path, state: Any, *, checksum: bool = False) -> None:
    """torch.save to `path` through a temporary file renamed over it (atomic on POSIX); on a
    failure the error names the cause and the free space, and `path` is left as it was. With
    `checksum`, its sha256 is saved beside it (`checksums_of(path)`)."""
    _remove_stale_temporaries(path.parent)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        if checksum:
            replace_with_checksum(tmp, path)
        else:
            os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        if isinstance(e.__context__, KeyboardInterrupt):  # torch.save's writer, unwound by Ctrl-C
            raise e.__context__ from None
        free = shutil.disk_usage(path.parent).free / 1e9
        raise Unusable(
            f"could not write {path} ({e}); {free:.1f} GB free on its disk. The previous "
            "checkpoint is unchanged; free some space or point hydra.run.dir elsewhere."
        ) from e
    finally:
        tmp.unlink(missing_ok=True)


def _remove_stale_temporaries(folder: Path) -> None:
    """Deletes `*.tmp-<pid>` files left by processes that were killed while saving."""
    # `*.pt.tmp-<pid>`: write_atomically's; `.*.json.tmp-<pid>`: its checksums' (base/files.py);
    # `checkpoint.tmp-<pid>`: earlier versions' name.
    patterns = ("*.pt.tmp-*", "*.json.tmp-*", f"{Path(FILENAME).stem}.tmp-*")
    for tmp in [path for pattern in patterns for path in folder.glob(pattern)]:
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
