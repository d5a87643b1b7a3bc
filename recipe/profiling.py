"""Optional per-run profiling, switched on with `+prof=trace` or `+prof=memory`:

- trace: a PyTorch profiler trace of a few steps (CPU ops and CUDA kernels) written to
  `<run>/trace.json` (rank 0; every other rank of a multi-process run to `trace-rank<R>.json`:
  a parallel step's time is only explained by all of its ranks, one of which may wait for the
  others); open it in https://ui.perfetto.dev or chrome://tracing. With
  `prof.trace.cpu=false` only the kernels (a smaller trace; recording still costs host time per
  kernel launch, which a host-bound step shows as GPU idle).
- memory: a CUDA memory snapshot of the first steps (every allocation with its stack) written to
  `<run>/memory_snapshot.pickle`; drop it on https://pytorch.org/memory_viz.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig

from base.distributed import log
from base.errors import ConfigError


def trace_name(rank: int) -> str:
    """The file a rank's trace is written to, in the run folder."""
    return "trace.json" if rank == 0 else f"trace-rank{rank}.json"


class Profiler:
    """Call `step()` after every optimizer step and `close()` at the end; does nothing unless a
    `prof` option is selected. Every rank records its trace; the memory snapshot is rank 0's."""

    def __init__(self, prof: DictConfig, run_dir: Path, device: torch.device, rank: int) -> None:
        self.run_dir, self.rank, self.steps = run_dir, rank, 0
        self.trace = self.memory = None
        if "trace" in prof:
            cfg = prof.trace
            if not cfg.cpu and device.type != "cuda":
                raise ConfigError(
                    "prof.trace.cpu=false records the GPU's kernels only: it needs device=cuda "
                    "(drop it to trace the CPU's operators)"
                )
            activities = [torch.profiler.ProfilerActivity.CPU] if cfg.cpu else []
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.trace = torch.profiler.profile(
                activities=activities,
                # repeat=1: one recording, then the profiler stays off (the default, 0, would
                # cycle wait/warmup/active to the end of the run, profiling half the steps).
                schedule=torch.profiler.schedule(
                    wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=1
                ),
                on_trace_ready=self._save_trace,
                record_shapes=cfg.record_shapes,
                with_stack=cfg.with_stack,
            )
            self.trace.start()
        if "memory" in prof and rank == 0:
            if device.type != "cuda":
                raise ConfigError("+prof=memory records CUDA allocations: it needs device=cuda")
            self.memory = prof.memory
            torch.cuda.memory._record_memory_history(max_entries=prof.memory.max_entries)

    def _save_trace(self, profiler: torch.profiler.profile) -> None:
        path = self.run_dir / trace_name(self.rank)
        profiler.export_chrome_trace(str(path))
        log(f"[prof] trace of {profiler.step_num} steps: {path} (open in ui.perfetto.dev)")

    def step(self) -> None:
        self.steps += 1
        if self.trace is not None:
            self.trace.step()
        if self.memory is not None and self.steps == self.memory.steps:
            self._save_memory()

    def _save_memory(self) -> None:
        path = self.run_dir / "memory_snapshot.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        self.memory = None
        log(f"[prof] memory snapshot: {path} (drop it on pytorch.org/memory_viz)")

    def close(self) -> None:
        if self.trace is not None:
            self.trace.stop()
            self.trace = None
        if self.memory is not None:  # fewer steps ran than asked for: save what there is
            self._save_memory()
