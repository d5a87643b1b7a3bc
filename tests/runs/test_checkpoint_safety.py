"""A run folder is read safely, whoever made it: a crafted DCP `.metadata` or
`LATEST` runs no code and leads nowhere else; one checkpoint layout at a time, chosen by its
step; a damaged checkpoint file is refused by name before anything is written."""

from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist
import torch.distributed.checkpoint as dcp
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import checkpointing
from base import distributed, errors
from checkpointing import checksums, safe_load
from helpers import CONF, ROOT, make_cfg, python, tiny_run
from model import GPT, GPTConfig
from opt.fsdp import apply_fsdp
from tools import consolidate_checkpoint as consolidate_app
from tools import evaluate as evaluate_app
from tools import export_hf as export_app
from tools import sample as sample_app
from train import build_optimizer

QUIET = ("sample.num_samples=0", "wandb.mode=disabled")


def _shard(run: Path, step: int | None = None, keep: int = 1) -> None:
    """Rewrites a run's checkpoint.pt as FSDP saves it (checkpoint.dcp/), over a process group
    of this one process: the same weights and optimizer state, at the same step (or `step`),
    keeping `keep` checkpoints (train.keep_checkpoints)."""
    state = checkpointing.read(run)
    cpu = torch.device("cpu")
    distributed.init_process_group(cpu, rank=0, world_size=1, store=torch_dist.HashStore())
    try:
        dist = distributed.Distributed(rank=0, local_rank=0, world_size=1, device=cpu)
        model = GPT(GPTConfig(**state["model_config"]))
        apply_fsdp(model, make_cfg("+opt=fsdp").opt.fsdp, dist, None)
        optimizer = build_optimizer(model, OmegaConf.create(state["config"]).train, {})
        scaler = torch.amp.GradScaler(enabled=False)
        checkpointing.restore(state, model, optimizer, scaler)
        kept = ("config", "model_config", "stages", "wandb_id", "samples")
        saver = checkpointing.Saver(run, dist, keep=keep)
        saver.save(model, optimizer, scaler, step or state["step"], {k: state[k] for k in kept})
        saver.close()
    finally:
        distributed.shutdown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny run stopped at step 2, in each layout: `single` (checkpoint.pt) and `sharded`
    (checkpoint.dcp/, as FSDP writes it)."""
    single, sharded = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("sharded")
    tiny_run(single, "train.max_steps=2", *QUIET)
    shutil.copytree(single, sharded, dirs_exist_ok=True)
    _shard(sharded)
    return {"single": single, "sharded": sharded}


def _copy(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


def _step_folder(run: Path) -> Path:
    return run / "checkpoint.dcp" / (run / "checkpoint.dcp" / "LATEST").read_text()


def _tool_cfg(name: str, *overrides: str):
    on_cpu = ["device=cpu"] if name in ("sample", "evaluate") else []
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(name, overrides=[*on_cpu, *overrides])


def _tools_refuse(run: Path, tmp_path: Path, message: str) -> None:
    """sample.py, evaluate.py, export_hf.py and consolidate_checkpoint.py each end in one line
    that matches `message`."""
    apps = {
        "sample.py": (sample_app, _tool_cfg("sample", f"run={run}", "max_new_tokens=2")),
        "evaluate.py": (evaluate_app, _tool_cfg("evaluate", f"run={run}")),
        "export_hf.py": (export_app, _tool_cfg("export_hf", f"run={run}", f"out={tmp_path}/hf")),
    }
    for name, (app, cfg) in apps.items():
        with pytest.raises(SystemExit, match=rf"^{name}: error: {message}"):
            app.main.__wrapped__(cfg)
    with pytest.MonkeyPatch.context() as mp, pytest.raises(SystemExit) as refused:
        mp.setattr("sys.argv", ["consolidate_checkpoint.py", str(run)])
        errors.main(consolidate_app.main)
    assert re.match(rf"^consolidate_checkpoint.py: error: {message}", str(refused.value))


def _resume(run: Path, steps: int = 4) -> dict:
    return tiny_run(run, f"train.max_steps={steps}", *QUIET, "train.resume=true")


# ---- 1. a crafted .metadata runs no code; LATEST leads nowhere else


class _Payload:
    """What an attacker pickles: unpickling it creates `marker` (a plain pickle.load would)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def test_a_crafted_dcp_metadata_is_refused_everywhere_and_runs_no_code(runs, tmp_path) -> None:
    run, marker = _copy(runs["sharded"], tmp_path), tmp_path / "pwned"
    folder = _step_folder(run)
    (folder / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    (folder / "sha256.json").unlink(missing_ok=True)  # an attacker would: then unchecked
    refusal = (
        f"{folder}/.metadata is not a checkpoint this recipe wrote (it would load the class "
        "builtins.exec): refusing to read it"
    )
    with pytest.raises(RuntimeError) as refused:
        checkpointing.load_model(run)
    assert str(refused.value) == refusal
    _tools_refuse(run, tmp_path, re.escape(refusal))
    with pytest.raises(RuntimeError, match=re.escape(refusal)):
        _resume(run)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=32))  # DCP's own reading
    optimizer, scaler = torch.optim.AdamW(model.parameters()), torch.amp.GradScaler(enabled=False)
    with pytest.raises(RuntimeError, match=re.escape(refusal)):
        checkpointing.restore({"sharded": folder}, model, optimizer, scaler)
    assert not marker.exists()  # no code ran


