"""Checkpoints that survive preemption: everything needed to continue a run exactly, written
atomically, read back safely, and never from broken weights.

Two layouts, one interface (`save`, `read`, `restore`, `load_model`):
- `checkpoint.pt`, one file written by rank 0 (a single process, DDP): the full, unsharded model
  and optimizer state keyed by parameter name.
- `checkpoint.dcp/` under FSDP: torch.distributed.checkpoint (DCP) shards, each rank writing its
  own (nothing is gathered on one rank), in `step-<N>/`, with `LATEST` naming the complete one.
  DCP reshards on load, so a run resumes on another number of processes, or in one process
  without FSDP; `python -m tools.consolidate_checkpoint` turns it into one `checkpoint.pt`.
Both are replaced atomically: a save killed midway leaves the previous checkpoint readable.
One latest checkpoint at a time: a save that writes one layout removes the other's latest once it
is complete (the other's kept steps stay until rotation removes them); the reader chooses by the
step each records (never by file times) and refuses two of different steps.

What a long run keeps (`Saver`): the last N checkpoints (`train.keep_checkpoints`; older single
files as hard links in `checkpoints/step-<N>/`, older DCP steps left in `checkpoint.dcp/`, the
two counted together after a resume that changed the layout) and the
best by validation loss (`train.keep_best`: `best/step-<N>/`, named by `best/LATEST`, its loss and
step in `best.json`), each a folder that `read` reads like a run's; the latest stays where every
reader looks. Older ones go only once the new one is complete. `train.async_save`: the state is
copied to host memory during the step and written by a background thread (DCP: its `async_save`).

Read safely, whoever wrote the folder: `checkpoint.pt` and `meta.pt` through `weights_only`, the
DCP `.metadata` pickle through an unpickler that knows only the classes DCP's `Metadata` holds,
DCP's non-tensor values as plain data, and `LATEST` only naming a `step-<N>` folder beside it.
Each file's sha256 is saved with it (`checkpoint.pt.sha256.json`; `sha256.json` in a DCP step
folder: {file name: [data/integrity.py's record, ...]}) and checked on every read; a checkpoint
written before that has none and is read unchecked.

Besides the weights: the AMP grad scaler, the step, the data position (samples consumed, so a
resume with another batch or GPU count continues the same data stream), every rank's RNG states,
and what rebuilds and continues the run without its command line: the resolved config, the
model's real shape (`model_config`, also for a pretrained start), the stages, the wandb run id
(the run's state beside the weights is one object, recipe/runstate.py's `RunState`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.tensor import DTensor

from base.distributed import Distributed, launcher_died, log
from base.errors import ConfigError, MissingFile, Reported, Unusable
from base.files import refuse_link, write_text_atomically
from data import integrity

FILENAME = "checkpoint.pt"
SHARDED = "checkpoint.dcp"  # a folder: step-<N>/ (DCP shards + meta.pt + sha256.json) and LATEST
META = "meta.pt"
CHECKSUMS = "sha256.json"  # in a step folder: {file name: [record]} of every file in it
STEP_FOLDER = re.compile(r"step-\d+")  # what LATEST may name
HISTORY = "checkpoints"  # keep_checkpoints > 1, single file: step-<N>/ each, hard links
BEST = "best"  # keep_best: step-<N>/ (a run-folder-like checkpoint) + LATEST, best.json in it
BEST_RECORD = "best.json"  # {"step": N, "val_loss": x, "measured": {"eval_sequences": n}}


def _is_sharded(model: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def _pipelined(dist: Distributed) -> bool:
    """+opt=pp: each rank holds other parameters (its stages), under the full model's names."""
    return dist.parallel.pp_enabled


def _optimizer_options(flat: bool) -> StateDictOptions:
    """The optimizer state keyed per parameter (`state.<name>.exp_avg`, `param_groups.<name>.lr`)
    when `flat`: pipeline ranks hold different parameters, and DCP would keep one rank's copy of
    an unflattened `param_groups` list (it takes equal keys for replicas)."""
    return StateDictOptions(flatten_optimizer_state_dict=flat)


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
            _replace_with_checksum(tmp, path)
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


