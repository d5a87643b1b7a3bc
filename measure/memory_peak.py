"""What is alive at the peak of a CUDA memory snapshot (`+prof=memory`), grouped by the code that
allocated it: the text version of pytorch.org/memory_viz, for finding out why a stage does not
lower the peak.

    python scripts/memory_peak.py outputs/.../memory_snapshot.pickle [--top 12]

A snapshot is a pickle, and unpickling can run any code the file names: the file is read with an
unpickler that refuses everything but the plain data a snapshot holds.
"""

from __future__ import annotations

import argparse
import io
import pickle
import sys
from collections import defaultdict
from pathlib import Path

GiB = 1024**3
# Frames in these files name the allocation better than the PyTorch internals below them.
OURS = ("model/", "opt/", "data/", "recipe/", "train.py", "torch/optim/", "torch/utils/checkpoint")


def _site(frames: list[dict]) -> str:
    for frame in frames:
        if any(part in frame["filename"] for part in OURS):
            return f"{Path(frame['filename']).name}:{frame['line']} {frame['name']}"
    return frames[0]["name"] if frames else "?"


class SnapshotUnpickler(pickle.Unpickler):
    """Unpickles plain data only. `torch.cuda.memory._dump_snapshot` pickles the dict that
    `torch.cuda.memory._snapshot()` returns: dicts, lists, tuples, str, int, float, bool and None,
    which pickle writes as opcodes of their own. Anything else is named by its module and class
    (`find_class`), and that is how a crafted file calls `os.system`: so nothing is found."""

    def find_class(self, module: str, name: str) -> object:
        raise pickle.UnpicklingError(
            f"it names {module}.{name}, which a CUDA memory snapshot never holds (it could run "
            "code): refusing to unpickle it"
        )


def load_snapshot(path: Path) -> dict:
    """The snapshot in `path`, read with the restricted unpickler; ValueError if it is not one."""
    try:
        snapshot = SnapshotUnpickler(io.BytesIO(path.read_bytes())).load()
    except Exception as e:  # a damaged pickle fails in many ways; none of them ran code
        raise ValueError(f"{path} is not a CUDA memory snapshot: {e}") from e
    if not isinstance(snapshot, dict) or "device_traces" not in snapshot:
        raise ValueError(
            f"{path} is not a CUDA memory snapshot (no device_traces): pass the "
            "memory_snapshot.pickle that +prof=memory writes"
        )
    return snapshot


def peak(snapshot: dict, device: int = 0) -> tuple[int, dict[str, int]]:
    """Replays the allocation trace; returns the peak of live bytes and, at that moment, the live
    bytes per allocation site. (`+prof=memory` starts recording before the model is built, so
    the trace holds every tensor of the run.)"""
    live: dict[int, tuple[int, str]] = {}
    total, best, best_live = 0, 0, {}
    for event in snapshot["device_traces"][device]:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], _site(event.get("frames", [])))
            total += event["size"]
            if total > best:
                best, best_live = total, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    sites: dict[str, int] = defaultdict(int)
    for size, site in best_live.values():
        sites[site] += size
    return best, dict(sites)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("snapshot", type=Path)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    try:
        snapshot = load_snapshot(args.snapshot)
    except (OSError, ValueError) as e:
        sys.exit(f"memory_peak.py: {e}")
    top, sites = peak(snapshot)
    print(f"peak of live tensors: {top / GiB:.2f} GiB, of which:")
    for site, size in sorted(sites.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {size / GiB:7.2f} GiB  {site}")
