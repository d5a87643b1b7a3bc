"""How the model's and the optimizer's state are laid out in a sharded (DCP) checkpoint: tied
parameters saved once, under the name they are tied to; under +opt=pp the optimizer state keyed
per parameter (flattened), and unflattened again for one file; and the layouts of the stages
whose parameters DCP cannot take as they are (`StateLayout`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions


class StateLayout(Protocol):
    """How a stage's parameters are laid out in a checkpoint when DCP or `set_state_dict` cannot
    take them as they are (a stage's `checkpoint_layout`: +opt=tp's strided QKV, opt/tp.py). The
    trainer hands the selected stages' layouts to `Saver` and `restore`."""

    def saved(self, tree: Any) -> Any:
        """`tree` ({"model": ..., "optimizer": ...}) as DCP saves and loads it."""

    def own(self, tree: Any, like: Any) -> Any:
        """`tree`, loaded as `saved` laid it out, in the layout of `like`, the model's own."""

    def restore_whole(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        model_state: dict[str, Any],
        optim_state: dict[str, Any] | None,
    ) -> Callable[[], None]:
        """Called before a whole (one-file) checkpoint's state is set into `model` and
        `optimizer`: what puts the stage's parameters in place once it is."""


def tied_parameters(model: torch.nn.Module) -> dict[str, str]:
    """Parameters that are another one (GPT's lm_head.weight is transformer.wte.weight):
    {name: the name it is saved under}. DCP would write each name's copy; one is saved."""
    first: dict[int, str] = {}
    ties = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(param), name) != name:
            ties[name] = first[id(param)]
    return ties


def optimizer_options(flat: bool) -> StateDictOptions:
    """The optimizer state keyed per parameter (`state.<name>.exp_avg`, `param_groups.<name>.lr`)
    when `flat`: pipeline ranks hold different parameters, and DCP would keep one rank's copy of
    an unflattened `param_groups` list (it takes equal keys for replicas)."""
    return StateDictOptions(flatten_optimizer_state_dict=flat)


def unflattened(flat: dict[str, Any], skip: set[str]) -> dict[str, Any]:
    """A flattened optimizer state (`state.<name>.<key>`, `param_groups.<name>.<key>`: +opt=pp)
    as `checkpoint.pt` holds it: {"state": {name: {key: value}}, "param_groups": [...]}, one
    group per distinct setting, in the order of their first parameter. `skip`: the pipeline's
    copies of tied weights, whose state is the weight's."""
    nested: dict[str, dict[str, dict[str, Any]]] = {"state": {}, "param_groups": {}}
    for flat_key, value in flat.items():
        part, rest = flat_key.split(".", 1)
        name, key = rest.rsplit(".", 1)
        if name not in skip:
            nested[part].setdefault(name, {})[key] = value
    groups: list[dict[str, Any]] = []
    for name, settings in nested["param_groups"].items():
        group = next((g for g in groups if _settings(g) == settings), None)
        if group is None:
            group = {**settings, "params": []}
            groups.append(group)
        group["params"].append(name)
    return {"state": nested["state"], "param_groups": groups}


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}