# ---- integrity: each checkpoint file's sha256, saved with it, checked on every read


def checksums_of(path: Path) -> Path:
    """The checksum file of a single-file checkpoint: `checkpoint.pt.sha256.json`."""
    return path.with_name(f"{path.name}.sha256.json")


def _write_json_atomically(path: Path, content: Any) -> None:
    write_text_atomically(path, json.dumps(content, indent=1) + "\n")


def _replace_with_checksum(tmp: Path, path: Path) -> None:
    """Renames `tmp` over `path` and records its checksum. Two renames cannot be one, so until
    the file's is done the checksums accept the old file's record too: a kill at any moment
    leaves a file that its checksums accept."""
    sums, new = checksums_of(path), integrity.file_record(tmp)
    old = []
    if path.exists():
        old = _listed(sums).get(path.name, [])[:1] or [integrity.file_record(path)]
    _write_json_atomically(sums, {path.name: [new, *old]})
    os.replace(tmp, path)
    _write_json_atomically(sums, {path.name: [new]})


def _record_folder(folder: Path) -> None:
    """Writes `sha256.json` in a DCP step folder: the checksum of every file in it."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != CHECKSUMS)
    _write_json_atomically(
        folder / CHECKSUMS, {name: [integrity.file_record(folder / name)] for name in names}
    )


def _plain_name(name: Any) -> bool:
    """A file name with no folder in it: what a checkpoint's own files are called."""
    return isinstance(name, str) and name not in ("", ".", "..") and not {"/", "\\"} & set(name)


def _listed(sums: Path) -> dict[str, list[dict[str, Any]]]:
    """A checksum file's {file name: [records]} ({} if there is none); refused if malformed."""
    if not sums.is_file():
        return {}
    try:
        listed = json.loads(sums.read_text())
    except ValueError as e:  # not JSON (a UnicodeDecodeError is one too)
        raise _damaged(sums, f"it is not JSON: {e}") from None
    if not isinstance(listed, dict) or not all(
        _plain_name(name) and isinstance(records, list) for name, records in listed.items()
    ):
        raise _damaged(sums, "it is not a checksum file this recipe wrote")
    return listed


def _damaged(path: Path, why: str) -> Unusable:
    return Unusable(
        f"{path} is damaged ({why}): the checkpoint cannot be used; copy the run folder again "
        "if it came from elsewhere, else resume from a backup or start a new run folder"
    )


def check_checksums(sums: Path, *, full: bool = False) -> None:
    """Refuses a checkpoint file that differs from each record `sums` lists for it, naming the
    file. Files up to 512 MiB are hashed whole, larger ones by sampled blocks unless `full`
    (data/integrity.py). No `sums`: a checkpoint from before checksums, read unchecked."""
    for name, records in _listed(sums).items():
        path = sums.parent / name
        if not path.is_file():
            raise _damaged(path, f"it is missing, and {sums.name} lists it")
        try:
            ok = any(integrity.matches(path, record, full=full) for record in records)
        except (KeyError, TypeError):  # a record without its fields
            raise _damaged(sums, f"its record of {name} is malformed") from None
        if not ok:
            raise _damaged(path, "its sha256 differs from the one saved with it")


# ---- DCP's files, read without running anything they could ask for

# Every class a DCP `Metadata` pickle refers to (torch/distributed/checkpoint/metadata.py and
# filesystem.py), and torch's dtypes: a `.metadata` that names anything else is refused.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # torch.strided, pickled by its name
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},  # checkpoint_id
    "pathlib._local": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}  # fmt: skip


