"""Resuming: a checkpoint's state put back into the run that continues it (`restore`), sharded
as its model now is, whatever the stages or the process count: the weights, the optimizer's
state (afresh when the optimizer changed), the grad scaler and each rank's RNG states."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from base.distributed import log
from checkpointing.reader import load_sharded
from checkpointing.state_layout import StateLayout, optimizer_options


def restore(
    state: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    rank: int = 0,
    layouts: Sequence[StateLayout] = (),
) -> int:
    """Puts a checkpoint's state back, sharded as the model now is (a sharded checkpoint is
    resharded by DCP: another process count, or one process); returns its step. The stages may
    differ from the saved run's: a float16 scaler starts afresh when the run was saved without
    one, and a saved scale is dropped when this run needs none; the optimizer's state starts
    afresh too when the optimizer changed (+opt=lowbit added or removed, its bits changed).
    Each rank takes its own saved RNG states (rank modulo the saved ranks, when there are now
    more)."""
    same_optimizer = _same_optimizer(state, optimizer)
    if "sharded" in state:
        options = optimizer_options(state.get("flat_optimizer", False))
        loaded: dict[str, Any] = {"model": get_model_state_dict(model)}
        if same_optimizer:
            loaded["optimizer"] = get_optimizer_state_dict(model, optimizer, options=options)
        loaded = load_sharded(state["sharded"], model, loaded, layouts)
        _set_state(model, optimizer, loaded["model"], loaded.get("optimizer"), options=options)
    else:
        optim_state = state["optimizer"] if same_optimizer else None
        full = StateDictOptions(full_state_dict=True)
        # Each layout reads what it needs before set_state_dict changes the state dicts.
        finish = [
            layout.restore_whole(model, optimizer, state["model"], optim_state)
            for layout in layouts
        ]
        _set_state(model, optimizer, state["model"], optim_state, options=full)
        for done in finish:
            done()
    if state["scaler"] and scaler.is_enabled():
        scaler.load_state_dict(state["scaler"])
    rng = state["rng"][rank % len(state["rng"])]
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return state["step"]


def _same_optimizer(state: dict[str, Any], optimizer: torch.optim.Optimizer) -> bool:
    """Whether the checkpoint's optimizer state is this optimizer's kind (AdamW, torchao's
    AdamW8bit or AdamW4bit): another's state cannot be loaded into it, so it starts afresh,
    saying so. A checkpoint that does not record it (older versions) is taken as the same."""
    now = type(optimizer).__name__
    saved = state.get("optimizer_class", now)
    if saved != now:
        log(
            f"[resume] the checkpoint's optimizer state is {saved}'s, this run steps with {now}: "
            f"{now}'s state starts afresh (the weights, step and data position are restored)"
        )
    return saved == now


def _set_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: dict[str, Any],
    optim_state: dict[str, Any] | None,
    options: StateDictOptions | None = None,
) -> None:
    """Loads the weights, and the optimizer state unless it is None (another optimizer's)."""
    if optim_state is None:
        set_model_state_dict(model, model_state, options=options)
    else:
        set_state_dict(
            model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
            options=options,
        )  # fmt: skip
