"""Checkpoints that survive preemption: everything needed to continue a run exactly, written
atomically, read back safely, and never from broken weights.

Two layouts, one interface (`save`/`Saver`, `read`, `restore`, `load_model`):
- `checkpoint.pt`, one file written by rank 0 (a single process, DDP): the full, unsharded model
  and optimizer state keyed by parameter name.
- `checkpoint.dcp/` under FSDP: torch.distributed.checkpoint (DCP) shards, each rank writing its
  own, in `step-<N>/`, with `LATEST` naming the complete one. DCP reshards on load, so a run
  resumes on another number of processes, or in one process without FSDP;
  `python -m tools.consolidate_checkpoint` turns it into one `checkpoint.pt`.
One latest checkpoint at a time: a save that writes one layout removes the other's latest once it
is complete; the reader chooses by the step each records (never by file times) and refuses two of
different steps.

By concern, lowest first:
    checksums.py     each file's sha256, saved with it and checked on every read
    folder.py        where each checkpoint lies in a run folder, and the LATEST files
    safe_load.py     DCP's files read without running anything they could ask for
    state_layout.py  the state as DCP holds it: tied weights once, pp's flat optimizer, the
                     stages' own layouts (StateLayout, a stage's `checkpoint_layout`)
    reader.py        which checkpoint, read and checked; the model the tools rebuild from it
    resume.py        a checkpoint put back into the run that continues it
    rotation.py      the last N and the best, kept beside the latest
    saver.py         writing: atomic, sharded or not, in the background (async_save)
    signals.py       SIGTERM and Ctrl-C turned into a checkpoint at the end of the step
"""

from checkpointing.folder import BEST, FILENAME, HISTORY, SHARDED
from checkpointing.reader import check_shape, load_model, read, unsharded
from checkpointing.resume import restore
from checkpointing.rotation import best_record
from checkpointing.saver import Saver, save, snapshot, write_atomically
from checkpointing.signals import StopSignal
from checkpointing.state_layout import StateLayout

__all__ = [
    "BEST", "FILENAME", "HISTORY", "SHARDED", "Saver", "StateLayout", "StopSignal", "best_record",
    "check_shape", "load_model", "read", "restore", "save", "snapshot", "unsharded",
    "write_atomically",
]  # fmt: skip
