"""A new user's first hour: the README's commands are what CI runs and install what the tests
need; float16 on a CPU says it is slow, once; DataLoader workers never outnumber the CPUs; FSDP
has no view to warn about."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import warnings

import pytest
import torch

import data
import opt
from base.distributed import Distributed
from helpers import ROOT, python, tiny_cfg
from model import GPT, GPTConfig

SINGLE = Distributed(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))

spec = importlib.util.spec_from_file_location("readme_commands", ROOT / ".ci/readme_commands.py")
readme_commands = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
spec.loader.exec_module(readme_commands)


# ---- the README's commands


def test_ci_runs_exactly_the_readmes_set_up_and_test_lines() -> None:
    lines = readme_commands.commands((ROOT / "README.md").read_text())
    commands = [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]
    torch_install, install, *rest = commands
    assert torch_install.startswith("pip install torch==2.13.0 --index-url ")
    assert install == 'pip install -e ".[dev]"'
    assert "python train.py" in rest
    # The whole suite, split by its marker: every test is in one of the two runs.
    tests = [line for line in rest if line.startswith("pytest")]
    assert tests == ['pytest -q -n 2 -m "not distributed"', "pytest -q -m distributed"]

    # The set-up installs what the test and lint commands run: the `dev` extra has them.
    extras = (ROOT / "pyproject.toml").read_text()
    dev = re.search(r"^dev = \[(.*)\]$", extras, flags=re.M).group(1)
    assert re.search(r'"pytest[^"]*"', dev) and re.search(r'"ruff[^"]*"', dev)
    assert re.search(r'"pytest-xdist[^"]*"', dev)  # -n 2
    assert re.search(r'"mypy[^"]*"', dev)
    assert "ruff check . && ruff format --check . && mypy" in rest

    # CI runs those lines and installs or tests nothing of its own.
    ci = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line[:1] != "#"]
    assert "python3 .ci/readme_commands.py README.md > .venv-ci/readme.sh" in ci
    assert "bash -euxo pipefail .venv-ci/readme.sh" in ci
    # Its one mention of pytest is the guard that fails CI when the README loses that line.
    guard = [line for line in ci if line.startswith('grep -q "^pytest" .venv-ci/readme.sh ||')]
    assert len(guard) == 1 and "exit 1" in guard[0]
    own = [line for line in ci if line not in guard]
    assert not [line for line in own if re.search(r"pip install|pytest|ruff|train\.py", line)]


def test_the_first_block_installs_the_cpu_wheel_without_a_gpu_and_says_how_long_tests_take(
    tmp_path,
) -> None:
    """CI's machine has no GPU: its torch comes from the CPU index (plain `pip install torch` is
    the CUDA build on Linux, gigabytes); with an `nvidia-smi` that lists a GPU, a CUDA build."""
    readme = (ROOT / "README.md").read_text()
    first = readme_commands.commands(readme)[:3]
    index = first[0].split("--index-url ")[1]
    echo = [shutil.which("bash") or "bash", "-c", f"echo {index}"]
    fake = tmp_path / "gpu" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100'\n")
    fake.chmod(0o755)
    without = subprocess.run(echo, env={"PATH": str(tmp_path)}, capture_output=True, text=True)
    gpu_path = {"PATH": str(fake.parent)}
    with_gpu = subprocess.run(echo, env=gpu_path, capture_output=True, text=True)
    assert without.stdout.strip() == "https://download.pytorch.org/whl/cpu"
    assert re.fullmatch(r"https://download.pytorch.org/whl/cu\d+", with_gpu.stdout.strip())
    assert re.search(r"pytest -q, about \d+ minutes on 2 CPU cores", " ".join(first))


def test_a_ci_mark_without_its_block_is_an_error() -> None:
    assert readme_commands.commands("<!-- ci -->\n```bash\nmake test\n```\n") == ["make test"]
    with pytest.raises(SystemExit, match="must precede a ```bash block"):
        readme_commands.commands("<!-- ci -->\nmake test\n")


# ---- one line of warning, once


def test_float16_on_a_cpu_warns_once_and_bfloat16_does_not(capsys) -> None:
    opt.plan(tiny_cfg("+opt=amp", "opt.amp.dtype=float16"), SINGLE)
    out = capsys.readouterr().out
    assert out.count("[warning]") == 1
    assert "opt.amp.dtype=float16 on a CPU gains no speed over float32" in out
    assert "use opt.amp.dtype=bfloat16" in out
    assert not re.search(r"\d+x slower", out)  # measured: float32's speed on a 2-core CPU
    opt.plan(tiny_cfg("+opt=amp", "opt.amp.dtype=bfloat16"), SINGLE)
    assert "[warning]" not in capsys.readouterr().out


def test_workers_are_capped_to_the_cpus_and_torch_has_nothing_to_warn_about(
    monkeypatch, capsys
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # a 2-core machine
    plan = opt.plan(tiny_cfg("+opt=workers"), SINGLE)  # the default: 4 workers
    assert plan.loader.num_workers == 2
    assert capsys.readouterr().out.splitlines() == [
        "[opt] workers: 2 persistent (opt.workers.num_workers=4 capped to the 2 CPUs this "
        "process may use), prefetch 2 batches each"
    ]
    loader = data.build_loader(
        data.RandomTokens(8, 0, 64), 4, rank=0, world_size=1, seed=0, options=plan.loader
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        next(iter(loader))  # the DataLoader checks the worker count as its workers start
    assert not [w for w in caught if "worker processes in total" in str(w.message)]
    plan = opt.plan(tiny_cfg("+opt=workers", "opt.workers.num_workers=1"), SINGLE)
    assert plan.loader.num_workers == 1 and "capped" not in capsys.readouterr().out


def test_the_opt_lines_of_a_cpu_run_describe_no_gpu_kernels(capsys) -> None:
    cfg = tiny_cfg("+opt=[tf32,lowbit,custom_op]")
    plan = opt.plan(cfg, SINGLE)
    opt.apply_model_stages(GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8)), cfg.opt, plan, SINGLE)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[opt]")]
    assert [line.split(":")[0] for line in lines] == [
        "[opt] tf32",
        "[opt] lowbit",
        "[opt] custom_op",
    ]
    assert (
        "no TF32 tensor cores: cpu" in lines[0]
        and "(on the cpu)" in lines[1]
        and "on the cpu" in lines[2]
    )
    assert not re.search(r"on TF32 tensor cores|Triton kernel on CUDA|kernel block", str(lines))


def test_torchao_is_imported_without_noise() -> None:
    """torchao (the lowbit extra; transformers imports it too) logs a 'Failed to load' line per
    compiled library it cannot use, here and in export, fine-tune and the planner's output."""
    code = "import recipe, torchao.optim"
    done = subprocess.run([python(), "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and done.stderr == "" and done.stdout == ""


# ---- FSDP's "returned a view tensor" warning


def test_model_outputs_are_no_views() -> None:
    """FSDP2 warns when a module it wraps returns a view that requires grad (an in-place op on
    it would skip its pre-backward hook). The cause was the logits returned as a slice of the
    padded vocabulary; they are now computed over the real vocabulary only."""
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=50))
    idx = torch.randint(0, 50, (2, 8))
    logits, _ = model(idx)
    _, loss = model(idx, idx)
    assert logits.requires_grad and logits._base is None and logits.shape == (2, 8, 50)
    assert loss.requires_grad and loss._base is None
    with torch.no_grad():  # the same numbers as the padded head, masked
        padded = torch.nn.functional.linear(
            model.transformer.ln_f(model.transformer.h[0](model.embed(idx))),
            model.lm_head.weight,
            model.vocab_pad_mask,
        )
    torch.testing.assert_close(logits.detach(), padded[..., :50])


