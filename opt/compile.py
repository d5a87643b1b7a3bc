"""`+opt=compile`: torch.compile. TorchDynamo captures the Python code as graphs and Inductor
generates fused Triton (GPU) or C++ (CPU) kernels: fewer launches and fewer round trips of
activations through memory.

- scope=model compiles the whole forward (and the loss) as one graph: the most fusion. Under
  DDP, compile's DDP optimizer splits that graph at the gradient buckets (opt.ddp.optimize_ddp).
  Under FSDP, whose hooks run around every block, one graph cannot span the block loop (dynamo
  would skip the whole forward and run it eagerly): the same code is compiled in the pieces
  between those hooks instead, each block, `embed` and `head` (the final norm, the tied head
  and the loss), each as one graph (fullgraph), as torchtitan does.
- Under a pipeline (+opt=pp) without FSDP or tp, scope=model compiles each pipeline stage's forward
  (its blocks, with the embeddings on the first) as one graph, once +opt=pp has built the
  stages (`Plan.compile_later`), and the head with the loss, which the schedule's loss function
  runs, as one more: a rank runs its stage once per micro-batch, and per-block
  graphs made that a compiled call per block and micro-batch (GPT-2 large over 2 GPUs: 152 a
  step, their wrappers ~70 ms of a 635 ms host-bound step, traced).
- scope=block compiles each transformer block; the blocks share one compiled graph, which
  compiles faster and keeps the boundaries that DDP/FSDP overlap communication on.
Everything compiles in place (`nn.Module.compile` for the whole model, a method replaced on the
instance for the pieces): the module and its parameter names stay the same.

Warm start: `cache_dir` is Inductor's on-disk cache (FX graphs, AOTAutograd graphs, generated
kernels, Triton's binaries and tuning). A second launch with the same code, shapes and torch finds
its graphs there and skips the compilation (summary.json: `compile_s`, `compile_warm`).

Each precision has its own subfolder (`<cache_dir>/bfloat16`; torch-workaround(<2.13)): torch 2.11
keys AOTAutograd's cached graphs on whether autocast is on, not on its dtype
(pytorch/pytorch#181564; 2.13 keys the dtype), so a bfloat16 launch after a float16 one can load the
float16 graph and train in float16 with no loss scaler: reproduced on a CPU with torch 2.11, and the
likely cause of the speed ladder's diverged bf16 rows on an H100
(docs/results/nvidia-h100-80gb-hbm3/speed_bf16_cache.md).

Inductor's looped reductions (rows wider than 1024, on CUDA) can read back a buffer the same
kernel stored in an earlier loop over the row, laid out over the warps differently: with no barrier
between them a warp reads values another warp has not yet stored (pytorch/pytorch#190517). It hit
gpt2-large and gpt2-xl under +opt=custom_op: the final norm's kernel stores the normalised rows,
which backward keeps, then reloads them for the bfloat16 copy the fused head takes, which held
some pre-norm values (30% off at the first step, the loss rising to 678 in 12 steps). Until
torch emits the barrier itself, `barrier_before_reloads` makes Inductor emit it
(torch-workaround(unfixed)).

Only a private cache is used: Inductor and AOTAutograd unpickle its entries and import its
generated code without any check, so whoever can write the folder runs code in every later
compiled launch. The folder (and each precision's) must be owned by this user and writable by no
one else; the default is a per-user folder apart from the data cache (which may be shared), made
with mode 0700, and with `cache_dir: null` Inductor's own default folder is held to the same rule.
So is the folder of every other compile in the recipe (`sample.py compile=true`, the low-bit
optimizer's compiled update): each calls `ready_inductor` first.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch._dynamo
from omegaconf import DictConfig
from torch._inductor.custom_graph_pass import CustomGraphPass

from base.distributed import log
from base.errors import ConfigError, Unusable
from opt.stage import Context, Stage

Mode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
# The modes whose compiled step Inductor replays as CUDA graphs.
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
Scope = Literal["model", "block"]


def check_compile(cfg: DictConfig) -> None:
    """Refuses knobs that cannot work, before any work starts (opt.plan calls it)."""
    backends = torch._dynamo.list_backends(exclude_tags=())
    if cfg.backend not in backends:
        raise ConfigError(
            f"opt.compile.backend={cfg.backend!r}: choose one of {', '.join(sorted(backends))}"
        )


def cache_folder(cache_dir: str, amp_dtype: torch.dtype | None) -> Path:
    """Inductor's cache folder for a run in `amp_dtype` (None: no autocast): one subfolder of
    `cache_dir` per precision, so that no run loads a graph traced under another autocast dtype."""
    precision = str(amp_dtype).removeprefix("torch.") if amp_dtype is not None else "float32"
    return Path(cache_dir).expanduser() / precision


def private_cache(folder: Path) -> Path:
    """`folder`, made with mode 0700 if missing; refused in one line unless it is this user's
    own and writable by no one else (anyone who can write an Inductor cache runs code in the
    launches that read it). Returns `folder`."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = folder.stat()
    except OSError as e:
        raise Unusable(
            f"cannot make the compile cache {folder} ({e.strerror}): set opt.compile.cache_dir "
            "to a folder of your own"
        ) from e
    if info.st_uid != os.getuid():
        problem = f"is owned by user id {info.st_uid}, not by you ({os.getuid()})"
    elif info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = f"is writable by others (mode {stat.filemode(info.st_mode)})"
    else:
        return folder
    raise Unusable(
        f"the compile cache {folder} {problem}: Inductor's cache holds pickles and compiled code "
        "that torch.compile loads and runs, so only a folder of your own is used; set "
        "opt.compile.cache_dir to a new folder (it is made private) or delete that one"
    )


