"""The static type check (`mypy`, CI's lint line) catches a call with a missing argument in code
that CI never runs: a GPU-only test stepping without its `guard` rotted that way. An unannotated
test body is checked too (check_untyped_defs)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from helpers import ROOT

# A GPU-only test as they are written: unannotated, so mypy checks its body only when configured
# to (check_untyped_defs), and CI on a CPU skips it, so only the type check can see the call.
CALLER = """
    import opt
    from recipe.guard import NonFiniteGuard
    from train import train_step

    def test_on_the_gpu(cfg, model, optimizer, scaler, x, plan, gpu):
        guard = NonFiniteGuard(gpu.device, gpu, max_bad_steps=10)
        step = opt.build_step(cfg.opt, plan{guard}, model, model, optimizer, scaler)
        train_step(step, x[:, :-1], x[:, 1:], 1.0)
"""


def _mypy(module: Path) -> tuple[int, str]:
    """mypy with the project's configuration on `module` alone (and what it imports)."""
    from mypy import api

    out, err, status = api.run(["--config-file", str(ROOT / "pyproject.toml"), str(module)])
    return status, out + err


@pytest.mark.slow  # a cold cache analyses torch: ~40 s on 2 cores (a warm one takes seconds)
def test_mypy_reports_a_step_built_without_its_guard(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)  # the project's modules and its .mypy_cache
    module = tmp_path / "gpu_only_caller.py"
    module.write_text(textwrap.dedent(CALLER.format(guard="")))
    status, out = _mypy(module)
    assert status == 1, out
    assert 'Missing positional argument "scaler" in call to "build_step"  [call-arg]' in out, out
    # The same call with its guard passes: the error is the missing argument, nothing else.
    module.write_text(textwrap.dedent(CALLER.format(guard=", guard")))
    status, out = _mypy(module)
    assert status == 0, out