class _ForeignClass(Exception):
    """A pickle asked for a class that DCP's metadata never holds."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if not dtype and name not in _METADATA_CLASSES.get(module, ()):
            raise _ForeignClass(f"{module}.{name}")
        return super().find_class(module, name)


def read_metadata(path: Path) -> Metadata:
    """A DCP `.metadata` file, refused in one line unless it holds only DCP's metadata: DCP's
    own reader is a plain pickle.load, which runs whatever a crafted file asks for."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _ForeignClass as e:
        raise Unusable(
            f"{path} is not a checkpoint this recipe wrote (it would load the class {e}): "
            "refusing to read it"
        ) from None
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 (any failure of a damaged pickle)
        raise _damaged(path, f"it cannot be unpickled: {e!r}") from None
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(metadata, Metadata) or not isinstance(storage, dict):
        raise Unusable(f"{path} holds no DCP metadata: refusing to read it")
    for info in storage.values():  # shards are files beside it, not paths elsewhere
        if not isinstance(info, _StorageInfo) or not _plain_name(info.relative_path):
            raise Unusable(
                f"{path} points outside its folder ({getattr(info, 'relative_path', info)!r}): "
                "refusing to read it"
            )
    return metadata


class _Reader(FileSystemReader):
    """DCP's file reader, with its metadata read by `read_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as FileSystemReader does
        return metadata


class _PlainValues:
    """A DCP load planner whose non-tensor values (the optimizer's settings) are unpickled as
    plain data only: DCP's own planners use torch.load(weights_only=False) for them."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        try:
            torch.load(value, weights_only=True)  # raises on anything but plain data
        except pickle.UnpicklingError as e:
            first = str(e).strip().splitlines()[-1]
            raise Unusable(
                f"its value {read_item.dest_index.fqn} is not plain data ({first}): refusing "
                "to read it"
            ) from None
        value.seek(0)
        super().load_bytes(read_item, value)  # type: ignore[misc]  # a mixin before DCP's planner


class _Planner(_PlainValues, DefaultLoadPlanner):
    pass


class _WholePlanner(_PlainValues, _EmptyStateDictLoadPlanner):
    """Loads everything the checkpoint holds, unsharded (as torch's dcp_to_torch_save)."""


def _dcp_load(states: dict[str, Any], folder: Path, *, whole: bool = False, **kwargs: Any) -> None:
    """DCP's load of `states` from `folder` in place (everything in it, `whole`), through the
    reader and planners above; a failure is one line naming the folder."""
    reader = _Reader(folder)
    try:
        if whole:  # no public API fills an empty dict: the one dcp_to_torch_save uses
            _load_state_dict(states, storage_reader=reader, planner=_WholePlanner(), no_dist=True)
        else:
            dcp.load(states, storage_reader=reader, planner=_Planner(), **kwargs)
    except CheckpointException as e:  # a BaseException, wrapping each rank's failure
        failure = next(iter(e.failures.values()), None)
        cause = failure[0] if isinstance(failure, tuple) else e
        raise Unusable(f"cannot read the checkpoint in {folder}: {cause}") from None


def _tied(model: torch.nn.Module) -> dict[str, str]:
    """Parameters that are another one (GPT's lm_head.weight is transformer.wte.weight):
    {name: the name it is saved under}. DCP would write each name's copy; one is saved."""
    first: dict[int, str] = {}
    tied = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(param), name) != name:
            tied[name] = first[id(param)]
    return tied


class StateLayout(Protocol):
    """How a stage's parameters are laid out in a checkpoint when DCP or `set_state_dict` cannot
    take them as they are (a stage's `checkpoint_layout`: +opt=tp's strided QKV, opt/tp.py). The
    trainer hands the selected stages' layouts to `Saver` and `restore`."""

    def saved(self, tree: Any) -> Any:
        """`tree` ({"model": ..., "optimizer": ...}) as DCP saves and loads it."""

    def own(self, tree: Any, like: Any) -> Any:
        """`tree`, loaded as `saved` laid it out, in the layout of `like`, the model's own."""

    def restore_whole(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        model_state: dict[str, Any],
        optim_state: dict[str, Any] | None,
    ) -> Callable[[], None]:
        """Called before a whole (one-file) checkpoint's state is set into `model` and
        `optimizer`: what puts the stage's parameters in place once it is."""


