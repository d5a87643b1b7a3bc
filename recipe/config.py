"""The run's configuration: checked before any work, saved in the run folder, and on resume
rebuilt from what was saved plus what the command line changes.

- `validate(cfg)`: every number and choice the trainer reads, with its allowed range; a bad one
  fails at once naming the key, the range and the value.
- `save(run_dir, cfg, overrides)` writes `config.yaml` (the resolved config, with the model's
  real shape, also for a pretrained start) and `overrides.yaml` (the command line that built it).
- `for_resume(run_dir, overrides)`: the saved command line with the new overrides on top, composed
  again by Hydra; what changed is printed, and changes that would make the checkpoint meaningless
  (the model's shape, the corpus, the seed) are refused naming both values.
- `annotated_help(config_name)`: `--help` of the Hydra apps (train.py, sample.py, the scripts):
  their yaml file as written, comments included, and the options of its groups.
- `check_device(cfg, device)`: a preset sized for a GPU (its `measured` row of results) is not
  started on a CPU by accident.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import hydra
import torch
import yaml
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

import data
from base import knobs
from base.distributed import DEVICES, log
from base.errors import ConfigError, MissingFile, Unusable, unknown_key
from base.files import write_text_atomically
from base.knobs import Choices, Number, count, positive
from recipe import rundir

CONFIG_FILE, OVERRIDES_FILE = "config.yaml", "overrides.yaml"
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
ROOT = CONF_DIR.parent  # a preset's `measured` file is named from here
CPU_PRESET = "laptop"  # the preset sized for a CPU


# Logits are divided by the temperature: below this, a float32 logit overflows to inf and the
# sampling probabilities become NaN (top_k=1 is greedy decoding, the limit of a small one).
TEMPERATURE = Number(integer=False, low=1e-6)

NUMBERS: dict[str, Number] = {
    "train.max_steps": count(1),
    "train.batch_size": count(1),
    "train.lr": positive(),
    "train.min_lr": Number(integer=False, low=0),
    "train.warmup_steps": count(0),
    "train.weight_decay": Number(integer=False, low=0),
    "train.beta1": Number(integer=False, low=0, high=1, high_open=True),
    "train.beta2": Number(integer=False, low=0, high=1, high_open=True),
    "train.grad_clip": Number(integer=False, low=0, low_open=True, infinite=True),
    "train.seed": count(0),
    "train.log_interval": count(1),
    "train.eval_interval": count(1),
    "train.eval_sequences": count(1),
    "train.hellaswag_items": count(1, nullable=True),
    "train.checkpoint_interval": count(0),
    "train.keep_checkpoints": count(1),
    "train.max_bad_steps": count(1),
    "perf.warmup_steps": count(0),
    "perf.peak_tflops": positive(nullable=True),
    "perf.memory_cap_gib": positive(nullable=True),
    "sample.num_samples": count(0),
    "sample.max_new_tokens": count(1),
    "sample.temperature": TEMPERATURE,
    "sample.top_k": count(1, nullable=True),
    "model.n_layer": count(1),
    "model.n_head": count(1),
    "model.n_embd": count(1),
    "model.block_size": count(1),
    "model.vocab_size": count(1),
    "model.pad_vocab_to": count(1),
    "model.dropout": Number(integer=False, low=0, high=1, high_open=True),
    "data.val_fraction": Number(integer=False, low=0, high=1, low_open=True, high_open=True),
    "data.num_proc": count(1, nullable=True),
}
CHOICES: dict[str, Choices] = {
    "device": Choices(DEVICES),
    "wandb.mode": Choices(("auto", "online", "offline", "disabled")),
    "train.resume": Choices((True, False)),
    "train.keep_best": Choices((True, False)),
    "train.async_save": Choices((True, False)),
    "perf.checkpoint_time": Choices((True, False)),
    "perf.matmul_ceiling": Choices((True, False)),
    "model.bias": Choices((True, False)),
}


def check_numbers(cfg: DictConfig, rules: Mapping[str, knobs.Rule]) -> None:
    """Refuses the first setting outside its rule, naming the key, the rule and the value."""
    for key, rule in rules.items():
        knobs.check_value(key, OmegaConf.select(cfg, key), rule)


# Dicts whose keys are free: `+data.hub.name=sample-10BT` adds a keyword of `load_dataset`.
FREE_FORM = ("data.hub.",)


def leaf_keys(cfg: DictConfig, prefix: str = "") -> list[str]:
    """Every setting of `cfg` as a dotted key (`train.max_steps`)."""
    keys = []
    for key, value in cfg.items():
        name = f"{prefix}{key}"
        keys += leaf_keys(value, name + ".") if isinstance(value, DictConfig) else [name]
    return keys


def check_added_keys(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """Refuses a key that the command line adds with `+key=value` (Hydra accepts it, and nothing
    would read it): a misspelt setting, or a knob of a stage that is not selected."""
    for override in overrides:
        name = override.split("=", 1)[0]
        key = name.removeprefix("+")
        if not name.startswith("+") or key.startswith("+") or key.startswith(FREE_FORM):
            continue  # a plain or `++` override; a free-form dict's key
        if _is_group(key):
            continue  # a group's option: +opt=ac, +prof=trace
        known = [k for k in leaf_keys(cfg) if k != key and not k.startswith(key + ".")]
        raise ConfigError(f"{override}: {unknown_key(key, known)}")


def take_drops(argv: list[str]) -> list[str]:
    """Takes `~opt=<stage>` out of `argv` (changed in place) and returns it: on a resume it drops
    a stage of the saved command line (`merge_overrides`), which Hydra, composing this command
    line alone first, would look for here and not find."""
    drops = [a for a in argv[1:] if a.startswith("~") and "=" in a and _is_group(a[1:])]
    for drop in drops:
        argv.remove(drop)
    return drops


def _is_group(override: str) -> bool:
    """Whether `override` selects options of a config group: `opt=ac`, `+opt=[ac,amp]`."""
    key = override.split("=", 1)[0].lstrip("+~")
    return "." not in key and (CONF_DIR / key).is_dir()


def validate(cfg: DictConfig, overrides: Sequence[str] = ()) -> None:
    """Refuses the first bad setting, naming the key, what it must be and what it is; and any
    key that `overrides` (the command line) adds that the recipe does not have."""
    for drop in [o for o in overrides if o.startswith("~") and _is_group(o)]:
        raise ConfigError(
            f"{drop} drops a stage of the run being resumed: add train.resume=true (for a new "
            f"run, leave out +{drop[1:]})"
        )
    check_added_keys(cfg, overrides)
    check_numbers(cfg, {**NUMBERS, **CHOICES})
    data.check_config(cfg.data)
    if cfg.model.vocab_size < data.VOCAB_SIZE and cfg.data.source != "synthetic":
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than GPT-2's {data.VOCAB_SIZE} "
            f"tokens, which data.source={cfg.data.source} produces: keep it at {data.VOCAB_SIZE}"
        )
    if cfg.data.source == "synthetic" and cfg.data.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"data.vocab_size={cfg.data.vocab_size} exceeds model.vocab_size="
            f"{cfg.model.vocab_size}: random tokens must be ids the model can predict"
        )
    train = cfg.train
    if train.min_lr > train.lr:
        raise ConfigError(f"train.min_lr={train.min_lr} exceeds train.lr={train.lr}")
    if cfg.model.n_embd % cfg.model.n_head:
        raise ConfigError(
            f"model.n_embd={cfg.model.n_embd} must be divisible by model.n_head={cfg.model.n_head}"
        )


def measured(ref: str) -> str:
    """A preset's `measured` row (`<results json>#<step>`) in words: its tokens/s and peak memory,
    on which GPU, and where they come from (the shipped results, not a copy that can go stale)."""
    path, _, name = ref.partition("#")
    results = json.loads((ROOT / path).read_text())
    row = next(r for r in results["steps"] if r["name"] == name)
    return (
        f"{row['tokens_per_sec']:,.0f} tokens/s and {row['peak_allocated_gib']:.1f} GiB peak "
        f"allocated on one {results['environment']['device']} ({path}, row {name})"
    )


def check_device(cfg: DictConfig, device: torch.device) -> None:
    """A preset sized for a GPU (its `measured` row) on a CPU: refused where the CPU was chosen
    for it (device=auto on a machine without a GPU: the kernel may kill the run for its memory,
    or it takes days), a warning where the CPU was asked for (device=cpu)."""
    if device.type != "cpu" or not cfg.get("measured"):
        return
    line = (
        f"this preset is sized for a GPU: {measured(cfg.measured)}; on a CPU use "
        f"preset={CPU_PRESET}"
    )
    if cfg.device == "auto":
        raise ConfigError(f"{line} (device=cpu runs this one on the CPU anyway)")
    log(f"[train] warning: {line}")


# ---- the run folder's copy of the configuration, and resuming from it

# Settings a resumed run may not change: the checkpoint would not fit them (the model's shape) or
# would mean something else (the corpus the data position points into, the seeded data order).
FROZEN = (
    "model.n_layer", "model.n_head", "model.n_embd", "model.block_size", "model.vocab_size",
    "model.pad_vocab_to", "model.bias", "data.name", "data.source", "data.files", "data.hub",
    "train.seed",
)  # fmt: skip


def resolved(cfg: DictConfig, model_config: Any) -> dict[str, Any]:
    """The config as plain data, with the model's real shape (a GPTConfig: for a pretrained
    start it comes from the weights, not from the preset)."""
    out = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))
    shape = dataclasses.asdict(model_config)
    out["model"].update({k: v for k, v in shape.items() if k in out["model"]})
    return out


def save(run_dir: Path, resolved_cfg: dict[str, Any], overrides: list[str]) -> None:
    """Writes `config.yaml` (what ran) and `overrides.yaml` (the command line that built it),
    each replaced whole by a rename (a symbolic link there is replaced, never followed)."""
    for name, value in ((CONFIG_FILE, resolved_cfg), (OVERRIDES_FILE, overrides)):
        write_text_atomically(run_dir / name, OmegaConf.to_yaml(OmegaConf.create(value)))


def compose(overrides: list[str]) -> DictConfig:
    """Hydra's composition of conf/config.yaml with `overrides`, inside or outside a Hydra app."""
    if GlobalHydra.instance().is_initialized():
        return hydra.compose(config_name="config", overrides=overrides)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra.compose(config_name="config", overrides=overrides)


