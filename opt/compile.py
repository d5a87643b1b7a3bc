"""`+opt=compile`: torch.compile. TorchDynamo captures the Python code as graphs and Inductor
generates fused Triton (GPU) or C++ (CPU) kernels: fewer launches and fewer round trips of
activations through memory.

- scope=model compiles the whole forward (and the loss) as one graph: the most fusion.
- scope=block compiles each transformer block; the blocks share one compiled graph, which
  compiles faster and keeps the boundaries that DDP/FSDP overlap communication on.
Both compile in place (`nn.Module.compile`): the module and its parameter names stay the same.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from recipe.distributed import log

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
SCOPES = ("model", "block")


def apply_compile(model: torch.nn.Module, cfg: DictConfig) -> None:
    if cfg.mode not in MODES:
        raise ValueError(f"opt.compile.mode={cfg.mode!r}: choose one of {', '.join(MODES)}")
    if cfg.scope not in SCOPES:
        raise ValueError(f"opt.compile.scope={cfg.scope!r}: choose one of {', '.join(SCOPES)}")
    targets = [model] if cfg.scope == "model" else list(model.transformer.h)
    for module in targets:
        module.compile(mode=cfg.mode, fullgraph=cfg.fullgraph)
    log(f"[opt] compile: mode={cfg.mode}, scope={cfg.scope}, fullgraph={cfg.fullgraph}")
