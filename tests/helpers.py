"""What the tests share, imported as `from helpers import ...` (pyproject.toml puts tests/ on
pytest's and mypy's path): the composed configs over the real `conf/`, a few tiny training-run
settings that take seconds on a CPU, readers of a run's metrics and wandb files, fakes, and the
torchrun launches. The fixtures are in conftest.py; no test module imports another."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from launch.torchrun import descendants, torchrun

if TYPE_CHECKING:
    import opt
    from model import GPT

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

# A 2-layer, 32-wide GPT on 32-token windows: a training step takes ~50 ms on a CPU.
TINY = [
    "model=tiny", "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32",
    "train.batch_size=4", "train.warmup_steps=2", "train.eval_sequences=8",
    "sample.num_samples=1", "sample.max_new_tokens=4", "wandb.mode=offline", "device=cpu",
]  # fmt: skip


def make_cfg(*overrides: str) -> DictConfig:
    """The composed config, exactly as `python train.py <overrides>` would see it."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def planned(processes: int, *overrides: str) -> opt.Plan:
    """`opt.plan` of `python train.py <overrides>` on rank 0 of `processes` processes (planning
    only: no process group is made)."""
    import opt
    from base.distributed import Distributed

    dist = Distributed(rank=0, local_rank=0, world_size=processes, device=torch.device("cpu"))
    return opt.plan(make_cfg(*overrides), dist)


def tiny_cfg(*overrides: str) -> DictConfig:
    return make_cfg(*TINY, *overrides)


def tiny_run(run_dir: Path, *overrides: str) -> dict:
    """`python train.py <TINY> <overrides> hydra.run.dir=<run_dir>`, in this process: the command
    line travels with the config, as it does from the CLI, so that a resume can rebuild it."""
    from train import train

    return train(tiny_cfg(*overrides), run_dir, overrides=[*TINY, *overrides])


def wandb_records(run_dir: Path, timeout_s: float = 30.0) -> list[Any]:
    """The records of the offline wandb run in `run_dir`, read back from its `run-<id>.wandb`
    file (wandb 0.31 writes no wandb-summary.json offline, and has no Python reader: the file is
    a LevelDB log of `wandb_internal_pb2.Record`s). wandb's service process may still be writing
    when `finish()` returns: this waits for the run's last record, its exit."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    deadline = time.monotonic() + timeout_s
    while True:
        records = []
        for payload in _leveldb_log(path.read_bytes()):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
            record.ParseFromString(payload)
            records.append(record)
        if any(r.HasField("exit") for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def _leveldb_log(data: bytes) -> Iterator[bytes]:
    """The payloads of a LevelDB log after wandb's 7-byte file header: 32 KiB blocks of chunks,
    each a 7-byte header (checksum, length, type: 1 whole, 2 first, 3 middle, 4 last)."""
    assert data[:4] == b":W&B", "not a wandb run file"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 or pos + 7 + length > len(data):  # zeros, or a chunk still being written
            return
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            yield pending
            pending = b""


def wandb_summary(run_dir: Path) -> dict[str, Any]:
    """The offline wandb run's final summary, as wandb would upload it: its summary records'
    updates and removals in order."""
    summary: dict[str, Any] = {}
    for record in wandb_records(run_dir):
        if record.HasField("summary"):
            for item in record.summary.update:
                summary[item.key or ".".join(item.nested_key)] = json.loads(item.value_json)
            for item in record.summary.remove:
                summary.pop(item.key or ".".join(item.nested_key), None)
    return summary


def wandb_run_record(run_dir: Path) -> Any:
    """The offline wandb run's `run` record: its name (`display_name`), `run_group`, id."""
    return next(r.run for r in wandb_records(run_dir) if r.HasField("run"))


@dataclass
class WandbCalls:
    """What the trainer handed to wandb's public API: `wandb.init`'s arguments and each
    `run.log(metrics, step=...)` call, recorded around the real (offline) calls."""

    init: list[dict] = field(default_factory=list)
    logs: list[tuple[dict, int]] = field(default_factory=list)
    finished: int = 0


