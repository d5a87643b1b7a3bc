"""The measuring code: what runs the programs and turns their runs into numbers, tables and charts.
Each command is a module with a `main`, run by its thin entry point `python scripts/<command>.py`
(ablate, plan_memory, quality, vs_nanogpt, gpu_check, render_readme, step_budget, memory_peak,
save_stall, plot, bench_head); the ladder harness is split by what each part is: ladders (reading
a ladder, its steps), runner (launching a step's processes), stats (medians, intervals, ratios,
Welch), ladder_table, ladder_chart and ladder_results (the results files), ladder_profile (a
step's time by kernel family); memory_model is plan_memory's model of a step's memory."""
