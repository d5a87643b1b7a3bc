"""torchrun: the command lines that start it, the processes it starts, and
`python -m launch.torchrun <torchrun's arguments>`, torchrun with one difference. When the
launcher itself gets SIGTERM or SIGINT (a scheduler preempting the job, Ctrl-C), torchrun
forwards it to the trainers, which save a checkpoint and exit 0, but then exits 1 itself; a
scheduler reads that as a failed job. This launcher exits 0 when every trainer it started
reported its checkpoint saved (`mark_saved_on_stop`, called by train.py), and 1 otherwise.
Everything else is torchrun's.

    python -m launch.torchrun --nproc_per_node=2 train.py model=gpt2 +opt=fsdp

Give the trainers time to finish their step and save: `--shutdown-timeout` (seconds; torchrun's
default is 30) before torchrun kills them.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from base.errors import ConfigError

STOP_MARKS = "GPT2_RECIPE_STOP_MARKS"  # where each trainer marks "checkpoint saved on a stop"


def torchrun(
    nproc_per_node: int, nnodes: int = 1, rdzv_endpoint: str = "", rdzv_id: str = "gpt2-recipe"
) -> list[str]:
    """The command that starts `nproc_per_node` processes here: alone (`--standalone`), or as
    one of `nnodes` machines meeting at a c10d rendezvous on `rdzv_endpoint` (host:port of the
    first machine; every machine runs the same command, and c10d assigns the node ranks)."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc_per_node}"]
    if nnodes == 1:
        return [*command, "--standalone"]
    if not rdzv_endpoint:
        raise ConfigError(f"{nnodes} nodes need a rendezvous endpoint (host:port of the first)")
    return [
        *command,
        f"--nnodes={nnodes}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={rdzv_endpoint}",
        f"--rdzv_id={rdzv_id}",
    ]


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (children first), from /proc: torchrun starts each worker in a
    session of its own, out of reach of a signal to the agent's process group."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (command)"
        except OSError:  # exited meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, queue = [], list(children.get(pid, []))
    while queue:
        child = queue.pop(0)
        found.append(child)
        queue += children.get(child, [])
    return found


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