def compiled_against_eager(
    run_dir: Path, eager: Sequence[str], compiled: Sequence[str], rtol: float
) -> dict:
    """Trains the tiny config with the `eager` overrides, then with the `compiled` ones (from a
    fresh dynamo state); their logged losses must agree within `rtol`. Returns dynamo's counters
    of the compiled run (graphs, breaks), for the caller to check."""
    import torch._dynamo

    from train import train

    train(tiny_cfg(*eager), run_dir / "eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    train(tiny_cfg(*compiled), run_dir / "compiled")
    counters = {k: dict(v) for k, v in torch._dynamo.utils.counters.items()}
    torch.testing.assert_close(
        logged(run_dir / "compiled", "train/loss"),
        logged(run_dir / "eager", "train/loss"),
        rtol=rtol,
        atol=0,
    )
    torch._dynamo.reset()
    return counters


def logged(run_dir: Path, key: str) -> list:
    """The values of metric `key` in a run's metrics.jsonl, in order."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [row[key] for row in map(json.loads, lines) if key in row]


def write_line(path: Path, line: str | bytes) -> Path:
    """A one-line file: `line` as text with its newline, or as given when bytes (a file that is
    not UTF-8, say)."""
    if isinstance(line, bytes):
        path.write_bytes(line)
    else:
        path.write_text(line + "\n")
    return path


def python() -> str:
    return sys.executable


def tool_cfg(name: str, *overrides: str) -> DictConfig:
    """conf/<name>.yaml composed as `python <tool> <overrides>` would see it (on the CPU, where
    the tiny runs trained)."""
    on_cpu = ["device=cpu"] if name in ("sample", "evaluate") else []
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(name, overrides=[*on_cpu, *overrides])


# ---- The loop meter's fakes (recipe.metrics.LoopMeter).

PERF_ARGS = dict(
    tokens_per_step=128,
    flops_per_token=1.0,
    hardware_flops_per_token=1.0,
    peak_flops=None,
    world_size=1,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeBatches:
    """What LoopMeter reads of data.DeviceBatches: the host's total wait for batches."""

    wait_s = 0.0


# ---- The fused head's toy model (opt/custom_op.py).


def custom_op_knobs(**overrides):
    """conf/opt/custom_op.yaml's knobs, with `overrides`."""
    return OmegaConf.merge(OmegaConf.load(CONF / "opt/custom_op.yaml").custom_op, overrides)


def toy_gpt(vocab_size: int = 60, **knobs) -> GPT:
    """A 2-layer GPT whose padded vocabulary (64) has 4 padding rows; fused if knobs are given."""
    from model import GPT, GPTConfig
    from opt.custom_op import apply_custom_op

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=vocab_size))
    if knobs:
        apply_custom_op(model, custom_op_knobs(**knobs))
    return model


# ---- scripts/vs_nanogpt.py's results.


def vs_nanogpt_config(
    name: str, side: str, batch: int, bias: bool, math: str | None = None
) -> dict:
    """One configuration of scripts/vs_nanogpt.py's results."""
    variant = {"variant": name.split()[-1]} if side == "ours" else {}
    return {"name": name, "side": side, "batch": batch, "bias": bias, "math": math,
            "what": "w", "command": f"python {name}", **variant}  # fmt: skip


def fake_vs_nanogpt_result() -> dict:
    """scripts/vs_nanogpt.py's results: two batches of bench.py, ours plain and fastest at batch
    64, three rounds; round 3 of ours plain failed."""
    configs = [
        vs_nanogpt_config("bench.py b32", "nanogpt", 32, False),
        vs_nanogpt_config("bench.py b64", "nanogpt", 64, False),
        vs_nanogpt_config("bench.py b64 bias", "nanogpt", 64, True),
        vs_nanogpt_config("ours b64 plain", "ours", 64, True),
        vs_nanogpt_config("ours b64 fastest", "ours", 64, True, "bfloat16 residual stream"),
    ]
    tps = {
        "bench.py b32": [480, 481, 479],
        "bench.py b64": [495, 494, 496],
        "bench.py b64 bias": [472, 470, 474],
        "ours b64 plain": [500, 488, None],
        "ours b64 fastest": [530, 528, 531],
    }
    runs = [
        {"config": name, "repeat": r + 1, "tokens_per_sec": None if v is None else v * 1e3}
        for r in range(3)
        for name, values in tps.items()
        for v in [values[r]]
    ]
    env = {"device": "NVIDIA H100 80GB HBM3", "date": "d", "torch": "2.11", "git_commit": "abc"}
    return {"environment": env, "configs": configs, "runs": runs, "order": "rounds"}


# ---- torchrun launches (CPU processes, gloo).

# A constant learning rate, so that a run of 2 steps resumed to 4 is the 4-step run.
RUN_4_STEPS = (
    "train.max_steps=4", "train.log_interval=1", "train.eval_interval=2", "wandb.mode=disabled",
    "train.warmup_steps=0", "train.min_lr=${train.lr}",
)  # fmt: skip


def launch_agents(*commands: list[str], timeout: float = 300) -> str:
    """Runs the commands side by side (one per torchrun agent) from the checkout; returns their
    output (each must succeed). A worker that dies of a signal (a crash in native code) prints
    every thread's Python stack first (faulthandler), so that the failure says where; so does
    every process still running at the timeout (a hang). Inductor compiles in each worker's own
    process: its pool of compile processes can hang a distributed run's exit (as PyTorch's
    own distributed Inductor tests note), and these graphs are tiny."""
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    with tempfile.TemporaryDirectory() as logs:
        agents = []
        for i, command in enumerate(commands):
            with open(Path(logs) / f"{i}.log", "w") as log:
                agents.append(subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=log, env=env))
        deadline, hung = time.time() + timeout, False
        try:
            for agent in agents:
                agent.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            hung = True
            dump_stacks(agents)
        finally:
            for agent in agents:
                stop_agent(agent)
        output = "".join((Path(logs) / f"{i}.log").read_text() for i in range(len(agents)))
    assert not hung, f"still running after {timeout:.0f} s; the stacks:\n{output[-20000:]}"
    assert all(agent.returncode == 0 for agent in agents), output[-6000:]
    return output


