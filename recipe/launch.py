"""`python -m recipe.launch <torchrun's arguments>`: torchrun, with one difference. When the
launcher itself gets SIGTERM or SIGINT (a scheduler preempting the job, Ctrl-C), torchrun
forwards it to the trainers, which save a checkpoint and exit 0, but then exits 1 itself; a
scheduler reads that as a failed job. This launcher exits 0 when every trainer it started
reported its checkpoint saved, and 1 otherwise. Everything else is torchrun's.

    python -m recipe.launch --nproc_per_node=2 train.py model=gpt2 +opt=fsdp

Give the trainers time to finish their step and save: `--shutdown-timeout` (seconds; torchrun's
default is 30) before torchrun kills them.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

STOP_MARKS = "GPT2_RECIPE_STOP_MARKS"  # where each trainer marks "checkpoint saved on a stop"


def mark_saved_on_stop(rank: int) -> None:
    """Called by a trainer after the checkpoint it saved because of a stop signal."""
    folder = os.environ.get(STOP_MARKS)
    if folder:
        (Path(folder) / f"rank-{rank}").touch()


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gpt2-recipe-stop-") as marks:
        os.environ[STOP_MARKS] = marks
        try:
            run(args)
        except SignalException as e:
            saved = len(list(Path(marks).iterdir()))
            expected = int(args.nproc_per_node) if str(args.nproc_per_node).isdigit() else 1
            if saved >= expected:
                print(f"[launch] {e.sigval.name}: all {saved} trainers saved a checkpoint; exit 0")
                return 0
            print(f"[launch] {e.sigval.name}: only {saved} of {expected} trainers saved; exit 1")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