def _load_sharded(
    folder: Path,
    model: torch.nn.Module,
    states: dict[str, Any],
    layouts: Sequence[StateLayout] = (),
    **kwargs: Any,
) -> dict[str, Any]:
    """Fills `states` ({"model": its state dict, ...}) from the DCP checkpoint in `folder`, the
    tied parameters read once and tied again, the stages' `layouts` undone; returns `states`."""
    tied = {k: v for k, v in _tied(model).items() if k in states["model"]}
    states["model"] = {k: v for k, v in states["model"].items() if k not in tied}
    own = states
    for layout in layouts:
        states = layout.saved(states)
    _dcp_load(states, folder, **kwargs)
    for layout in reversed(layouts):
        states = layout.own(states, own)
    for name, saved_as in tied.items():
        states["model"][name] = states["model"][saved_as]
    return states


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
        _retire_other_layout(self.run_dir, written)
        steps = [self.run_dir / HISTORY, self.run_dir / SHARDED]  # both layouts' kept steps
        if written.name == FILENAME:
            if self.keep > 1:
                _link_checkpoint(written, self.run_dir / HISTORY / f"step-{step:08d}")
            _remove_older(steps, self.keep if self.keep > 1 else 0)
        else:
            _remove_older(steps, self.keep, latest=written)
        if self.keep_best and val_loss is not None:
            _keep_if_best(self.run_dir / BEST, written, step, val_loss, self.measured)


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


def _retire_other_layout(run_dir: Path, written: Path) -> None:
    """Once a checkpoint is complete, the other layout's latest (left by the run before it added
    or dropped FSDP) goes, so that the folder holds one latest checkpoint. Its kept steps stay,
    read like this layout's (`checkpoint=<step>`), until rotation removes them."""
    if written.name == FILENAME:
        stale = run_dir / SHARDED / "LATEST"
        if not stale.exists():
            return
        stale.unlink()
    else:
        stale = run_dir / FILENAME
        if not stale.exists():
            return
        stale.unlink()
        checksums_of(stale).unlink(missing_ok=True)
    kept = FILENAME if written.name == FILENAME else SHARDED
    log(
        f"[checkpoint] removed {stale}, an older layout's latest: this run saves {kept}; the "
        "older layout's kept steps stay until train.keep_checkpoints rotates them out"
    )


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
    model_state, optim_state = get_state_dict(model, optimizer, options=_optimizer_options(flat))
    meta = {**meta, "flat_optimizer": flat}  # how restore asks for it back
    tied = _tied(model)  # saved once, under the name they are tied to
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
            _record_folder(target)
            _point(root, target.name)

    return target, finish


def _background_group() -> Any:
    """A gloo group for async_save's collectives, apart from the training's (as DCP advises);
    None in a process without one. A collective: made by every rank."""
    import torch.distributed as torch_dist

    return torch_dist.new_group(backend="gloo") if torch_dist.is_initialized() else None


def _point(root: Path, name: str) -> None:
    """Writes `root/LATEST` naming `name` (an atomic rename)."""
    write_text_atomically(root / "LATEST", name)


def _step_of(folder: Path) -> int:
    return int(folder.name.split("-", 1)[1])


def _remove_older(roots: list[Path], keep: int, latest: Path | None = None) -> None:
    """Removes all but the newest `keep` step-<N> folders in `roots` together (never `latest`);
    a root left with no step folder and no LATEST (no checkpoint any more) goes too."""
    folders = sorted((p for root in roots for p in root.glob("step-*")
                      if STEP_FOLDER.fullmatch(p.name)), key=_step_of)  # fmt: skip
    kept = set(folders[max(0, len(folders) - keep) :] if keep else []) | {latest}
    for old in folders:
        if old not in kept:
            shutil.rmtree(old, ignore_errors=True)
    for root in roots:
        emptied = not any(root.glob("step-*")) and not (root / "LATEST").exists()
        if root.is_dir() and not root.is_symlink() and emptied:
            shutil.rmtree(root)