def dump_stacks(agents: list[subprocess.Popen], grace: float = 10.0) -> None:
    """Makes the agents' workers (and whatever they started) print every thread's Python stack:
    SIGABRT, which faulthandler catches, then waits up to `grace` seconds for them to end."""
    workers = [pid for agent in agents for pid in descendants(agent.pid)]
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGABRT)
    deadline = time.time() + grace
    while time.time() < deadline and any(map(still_running, workers)):
        time.sleep(0.2)


def process_state(pid: int) -> str:
    """A process's state letter from /proc (Z: a zombie, exited and not yet reaped), or 'gone'."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def still_running(pid: int) -> bool:
    """Whether process `pid` still runs (an exited one nobody has reaped yet does not)."""
    return process_state(pid) not in ("Z", "gone")


def stop_agent(agent: subprocess.Popen) -> None:
    """Kills a torchrun agent that is still running, and its workers."""
    if agent.poll() is None:
        for pid in [*descendants(agent.pid), agent.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        agent.wait()


def torchrun_output(processes: int, *args: str, timeout: float = 600) -> str:
    """`torchrun --nproc_per_node=<processes> <args>`; its output (it must succeed)."""
    return launch_agents([*torchrun(processes), *args], timeout=timeout)


# ---- Multi-process layouts judged against one process (test_pp_dp, test_pp_tp, test_hsdp).

# 4 blocks; a constant learning rate, so that a run stopped at step 4 and resumed is the 8-step
# run; 8 validation windows: each pipeline evaluates 4 of the one process's 8.
LAYOUT_RUN = (
    "model.n_layer=4", "train.max_steps=8", "train.log_interval=1", "train.eval_interval=4",
    "wandb.mode=disabled", "train.warmup_steps=0", "train.min_lr=${train.lr}",
    "train.eval_sequences=8",
)  # fmt: skip
# The dp ranks reduce gradients in another order than one process: float rounding, amplified a
# little by Adam in the gradient norm (as in tests/distributed/test_tp.py).
LAYOUT_RTOL = {"train/loss": 1e-5, "val/loss": 1e-5, "train/grad_norm": 1e-3}
GLOBAL_BATCH = "train.batch_size=8"
Layouts = dict[str, tuple[int, list[str]]]  # name: (processes, the stages and knobs)


def layout_runs(root: Path, layouts: Layouts, stopped: str, drop: list[str]) -> dict[str, Path]:
    """The runs a multi-process layout is judged by, under `root`: one process with the global
    batch ("single"); each of `layouts` under torchrun (its console output in stdout.txt); and
    the layout `stopped` run to step 4, then continued in one process without the stages
    `drop` ("on_one")."""
    from train import train

    out = {name: root / name for name in ("single", *layouts, "on_one")}
    train(
        tiny_cfg(*LAYOUT_RUN, GLOBAL_BATCH), out["single"],
        overrides=[*TINY, *LAYOUT_RUN, GLOBAL_BATCH],
    )  # fmt: skip
    for name, (processes, stages) in layouts.items():
        out[name].mkdir()
        args = (*TINY, *LAYOUT_RUN, *stages, f"hydra.run.dir={out[name]}")
        (out[name] / "stdout.txt").write_text(torchrun_output(processes, "train.py", *args))
    processes, stages = layouts[stopped]
    torchrun_output(processes, "train.py", *TINY, *LAYOUT_RUN, *stages, "train.max_steps=4",
                    f"hydra.run.dir={out['on_one']}")  # fmt: skip
    resume_here = (
        "train.resume=true", "train.max_steps=8", *(f"~opt.{s}" for s in drop), GLOBAL_BATCH,
    )  # fmt: skip
    cfg = make_cfg(*TINY, *LAYOUT_RUN, *stages, *resume_here)
    train(cfg, out["on_one"], overrides=list(resume_here))
    return out


def assert_same_run(run_dir: Path, reference: Path) -> None:
    """`run_dir` logged the reference run's losses and gradient norms (within LAYOUT_RTOL)."""
    for key, rtol in LAYOUT_RTOL.items():
        ours, theirs = logged(run_dir, key), logged(reference, key)
        assert len(ours) == len(theirs) > 0, key
        torch.testing.assert_close(ours, theirs, rtol=rtol, atol=0)


def assert_holds_the_weights_of(run_dir: Path, reference: Path) -> None:
    """`run_dir`'s checkpoint, read whole in one process (sample.py, export), holds the
    reference run's weights: the fused QKV in GPT-2's row order although each rank held strided
    slices of it (under FSDP too: slices of slices)."""
    import checkpointing

    loaded, _ = checkpointing.load_model(run_dir)
    one_model, _ = checkpointing.load_model(reference)
    for name, weight in one_model.state_dict().items():  # weights ~0.02; a wrong row order
        # would be off by that much. Adam turns the rounding of near-zero gradients (rare
        # tokens' embedding rows) into up to a tenth of a step's lr (2e-3).
        torch.testing.assert_close(loaded.state_dict()[name], weight, rtol=1e-4, atol=2e-4)
