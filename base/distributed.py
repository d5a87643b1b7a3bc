"""One process per GPU (launched by `torchrun`) or a single process; the device each one uses,
the process groups they talk through, and the command that started them (`launcher`, for the
commands a run prints); the `torchrun` command lines that start them are launch/torchrun.py's."""

from __future__ import annotations

import ctypes
import datetime
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from base.errors import ConfigError, Reported, Unusable

DEVICES = ("auto", "cpu", "cuda")
# The CPU group's collectives wait this long. It carries host-side waits, such as the other
# ranks waiting for a corpus to be prepared, which can take hours; when a process dies, torchrun
# stops the others, so a long timeout never holds a failed job.
HOST_TIMEOUT = datetime.timedelta(hours=24)
PR_SET_PDEATHSIG = 1  # prctl's option (<linux/prctl.h>): a signal for when the parent dies
# How long destroying the process group may take once a run is over. It can hang inside PyTorch
# (NCCL communicators still held by something): the run's results are written by then, so the
# process exits without it rather than holding its job until a scheduler's time limit.
SHUTDOWN_TIMEOUT_S = 60.0


def log(message: str) -> None:
    """Prints on the main process only (RANK 0, or a single process)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, flush=True)


def resolve_device(choice: str, local_rank: int = 0) -> torch.device:
    """`auto` picks this process's GPU when there is one, else the CPU."""
    if choice not in DEVICES:
        raise ConfigError(f"device={choice!r}: choose one of {', '.join(DEVICES)}")
    has_cuda = torch.cuda.is_available()
    if choice == "cuda" and not has_cuda:
        built = (
            f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        )
        raise Unusable(
            f"device=cuda, but no CUDA GPU is visible (torch {torch.__version__} is {built}). "
            "Use device=auto or device=cpu, or check CUDA_VISIBLE_DEVICES and the driver."
        )
    if choice == "cpu" or not has_cuda:
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