def _inductor_default() -> Path:
    """The folder Inductor uses when the recipe sets none: TORCHINDUCTOR_CACHE_DIR, else its
    default in the shared temporary folder (`/tmp/torchinductor_<user>`)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()).absolute()


class _ReloadBarrierKey(CustomGraphPass):
    """Changes no graph: its uuid enters Inductor's cache keys, so that graphs generated before
    `barrier_before_reloads` (without the barriers) are never loaded from a cache."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        pass

    def uuid(self) -> str:
        return "gpt2-recipe: tl.debug_barrier() before each reload of a stored buffer, v1"


def barrier_before_reloads() -> None:
    """Makes Inductor's Triton kernels wait for every warp's stores (`tl.debug_barrier()`) before
    they load a buffer they stored in an earlier loop of a reduction (the race in the module's
    docstring); process-wide, once. Kernels without such a reload are unchanged."""
    from torch._inductor import config as inductor_config
    from torch._inductor.codegen.triton import TritonKernel

    if inductor_config.post_grad_custom_pre_pass is None:
        inductor_config.post_grad_custom_pre_pass = _ReloadBarrierKey()
    load = TritonKernel.load
    if getattr(load, "barrier_before_reloads", False):
        return

    def load_after_barrier(self: TritonKernel, name: str, index: Any) -> Any:
        if name not in self.cse.invalidated_stores:  # not stored by an earlier loop
            return load(self, name, index)
        pick = self.get_load_buffer  # where the load's line goes: the loop, or before it

        def barrier_then(indexing: Any) -> Any:
            lines = pick(indexing)
            lines.writeline("tl.debug_barrier()")
            return lines

        self.get_load_buffer = barrier_then  # type: ignore[method-assign]
        try:
            return load(self, name, index)
        finally:
            del self.get_load_buffer

    load_after_barrier.barrier_before_reloads = True  # type: ignore[attr-defined]
    TritonKernel.load = load_after_barrier  # type: ignore[method-assign]


def ready_inductor(cache_dir: str | None, amp_dtype: torch.dtype | None = None) -> None:
    """What any `torch.compile` of the recipe's needs first (the stage, `sample.py compile=true`,
    the low-bit optimizer's compiled update): Inductor's cache folder private, or refused in one
    line (`cache_dir`'s folder for `amp_dtype`, made the one Inductor uses; None: Inductor's
    own), and the barrier before reloads. Inductor reads the folder when it first compiles,
    lazily: this must run before that."""
    if cache_dir:  # the folder and its precision's: whoever can write it can swap the other
        folder = cache_folder(cache_dir, amp_dtype)
        private_cache(folder.parent)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(private_cache(folder))
    else:
        private_cache(_inductor_default())
    barrier_before_reloads()


