"""One `checkpoint.pt` from a run's sharded checkpoint (`checkpoint.dcp/`, written by FSDP runs):
the single-file layout that one process reads, for sampling, evaluation, export or a resume
anywhere. Runs in one process; needs host memory for the full model and optimizer state.

    python scripts/consolidate_checkpoint.py outputs/2026-11-23/10-00-00-1234
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runnable from a checkout without installing

import torch  # noqa: E402
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: E402

from recipe import checkpoint  # noqa: E402


def consolidate(run_dir: Path) -> Path:
    state = checkpoint.read(run_dir)
    if "sharded" not in state:
        raise SystemExit(
            f"{run_dir}'s latest checkpoint is already one file: {checkpoint.FILENAME}"
        )
    full = run_dir / f"{checkpoint.FILENAME}.full-{state['step']}"
    dcp_to_torch_save(state.pop("sharded"), full)  # {"model": ..., "optimizer": ...}, unsharded
    weights = torch.load(full, map_location="cpu", weights_only=True)
    path = run_dir / checkpoint.FILENAME
    checkpoint.write_atomically(path, {**weights, **state})
    full.unlink()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="the run folder holding checkpoint.dcp/")
    path = consolidate(parser.parse_args().run_dir)
    print(f"[consolidate] wrote {path}")


if __name__ == "__main__":
    main()
