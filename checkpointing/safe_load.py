"""DCP's files, read without running anything they could ask for. DCP's own reader unpickles
the `.metadata` file and the non-tensor values (the optimizer's settings) with plain pickle,
which runs whatever a crafted file asks for: here the `.metadata` pickle goes through an
unpickler that knows only the classes DCP's `Metadata` holds, its shards must be files beside
it, and the non-tensor values are unpickled as plain data only (`torch.load(weights_only=True)`).
A file that asks for more is refused in one line naming it."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from base.errors import Unusable
from checkpointing.checksums import damaged, plain_name

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
        raise damaged(path, f"it cannot be unpickled: {e!r}") from None
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(metadata, Metadata) or not isinstance(storage, dict):
        raise Unusable(f"{path} holds no DCP metadata: refusing to read it")
    for info in storage.values():  # shards are files beside it, not paths elsewhere
        if not isinstance(info, _StorageInfo) or not plain_name(info.relative_path):
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


def dcp_load(states: dict[str, Any], folder: Path, *, whole: bool = False, **kwargs: Any) -> None:
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