# The mesh's dimensions, outermost first: pipeline stages, data-parallel replicas or shards,
# tensor-parallel shards (innermost: its collectives run every layer, so its ranks are adjacent,
# i.e. on one machine under torchrun's rank order). Under HSDP (opt.fsdp.replicas > 1) the
# data-parallel dimension is two: replicas of the model (outer: across machines, one gradient
# all-reduce a step), each sharded over its own processes (inner: a machine's, FSDP's gathers).
MESH_DIMS = ("pp", "dp", "tp")
HSDP_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass
class ParallelDims:
    """How a run's processes share the work, in one place: `pp` pipeline stages x the
    data-parallel rest x `tp` tensor shards, the data-parallel rest as `dp_replicate` HSDP
    replicas x `dp_shard` FSDP shards, and whether FSDP wraps the model. The stages that split
    or shard the model set their degrees while planning (opt.plan); the trainer then builds the
    device mesh once (`Distributed.with_parallel`), and everything that depends on the layout
    asks this object, not which stages were selected."""

    world_size: int
    pp: int = 1  # +opt=pp: pipeline stages (opt.pp.degree)
    tp: int = 1  # +opt=tp: ranks per tensor-parallel group (opt.tp.degree)
    dp_replicate: int = 1  # +opt=fsdp's replicas: HSDP (opt.fsdp.replicas)
    # FSDP's `fully_shard` wraps the model: +opt=fsdp, or +opt=offload on a GPU (their plans).
    fully_sharded: bool = False
    # The processes as a pp x dp x tp DeviceMesh (HSDP: pp x dp_replicate x dp_shard x tp) once
    # built, when a stage splits the model or HSDP replicates it; else None: then every process
    # is a data-parallel rank.
    mesh: DeviceMesh | None = None
    # HSDP's two data-parallel dimensions as one (DeviceMesh._flatten makes its process group
    # once: kept here, as torch asks, rather than sliced from `mesh` again).
    flat_dp: DeviceMesh | None = None

    @property
    def dp_size(self) -> int:
        """How many different slices each global batch is split into: the processes that the
        pipeline and tensor-parallel groups leave."""
        return self.world_size // (self.pp * self.tp)

    @property
    def dp_shard(self) -> int:
        """The processes each HSDP replica shards the model over (all of dp without HSDP)."""
        return self.dp_size // self.dp_replicate

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP wraps the model of a multi-process run (+opt=fsdp): each micro-step's gradients
        are reduce-scattered (+opt=offload's FSDP runs in one process, with nothing to reduce)."""
        return self.fully_sharded and self.world_size > 1

    @property
    def meshed(self) -> bool:
        """Whether the layout needs a device mesh: a model split over processes, or HSDP."""
        return self.pp_enabled or self.tp_enabled or self.hsdp_enabled

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        """The data-parallel dimension (each of its ranks reads another slice of the batch;
        DDP's replicas), or None without a mesh."""
        if self.mesh is None:
            return None
        return self.flat_dp if self.flat_dp is not None else self.mesh["dp"]

    @property
    def shard_mesh(self) -> DeviceMesh | None:
        """What FSDP shards over: the data-parallel dimension, or HSDP's (replicate, shard)
        pair, on which FSDP2 replicates over the first and shards over the second."""
        if self.mesh is not None and self.flat_dp is not None:
            return self.mesh["dp_replicate", "dp_shard"]
        return self.dp_mesh

    def build_mesh(self, device: torch.device) -> None:
        """The pp x dp x tp DeviceMesh over the default process group (torchrun's ranks,
        row-major: tp innermost); under HSDP pp x dp_replicate x dp_shard x tp, its two
        data-parallel dimensions also flattened into one. A collective: every rank builds it."""
        pp, dp, tp = mesh_shape(self.world_size, self.pp, self.tp)
        if self.hsdp_enabled:
            shape = (pp, self.dp_replicate, hsdp_shards(dp, self.dp_replicate), tp)
            self.mesh = init_device_mesh(device.type, shape, mesh_dim_names=HSDP_DIMS)
            self.flat_dp = self.mesh["dp_replicate", "dp_shard"]._flatten("dp")
        else:
            self.mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=MESH_DIMS)


