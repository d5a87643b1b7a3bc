"""A ladder's results as a markdown table: a row per step, its gains against the row before and
the baseline, the notes its columns need, the failures, the environment and the commands."""

from __future__ import annotations

from collections.abc import Sequence

from omegaconf import DictConfig

from measure import ladder_profile, stats


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _percent(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec) + "%"


def _ratio(row: dict, ref: dict | None, key: str) -> str:
    if not ref or row.get(key) is None or ref.get(key) in (None, 0):
        return "–"
    stored = next((s for s in ("", "_ref") if row.get(f"ratio{s}_vs") == ref["name"]), None)
    if key == "tokens_per_sec" and stored is not None and row.get(f"ratio{stored}") is not None:
        return _speed_cell(row, stored)
    if key == "tokens_per_sec":
        return f"{row[key] / ref[key]:.2f}x"
    return f"{100 * (row[key] / ref[key] - 1):+.0f}%"


def _speed_cell(row: dict, suffix: str) -> str:
    """A stored tokens/s ratio; with repeats, its interval and whether it is within noise; from
    two calls, only that."""
    ratio, interval = row[f"ratio{suffix}"], row[f"ratio{suffix}_interval"]
    if interval is None:
        return f"{ratio:.2f}x (across calls)"
    low, high = interval
    if row.get("repeats", 1) <= 1 and low == high:
        return f"{ratio:.2f}x"
    noise = " within noise" if row.get(f"within_noise{suffix}") else ""
    return f"{ratio:.3f}x ({low:.3f}–{high:.3f}){noise}"


def _tokens_cell(row: dict) -> str:
    """Tokens/s: the median of the repeats with their min–max, or one run's p10–p90."""
    low, high = stats.spread(row)
    runs = f", {row['repeats']} runs" if row.get("repeats", 1) > 1 else ""
    spread = "" if low is None or high is None else f" ({low:,.0f}–{high:,.0f}{runs})"
    return _fmt(row.get("tokens_per_sec"), ",.0f") + spread


def _loss_cell(row: dict) -> str:
    """The training loss, marked when some of the row's runs diverged (its numbers then time a
    broken model)."""
    loss, broken = _fmt(row.get("train_loss"), ".3f"), row.get("diverged_runs")
    return f"{loss} **({broken} of {row.get('repeats') or 1} runs diverged)**" if broken else loss


def _kernel_cell(kernel: str | None) -> str:
    """opt/attention.py's `<family>: <kernel name>`, the name cut to its first 40 characters."""
    if not kernel:
        return "–"
    family, _, name = kernel.partition(": ")
    return f"{family}: `{name[:40]}{'…' if len(name) > 40 else ''}`" if name else kernel


def gpus_label(row: dict) -> str:
    """`2` for 2 GPUs of one torchrun, `2 x 1` for two "machines" of one GPU."""
    nnodes, gpus = row.get("nnodes", 1), row.get("gpus", 1)
    return f"{nnodes} x {gpus // nnodes}" if nnodes > 1 else str(gpus)


def efficiency_cell(row: dict, missing: str = "–") -> str:
    """The per-GPU efficiency, marked where its 1-GPU reference ran in another call."""
    if row.get("efficiency") is None:
        return missing
    cell = format(row["efficiency"], ".3f")
    return cell + " (across calls)" if row.get("efficiency_across_calls") else cell