def test_a_crafted_value_in_a_dcp_shard_runs_no_code(tmp_path) -> None:
    """DCP unpickles a checkpoint's non-tensor values (the optimizer's settings) with
    weights_only=False; here only plain data is accepted."""
    folder, marker = tmp_path / "step-00000001", tmp_path / "pwned"
    dcp.save({"model": {"w": torch.zeros(2)}, "v": _Payload(marker)}, checkpoint_id=folder,
             no_dist=True)  # fmt: skip
    refusal = f"cannot read the checkpoint in {folder}: its value v is not plain data"
    with pytest.raises(RuntimeError, match=f"^{re.escape(refusal)}"):
        safe_load.dcp_load({"model": {"w": torch.zeros(2)}, "v": None}, folder, no_dist=True)
    assert not marker.exists()


@pytest.mark.parametrize("latest", ["absolute", "parent", "symlink"])
def test_latest_must_name_a_step_folder_of_its_own(runs, tmp_path, latest) -> None:
    run = _copy(runs["sharded"], tmp_path)
    elsewhere = Path(shutil.copytree(_step_folder(run), tmp_path / "elsewhere" / "step-00000002"))
    name = {
        "absolute": str(elsewhere), "parent": "../../elsewhere/step-00000002",
        "symlink": "step-00000009",
    }[latest]  # fmt: skip
    if latest == "symlink":
        (run / checkpointing.SHARDED / name).symlink_to(elsewhere, target_is_directory=True)
    (run / checkpointing.SHARDED / "LATEST").write_text(name)
    with pytest.raises(RuntimeError, match=rf"LATEST names '{re.escape(name)}', not a step-<N>"):
        checkpointing.read(run)


def test_a_genuine_sharded_checkpoint_loads(runs) -> None:
    sharded, _ = checkpointing.load_model(runs["sharded"])
    single, _ = checkpointing.load_model(runs["single"])
    assert sharded.lm_head.weight is sharded.transformer.wte.weight  # tied again
    for name, tensor in single.state_dict().items():
        torch.testing.assert_close(sharded.state_dict()[name], tensor, rtol=0, atol=0)


# ---- a save never writes through a link planted in place of a checkpoint folder


@pytest.mark.parametrize("planted", ["checkpoint.dcp", "checkpoints", "best"])
def test_a_save_refuses_a_planted_link_and_keeps_the_last_checkpoint(runs, tmp_path, planted):
    run = _copy(runs["sharded" if planted == "checkpoint.dcp" else "single"], tmp_path)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "meta.pt").write_text("precious")
    (run / planted).mkdir(exist_ok=True)
    (run / planted / "step-00000004").symlink_to(victim)
    with pytest.raises(errors.Unusable, match=rf"{planted}/step-00000004 is a symbolic link"):
        if planted == "checkpoint.dcp":  # an FSDP run's save at step 4
            _shard(run, step=4)
        else:
            tiny_run(run, "train.max_steps=4", *QUIET, "train.resume=true",
                     "train.keep_checkpoints=2", "train.keep_best=true")  # fmt: skip
    assert sorted(p.name for p in victim.iterdir()) == ["meta.pt"]
    assert (victim / "meta.pt").read_text() == "precious"
    assert checkpointing.read(run)["step"] == 2  # the last good one, still where readers look
    assert not [p for p in run.rglob("*") if ".tmp-" in p.name]


# ---- 2. one layout at a time, chosen by its step