FSDP_PROBE = """
import warnings, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from model import GPT, GPTConfig
from base.distributed import init_process_group
init_process_group(torch.device("cpu"), rank=0, world_size=1, store=dist.HashStore())
model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=50))
fully_shard(model.transformer.h[0])
fully_shard(model)
idx = torch.randint(0, 50, (2, 8))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model(idx)[0].sum().backward()  # logits, with autograd on
    model(idx, idx)[1].backward()  # the training loss
print("views:", sum("returned a view tensor" in str(w.message) for w in caught))
dist.destroy_process_group()
"""


def test_fsdp_sees_no_view_from_the_model() -> None:
    done = subprocess.run(
        [python(), "-c", FSDP_PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "views: 0" in done.stdout


def test_ci_runs_the_multi_process_tests_under_the_oldest_torch_admitted() -> None:
    """The GPU machines run an older torch than CI's, whose torch.distributed differs: CI runs the
    multi-process tests again under the oldest torch pyproject.toml admits, so that the bound
    states a version the tests really ran under."""
    oldest = re.search(r'"torch>=([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    lines = readme_commands.commands((ROOT / "README.md").read_text())
    installs = [line for line in lines if re.search(r"pip install -q torch==[\d.]+ -e \.", line)]
    assert len(installs) == 1, lines
    version = re.search(r"torch==([\d.]+)", installs[0]).group(1)
    assert version.removesuffix(".0") == oldest.removesuffix(".0")
    venv = installs[0].split("python3 -m venv ")[1].split()[0]
    runs = [line for line in lines if line.startswith(f"{venv}/bin/python -m pytest")]
    paths = [ROOT / word for word in runs[0].split() if word.startswith("tests/")]  # files, folders
    tested = {p.stem for path in paths for p in [path, *path.rglob("test_*.py")] if p.is_file()}
    assert {"test_pp", "test_tp", "test_distributed"} <= tested
