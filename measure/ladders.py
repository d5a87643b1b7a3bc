"""A ladder read: conf/ablate/ladder/<name>.yaml composed with the harness's own config, what
each step runs (its stages, overrides and processes, accumulated over the steps before it), and
which steps a call measures, how often and in what order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import base.errors

ROOT = Path(__file__).resolve().parents[1]
# The harness's own config, apart from conf/'s groups: train.py's search path does not see it.
CONF = ROOT / "conf" / "ablate"


def config(overrides: list[str]) -> DictConfig:
    """The harness's config (conf/ablate/ablate.yaml and its ladder), as `python
    scripts/ablate.py <overrides>` composes it."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("ablate", overrides=overrides)


def read(name: str) -> DictConfig:
    """The ladder conf/ablate/ladder/<name>.yaml."""
    return config([f"ladder={name}"]).ladder


def strategy(stages: list[str], gpus: int) -> str:
    """How a step spreads over its GPUs: the model-splitting and sharding stages it runs
    ("pp x tp x fsdp"), else "ddp" on several GPUs (the default there), "single" on one."""
    spread = [s for s in ("pp", "tp", "fsdp") if s in stages]
    return " x ".join(spread) if spread else "ddp" if gpus > 1 else "single"


def step_plans(ladder: DictConfig) -> list[dict[str, Any]]:
    """What each step runs: its stages and overrides (after the workload's), accumulated when the
    ladder is cumulative, less the stages it drops (and their knobs), and its processes."""
    common = list(ladder.get("opt", []))
    overrides: list[str]
    plans, stages, overrides = [], common, []
    names = [step.name for step in ladder.steps]
    for index, step in enumerate(ladder.steps):
        vs = step.get("vs")
        if vs is not None and vs not in names[:index]:
            raise base.errors.ConfigError(
                f"ladder {ladder.get('name')}: step {step.name} has vs={vs}, which is not a step "
                f"above it ({names[:index]}): name the step its gains compare with"
            )
        if not ladder.cumulative:
            stages, overrides = common, []
        stages = stages + [s for s in step.get("opt", []) if s not in stages]
        dropped = step.get("drop", [])
        stages = [s for s in stages if s not in dropped]
        # A dropped stage's knobs go with it (its config group is no longer composed).
        overrides = [o for o in overrides if not o.startswith(tuple(f"opt.{d}." for d in dropped))]
        overrides = overrides + list(step.get("overrides", []))
        nproc, nnodes = step.get("nproc", 1), step.get("nnodes", 1)
        cap = step.get("memory_cap_gib")  # this step's only
        env = {str(k): str(v) for k, v in step.get("env", {}).items()}  # this step's only
        plans.append(
            {
                "index": index,
                "name": step.name,
                "what": step.get("what", ""),
                "stages": stages,
                "overrides": overrides,
                "nproc": nproc,
                "nnodes": nnodes,
                "gpus": nproc * nnodes,
                "strategy": strategy(stages, nproc * nnodes),
                **({"vs": vs} if vs else {}),
                **({"memory_cap_gib": cap} if cap else {}),
                **({"env": env} if env else {}),
            }
        )
    return plans


def selection(cfg: DictConfig, plans: list[dict]) -> tuple[list[dict], dict | None]:
    """The steps this call measures (ladder order) and its anchor: `anchor=<step>`, else, when
    the first of `steps=[...]` is not the ladder's first, the step its row is compared with (its
    `vs`, the one above it in a cumulative ladder, the baseline), so that its ratio comes from
    this call too; `anchor=none`: no anchor (the steps compare among
    themselves, e.g. a multi-GPU row with the 1-GPU row of its size). Unknown or repeated names
    are refused up front."""
    ladder, names = cfg.ladder, [p["name"] for p in plans]
    where = f"ladder {ladder.name} (conf/ablate/ladder/{ladder.name}.yaml)"
    if repeated(names):
        raise base.errors.ConfigError(
            f"{where} names {repeated(names)} more than once; rename them"
        )
    wanted = list(cfg.steps) if cfg.steps else names
    if repeated(wanted):
        raise base.errors.ConfigError(f"steps={wanted} names {repeated(wanted)} more than once")
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        raise base.errors.ConfigError(f"steps {unknown} are not in {where}: {names}")
    chosen = [p for p in plans if p["name"] in wanted]
    if cfg.get("anchor") == "none":
        return chosen, None
    if cfg.get("anchor"):
        if cfg.anchor not in names:
            raise base.errors.ConfigError(f"anchor={cfg.anchor} is not a step of {where}: {names}")
        if cfg.anchor in wanted:
            raise base.errors.ConfigError(f"anchor={cfg.anchor} is one of steps={wanted}; drop it")
        return chosen, plans[names.index(cfg.anchor)]
    first = chosen[0]["index"]
    candidate: dict | None
    if chosen[0].get("vs"):
        candidate = plans[names.index(chosen[0]["vs"])]
    elif ladder.cumulative:
        candidate = plans[first - 1] if first > 0 else None
    else:
        reference = ladder.get("reference")
        candidate = plans[names.index(reference)] if reference else plans[0]
    return chosen, None if candidate is None or candidate["name"] in wanted else candidate


def check_device(cfg: DictConfig) -> None:
    """A ladder that measures a GPU's work (its workload does not say device=cpu), on a machine
    without a GPU: refused up front, naming the ladder sized for a CPU. A step would otherwise
    train its model on the CPU for hours, or until the kernel kills it for its memory."""
    ladder = cfg.ladder
    if torch.cuda.is_available() or "device=cpu" in [*ladder.workload, *cfg.extra]:
        return
    model = next((w for w in ladder.workload if w.startswith("model=")), "its model")
    raise base.errors.ConfigError(
        f"ladder={ladder.name} measures {model} on a GPU, and this machine has none: use "
        "ladder=quick, sized for a CPU (or \"extra=['device=cpu']\" to run this one anyway)"
    )


def repeated(names: list[str]) -> list[str]:
    return sorted({n for n in names if names.count(n) > 1})


def repeat_count(cfg: DictConfig, ladder: DictConfig) -> int:
    """How often each step runs: `repeats=N`, else the ladder's `repeats`, else 3 on a GPU (where
    a few percent decide a row) and 1 on a CPU (where the harness itself is what is tried)."""
    for value in (cfg.get("repeats"), ladder.get("repeats")):
        if value is not None:
            if not isinstance(value, int) or value < 1:
                raise base.errors.ConfigError(f"repeats={value}: give a whole number of runs, >= 1")
            return value
    return 3 if torch.cuda.is_available() else 1


def interleaved(plans: list[dict], repeats: int) -> list[tuple[int, dict]]:
    """(repeat, step) in running order, A B C A B C ...: a drift of the machine (clocks,
    temperature, a neighbour) then touches every step alike instead of the last ones."""
    return [(repeat, plan) for repeat in range(repeats) for plan in plans]


def in_ladder_order(plans: list[dict], rows: dict[str, dict]) -> list[dict]:
    """The rows of the ladder's steps, in its order and numbered by it: a row kept from an
    earlier call keeps its measurement but takes its step's place now (a step added before it
    moves it down)."""
    return [{**rows[p["name"]], "index": p["index"]} for p in plans if p["name"] in rows]
