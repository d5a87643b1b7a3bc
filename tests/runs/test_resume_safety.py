"""A lowbit run's checkpoint holds plain tensors (the tools read it
without torchao) and resumes across an optimizer change; `model.pretrained` refuses weights that
do not fit their config; a resume on a changed corpus is refused before any work."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from checkpointing import checksums
from helpers import CONF, ROOT, logged, python, tiny_cfg, tiny_run
from model import GPT

QUIET = ("sample.num_samples=0", "wandb.mode=disabled", "train.log_interval=1")
LOWBIT = ("+opt=lowbit", "train.checkpoint_interval=2", *QUIET)


def _eager_run(run_dir: Path, *overrides: str) -> dict:
    """A tiny run with torchao's compiled update run eagerly (the same update, no compiling)."""
    with torch.compiler.set_stance("force_eager"):
        return tiny_run(run_dir, *overrides)


def _tensors(tree: object) -> list[torch.Tensor]:
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, list | tuple):
        return [t for v in tree for t in _tensors(v)]
    return [tree] if isinstance(tree, torch.Tensor) else []


# ---- 4. a lowbit run: the tools read it, a resume may change the optimizer


@pytest.fixture(scope="module")
def lowbit_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("lowbit")
    _eager_run(run, "train.max_steps=2", *LOWBIT)
    return run


def test_a_lowbit_checkpoint_holds_plain_tensors(lowbit_run) -> None:
    state = torch.load(lowbit_run / "checkpoint.pt", weights_only=True)
    assert {type(t) for t in _tensors(state)} == {torch.Tensor}  # no torchao subclass
    moments = state["optimizer"]["state"]["transformer.wte.weight"]["exp_avg"]
    assert int(moments["lowbit_bits"]) == 8 and moments["codes"].dtype == torch.uint8
    assert state["optimizer_class"] == "AdamW8bit"


