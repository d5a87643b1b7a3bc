"""The fixtures every test folder sees (this file sits at the root of tests/): a per-session data
and compile cache, a fresh RNG per test, a Hugging Face folder, a read-only folder, a wandb spy.
The helpers that tests import are in helpers.py."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from base.distributed import Distributed
from helpers import WandbCalls

# Before anything imports `datasets` (it reads these once): tests never reach for the hub.
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["WANDB_SILENT"] = "true"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory):
    """A randomly initialised Hugging Face GPT-2 with GPT-2's vocabulary, saved to disk."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64)).eval()
    folder = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(folder)
    return folder, hf


@pytest.fixture
def read_only_dir() -> Path:
    """A folder that no user may write, root included (sysfs); the test is skipped without one."""
    folder = Path("/sys")
    try:
        (folder / "gpt2-recipe-probe").mkdir()
    except OSError:
        return folder
    (folder / "gpt2-recipe-probe").rmdir()
    pytest.skip(f"{folder} is writable here")


@pytest.fixture(scope="session", autouse=True)
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One prepared-corpus cache for the whole session (the config reads GPT2_RECIPE_CACHE)."""
    cache = Path(os.environ.get("GPT2_RECIPE_TEST_CACHE") or tmp_path_factory.mktemp("cache"))
    os.environ["GPT2_RECIPE_CACHE"] = str(cache)
    return cache


@pytest.fixture(scope="session", autouse=True)
def compile_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private Inductor cache for the session (opt.compile.cache_dir reads
    GPT2_RECIPE_COMPILE_CACHE), not the user's own."""
    cache = tmp_path_factory.mktemp("compile-cache")
    os.environ["GPT2_RECIPE_COMPILE_CACHE"] = str(cache)
    return cache


@pytest.fixture(autouse=True)
def _fresh_torch_state() -> None:
    """Each test starts from the same global RNG and matmul precision."""
    torch.manual_seed(0)
    torch.set_float32_matmul_precision("highest")


@pytest.fixture
def group_of_one() -> Iterator[Distributed]:
    """A process group of one process on the CPU (gloo): FSDP, DTensor and the checkpoint's
    collectives run in-process."""
    import torch.distributed as torch_dist

    from base import distributed

    cpu = torch.device("cpu")
    distributed.init_process_group(cpu, rank=0, world_size=1, store=torch_dist.HashStore())
    try:
        yield Distributed(rank=0, local_rank=0, world_size=1, device=cpu)
    finally:
        distributed.shutdown()


@pytest.fixture
def wandb_calls(monkeypatch: pytest.MonkeyPatch) -> WandbCalls:
    """Spies on wandb through its public API: what the trainer asked for. What wandb made of it
    (the final summary, the run's name and group) is read back with `wandb_records`."""
    import wandb

    calls, real_init = WandbCalls(), wandb.init

    def init(**kwargs):
        calls.init.append(kwargs)
        run = real_init(**kwargs)
        real_log, real_finish = run.log, run.finish

        def log(metrics, step=None, **rest):
            calls.logs.append((dict(metrics), step))
            return real_log(metrics, step=step, **rest)

        def finish(*args, **rest):
            calls.finished += 1
            return real_finish(*args, **rest)

        run.log, run.finish = log, finish  # type: ignore[method-assign, assignment]
        return run

    monkeypatch.setattr(wandb, "init", init)
    return calls