def for_resume(run_dir: Path, overrides: list[str]) -> tuple[DictConfig, list[str]]:
    """The resumed run's config: its saved command line with `overrides` on top, and that
    command line (which the run folder then records)."""
    path = run_dir / OVERRIDES_FILE
    if not path.exists():
        raise MissingFile(
            f"train.resume=true, but {run_dir} holds no run to continue (no {OVERRIDES_FILE}): "
            "point hydra.run.dir at the folder of the run, or drop train.resume to start afresh"
        )
    merged = merge_overrides(saved_overrides(path), overrides)
    cfg = compose([*merged, "train.resume=true"])
    return cfg, merged


def saved_overrides(path: Path) -> list[str]:
    """The command line `save` wrote (a YAML list of overrides), refused in one line when the
    file is anything else: it is read as plain YAML (a tag such as !!python/... is refused)."""
    try:
        saved = OmegaConf.to_container(OmegaConf.load(path))
        why = "" if isinstance(saved, list) else f"not a list but {type(saved).__name__}"
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        saved, why = None, " ".join(str(e).split())
    if isinstance(saved, list) and not all(isinstance(o, str) for o in saved):
        why = "not every entry is an override (key=value)"
    if why:
        raise Unusable(
            f"{path} is damaged ({why}): it holds the run's command line, a YAML list of "
            "overrides (- model=tiny); write it so, or start a new run folder"
        )
    return cast(list[str], saved)


