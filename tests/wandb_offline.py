"""Reads an offline wandb run back (`offline-run-*/run-*.wandb`), to check what was logged.

The file is a 7-byte header (`:W&B`, a 2-byte magic, a version byte) followed by a LevelDB-style
log: 32 KiB blocks of records framed as crc32 (4 bytes), length (2), type (1: full, 2: first,
3: middle, 4: last), each record a protobuf `wandb.proto.wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

HEADER, BLOCK, FRAME = 7, 32 * 1024, 7


def records(path: Path) -> list[wandb_internal_pb2.Record]:
    raw = path.read_bytes()
    if raw[:4] != b":W&B":
        raise ValueError(f"{path} is not a wandb run file")
    out, pending, pos = [], b"", HEADER
    while pos + FRAME <= len(raw):
        if BLOCK - pos % BLOCK < FRAME:  # a block's tail too short for a frame is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos : pos + FRAME])
        chunk = raw[pos + FRAME : pos + FRAME + length]
        pos += FRAME + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def _items(items) -> dict:  # noqa: ANN001 (repeated protobuf field)
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def read_run(run_dir: Path) -> dict:
    """The (single) offline run under `run_dir`: its name, config and every `log` call."""
    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    run: dict = {"name": None, "config": {}, "history": []}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["name"] = record.run.display_name
            run["config"] |= _items(record.run.config.update)
        elif kind == "config":
            run["config"] |= _items(record.config.update)
        elif kind == "history":
            run["history"].append(_items(record.history.item))
    return run