def _link(source: Path, target: Path) -> None:
    """`target` the same file as `source`: a hard link (no space, no time), else a copy."""
    try:
        os.link(source, target)
    except OSError:  # a file system without hard links
        shutil.copy2(source, target)


def _link_checkpoint(written: Path, folder: Path) -> None:
    """`folder` a run-folder-like copy of the checkpoint `written` (a `checkpoint.pt` or a DCP
    step folder) that `read` reads, made beside it and renamed into place when complete."""
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if written.name == FILENAME:
        tmp.mkdir(parents=True)
        for path in (written, checksums_of(written)):
            _link(path, tmp / path.name)
    else:
        (tmp / SHARDED / written.name).mkdir(parents=True)
        for path in written.iterdir():
            _link(path, tmp / SHARDED / written.name / path.name)
        _point(tmp / SHARDED, written.name)
    shutil.rmtree(folder, ignore_errors=True)  # an earlier attempt at this step
    os.replace(tmp, folder)


def best_record(run_dir: Path) -> dict[str, Any] | None:
    """The best checkpoint's {"step", "val_loss", "measured"} (train.keep_best), or None if there
    is none."""
    if not (run_dir / BEST / "LATEST").exists():
        return None
    return json.loads((_latest_folder(run_dir / BEST) / BEST_RECORD).read_text())


def _keep_if_best(
    root: Path, written: Path, step: int, val_loss: float, measured: dict[str, Any]
) -> None:
    """Makes `written` the best checkpoint (`root/step-<N>/`, named by `root/LATEST`) if its
    validation loss is lower than the best so far, measured alike (a resume may change
    train.eval_sequences: losses over other sequences do not compare, and the comparison
    restarts, saying so); the previous best goes once it is."""
    best = best_record(root.parent)
    if best is not None and best.get("measured") != measured:
        log(
            f"[checkpoint] the best so far (step {best['step']}, val/loss {best['val_loss']:.4f}) "
            f"was measured with {best.get('measured') or 'settings it did not record'}, this "
            f"run's losses with {measured}: the comparison restarts from step {step}"
        )
        best = None
    if best is not None and best["val_loss"] <= val_loss:
        return
    folder = root / f"step-{step:08d}"
    _link_checkpoint(written, folder)
    record = {"step": step, "val_loss": val_loss, "measured": measured}
    _write_json_atomically(folder / BEST_RECORD, record)
    _point(root, folder.name)
    _remove_older([root], 0, latest=folder)
    log(f"[checkpoint] step {step} is the best so far (val/loss {val_loss:.4f}): {folder}")


def read(run_dir: Path, *, verify: bool = False, which: str | int = "latest") -> dict[str, Any]:
    """The run's checkpoint onto the CPU, accepting only tensors and plain containers: the whole
    state of a `checkpoint.pt`, or a sharded checkpoint's metadata plus `sharded`, its folder
    (the weights stay on disk until `restore` or `load_model` reads them into place). Its files
    are checked against their checksums first (`verify`: every file hashed whole). Both layouts
    at the same step (a consolidated run): the one file; at different steps: refused.
    `which`: the latest, `best` (train.keep_best) or a step the run keeps (an int or step-<N>)."""
    if which != "latest":
        return _read_kept(run_dir, which, verify)
    path, latest = run_dir / FILENAME, run_dir / SHARDED / "LATEST"
    found = []
    if path.exists():
        found.append(_read_file(path, verify))
    if latest.exists():
        found.append(_read_sharded(run_dir, verify))
    if not found:
        raise MissingFile(
            f"there is no checkpoint at {path}: point at the folder of a run that saved one "
            "(train.checkpoint_interval > 0, or a run that reached its end or was stopped)"
        )
    if len(found) == 2 and found[0]["step"] != found[1]["step"]:
        steps = {path: found[0]["step"], run_dir / SHARDED: found[1]["step"]}
        older = min(steps, key=steps.__getitem__)
        raise Unusable(
            f"{run_dir} holds two checkpoints, {FILENAME} at step {found[0]['step']} and "
            f"{SHARDED}/ at step {found[1]['step']}: remove the stale one (the older is "
            f"{older}) and run again"
        )
    return found[0]