def test_a_stale_layout_is_removed_by_a_save_and_never_chosen(runs, tmp_path, capsys) -> None:
    run = _copy(runs["sharded"], tmp_path)
    _resume(run)  # the FSDP run, continued in one process: it saves checkpoint.pt
    assert not (run / checkpointing.SHARDED).exists()
    assert (
        f"[checkpoint] removed {run / checkpointing.SHARDED / 'LATEST'}, an older layout's latest"
        in capsys.readouterr().out
    )
    assert checkpointing.read(run)["step"] == 4

    # The copy: the old step-2 shards beside the step-4 file, LATEST touched last.
    shutil.copytree(runs["sharded"] / checkpointing.SHARDED, run / checkpointing.SHARDED)
    os.utime(run / checkpointing.SHARDED / "LATEST")
    message = (
        f"{run} holds two checkpoints, checkpoint.pt at step 4 and checkpoint.dcp/ at step 2: "
        f"remove the stale one (the older is {run / checkpointing.SHARDED}) and run again"
    )
    with pytest.raises(RuntimeError) as refused:
        checkpointing.read(run)
    assert str(refused.value) == message
    metrics = (run / "metrics.jsonl").read_bytes()
    with pytest.raises(RuntimeError, match="holds two checkpoints"):
        _resume(run, steps=6)
    assert (run / "metrics.jsonl").read_bytes() == metrics  # nothing cut back


def test_a_layout_change_keeps_what_keep_checkpoints_keeps(runs, tmp_path) -> None:
    run = _copy(runs["sharded"], tmp_path)
    _shard(run, step=3, keep=2)  # an FSDP run keeping steps 2 and 3 in checkpoint.dcp/
    keep = "train.keep_checkpoints=2"
    tiny_run(run, "train.max_steps=4", keep, *QUIET, "train.resume=true")  # one process
    assert checkpointing.read(run)["step"] == 4  # checkpoint.pt
    assert checkpointing.read(run, which=3)["step"] == 3  # the older layout's kept step
    with pytest.raises(FileNotFoundError, match="keeps steps 3, 4"):
        checkpointing.read(run, which=2)  # one more than train.keep_checkpoints: rotated out
    tiny_run(run, "train.max_steps=5", keep, *QUIET, "train.resume=true")
    assert [checkpointing.read(run, which=n)["step"] for n in (4, 5)] == [4, 5]
    assert not (run / checkpointing.SHARDED).exists()  # its last kept step rotated out


def test_both_layouts_at_one_step_read_the_single_file(runs, tmp_path) -> None:
    run = _copy(runs["sharded"], tmp_path)
    consolidate_app.consolidate(run)  # writes checkpoint.pt beside checkpoint.dcp/
    state = checkpointing.read(run)
    assert "sharded" not in state and state["step"] == 2
    assert "lm_head.weight" in state["model"]  # as a one-process run saves it


# ---- 3. checksums, checked on every read; tied weights saved once


def _flip_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def _last_tensor_offset(path: Path) -> int:
    """An offset inside the last tensor torch.save wrote (the optimizer's state comes after the
    model's): its zip member's data, past the local header."""
    with zipfile.ZipFile(path) as archive:
        member = max(
            (i for i in archive.infolist() if "/data/" in i.filename and i.filename[-1].isdigit()),
            key=lambda i: int(i.filename.rsplit("/", 1)[1]),
        )
    with open(path, "rb") as f:
        f.seek(member.header_offset + 26)
        name_len, extra_len = (int.from_bytes(f.read(2), "little") for _ in range(2))
    return member.header_offset + 30 + name_len + extra_len + member.file_size // 2


