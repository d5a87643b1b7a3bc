"""Reading a run's checkpoint, whoever wrote the folder: the latest (the one file or the DCP
step `LATEST` names, chosen by the step each records, never by file times), the best, or a
kept step; each file checked against its checksums first, `checkpoint.pt` and `meta.pt` read
through `weights_only`, DCP's files through safe_load.py. And what the tools build from it in
one process: the trained model (`load_model`), a sharded checkpoint's state whole
(`unsharded`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from base.errors import ConfigError, MissingFile, Unusable
from checkpointing.checksums import CHECKSUMS, check_checksums, checksums_of
from checkpointing.folder import (
    BEST,
    FILENAME,
    HISTORY,
    META,
    SHARDED,
    STEP_FOLDER,
    complete_step,
    latest_folder,
    step_of,
)
from checkpointing.safe_load import dcp_load, read_metadata
from checkpointing.state_layout import StateLayout, tied_parameters, unflattened


def read(run_dir: Path, *, verify: bool = False, which: str | int = "latest") -> dict[str, Any]:
    """The run's checkpoint onto the CPU, accepting only tensors and plain containers: the whole
    state of a `checkpoint.pt`, or a sharded checkpoint's metadata plus `sharded`, its folder
    (the weights stay on disk until `restore` or `load_model` reads them into place). Its files
    are checked against their checksums first (`verify`: every file hashed whole). Both layouts
    at the same step (a consolidated run): the one file; at different steps: refused.
    `which`: the latest, `best` (train.keep_best) or a step the run keeps (an int or step-<N>)."""
    if which != "latest":
        return _read_kept(run_dir, which, verify)
    path, latest = run_dir / FILENAME, run_dir / SHARDED / "LATEST"
    found = []
    if path.exists():
        found.append(_read_file(path, verify))
    if latest.exists():
        found.append(_read_sharded(run_dir, verify))
    if not found:
        raise MissingFile(
            f"there is no checkpoint at {path}: point at the folder of a run that saved one "
            "(train.checkpoint_interval > 0, or a run that reached its end or was stopped)"
        )
    if len(found) == 2 and found[0]["step"] != found[1]["step"]:
        steps = {path: found[0]["step"], run_dir / SHARDED: found[1]["step"]}
        older = min(steps, key=steps.__getitem__)
        raise Unusable(
            f"{run_dir} holds two checkpoints, {FILENAME} at step {found[0]['step']} and "
            f"{SHARDED}/ at step {found[1]['step']}: remove the stale one (the older is "
            f"{older}) and run again"
        )
    return found[0]


def _read_file(path: Path, verify: bool) -> dict[str, Any]:
    check_checksums(checksums_of(path), full=verify)
    return torch.load(path, map_location="cpu", weights_only=True)


def _read_kept(run_dir: Path, which: str | int, verify: bool) -> dict[str, Any]:
    """The best checkpoint, or the one of a step that the run keeps (train.keep_checkpoints)."""
    if which == "best":
        if not (run_dir / BEST / "LATEST").exists():
            raise MissingFile(
                f"checkpoint=best: {run_dir} keeps no best checkpoint (a run with "
                "train.keep_best=true does): use checkpoint=latest or a step"
            )
        return read(latest_folder(run_dir / BEST), verify=verify)
    name = str(which) if str(which).startswith("step-") else f"step-{which}"
    if not STEP_FOLDER.fullmatch(name):
        raise ConfigError(f"checkpoint={which}: choose latest, best, or a step number")
    name = f"step-{step_of(Path(name)):08d}"
    if (run_dir / HISTORY / name).is_dir():
        return read(run_dir / HISTORY / name, verify=verify)
    if complete_step(run_dir / SHARDED / name):
        return _read_step_folder(run_dir / SHARDED / name, verify)
    state = read(run_dir, verify=verify)
    if state["step"] == step_of(Path(name)):
        return state
    folders = [*run_dir.glob(f"{HISTORY}/step-*"), *run_dir.glob(f"{SHARDED}/step-*")]
    kept = sorted(
        {step_of(p) for p in folders if STEP_FOLDER.fullmatch(p.name) and complete_step(p)}
        | {state["step"]}
    )
    raise MissingFile(
        f"checkpoint={which}: {run_dir} keeps no checkpoint of that step; it keeps steps "
        f"{', '.join(map(str, kept))}"
    )


def _read_sharded(run_dir: Path, verify: bool) -> dict[str, Any]:
    return _read_step_folder(latest_folder(run_dir / SHARDED), verify)


def _read_step_folder(folder: Path, verify: bool) -> dict[str, Any]:
    check_checksums(folder / CHECKSUMS, full=verify)
    read_metadata(folder / ".metadata")  # refused here in one line, before DCP is handed it
    state = torch.load(folder / META, map_location="cpu", weights_only=True)
    return {**state, "sharded": folder}


def load_model(
    run_dir: Path,
    device: torch.device | str = "cpu",
    *,
    verify: bool = False,
    which: str | int = "latest",
) -> tuple[Any, dict[str, Any]]:
    """A trained model from a run folder, rebuilt from its checkpoint alone (the model's saved
    shape, then its weights; a sharded checkpoint is read whole in this one process), and the
    run's saved config: for sampling, evaluation, export. `which`: as `read`'s."""
    from model import GPT, GPTConfig

    state = read(run_dir, verify=verify, which=which)
    check_shape(state, None)
    model = GPT(GPTConfig(**state["model_config"]))
    if "sharded" in state:
        weights = load_sharded(state["sharded"], model, {"model": model.state_dict()}, no_dist=True)
        model.load_state_dict(weights["model"])
    else:
        model.load_state_dict(state["model"])
    return model.to(device), state["config"]


def unsharded(state: dict[str, Any]) -> dict[str, Any]:
    """A sharded checkpoint's (`read`'s state) model and optimizer state, whole in this
    process, as `checkpoint.pt` holds them (tied parameters under each name)."""
    from model import GPT, GPTConfig

    check_shape(state, None)
    whole: dict[str, Any] = {}
    dcp_load(whole, state["sharded"], whole=True)
    with torch.device("meta"):  # only the names of the tied parameters
        tied = tied_parameters(GPT(GPTConfig(**state["model_config"])))
    for name, saved_as in tied.items():
        whole["model"].setdefault(name, whole["model"][saved_as])
    if state.get("flat_optimizer") and "optimizer" in whole:
        whole["optimizer"] = unflattened(whole["optimizer"], skip=set(tied))
    return whole


def check_shape(state: dict[str, Any], config: Any) -> None:
    """Refuses a checkpoint whose model shape differs from `config` (a GPTConfig; None: only
    checks that the checkpoint records its shape), naming the first setting that differs."""
    saved = state.get("model_config")
    if saved is None:
        raise ConfigError(
            "this checkpoint was written by an older version of the recipe (it has no "
            "model_config): start a new run"
        )
    for key, value in (dataclasses.asdict(config) if config else {}).items():
        if key in saved and saved[key] != value and key != "dropout":
            raise ConfigError(
                f"the checkpoint's model has {key}={saved[key]!r}, this run's has {value!r}: "
                f"set model.{key}={saved[key]!r} (or start a new run folder)"
            )


def load_sharded(
    folder: Path,
    model: torch.nn.Module,
    states: dict[str, Any],
    layouts: Sequence[StateLayout] = (),
    **kwargs: Any,
) -> dict[str, Any]:
    """Fills `states` ({"model": its state dict, ...}) from the DCP checkpoint in `folder`, the
    tied parameters read once and tied again, the stages' `layouts` undone; returns `states`."""
    tied = {k: v for k, v in tied_parameters(model).items() if k in states["model"]}
    states["model"] = {k: v for k, v in states["model"].items() if k not in tied}
    own = states
    for layout in layouts:
        states = layout.saved(states)
    dcp_load(states, folder, **kwargs)
    for layout in reversed(layouts):
        states = layout.own(states, own)
    for name, saved_as in tied.items():
        states["model"][name] = states["model"][saved_as]
    return states