def merge_overrides(saved: list[str], new: list[str]) -> list[str]:
    """The saved command line with the new one on top: a key given again replaces its old value;
    `~opt=<stage>` (or `~opt=[a,b]`) drops stages the saved run selected, with their knobs (e.g.
    an FSDP run resumed in one process: '~opt=fsdp'); `train.resume` itself is not kept."""

    def key(override: str) -> str:
        return override.split("=", 1)[0].lstrip("+~")

    new = list(new)
    for drop in [o for o in new if o.startswith("~") and "=" in o and _is_group(o)]:
        saved = _without_options(saved, key(drop), _options(drop))
        new.remove(drop)
    new = [o for o in new if key(o) != "train.resume"]
    replaced = {key(o) for o in new}
    return [o for o in saved if key(o) not in replaced] + new


def _options(override: str) -> list[str]:
    """The options a group override names: `+opt=ac` or `+opt=[ac,amp]`."""
    value = override.split("=", 1)[1].strip()
    return [o.strip() for o in value.strip("[]").split(",") if o.strip()]


def _without_options(saved: list[str], group: str, dropped: list[str]) -> list[str]:
    """`saved` without the options `dropped` of `group` and their knobs (`opt.fsdp.*`)."""
    selected = [o for s in saved if s.startswith(f"+{group}=") for o in _options(s)]
    missing = [o for o in dropped if o not in selected]
    if missing:
        raise ConfigError(
            f"~{group}={','.join(missing)}: the saved run did not select it (its {group}: "
            f"{', '.join(selected) or 'none'}); drop only what it selected"
        )
    kept = []
    for override in saved:
        if override.startswith(f"+{group}="):
            rest = [o for o in _options(override) if o not in dropped]
            override = f"+{group}=[{','.join(rest)}]" if rest else ""
        elif any(override.lstrip("+~").startswith(f"{group}.{o}.") for o in dropped):
            override = ""  # a knob of a dropped option
        if override:
            kept.append(override)
    return kept