@pytest.mark.slow
def test_smoke_the_tools_read_a_lowbit_run_without_torchao(lowbit_run, tmp_path) -> None:
    """In fresh processes, which never import torchao: sample, evaluate, export (the test
    above is the fast check that the checkpoint holds no torchao class)."""
    for command in (
        ["sample.py", f"run={lowbit_run}", "num_samples=1", "max_new_tokens=2", "device=cpu"],
        ["-m", "tools.evaluate", f"run={lowbit_run}", "device=cpu", "eval_sequences=2"],
        ["-m", "tools.export_hf", f"run={lowbit_run}", f"out={tmp_path / 'hf'}"],
    ):
        done = subprocess.run(
            [python(), "-c", _WITHOUT_TORCHAO, *command], cwd=ROOT, capture_output=True,
            text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, (command, done.stderr[-2000:])
    assert (tmp_path / "hf" / "config.json").exists()


# Runs `python <script> <args>` or `python -m <module> <args>` as Python would, with torchao made
# unimportable.
_WITHOUT_TORCHAO = """
import runpy, sys
sys.modules["torchao"] = None
if sys.argv[1] == "-m":
    sys.argv = sys.argv[2:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize(
    "first,then,line",
    [
        (("+opt=lowbit",), ("+opt=forloop",), "AdamW8bit's, this run steps with AdamW"),
        (("+opt=forloop",), ("+opt=lowbit",), "AdamW's, this run steps with AdamW8bit"),
        (("+opt=lowbit",), ("+opt=lowbit", "opt.lowbit.bits=4"), "AdamW8bit's, this run steps "
         "with AdamW4bit"),
    ],
)  # fmt: skip
def test_a_resume_may_change_the_optimizer_and_says_so(tmp_path, capsys, first, then, line):
    _eager_run(tmp_path, "train.max_steps=2", *first, *QUIET)
    capsys.readouterr()
    summary = _eager_run(tmp_path, "train.max_steps=3", "train.resume=true", *then, *QUIET)
    out = capsys.readouterr().out
    assert f"[resume] the checkpoint's optimizer state is {line}" in out
    assert "state starts afresh (the weights, step and data position are restored)" in out
    assert summary["step"] == 3 and len(logged(tmp_path, "train/loss")) == 3


@pytest.mark.parametrize("bits", [8, 4])
def test_a_lowbit_resume_with_the_same_stage_is_exact(tmp_path, bits) -> None:
    """The quantized moments come back as they were saved: the losses of the straight run."""
    args = (*LOWBIT, f"opt.lowbit.bits={bits}")
    _eager_run(tmp_path / "straight", "train.max_steps=4", *args)
    _eager_run(tmp_path / "resumed", "train.max_steps=2", *args)
    _eager_run(tmp_path / "resumed", "train.max_steps=4", "train.resume=true")
    expected = logged(tmp_path / "straight", "train/loss")
    assert logged(tmp_path / "resumed", "train/loss") == expected


# ---- 5. model.pretrained: weights that do not fit their config are refused


@pytest.fixture(scope="module")
def hf_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Hugging Face GPT-2, saved by `save_pretrained`."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("hf")
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=32)).save_pretrained(
        folder
    )
    return folder


def _with_config(hf_weights: Path, folder: Path, **changes: object) -> Path:
    """The same weights beside a config.json with `changes`."""
    folder.mkdir()
    config = json.loads((hf_weights / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    for weights in hf_weights.glob("*.safetensors"):
        (folder / weights.name).symlink_to(weights)
    return folder


def test_pretrained_weights_load_when_they_fit(hf_weights) -> None:
    assert GPT.from_pretrained(hf_weights).config.n_layer == 2


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"n_layer": 3}, r"the weights lack part of what config.json describes \(missing keys: "
         r"transformer\.h\.2\.attn\.c_attn\.bias, .* and \d+ more\)"),
        ({"n_layer": 1}, r"the weights hold more than config.json describes "
         r"\(unexpected keys: transformer\.h\.1\."),
        ({"n_positions": 64}, r"transformer\.wpe\.weight has shape \(32, 32\) in the weights but "
         r"\(64, 32\) by config.json"),
        ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
         r"its config.json has model_type='llama', not 'gpt2'"),
    ],
)  # fmt: skip
def test_pretrained_weights_that_do_not_fit_are_refused(hf_weights, tmp_path, changes, message):
    folder = _with_config(hf_weights, tmp_path / "hf", **changes)
    with pytest.raises(ValueError, match=rf"^model.pretrained={folder}: {message}") as refused:
        GPT.from_pretrained(folder)
    assert "\n" not in str(refused.value)


def test_sample_refuses_a_llama_folder_in_one_line(hf_weights, tmp_path) -> None:
    from tools import sample

    folder = _with_config(hf_weights, tmp_path / "llama", model_type="llama")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("sample", overrides=[f"model.pretrained={folder}", "device=cpu"])
    with pytest.raises(SystemExit, match=rf"^sample\.py: error: model.pretrained={folder}: its"):
        sample.main.__wrapped__(cfg)


# ---- 6. a resume on a changed corpus is refused before any work


def _run_files(run_dir: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(run_dir)): p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def test_a_resume_on_an_edited_corpus_is_refused_and_writes_nothing(tmp_path) -> None:
    corpus, run = tmp_path / "corpus.txt", tmp_path / "run"
    corpus.write_text("a line of a small corpus with enough words to fill some windows\n" * 300)
    text = ("data=text", f"data.files={corpus}", "data.num_proc=1")
    tiny_run(run, "train.max_steps=2", *text, *QUIET)
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    assert state["corpus"]["tokenizer"] == "gpt2" and state["corpus"]["dtype"] == "uint16"
    before = _run_files(run)
    corpus.write_text("another corpus altogether, at the same path, with other words\n" * 300)
    with pytest.raises(ValueError) as refused:
        tiny_run(run, "train.max_steps=4", "train.resume=true")
    message = str(refused.value)
    assert message.startswith(
        "the corpus changed since the checkpoint: data.files content differs (sha256 "
        f"{state['corpus']['sha256'][:12]}… -> "
    )
    assert message.endswith("); resume with the original files or start a new run")
    assert "\n" not in message
    assert _run_files(run) == before  # not a byte rewritten


def test_a_checkpoint_without_a_corpus_identity_resumes_as_before(tmp_path) -> None:
    tiny_run(tmp_path, "train.max_steps=2", *QUIET)
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    del state["corpus"]  # as an older version wrote it: without checksums either
    torch.save(state, tmp_path / "checkpoint.pt")
    checksums.checksums_of(tmp_path / "checkpoint.pt").unlink()
    assert tiny_run(tmp_path, "train.max_steps=3", "train.resume=true", *QUIET)["step"] == 3


def test_a_prepared_cache_with_another_tokenizer_or_dtype_is_refused(tmp_path) -> None:
    from data.prepare import cache_folder, prepare, read_meta

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a line of a small corpus with enough words to fill some windows\n" * 300)
    cfg = tiny_cfg("data=text", f"data.files={corpus}", "data.num_proc=1").data
    folder = prepare(cfg)
    meta_path = folder / "meta.json"
    meta = json.loads(meta_path.read_text())
    for key, value, recorded in (
        ("tokenizer", "cl100k_base", "tokenizer 'cl100k_base' and dtype 'uint16'"),
        ("dtype", "uint32", "tokenizer 'gpt2' and dtype 'uint32'"),
    ):
        meta_path.write_text(json.dumps({**meta, key: value}))
        with pytest.raises(RuntimeError, match=f"meta.json records {recorded}; this version reads"):
            read_meta(cache_folder(cfg), "train", "bin")


def test_a_resume_with_another_tokenizer_or_dtype_names_it() -> None:
    from data import check_corpus, corpus_identity

    current = corpus_identity(tiny_cfg().data)
    check_corpus(dict(current), current)
    with pytest.raises(ValueError, match=r"the tokenizer differs \(tokenizer 'r50k' -> 'gpt2'\)"):
        check_corpus({**current, "tokenizer": "r50k"}, current)
    with pytest.raises(ValueError, match=r"the token dtype differs \(dtype 'uint32' -> 'uint16'"):
        check_corpus({**current, "dtype": "uint32"}, current)


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"- !!python/object/apply:os.system ['echo planted']\n", r"could not determine a const"),
        (b"- model=tiny\n- train.lr: [\n", r"while parsing"),
        (b"model: tiny\n", r"not a list but dict"),
        (b"- model=tiny\n- [1]\n", r"not every entry is an override"),
        (b"- model=tiny\xff\n", r"can't decode byte 0xff"),
    ],
)
def test_a_damaged_overrides_file_is_refused_in_one_line_on_resume(tmp_path, content, why) -> None:
    from base import errors
    from recipe import config

    (tmp_path / "overrides.yaml").write_bytes(content)
    with pytest.raises(errors.Unusable, match=rf"overrides.yaml is damaged \(.*{why}") as refused:
        config.for_resume(tmp_path, ["train.resume=true"])
    assert "\n" not in str(refused.value) and "write it so, or start a new run folder" in str(
        refused.value
    )


class _Planted:
    def __reduce__(self):
        return (os.system, ("touch planted",))


@pytest.mark.parametrize("weights", ["malicious", "garbled"])
def test_a_pretrained_folder_with_a_foreign_pickle_is_refused_in_one_line(
    hf_weights, tmp_path, monkeypatch, weights
) -> None:
    from base import errors

    folder = tmp_path / "hf"
    folder.mkdir()
    shutil.copy(hf_weights / "config.json", folder)
    if weights == "malicious":
        torch.save({"transformer.wte.weight": _Planted()}, folder / "pytorch_model.bin")
    else:
        (folder / "pytorch_model.bin").write_bytes(b"not a torch file at all")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(errors.Unusable, match=rf"^model.pretrained={folder}: its weights file ho"):
        GPT.from_pretrained(folder)
    assert not (tmp_path / "planted").exists()
