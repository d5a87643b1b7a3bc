"""One `checkpoint.pt` from a run's sharded checkpoint (`checkpoint.dcp/`, written by FSDP runs):
the single-file layout that one process reads, for sampling, evaluation, export or a resume
anywhere. Runs in one process; needs host memory for the full model and optimizer state.

    python -m tools.consolidate_checkpoint outputs/<date>/<time>-<pid>
"""

from __future__ import annotations

import argparse
from pathlib import Path

import checkpointing
from base import errors


def consolidate(run_dir: Path, verify: bool = False) -> Path:
    state = checkpointing.read(run_dir, verify=verify)
    if "sharded" not in state:
        raise errors.ConfigError(
            f"{run_dir}'s latest checkpoint is already one file: {checkpointing.FILENAME}"
        )
    weights = checkpointing.unsharded(state)  # {"model": ..., "optimizer": ...}, unsharded
    del state["sharded"]
    path = run_dir / checkpointing.FILENAME
    checkpointing.write_atomically(path, {**weights, **state}, checksum=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="the run folder holding checkpoint.dcp/")
    parser.add_argument(
        "--verify", action="store_true", help="hash every checkpoint file whole (large ones are "
        "otherwise checked by sampled blocks)",
    )  # fmt: skip
    args = parser.parse_args()
    path = consolidate(args.run_dir, args.verify)
    print(f"[consolidate] wrote {path}")


if __name__ == "__main__":
    errors.main(main)  # bad input in one line, exit 2 (base/errors.py)