@dataclass(frozen=True)
class Distributed:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    # How the processes share the work (`with_parallel`); None given: every process a
    # data-parallel rank of the whole model.
    parallel: ParallelDims = None  # type: ignore[assignment]  # set in __post_init__

    def __post_init__(self) -> None:
        if self.parallel is None:
            object.__setattr__(self, "parallel", ParallelDims(self.world_size))

    @property
    def dp_rank(self) -> int:
        """This process's data-parallel coordinate: which slice of each global batch it reads.
        The ranks of one pipeline or tensor-parallel group read the same batch."""
        dp = self.parallel.dp_mesh
        return dp.get_local_rank() if dp is not None else self.rank

    @property
    def dp_size(self) -> int:
        """How many different slices each global batch is split into (`ParallelDims.dp_size`)."""
        return self.parallel.dp_size

    def with_parallel(self, parallel: ParallelDims) -> Distributed:
        """These processes laid out as `parallel` (the plan's), its device mesh built when the
        layout needs one."""
        if parallel.meshed and parallel.mesh is None:
            parallel.build_mesh(self.device)
        return replace(self, parallel=parallel)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """The first process of its machine (it prepares the machine's data cache)."""
        return self.local_rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def host_barrier(self) -> None:
        """A barrier on the CPU group: no GPU work, and HOST_TIMEOUT instead of the default
        group's 10 minutes (for waits as long as preparing a corpus)."""
        if self.enabled:
            dist.barrier(group=_cpu_group())

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of `value` over all ranks (a collective: every rank must call it)."""
        if self.enabled:
            value = value.clone()
            dist.all_reduce(value, op=dist.ReduceOp.AVG if value.is_cuda else dist.ReduceOp.SUM)
            if not value.is_cuda:  # gloo has no AVG
                value /= self.world_size
        return value

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank (over the CPU group)."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=_cpu_group())
        return out

    def any(self, flag: bool) -> bool:
        """True on every rank if `flag` is true on any, now (a blocking all-reduce on the CPU
        group: for decisions that cannot wait a step, such as refusing to save broken weights)."""
        if not self.enabled:
            return flag
        vote = torch.tensor([int(flag)])
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=_cpu_group())
        return bool(vote.item())

    def any_one_step_late(self, flag: bool) -> bool:
        """Whether `flag` was true on any rank at the previous call: the same answer on every
        rank at the same call, without a barrier. Each call starts an all-reduce of its flag
        in the background (on the CPU group: no GPU sync) and reads the previous call's, which
        has finished by then unless another rank is more than a call behind. Call it once per
        step on every rank; a single process answers at once."""
        global _PENDING_VOTE
        if not self.enabled:
            return flag
        vote = torch.tensor([int(flag)])
        work = dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=_cpu_group(), async_op=True)
        previous, _PENDING_VOTE = _PENDING_VOTE, (work, vote)
        if previous is None:
            return False
        previous[0].wait()
        return bool(previous[1].item())


_CPU_GROUP: dist.ProcessGroup | None = None
_PENDING_VOTE: tuple[dist.Work, torch.Tensor] | None = None  # any_one_step_late's last call


def mesh_shape(world_size: int, pp: int, tp: int) -> tuple[int, int, int]:
    """(pp, dp, tp) for `world_size` processes: dp takes the processes the others leave."""
    if world_size % (pp * tp):
        raise ConfigError(
            f"{world_size} processes cannot form {pp} pipeline stage(s) x {tp} tensor shard(s): "
            f"launch a multiple of {pp * tp} processes (torchrun --nproc_per_node), or change "
            "opt.pp.degree / opt.tp.degree"
        )
    return pp, world_size // (pp * tp), tp


def hsdp_shards(dp_size: int, replicas: int) -> int:
    """The processes each of HSDP's `replicas` shards the model over; refuses a count that
    `replicas` does not divide."""
    if dp_size % replicas:
        raise ConfigError(
            f"opt.fsdp.replicas={replicas} does not divide the {dp_size} data-parallel processes "
            "(the processes over opt.pp.degree x opt.tp.degree): choose a divisor, e.g. the "
            "number of machines"
        )
    return dp_size // replicas


def _cpu_group() -> dist.ProcessGroup:
    global _CPU_GROUP
    if _CPU_GROUP is None:
        _CPU_GROUP = dist.new_group(backend="gloo", timeout=HOST_TIMEOUT)
    return _CPU_GROUP


def backend(device: torch.device) -> str:
    """The default group's backend: NCCL for GPU tensors plus gloo for CPU tensors on a GPU
    (DTensors offloaded to the CPU, as FSDP's cpu_offload keeps them, reduce through gloo: e.g.
    the gradient norm in clip_grad_norm_); gloo alone on a CPU."""
    return "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"


def init_process_group(device: torch.device, **how: Any) -> None:
    """Creates the default process group for `device`, and the CPU group for host-side flags
    and waits. `how` is passed to `torch.distributed.init_process_group`: empty under torchrun
    (it reads RANK, WORLD_SIZE, MASTER_ADDR/PORT), or e.g. `rank=0, world_size=1,
    store=dist.HashStore()` for a group of one process."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group(backend=backend(device), device_id=device, **how)
    else:
        dist.init_process_group(backend=backend(device), **how)
    _cpu_group()  # created now, collectively, before anything can be unequal between ranks


def init(device_choice: str) -> Distributed:
    """Joins the process group when launched by torchrun (dying with its agent:
    `die_with_launcher`); otherwise a world of one."""
    die_with_launcher()
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = resolve_device(device_choice, local_rank)
    if world_size > 1 and not dist.is_initialized():
        init_process_group(device)
    return Distributed(rank, local_rank, world_size, device)