def _read_file(path: Path, verify: bool) -> dict[str, Any]:
    check_checksums(checksums_of(path), full=verify)
    return torch.load(path, map_location="cpu", weights_only=True)


def _read_kept(run_dir: Path, which: str | int, verify: bool) -> dict[str, Any]:
    """The best checkpoint, or the one of a step that the run keeps (train.keep_checkpoints)."""
    if which == "best":
        if not (run_dir / BEST / "LATEST").exists():
            raise MissingFile(
                f"checkpoint=best: {run_dir} keeps no best checkpoint (a run with "
                "train.keep_best=true does): use checkpoint=latest or a step"
            )
        return read(_latest_folder(run_dir / BEST), verify=verify)
    name = str(which) if str(which).startswith("step-") else f"step-{which}"
    if not STEP_FOLDER.fullmatch(name):
        raise ConfigError(f"checkpoint={which}: choose latest, best, or a step number")
    name = f"step-{_step_of(Path(name)):08d}"
    if (run_dir / HISTORY / name).is_dir():
        return read(run_dir / HISTORY / name, verify=verify)
    if _complete_step(run_dir / SHARDED / name):
        return _read_step_folder(run_dir / SHARDED / name, verify)
    state = read(run_dir, verify=verify)
    if state["step"] == _step_of(Path(name)):
        return state
    folders = [*run_dir.glob(f"{HISTORY}/step-*"), *run_dir.glob(f"{SHARDED}/step-*")]
    kept = sorted(
        {_step_of(p) for p in folders if STEP_FOLDER.fullmatch(p.name) and _complete_step(p)}
        | {state["step"]}
    )
    raise MissingFile(
        f"checkpoint={which}: {run_dir} keeps no checkpoint of that step; it keeps steps "
        f"{', '.join(map(str, kept))}"
    )


def _complete_step(folder: Path) -> bool:
    """Whether a kept step folder was written whole: a DCP step's `meta.pt` is written last,
    after every shard (a save killed before it leaves a folder that is no checkpoint);
    `checkpoints/` folders are renamed into place complete."""
    return folder.is_dir() and (folder.parent.name != SHARDED or (folder / META).is_file())


def _read_sharded(run_dir: Path, verify: bool) -> dict[str, Any]:
    return _read_step_folder(_latest_folder(run_dir / SHARDED), verify)


def _read_step_folder(folder: Path, verify: bool) -> dict[str, Any]:
    check_checksums(folder / CHECKSUMS, full=verify)
    read_metadata(folder / ".metadata")  # refused here in one line, before DCP is handed it
    state = torch.load(folder / META, map_location="cpu", weights_only=True)
    return {**state, "sharded": folder}


def _latest_folder(root: Path) -> Path:
    """The step folder `LATEST` names: only a `step-<N>` folder in `root` itself, so that a
    copied or crafted `LATEST` cannot lead elsewhere."""
    name = (root / "LATEST").read_text().strip()
    folder = root / name
    if not STEP_FOLDER.fullmatch(name) or folder.is_symlink():
        raise Unusable(
            f"{root / 'LATEST'} names {name!r}, not a step-<N> folder in {root}: refusing to "
            "follow it (a checkpoint this recipe wrote names its own step folder)"
        )
    if not folder.is_dir():
        raise _damaged(folder, f"it is missing, and {root / 'LATEST'} names it")
    return folder