def differences(old: dict, new: dict, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """Leaf keys whose values differ between two nested dicts: {key: (old, new)}."""
    out: dict[str, tuple[Any, Any]] = {}
    for k in sorted(set(old) | set(new), key=str):
        a, b = old.get(k), new.get(k)
        name = f"{prefix}{k}"
        if isinstance(a, dict) and isinstance(b, dict):
            out |= differences(a, b, name + ".")
        elif a != b:
            out[name] = (a, b)
    return out


def check_resume(saved: dict, cfg: DictConfig) -> dict[str, tuple[Any, Any]]:
    """Compares the resumed run's config with the checkpoint's: prints what changes, refuses
    changes to the frozen settings naming both values. Returns the changes."""
    current = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))
    changes = {
        k: v for k, v in differences(saved, current).items() if not k.startswith("train.resume")
    }
    pretrained = saved["model"].get("pretrained") and current["model"].get("pretrained")
    for key in FROZEN:
        if pretrained and key.startswith("model."):
            continue  # the shape comes from the weights, checked against the checkpoint later
        hits = [k for k in changes if k == key or k.startswith(key + ".")]
        if hits:
            old, new = changes[hits[0]]
            raise ConfigError(
                f"train.resume: {hits[0]} was {old!r} in the saved run and is {new!r} now; a "
                "resumed run cannot change it (start a new run folder instead)"
            )
    for key, (old, new) in changes.items():
        if not (pretrained and key.startswith("model.")):
            log(f"[resume] {key}: {old!r} -> {new!r}")
    return changes


# ---- --help: the yaml files themselves, with their comments


def register_resolvers() -> None:
    """The resolvers the yaml files use: `${launch:}` (the run folder's name) and
    `${annotated_help:<config name>}` (conf/hydra/help/annotated.yaml)."""
    OmegaConf.register_new_resolver("launch", rundir.launch_stamp, replace=True)
    OmegaConf.register_new_resolver("annotated_help", annotated_help, replace=True)


def _header(path: Path) -> str:
    """A yaml file's opening comment, as one line (without Hydra's `# @package` line); a preset's
    with its `measured` row's numbers, read from the results."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if not line.lstrip("#").strip().startswith("@package"):
            lines.append(line.lstrip("#").strip())
    row = cast(DictConfig, OmegaConf.load(path)).get("measured")
    return " ".join(lines + ([f"Measured: {measured(row)}."] if row else []))


def _groups(config_name: str) -> list[tuple[str, Any]]:
    """The config groups a primary config's defaults list selects, with its default choice
    (an option, a list of them, or None)."""
    defaults = OmegaConf.load(CONF_DIR / f"{config_name}.yaml").get("defaults", [])  # type: ignore[arg-type]
    groups = []
    for entry in OmegaConf.to_container(defaults):
        if isinstance(entry, dict):  # not _self_ nor a plain config file
            ((group, choice),) = entry.items()
            if (CONF_DIR / group).is_dir():  # not an override of Hydra's own groups
                groups.append((group, choice))
    return groups


def annotated_help(config_name: str) -> str:
    """`--help`: conf/<config_name>.yaml as written (every key with its comment), then each of
    its groups' options with the opening comment of the option's file. Escaped for Hydra's help
    template (a string.Template: `$` is written `$$`)."""
    path = CONF_DIR / f"{config_name}.yaml"
    out = [f"== {path.relative_to(CONF_DIR.parent)}: override any key with key=value ==", ""]
    out += [path.read_text().rstrip(), ""]
    for group, choice in _groups(config_name):
        if isinstance(choice, list):
            how = f"any number of them: +{group}=<option> or +{group}=[<option>,<option>]"
        else:
            how = f"{group}=<option>, default {choice if choice is not None else 'none'}"
        out.append(f"== {group}: {how} (conf/{group}/) ==")
        options = sorted((CONF_DIR / group).glob("*.yaml"), key=lambda p: p.stem)
        width = max(14, *(len(option.stem) + 2 for option in options))  # names, then their text
        for option in options:
            text = f"{option.stem:<{width}}{_header(option)}"
            indent = " " * (width + 2)
            out += textwrap.wrap(text, 98, initial_indent="  ", subsequent_indent=indent)
        out.append("")
    out.append("Hydra: --cfg job prints the composed config, -m runs a sweep, --hydra-help its own")
    return "\n".join(out).replace("$", "$$")
