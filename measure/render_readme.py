"""Renders the README's measured numbers from the results files, so none is copied by hand.

    python scripts/render_readme.py           # rewrites README.md in place
    python scripts/render_readme.py --check   # exit 1 with a diff when README.md differs

Each measured table or sentence of README.md sits between two markers that name what it shows
and the results file it comes from:

    <!-- results:speed docs/results/nvidia-h100-80gb-hbm3/speed.json -->
    ...rendered here...
    <!-- /results:speed -->

Kinds: `speed` (the speed ladder table), `memory` (the memory ladder table), `memory_range` (its
first and last peak), `memory_xl` (GPT-2 XL's table), `xl_target` (its target row), `scaling`
(the scaling ladder's rows), `sizes` (each GPT-2 size on one GPU), `layouts` (the fastest
measured layout per model and GPU count, from the scaling ladder's rows),
`vs_nanogpt` (the headline against nanoGPT's bench.py and the ratios at equal batch and biases),
`quality` (a quality report's verdict: the difference, the test, the seeds), `checkpoint_save`
(how long an async save held the loop against a sync one).
Rows with `repeats`, `interval` (tokens/s, [low, high]) and `within_noise` (their ratio's interval
contains 1.00x) show them; a field a results file lacks renders as '—'. Which rows a table shows
is in this file; each row's caption is its step's `what` in the ladder's yaml
(conf/ablate/ladder/<ladder>.yaml); every number comes from the json.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from omegaconf import OmegaConf

from measure import ladder_table, ladders, save_stall, stats, vs_nanogpt
from measure import quality as quality_report

ROOT = Path(__file__).resolve().parents[1]
OPT_CONF = ROOT / "conf" / "opt"  # each stage's knobs and their defaults
MARKER = re.compile(
    r"<!-- results:(?P<kind>\w+) (?P<path>\S+) -->(?P<body>.*?)<!-- /results:(?P=kind) -->",
    re.DOTALL,
)
MISSING = "—"

# The rows each table shows, in the results file's order (the others are left out). A row's
# caption is its step's `what` in the ladder's yaml, the one place it is written.
SPEED_ROWS = (
    "baseline", "bs", "workers", "non_blocking", "compile", "amp_fp16", "tf32", "fused", "bf16",
    "reduce_overhead", "memmap", "custom_op", "residual_bf16", "bs64",
)  # fmt: skip
MEMORY_ROWS = ("baseline", "accum", "ac", "forloop", "fsdp")
XL_ROWS = (
    "bf16", "ac", "custom_op", "weight_cache", "opt_in_backward", "ac_op", "offload",
    "lowbit_torchao", "lowbit", "bs128", "cap22", "cap14", "cap10",
)  # fmt: skip
XL_REFERENCE, XL_TARGET = "ac", "lowbit"


# ---- cells


def _num(value: float | None, spec: str, suffix: str = "") -> str:
    return MISSING if value is None else format(value, spec) + suffix


def _interval(row: dict) -> str:
    """`low–high` tokens/s, from [low, high] (or a {"low": .., "high": ..} mapping); none for
    a single run, whose interval is its one number."""
    interval = row.get("interval")
    if not interval:
        return MISSING
    values = list(interval.values()) if isinstance(interval, dict) else list(interval)
    if min(values) == max(values):
        return MISSING
    return f"{min(values):,.0f}–{max(values):,.0f}"


def _speed_ratio(row: dict, ref: dict | None) -> str:
    """Tokens/s against `ref`: the harness's own ratio where it compared the row with `ref` (vs
    prev, or vs the ladder's reference), with three decimals and that comparison's noise
    verdict; else the ratio of the two rows' numbers, marked when they come from another call
    (perhaps another machine: stats.same_call)."""
    if ref is None or row.get("tokens_per_sec") is None or not ref.get("tokens_per_sec"):
        return MISSING
    if ref is row:
        return "1.00x"  # the reference row itself
    for suffix in ("", "_ref"):  # the harness's ratio vs prev, and vs the reference row
        if (
            row.get("repeats", 1) > 1
            and row.get(f"ratio{suffix}_interval")
            and row.get(f"ratio{suffix}_vs") == ref.get("name")
        ):
            # Against `ref` re-measured in the row's call (its anchor), run by run.
            noise = " (within noise)" if row.get(f"within_noise{suffix}") else ""
            return f"{row[f'ratio{suffix}']:.3f}x{noise}"
    text = f"{row['tokens_per_sec'] / ref['tokens_per_sec']:.2f}x"
    return text if stats.same_call(row, ref) else text + " (vs another call)"


def _memory_change(row: dict, ref: dict | None) -> str:
    if ref is None or row.get("peak_allocated_gib") is None or not ref.get("peak_allocated_gib"):
        return MISSING
    return f"{100 * (row['peak_allocated_gib'] / ref['peak_allocated_gib'] - 1):+.0f}%".replace(
        "-", "−"
    )


def _tokens(row: dict) -> str:
    """Tokens/s; on several GPUs, their sum."""
    text = _num(row.get("tokens_per_sec"), ",.0f")
    gpus = row.get("gpus", row.get("nproc", 1))
    return text + (f" ({gpus} GPUs together)" if gpus > 1 and text != MISSING else "")


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(cells) + " |" for cells in rows)])


def caption(row: dict) -> str:
    """A row's caption: its step's name and `what` (from the ladder's yaml: see load)."""
    if row.get("what") is None:
        raise SystemExit(
            f"render_readme.py: step {row['name']} is not in conf/ablate/ladder/"
            f"{row.get('ladder')}.yaml, where a row's caption is written"
        )
    return f"`{row['name']}`: {row['what']}"


def labelled(result: dict, names: tuple[str, ...]) -> list[tuple[str, dict]]:
    """(caption, row) for each row the README shows, in the results file's order."""
    return [(caption(r), r) for r in result["steps"] if r["name"] in names]


# ---- the kinds


def speed(result: dict) -> str:
    rows, previous = [], None
    for label, row in labelled(result, SPEED_ROWS):
        cells = [label, _num(row.get("tokens_per_sec"), ",.0f"), _interval(row)]
        cells += [str(row.get("repeats", MISSING)), _speed_ratio(row, previous)]
        cells.append(_num(row.get("peak_allocated_gib"), ".1f"))
        rows.append(cells)
        previous = row if row.get("tokens_per_sec") else previous
    header = ["step", "tokens/s", "interval", "repeats", "vs prev", "peak GiB"]
    return table(header, rows)


def memory(result: dict) -> str:
    rows, previous = [], None
    for label, row in labelled(result, MEMORY_ROWS):
        peak = _num(row.get("peak_allocated_gib"), ".2f", " GiB")
        rows.append([label, peak, _memory_change(row, previous), _tokens(row)])
        previous = row
    return table(["step", "peak allocated", "vs prev", "tokens/s"], rows)


def memory_range(result: dict) -> str:
    ran = [r for r in labelled(result, MEMORY_ROWS) if r[1].get("peak_allocated_gib")]
    first, last = ran[0][1]["peak_allocated_gib"], ran[-1][1]["peak_allocated_gib"]
    return f"from {first:.1f} GiB to {last:.1f} GiB per GPU"


def _xl_rows(result: dict) -> tuple[list[tuple[str, dict]], dict]:
    rows = labelled(result, XL_ROWS)
    return rows, next(r for r in result["steps"] if r["name"] == XL_REFERENCE)


def _measured_beside(result: dict, row: dict, reference: dict) -> dict:
    """`reference` as re-measured in `row`'s call (stats.measured_beside), from the segments
    of `result`."""
    anchors = stats.anchors_by_call(result.get("segments", []))
    return stats.measured_beside(row, reference, anchors)


def memory_xl(result: dict) -> str:
    rows, reference = _xl_rows(result)
    cells = []
    for label, row in rows:
        peak = _num(row.get("peak_allocated_gib"), ".2f", " GiB")
        ratio = _speed_ratio(row, _measured_beside(result, row, reference))
        if row["name"] == XL_TARGET:
            peak, ratio = f"**{peak}**", f"**{ratio}**"
        cells.append([label, peak, _num(row.get("tokens_per_sec"), ",.0f"), _interval(row)])
        cells[-1] += [str(row.get("repeats", MISSING)), ratio]
    return table(["step", "peak allocated", "tokens/s", "interval", "repeats", "vs `ac`"], cells)


def xl_target(result: dict) -> str:
    rows, reference = _xl_rows(result)
    row = next(r for _, r in rows if r["name"] == XL_TARGET)
    return (
        f"{row['peak_allocated_gib']:.2f} GiB at "
        f"{_speed_ratio(row, _measured_beside(result, row, reference))} of the checkpointed "
        "bf16 run measured beside it (target: ≤ 20 GiB at "
        f"≥ 0.6x), {row['peak_reserved_gib']:.2f} GiB reserved"
    )


def scaling(result: dict) -> str:
    """Every row of the scaling ladder that was measured: GPUs, tokens/s with their spread, and
    the per-GPU efficiency against the 1-GPU row of the same call where it ran there
    (stats.with_efficiency)."""
    cells = []
    for row in result["steps"]:
        efficiency = ladder_table.efficiency_cell(row, missing=MISSING)
        if row["status"] != "ok":
            efficiency = row["status"]
        cells.append([caption(row), ladder_table.gpus_label(row)])
        cells[-1] += [_num(row.get("tokens_per_sec"), ",.0f"), _interval(row)]
        cells[-1] += [str(row.get("repeats", MISSING)), efficiency]
        cells[-1].append(_num(row.get("peak_allocated_gib"), ".2f"))
    header = ["step", "GPUs", "tokens/s", "interval", "repeats", "per-GPU efficiency", "peak GiB"]
    return table(header, cells)


def sizes(result: dict) -> str:
    """Each GPT-2 size on one GPU (conf/ablate/ladder/sizes.yaml): the batch it ran at (from its
    command's overrides: the ladder's batches may have moved since), which head (the fused one,
    `custom_op`, or the plain), tokens/s with their spread (and how many runs diverged: their
    speed times a model that broke), MFU and peak memory; the caption names llm.c's per-GPU rate
    for the size."""
    cells = []
    for row in result["steps"]:
        batches = [o.split("=")[1] for o in row["overrides"] if o.startswith("train.batch_size=")]
        tokens = _num(row.get("tokens_per_sec"), ",.0f") if row["status"] == "ok" else row["status"]
        if row.get("diverged_runs"):
            tokens += f" (diverged: {row['diverged_runs']} of {row.get('repeats', 1)} runs)"
        head = (
            MISSING if "stages" not in row else "fused" if "custom_op" in row["stages"] else "plain"
        )
        cells.append([caption(row), batches[-1] if batches else MISSING, head, tokens])
        cells[-1] += [_interval(row), str(row.get("repeats", MISSING))]
        cells[-1] += [_num(row.get("mfu"), ".1f", "%"), _num(row.get("peak_allocated_gib"), ".1f")]
    header = ["size", "batch", "head", "tokens/s", "interval", "repeats", "MFU", "peak GiB"]
    return table(header, cells)


def _row_args(row: dict) -> list[str]:
    """The train.py overrides of a row's command (its first machine's, where several)."""
    args = shlex.split(row["command"].split(" & ")[0])
    return args[args.index("train.py") + 1 :]


def _knob(args: list[str], stage: str, knob: str) -> str:
    """A stage's knob as the row's command set it, else its conf/opt/<stage>.yaml default."""
    given = [a.split("=", 1)[1] for a in args if a.startswith(f"opt.{stage}.{knob}=")]
    return given[-1] if given else str(OmegaConf.load(OPT_CONF / f"{stage}.yaml")[stage][knob])


def layout_name(row: dict) -> str:
    """How a row spreads its step over its GPUs: `1 GPU`, `DDP 2`, `FSDP 4`, `pp=2`,
    `tp=2 x FSDP 2`, `pp=2 x tp=2`, ... (`+ ac` with activation checkpointing)."""
    args, stages, gpus = _row_args(row), set(row["stages"]), row.get("gpus", 1)
    pp = int(_knob(args, "pp", "degree")) if "pp" in stages else 1
    tp = int(_knob(args, "tp", "degree")) if "tp" in stages else 1
    parts = [f"pp={pp}"] if pp > 1 else []
    if pp > 1 and _knob(args, "pp", "schedule") != "1f1b":
        parts[-1] += f" ({_knob(args, 'pp', 'schedule')})"
    parts += [f"tp={tp}"] if tp > 1 else []
    replicas = gpus // (pp * tp)
    if replicas > 1:
        parts.append(f"{'FSDP' if 'fsdp' in stages else 'DDP'} {replicas}")
    return " x ".join(parts or ["1 GPU"]) + (" + ac" if "ac" in stages else "")


def layouts(result: dict) -> str:
    """Which layout for my run: for each model and GPU count of one machine with measured rows,
    the fastest measured layout (its step, tokens/s and peak), then the other layouts measured
    there, each by its fastest row; a model or GPU count without a measured row is not shown.
    Where fewer GPUs measured more tokens/s, the row says so: more GPUs are then no faster."""
    fastest: dict[tuple[str, int], dict[str, dict]] = {}  # (model, GPUs) -> layout -> row
    for row in result["steps"]:
        if row["status"] != "ok" or not row.get("tokens_per_sec") or row.get("nnodes", 1) > 1:
            continue
        model = [a.split("=", 1)[1] for a in _row_args(row) if a.startswith("model=")][-1]
        measured = fastest.setdefault((model, row.get("gpus", 1)), {})
        name = layout_name(row)
        if row["tokens_per_sec"] > measured.get(name, {}).get("tokens_per_sec", 0):
            measured[name] = row
    models = list(dict.fromkeys(model for model, _ in fastest))  # as the results list them
    cells = []
    best: dict[str, tuple[int, float]] = {}  # model -> (GPUs, tokens/s): its fastest so far
    for model, gpus in sorted(fastest, key=lambda key: (models.index(key[0]), key[1])):
        ranked = sorted(fastest[model, gpus].items(), key=lambda kv: -kv[1]["tokens_per_sec"])
        (name, row), others = ranked[0], ranked[1:]
        slower = ""
        if model in best and best[model][1] > row["tokens_per_sec"]:
            fewer, tokens = best[model]
            owner = f"{fewer} GPUs'" if fewer > 1 else "1 GPU's"
            slower = f": below {owner} {tokens:,.0f}"
        if row["tokens_per_sec"] > best.get(model, (0, 0.0))[1]:
            best[model] = gpus, row["tokens_per_sec"]
        also = "; ".join(
            f"{n} (`{r['name']}`): {r['tokens_per_sec']:,.0f}, "
            f"{_num(r.get('peak_allocated_gib'), '.2f', ' GiB')}"
            for n, r in others
        )
        cells.append([f"`{model}`", str(gpus), f"{name} (`{row['name']}`){slower}"])
        cells[-1] += [
            _num(row["tokens_per_sec"], ",.0f"),
            _num(row.get("peak_allocated_gib"), ".2f"),
        ]
        cells[-1].append(also or MISSING)
    header = ["model", "GPUs", "fastest measured layout", "tokens/s", "peak GiB",
              "other layouts measured (tokens/s, peak)"]  # fmt: skip
    return table(header, cells)


def nanogpt(result: dict) -> str:
    return vs_nanogpt.headline(result) + "\n\n" + vs_nanogpt.equal_work_table(result)


def quality(result: dict) -> str:
    """A scripts/quality.py report's verdict in a sentence: the difference of the final
    validation losses, what the test says and the seeds behind it."""
    diff, seeds = result["difference"], [s for s in result["seeds"] if s is not None]
    status = result["status"]
    said = f"same within {result['tolerance']} nats" if status == "same" else status
    tested = f", p={diff['p']:.2g}" if diff.get("p") is not None else ""
    n = len(seeds) or 1  # a one-seed report of before lists its seed as None
    largest = quality_report.unbounded(result)
    open_ = "" if largest is None else f"; the 95% interval reaches ±{largest:.3f}"
    return f"{diff['delta']:+.3f} nats ({said}{tested}; {n} seed{'s' * (n > 1)} per arm{open_})"


def checkpoint_save(result: dict) -> str:
    """How long the first save held the loop, async against sync (scripts/save_stall.py)."""
    held = {mode: save_stall.first_save_held(run["held_s"]) for mode, run in result["runs"].items()}
    return f"{held['async']:.1f} s instead of {held['sync']:.1f} s"


KINDS: dict[str, tuple[Callable[[dict], str], bool]] = {  # kind: (render, is a block)
    "speed": (speed, True),
    "memory": (memory, True),
    "memory_range": (memory_range, False),
    "memory_xl": (memory_xl, True),
    "xl_target": (xl_target, False),
    "scaling": (scaling, True),
    "sizes": (sizes, True),
    "layouts": (layouts, True),
    "vs_nanogpt": (nanogpt, True),
    "quality": (quality, False),
    "checkpoint_save": (checkpoint_save, False),
}


# ---- the README


def load(path: Path) -> dict:
    if not path.exists():
        raise SystemExit(f"render_readme.py: {path} not found: fix the path in its README marker")
    if path.name.startswith("vs_nanogpt"):
        return vs_nanogpt.load(path)  # either schema
    result = json.loads(path.read_text())
    if (ladders.CONF / "ladder" / f"{path.stem}.yaml").exists():  # a ladder's: its yaml's captions
        what = {plan["name"]: plan["what"] for plan in ladders.step_plans(ladders.read(path.stem))}
        for row in result["steps"]:
            row["what"] = what.get(row["name"])  # a step no longer in the yaml has none
            row["ladder"] = path.stem
    return result


def render(text: str, root: Path = ROOT) -> str:
    """`text` with the body of every marker rendered afresh from the file the marker names."""

    def body(match: re.Match) -> str:
        kind, path = match["kind"], match["path"]
        if kind not in KINDS:
            raise SystemExit(f"render_readme.py: unknown kind {kind!r} in a marker: {list(KINDS)}")
        fn, block = KINDS[kind]
        rendered = fn(load(root / path))
        if block:
            rendered = f"\n\n{rendered}\n\n"  # blank lines: a table apart from the markers
        return f"<!-- results:{kind} {path} -->{rendered}<!-- /results:{kind} -->"

    return MARKER.sub(body, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 with a diff if it differs")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    args = parser.parse_args(argv)
    text = args.readme.read_text()
    fresh = render(text, args.readme.resolve().parent)
    if not args.check:
        args.readme.write_text(fresh)
        return 0
    if fresh == text:
        return 0
    diff = difflib.unified_diff(
        text.splitlines(keepends=True), fresh.splitlines(keepends=True),
        f"{args.readme} (as committed)", f"{args.readme} (rendered from docs/results)",
    )  # fmt: skip
    sys.stdout.writelines(diff)
    print("README.md's measured numbers differ: run python scripts/render_readme.py")
    return 1