def load_model(
    run_dir: Path,
    device: torch.device | str = "cpu",
    *,
    verify: bool = False,
    which: str | int = "latest",
) -> tuple[Any, dict[str, Any]]:
    """A trained model from a run folder, rebuilt from its checkpoint alone (the model's saved
    shape, then its weights; a sharded checkpoint is read whole in this one process), and the
    run's saved config: for sampling, evaluation, export. `which`: as `read`'s."""
    from model import GPT, GPTConfig

    state = read(run_dir, verify=verify, which=which)
    check_shape(state, None)
    model = GPT(GPTConfig(**state["model_config"]))
    if "sharded" in state:
        weights = _load_sharded(
            state["sharded"], model, {"model": model.state_dict()}, no_dist=True
        )
        model.load_state_dict(weights["model"])
    else:
        model.load_state_dict(state["model"])
    return model.to(device), state["config"]


def unsharded(state: dict[str, Any]) -> dict[str, Any]:
    """A sharded checkpoint's (`read`'s state) model and optimizer state, whole in this
    process, as `checkpoint.pt` holds them (tied parameters under each name)."""
    from model import GPT, GPTConfig

    check_shape(state, None)
    whole: dict[str, Any] = {}
    _dcp_load(whole, state["sharded"], whole=True)
    with torch.device("meta"):  # only the names of the tied parameters
        tied = _tied(GPT(GPTConfig(**state["model_config"])))
    for name, saved_as in tied.items():
        whole["model"].setdefault(name, whole["model"][saved_as])
    if state.get("flat_optimizer") and "optimizer" in whole:
        whole["optimizer"] = _unflattened(whole["optimizer"], skip=set(tied))
    return whole


def _unflattened(flat: dict[str, Any], skip: set[str]) -> dict[str, Any]:
    """A flattened optimizer state (`state.<name>.<key>`, `param_groups.<name>.<key>`: +opt=pp)
    as `checkpoint.pt` holds it: {"state": {name: {key: value}}, "param_groups": [...]}, one
    group per distinct setting, in the order of their first parameter. `skip`: the pipeline's
    copies of tied weights, whose state is the weight's."""
    nested: dict[str, dict[str, dict[str, Any]]] = {"state": {}, "param_groups": {}}
    for flat_key, value in flat.items():
        part, rest = flat_key.split(".", 1)
        name, key = rest.rsplit(".", 1)
        if name not in skip:
            nested[part].setdefault(name, {})[key] = value
    groups: list[dict[str, Any]] = []
    for name, settings in nested["param_groups"].items():
        group = next((g for g in groups if _settings(g) == settings), None)
        if group is None:
            group = {**settings, "params": []}
            groups.append(group)
        group["params"].append(name)
    return {"state": nested["state"], "param_groups": groups}


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def check_shape(state: dict[str, Any], config: Any) -> None:
    """Refuses a checkpoint whose model shape differs from `config` (a GPTConfig; None: only
    checks that the checkpoint records its shape), naming the first setting that differs."""
    saved = state.get("model_config")
    if saved is None:
        raise ConfigError(
            "this checkpoint was written by an older version of the recipe (it has no "
            "model_config): start a new run"
        )
    for key, value in (dataclasses.asdict(config) if config else {}).items():
        if key in saved and saved[key] != value and key != "dropout":
            raise ConfigError(
                f"the checkpoint's model has {key}={saved[key]!r}, this run's has {value!r}: "
                f"set model.{key}={saved[key]!r} (or start a new run folder)"
            )


