"""scripts/memory_peak.py: the peak of a CUDA memory snapshot, read without running the code a
crafted pickle names."""

from __future__ import annotations

import os
import pickle
import subprocess
from pathlib import Path

import pytest
import torch

from helpers import ROOT, python
from measure import memory_peak


def _memory_peak(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python(), "scripts/memory_peak.py", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_memory_peak_reads_a_snapshot(tmp_path) -> None:
    frames = [{"filename": "/x/model/gpt.py", "line": 42, "name": "forward"}]
    trace = [
        {"action": "alloc", "addr": 1, "size": 3 * 2**30, "frames": frames, "stream": 0},
        {"action": "alloc", "addr": 2, "size": 2**30, "frames": [], "stream": 0},
        {"action": "free_completed", "addr": 1, "size": 3 * 2**30, "frames": frames},
    ]
    snapshot = {"segments": [{"segment_pool_id": (0, 0), "blocks": []}], "device_traces": [trace]}
    (tmp_path / "snapshot.pickle").write_bytes(pickle.dumps(snapshot))
    out = _memory_peak(tmp_path / "snapshot.pickle")
    assert out.returncode == 0, out.stderr
    assert "peak of live tensors: 4.00 GiB" in out.stdout and "gpt.py:42 forward" in out.stdout


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_memory_peak_refuses_a_pickle_that_would_run_code(tmp_path) -> None:
    marker = tmp_path / "pwned"
    crafted = {"device_traces": [[]], "x": _Exploit(marker)}
    (tmp_path / "snapshot.pickle").write_bytes(pickle.dumps(crafted))
    out = _memory_peak(tmp_path / "snapshot.pickle")
    assert not marker.exists()
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        f"memory_peak.py: {tmp_path / 'snapshot.pickle'} is not a CUDA memory snapshot: it "
        "names posix.system, which a CUDA memory snapshot never holds (it could run code): "
        "refusing to unpickle it"
    ]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_memory_peak_reads_a_real_cuda_snapshot(tmp_path) -> None:
    """The restricted unpickler accepts what torch really writes (plain data only)."""

    torch.cuda.memory._record_memory_history(max_entries=1000)
    x = torch.randn(1024, 1024, device="cuda")
    (x @ x).sum().item()
    torch.cuda.memory._dump_snapshot(str(tmp_path / "snapshot.pickle"))
    torch.cuda.memory._record_memory_history(enabled=None)
    snapshot = memory_peak.load_snapshot(tmp_path / "snapshot.pickle")
    top, sites = memory_peak.peak(snapshot, torch.cuda.current_device())
    assert top >= 4 * 2**20 and sites