def markdown(ladder: DictConfig, rows: list[dict], env: dict, segments: Sequence[dict] = ()) -> str:
    key = "tokens_per_sec" if ladder.focus == "speed" else "peak_allocated_gib"
    gain = "speed-up" if ladder.focus == "speed" else "peak memory"
    scaling = any(row.get("gpus", 1) > 1 for row in rows)  # then: GPUs and per-GPU efficiency
    # Compared with step 0, or with the row the ladder names as its reference, then also in
    # tokens/s when memory is the focus (a memory stage's price is speed).
    reference = ladder.get("reference")
    versus = f"`{reference}`" if reference else "baseline"
    speed_too = bool(reference) and key != "tokens_per_sec"
    repeats = any(r.get("repeats", 1) > 1 for r in rows)
    spread = "tokens/s (runs: median, min–max)" if repeats else "tokens/s (p10–p90)"
    busy = any(r.get("gpu_busy") is not None for r in rows)  # NVML's samples, when measured
    across = any(r.get("ratio_across_calls") or r.get("ratio_ref_across_calls") for r in rows)
    # Which attention kernel ran, where the rows' differ: the attention ladder's backends, or a
    # library on the path that changed PyTorch's choice between two calls.
    kernels = len({r.get("attention_kernel") for r in rows if r.get("attention_kernel")}) > 1
    columns = [
        "#", "step", "what changes", *(["GPUs"] if scaling else []), spread,
        *(["per-GPU efficiency"] if scaling else []), f"{gain} vs prev", f"{gain} vs {versus}",
        *([f"tokens/s vs {versus}"] if speed_too else []),
        "MFU", *(["GPU busy"] if busy else []), "step ms", "peak alloc GiB", "peak reserved GiB",
        *(["attention kernel"] if kernels else []), "loss", "status",
    ]  # fmt: skip
    header = "| " + " | ".join(columns) + " |"
    lines = [
        f"# Ladder `{ladder.name}` on {env['device']}",
        "",
        header,
        "|" + "---|" * len(columns),
    ]
    pairs = stats.comparisons(ladder, rows)
    own = stats.compared_with(ladder)  # rows compared with a step of their own, not the baseline
    for row, previous, baseline in pairs:
        against = f" vs `{own[row['name']]}`" if row["name"] in own and baseline else ""
        cells = [
            str(row["index"]),
            f"`{row['name']}`",
            row["what"] + (f" (cap {cap} GiB)" if (cap := row.get("memory_cap_gib")) else ""),
            *([gpus_label(row)] if scaling else []),
            _tokens_cell(row),
            *([efficiency_cell(row)] if scaling else []),
            _ratio(row, previous, key) if ladder.cumulative else "–",
            _ratio(row, baseline, key) + against,
            *([_ratio(row, baseline, "tokens_per_sec") + against] if speed_too else []),
            _percent(row.get("mfu"), ".1f"),
            *([_percent(row.get("gpu_busy"), ".0f")] if busy else []),
            _fmt(row.get("step_ms"), ".1f"),
            _fmt(row.get("peak_allocated_gib"), ".2f"),
            _fmt(row.get("peak_reserved_gib"), ".2f"),
            *([_kernel_cell(row.get("attention_kernel"))] if kernels else []),
            _loss_cell(row),
            row["status"] if row["status"] == "ok" else f"**{row['status']}**",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    versus_row = f"the `{reference}` row" if reference else "step 0"
    compared = (
        f"the last step that ran (`vs prev`) and with {versus_row}"
        if ladder.cumulative
        else versus_row
    )
    if own:
        compared += ", or with the step a cell names (`vs`: the step's own reference)"
    lines += ["", f"Gains compare with {compared}."]
    if scaling:
        lines += [
            "Per-GPU efficiency: tokens/s / (GPUs x tokens/s of the nearest 1-GPU step above), "
            "the same per-GPU batch on one GPU of this host (*across calls*: that step ran in "
            "another call, on another machine); `a x b` GPUs: a torchrun agents "
            '("machines", c10d rendezvous on 127.0.0.1) of b GPUs each.'
        ]
    if repeats:
        lines += [
            "Tokens/s: the median of the step's runs, interleaved with the other steps' (A B C A B "
            "C ...), with their min–max; a ratio's range is the min–max of the per-run ratios "
            "(run i of both rows, which ran side by side); *within noise*: that range includes "
            "1.00x. A single run shows the p10–p90 of its steps."
        ]
    if across:
        lines += [
            "*across calls*: the two rows ran in different device calls, perhaps on machines 2-5% "
            "apart, with no anchor between them: the ratio of their medians, not a measurement."
        ]
    if busy:
        lines += [
            "GPU busy: the mean of NVML's utilization samples over the measured steps (the share "
            "of time a kernel ran; 100% minus the idle a trace would show, without the tracer); "
            "'–': not measured (rows from before it was recorded)."
        ]
    if any(r.get("diverged_runs") for r in rows):
        lines += [
            f"*diverged*: a run's last logged training loss ended over {stats.DIVERGED:.0%} above "
            "its lowest; its tokens/s time a model that broke, not the step (on an H100 such runs "
            "ran 5.5% faster than converged runs of the same command): rerun the row before "
            "trusting its ratios."
        ]
    # A segment speaks for the rows that still come from its call (a later call may have
    # re-measured some of its steps).
    call_of = {r["name"]: r.get("call") for r in rows}
    lines += [
        f"Steps {shown} ran in one call ({s['call']}) with `{s['anchor']['name']}` "
        f"re-measured beside them as their anchor: {_tokens_cell(s['anchor'])} tokens/s."
        for s in segments
        if s.get("anchor") and s["anchor"].get("status") == "ok"
        if (shown := [n for n in s["steps"] if call_of.get(n) == s["call"]])
    ]
    lines += [f"\n- `{r['name']}`: {r['note']}" for r in rows if r.get("note")]
    lines += ladder_profile.table(
        [(row, previous if ladder.cumulative else baseline) for row, previous, baseline in pairs],
        stats.anchors_by_call(segments),
    )
    lines += ladder_profile.parallel_table(
        [(row, stats.efficiency_reference(row, rows, segments)) for row, _, _ in pairs]
    )
    failures = [r for r in rows if r["status"] != "ok"]
    if failures:
        lines += ["", "Steps that did not complete:", ""]
        lines += [f"- `{r['name']}` ({r['status']}): {r.get('error', '')}" for r in failures]
    lines += ["", "## Environment (of the last `ablate.py` call)", ""]
    lines += [f"- {name}: `{value}`" for name, value in env.items()]
    lines += ["", "## Step commands (and the commit each step ran at)", ""]
    lines += [f"{r['index']}. `{r['command']}` ({r.get('git_commit', '?')})" for r in rows]
    return "\n".join(lines) + "\n"
