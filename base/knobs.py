"""Settings and their rules, one mechanism for every key the recipe reads: the trainer's
(`train.*`, `model.*`, `data.*`: recipe/config.py's tables) and each stage's knobs (a dataclass
in its module, opt/stage.py). A rule is a `Number` (an integer or real range) or `Choices`; a
stage's dataclass gives them as field types: `Literal[...]` for choices, `bool`, and
`Annotated[int, count(1)]` for ranges. `check` refuses the first bad key in one line naming the
key, the rule and the value, and a key the dataclass does not have (a misspelt knob).

Why not Hydra structured configs: OmegaConf 2.3 refuses `Literal` field types ("Unexpected type
annotation"), and its Enum fields match names, which `reduce-overhead` cannot be. The check runs
right after the config is composed, before any data is prepared or model built (opt.plan)."""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

from base.errors import ConfigError, did_you_mean


@dataclasses.dataclass(frozen=True)
class Number:
    """An integer or real setting and its allowed range."""

    integer: bool
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # low itself is not allowed
    high_open: bool = False
    nullable: bool = False
    infinite: bool = False  # inf is allowed (train.grad_clip=inf: never clip)

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        bounds = []
        if self.low is not None:
            bounds.append(f"{'>' if self.low_open else '>='} {self.low:g}")
        if self.high is not None:
            bounds.append(f"{'<' if self.high_open else '<='} {self.high:g}")
        text = f"{kind} {' and '.join(bounds)}".strip()
        text += " (or inf)" if self.infinite else ""
        return text + (" (or null)" if self.nullable else "")

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.nullable
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.integer and not isinstance(value, int):
            return False
        if math.isnan(value) or (math.isinf(value) and not self.infinite):
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or not (
            value > self.high or (self.high_open and value == self.high)
        )


@dataclasses.dataclass(frozen=True)
class Choices:
    """A setting that is one of a few values (compared with their types: `1` is not `true`)."""

    options: tuple

    def describe(self) -> str:
        return f"one of {', '.join(map(str, self.options))}"

    def accepts(self, value: Any) -> bool:
        return any(value == o and type(value) is type(o) for o in self.options)


@dataclasses.dataclass(frozen=True)
class Text:
    """Any string (a path, a name), or null where allowed."""

    nullable: bool = False

    def describe(self) -> str:
        return "a string" + (" (or null)" if self.nullable else "")

    def accepts(self, value: Any) -> bool:
        return isinstance(value, str) or (value is None and self.nullable)


Rule = Number | Choices | Text


def count(low: int = 1, nullable: bool = False) -> Number:
    return Number(integer=True, low=low, nullable=nullable)


def positive(nullable: bool = False) -> Number:
    return Number(integer=False, low=0, low_open=True, nullable=nullable)


def check_value(key: str, value: Any, rule: Rule) -> None:
    if not rule.accepts(value):
        raise ConfigError(f"{key} must be {rule.describe()}, got {value!r}")


def rules(schema: type) -> dict[str, Rule | None]:
    """Each field of the dataclass `schema` and its rule (None: a structured value, e.g. a list,
    that the stage checks itself)."""
    hints = get_type_hints(schema, include_extras=True)
    return {f.name: _rule(hints[f.name]) for f in dataclasses.fields(schema)}


def check(node: Mapping[str, Any], schema: type, prefix: str) -> None:
    """Refuses a key of `node` that `schema` lacks, a key it lacks, and the first value outside
    its field's rule; `prefix` names the node (`opt.ac`)."""
    fields = rules(schema)
    for key in node:
        if key not in fields:
            known = [f"{prefix}.{name}" for name in fields]
            raise ConfigError(
                f"{prefix}.{key} is not a setting{did_you_mean(f'{prefix}.{key}', known)}"
            )
    for name, rule in fields.items():
        if name not in node:
            raise ConfigError(f"{prefix}.{name} is missing: the stage's yaml file gives it")
        if rule is not None:
            check_value(f"{prefix}.{name}", node[name], rule)


def _rule(hint: Any) -> Rule | None:
    nullable = False
    if get_origin(hint) in (Union, typing.get_origin(int | None)):
        args = [a for a in get_args(hint) if a is not type(None)]
        nullable, hint = len(args) < len(get_args(hint)), args[0]
    if get_origin(hint) is Annotated:
        rule = get_args(hint)[1]
        return dataclasses.replace(rule, nullable=nullable) if isinstance(rule, Number) else rule
    if get_origin(hint) is Literal:
        return Choices(get_args(hint) + ((None,) if nullable else ()))
    if hint is bool:
        return Choices((True, False))
    if hint is int:
        return Number(integer=True, nullable=nullable)
    if hint is float:
        return Number(integer=False, nullable=nullable)
    if hint is str:
        return Text(nullable=nullable)
    return None