def restore(
    state: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    rank: int = 0,
    layouts: Sequence[StateLayout] = (),
) -> int:
    """Puts a checkpoint's state back, sharded as the model now is (a sharded checkpoint is
    resharded by DCP: another process count, or one process); returns its step. The stages may
    differ from the saved run's: a float16 scaler starts afresh when the run was saved without
    one, and a saved scale is dropped when this run needs none; the optimizer's state starts
    afresh too when the optimizer changed (+opt=lowbit added or removed, its bits changed).
    Each rank takes its own saved RNG states (rank modulo the saved ranks, when there are now
    more)."""
    same_optimizer = _same_optimizer(state, optimizer)
    if "sharded" in state:
        options = _optimizer_options(state.get("flat_optimizer", False))
        loaded: dict[str, Any] = {"model": get_model_state_dict(model)}
        if same_optimizer:
            loaded["optimizer"] = get_optimizer_state_dict(model, optimizer, options=options)
        loaded = _load_sharded(state["sharded"], model, loaded, layouts)
        _set_state(model, optimizer, loaded["model"], loaded.get("optimizer"), options=options)
    else:
        optim_state = state["optimizer"] if same_optimizer else None
        full = StateDictOptions(full_state_dict=True)
        # Each layout reads what it needs before set_state_dict changes the state dicts.
        finish = [
            layout.restore_whole(model, optimizer, state["model"], optim_state)
            for layout in layouts
        ]
        _set_state(model, optimizer, state["model"], optim_state, options=full)
        for done in finish:
            done()
    if state["scaler"] and scaler.is_enabled():
        scaler.load_state_dict(state["scaler"])
    rng = state["rng"][rank % len(state["rng"])]
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return state["step"]


def _same_optimizer(state: dict[str, Any], optimizer: torch.optim.Optimizer) -> bool:
    """Whether the checkpoint's optimizer state is this optimizer's kind (AdamW, torchao's
    AdamW8bit or AdamW4bit): another's state cannot be loaded into it, so it starts afresh,
    saying so. A checkpoint that does not record it (older versions) is taken as the same."""
    now = type(optimizer).__name__
    saved = state.get("optimizer_class", now)
    if saved != now:
        log(
            f"[resume] the checkpoint's optimizer state is {saved}'s, this run steps with {now}: "
            f"{now}'s state starts afresh (the weights, step and data position are restored)"
        )
    return saved == now


def _set_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: dict[str, Any],
    optim_state: dict[str, Any] | None,
    options: StateDictOptions | None = None,
) -> None:
    """Loads the weights, and the optimizer state unless it is None (another optimizer's)."""
    if optim_state is None:
        set_model_state_dict(model, model_state, options=options)
    else:
        set_state_dict(
            model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
            options=options,
        )  # fmt: skip


class StopSignal:
    """Turns SIGTERM (cluster preemption, or the kernel's word that the torchrun agent died) and
    SIGINT (Ctrl-C) into a request to checkpoint and exit at the end of the current step. A
    second Ctrl-C quits at once, unless it comes within `echo_s` of the first: torchrun forwards
    the signal it receives to its workers, so one Ctrl-C in a terminal (which reaches the whole
    process group) arrives twice."""

    echo_s = 2.0

    def __init__(self) -> None:
        self.requested = False
        self.signal: str | None = None  # the name of the signal that requested the stop
        self._first: float | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self._first is not None:
            if signum == signal.SIGINT and now - self._first > self.echo_s:
                raise KeyboardInterrupt(  # a deliberate second Ctrl-C
                    "a second Ctrl-C: quit without waiting for the checkpoint; the last one "
                    "completed is kept"
                )
            return  # SIGTERM again, or the same Ctrl-C forwarded by torchrun
        self._first = now
        self.requested = True
        name = self.signal = signal.Signals(signum).name
        # The kernel's SIGTERM when the torchrun agent died (distributed.die_with_launcher): no
        # launcher waits for this trainer any more, and the user should know why it stopped.
        died = signum == signal.SIGTERM and launcher_died()  # the kernel's signal is SIGTERM
        why = " (the torchrun agent that launched this trainer died)" if died else ""
        print(f"\n[train] {name}{why}: saving a checkpoint after this step, then exiting",
              flush=True)  # fmt: skip

    def __enter__(self) -> StopSignal:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
