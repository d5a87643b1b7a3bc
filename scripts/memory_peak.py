"""What is alive at the peak of a CUDA memory snapshot (`+prof=memory`), grouped by the code that
allocated it: the text version of pytorch.org/memory_viz, for finding out why a stage does not
lower the peak.

    python scripts/memory_peak.py outputs/.../memory_snapshot.pickle [--top 12]
"""

from __future__ import annotations

import argparse
import pickle
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
    top, sites = peak(pickle.loads(args.snapshot.read_bytes()))
    print(f"peak of live tensors: {top / GiB:.2f} GiB, of which:")
    for site, size in sorted(sites.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {size / GiB:7.2f} GiB  {site}")


if __name__ == "__main__":
    main()