def test_a_flipped_bit_in_the_optimizer_state_is_refused_before_anything_is_written(
    runs, tmp_path
) -> None:
    run = _copy(runs["single"], tmp_path)
    _flip_bit(run / "checkpoint.pt", _last_tensor_offset(run / "checkpoint.pt"))
    damaged = f"{run}/checkpoint.pt is damaged (its sha256 differs from the one saved with it)"
    saved = {name: (run / name).read_bytes() for name in ("config.yaml", "overrides.yaml")}
    with pytest.raises(RuntimeError, match=rf"^{re.escape(damaged)}: the checkpoint cannot be"):
        _resume(run)
    assert saved == {name: (run / name).read_bytes() for name in saved}  # not rewritten
    done = subprocess.run(
        [python(), "-m", "tools.evaluate", f"run={run}", "device=cpu"], cwd=ROOT,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2 and "val/loss" not in done.stdout
    assert done.stderr.splitlines() == [
        f"evaluate.py: error: {damaged}: the checkpoint cannot be used; copy the run folder again "
        "if it came from elsewhere, else resume from a backup or start a new run folder"
    ]


def test_a_flipped_bit_in_a_dcp_shard_is_refused_by_name(runs, tmp_path) -> None:
    run = _copy(runs["sharded"], tmp_path)
    shard = _step_folder(run) / "__0_0.distcp"
    _flip_bit(shard, shard.stat().st_size // 2)
    damaged = re.escape(f"{shard} is damaged (its sha256 differs from the one saved with it)")
    with pytest.raises(RuntimeError, match=rf"^{damaged}"):
        checkpointing.load_model(run)
    _tools_refuse(run, tmp_path, damaged)


def test_checksums_are_saved_beside_every_checkpoint_file(runs) -> None:
    sums = checksums._listed(checksums.checksums_of(runs["single"] / "checkpoint.pt"))
    assert list(sums) == ["checkpoint.pt"] and set(sums["checkpoint.pt"][0]) == {
        "bytes", "sha256", "sampled_sha256"
    }  # fmt: skip
    folder = _step_folder(runs["sharded"])
    assert set(checksums._listed(folder / checksums.CHECKSUMS)) == {
        ".metadata", "__0_0.distcp", "meta.pt"
    }  # fmt: skip


def test_a_checkpoint_without_checksums_still_loads(runs, tmp_path) -> None:
    run = _copy(runs["single"], tmp_path)  # as an earlier version of the recipe saved it
    checksums.checksums_of(run / "checkpoint.pt").unlink()
    assert checkpointing.read(run)["step"] == 2


def test_large_files_are_sampled_and_verify_hashes_them_whole(runs, tmp_path, monkeypatch) -> None:
    from data import integrity

    run = _copy(runs["single"], tmp_path)
    path = run / "checkpoint.pt"
    monkeypatch.setattr(integrity, "FULL_CHECK_BYTES", 0)  # every file counts as large
    block, size = integrity.SAMPLE_BLOCK_BYTES, path.stat().st_size
    last = size - block
    blocks = integrity.SAMPLE_BLOCKS
    starts = sorted({last * i // (blocks - 1) for i in range(blocks)})
    gap = next((a + block, b) for a, b in zip(starts, starts[1:], strict=False) if b > a + block)
    _flip_bit(path, sum(gap) // 2)  # between two sampled blocks: unnoticed
    assert checkpointing.read(run)["step"] == 2
    with pytest.raises(RuntimeError, match="checkpoint.pt is damaged"):
        checkpointing.read(run, verify=True)


@pytest.mark.parametrize(("renames", "step"), [(1, 2), (2, 3)])
def test_a_save_killed_between_its_renames_leaves_an_accepted_checkpoint(
    runs, tmp_path, monkeypatch, renames, step
) -> None:
    """The file and its checksums are renamed into place one after the other: a kill after
    `renames` of the three (checksums of both, the file, checksums of the new) leaves the old
    or the new checkpoint, accepted by its checksums."""
    run = _copy(runs["single"], tmp_path)
    path, state, real_replace = run / "checkpoint.pt", checkpointing.read(run), os.replace
    done: list[str] = []

    def killed(src, dst) -> None:
        if len(done) == renames:
            raise KeyboardInterrupt
        done.append(dst)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpointing.write_atomically(path, {**state, "step": 3}, checksum=True)
    monkeypatch.undo()
    assert checkpointing.read(run)["step"] == step


def test_tied_weights_are_saved_once_in_shards(runs) -> None:
    metadata = dcp.FileSystemReader(_step_folder(runs["sharded"])).read_metadata()
    names = set(metadata.state_dict_metadata)
    assert "model.transformer.wte.weight" in names and "model.lm_head.weight" not in names


def test_a_half_written_dcp_step_is_not_a_kept_checkpoint(runs, tmp_path) -> None:
    run = _copy(runs["sharded"], tmp_path)
    half = run / "checkpoint.dcp" / "step-00000005"  # a save killed before its metadata
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"some shards")
    with pytest.raises(
        errors.MissingFile, match=r"keeps no checkpoint of that step; it keeps steps 2$"
    ):
        checkpointing.read(run, which=5)
    assert checkpointing.read(run, which=2)["step"] == 2