def apply_compile(
    model: torch.nn.Module,
    cfg: DictConfig,
    sharded: bool = False,
    amp_dtype: torch.dtype | None = None,
    later: bool = False,
) -> Callable[[torch.nn.Module], None]:
    """Compiles `model` in place; `sharded`: FSDP will wrap it (compile it in pieces); `later`:
    compile none of it now, a later stage compiles the modules it builds; `amp_dtype`: the
    autocast dtype it will run under (+opt=amp's), which picks its cache folder. Returns what
    compiles a module's forward whole with these knobs."""
    check_compile(cfg)
    # Process-wide, set (or reset) on every call like tf32: Inductor's kernel tuning.
    import torch._inductor.config as inductor_config

    inductor_config.coordinate_descent_tuning = cfg.coordinate_descent
    ready_inductor(cfg.cache_dir, amp_dtype)
    # Inductor's modes; other backends take none.
    options = {"backend": cfg.backend, "mode": cfg.mode if cfg.backend == "inductor" else None}

    def compile_forward(module: torch.nn.Module) -> None:
        _compile_method(module, "forward", fullgraph=cfg.fullgraph, **options)

    if later:  # the head (and loss) runs in the schedule's loss function, outside any stage
        _compile_method(model, "head", fullgraph=True, **options)
        pieces = "the head now, each pipeline stage whole once +opt=pp has built them"
    elif cfg.scope == "model" and not sharded:
        model.compile(fullgraph=cfg.fullgraph, **options)
        pieces = "the whole model"
    elif cfg.scope == "model":
        for block in model.transformer.h:
            _compile_method(block, "forward", fullgraph=True, **options)
        for method in ("embed", "head"):  # called by the model's own forward
            _compile_method(model, method, fullgraph=True, **options)
        pieces = "each block, embed and head (FSDP's hooks or a pipeline between them), fullgraph"
    else:
        for block in model.transformer.h:
            _compile_method(block, "forward", fullgraph=cfg.fullgraph, **options)
        pieces = "each block"
    log(
        f"[opt] compile: {pieces}; mode={cfg.mode}, backend={cfg.backend}, scope={cfg.scope}, "
        f"fullgraph={cfg.fullgraph}, coordinate_descent={cfg.coordinate_descent}, "
        f"cache {os.environ.get('TORCHINDUCTOR_CACHE_DIR', 'default')}"
    )
    return compile_forward


def _compile_method(owner: object, name: str, **options: Any) -> None:
    """Replaces the bound method `owner.<name>` with its compiled version, on the instance.
    A module's hooks (FSDP's) stay outside the graph, and a block's `forward` that activation
    checkpointing replaced is traced through `checkpoint` (compiling the module itself would
    start tracing inside torch's checkpoint code, capture nothing and run eagerly)."""
    setattr(owner, name, torch.compile(getattr(owner, name), **options))


@dataclass
class Knobs:
    mode: Mode
    fullgraph: bool
    scope: Scope
    backend: str  # one of torch._dynamo.list_backends(): checked by check_compile
    coordinate_descent: bool
    cache_dir: str | None


def _apply(ctx: Context) -> None:
    # Under FSDP (and offload's FSDP), in pieces: each block, embed and head. Under pp alone,
    # each stage whole, once built; with scope=block, FSDP or tp its blocks, embed and head (a
    # tp stage's residual stream enters and leaves DTensor inside it: compiled whole, its
    # backward recursed without end on torch 2.13, reproduced on CPUs).
    parallel = ctx.plan.parallel
    pieces = parallel.fully_sharded or parallel.pp_enabled
    later = (
        parallel.pp_enabled
        and not (parallel.fully_sharded or parallel.tp_enabled)
        and ctx.knobs.scope == "model"
    )
    compile_forward = apply_compile(
        ctx.model, ctx.knobs, sharded=pieces, amp_dtype=ctx.plan.amp_dtype, later=later
    )
    if later:
        ctx.plan.compile_later = compile_forward


def _plan(ctx: Context) -> None:
    ctx.plan.compiled = True


STAGE = Stage(
    "compile", "model", _apply, Knobs, check=lambda ctx: check_compile(ctx.knobs), plan=_plan
)