_launcher_pid: int | None = None  # the torchrun agent this worker dies with


def die_with_launcher() -> None:
    """Under torchrun on Linux, has the kernel send this worker SIGTERM when its agent dies: an
    agent killed outright (SIGKILL, the OOM killer) forwards no signal, and its workers, each in
    a session of its own, would go on training unseen, holding the run folder's lock. The stop
    handler then saves and exits like at any SIGTERM, saying why (`launcher_died`). An agent
    already gone when this runs (the signal is asked for too late) is reported at once."""
    global _launcher_pid
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ
    if not under_torchrun or not sys.platform.startswith("linux") or _launcher_pid is not None:
        return
    agent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        return  # refused (a sandbox): the worker lives on as without it
    _launcher_pid = agent
    if os.getppid() != agent:  # it died before the kernel would tell: nothing trained yet
        raise Reported(
            "the torchrun agent that launched this trainer is gone: stopping before training; "
            "launch the run again"
        )


def launcher_died(wait_s: float = 1.0) -> bool:
    """Whether the torchrun agent this worker was set to die with (`die_with_launcher`) has
    died: this process then belongs to another parent. The kernel sends the signal when the
    agent's thread that started this worker exits; when the whole agent is killed, that thread
    may go before the agent's last one, and until then this process still counts the agent as
    its parent: so the answer waits up to `wait_s` for the parent to change."""
    if _launcher_pid is None:
        return False
    deadline = time.monotonic() + wait_s
    while os.getppid() == _launcher_pid:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def shutdown() -> None:
    global _CPU_GROUP, _PENDING_VOTE
    if _PENDING_VOTE is not None:  # every rank started it: it completes
        _PENDING_VOTE[0].wait()
    if dist.is_initialized():
        if torch.cuda.is_initialized():
            # CUDA graphs that captured collectives (compile's reduce-overhead under tp, pp or
            # DDP) hold their communicators: destroying the group under them can hang.
            # Resetting compile frees the graphs.
            torch.compiler.reset()
        _destroy_process_group_within(SHUTDOWN_TIMEOUT_S)
    _CPU_GROUP, _PENDING_VOTE = None, None


def _destroy_process_group_within(seconds: float) -> None:
    """Destroys the process group; if that has not returned after `seconds`, this process says
    so and exits with status 0: `shutdown` comes after the run's results are written."""
    returned = threading.Event()

    def exit_if_stuck() -> None:
        if not returned.wait(seconds):
            rank = os.environ.get("RANK", "0")
            print(
                f"[train] rank {rank}: the process group did not shut down within {seconds:.0f} s; "
                "exiting without it (the run's results are saved)",
                flush=True,
            )
            os._exit(0)

    threading.Thread(target=exit_if_stuck, name="shutdown-watchdog", daemon=True).start()
    dist.destroy_process_group()
    returned.set()


def launcher() -> list[str]:
    """The words that start this run again, for the commands it prints (`continue: ...`): torchrun
    with the process count that started it (from the variables torchrun gives each worker), or
    `python` for a single process. The torchrun is `python -m launch.torchrun`, whose Ctrl-C or
    SIGTERM exits 0 once the trainers saved (stock torchrun's ends in a traceback, exit 1), so the
    printed way to continue is the clean way to stop. Across machines the rendezvous endpoint is
    not known to the workers: the command then names it as a placeholder to fill in."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world == 1:
        return ["python"]
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nnodes = max(world // per_node, 1)
    torchrun = ["python", "-m", "launch.torchrun"]  # launch/torchrun.py
    if nnodes == 1:
        return [*torchrun, "--standalone", f"--nproc_per_node={per_node}"]
    return [
        *torchrun,
        f"--nnodes={nnodes}",
        f"--nproc_per_node={per_node}",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=<host:port of the first machine>",
    ]
