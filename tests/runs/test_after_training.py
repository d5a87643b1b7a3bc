"""After training: sample.py, tools/evaluate.py and tools/export_hf.py read a run folder (or
Hugging Face weights) and agree with the trainer: the same samples, the same validation loss,
and an export whose logits are ours."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import checkpointing
from data.tokenizer import gpt2_encoding
from helpers import ROOT, logged, python, tiny_cfg, tiny_run, tool_cfg
from model import GPT
from tools import evaluate as evaluate_app
from tools import export_hf as export_app
from tools import generate
from tools import sample as sample_app
from train import train

QUIET = ("wandb.mode=disabled", "train.log_interval=1")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):
    """A finished tiny run (3 steps) with its two end-of-training samples."""
    folder = tmp_path_factory.mktemp("run")
    tiny_run(folder, "train.max_steps=3", "sample.num_samples=2", "sample.max_new_tokens=6", *QUIET)
    return folder


# ---- sample.py


def test_sample_from_a_run_folder_gives_the_trainers_samples(run, tmp_path) -> None:
    at_the_end = (run / "samples.txt").read_text()
    out = tmp_path / "samples.txt"
    texts = sample_app.sample(
        tool_cfg("sample", f"run={run}", "num_samples=2", "max_new_tokens=6", f"out={out}")
    )
    assert len(texts) == 2 and all(texts)
    assert at_the_end == "# step 3\n" + generate.show("\n", texts)  # the same text, bit for bit
    heading, *rest = out.read_text().splitlines(keepends=True)
    assert heading.startswith(f"# run={run} seed=1337") and "".join(rest) == at_the_end[9:]
    other = sample_app.sample(
        tool_cfg("sample", f"run={run}", "num_samples=2", "max_new_tokens=6", "seed=7")
    )
    assert other != texts


def test_sample_prompt_from_a_file_and_bfloat16(run, tmp_path) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("ROMEO:\nBut, soft!")
    cfg = tool_cfg("sample", f"run={run}", f"prompt_file={prompt}", "num_samples=1",
                   "max_new_tokens=5", "dtype=bfloat16")  # fmt: skip
    (text,) = sample_app.sample(cfg)
    assert len(gpt2_encoding().encode(text, allowed_special="all")) >= 1
    empty = tool_cfg("sample", f"run={run}", "prompt=''", "num_samples=1", "max_new_tokens=3")
    assert sample_app.sample(empty)[0]  # a new document: after <|endoftext|>


def test_sample_from_a_hugging_face_folder_matches_transformers_greedy(hf_dir) -> None:
    folder, hf = hf_dir
    cfg = tool_cfg("sample", f"model.pretrained={folder}", "prompt=Hello world", "top_k=1",
                   "num_samples=1", "max_new_tokens=8")  # fmt: skip
    (text,) = sample_app.sample(cfg)  # top_k=1: the most likely token each time
    encoding = gpt2_encoding()
    ids = torch.tensor([encoding.encode("Hello world")])
    greedy = hf.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=50256)
    assert text == encoding.decode(greedy[0, ids.shape[1] :].tolist())


@pytest.mark.slow
def test_sample_compiled_gives_the_eager_text(hf_dir) -> None:
    folder, _ = hf_dir
    settings = (f"model.pretrained={folder}", "prompt=Hello", "top_k=1", "max_new_tokens=6")
    eager = sample_app.sample(tool_cfg("sample", *settings))
    torch._dynamo.reset()
    counters.clear()
    assert sample_app.sample(tool_cfg("sample", *settings, "compile=true")) == eager
    assert counters["stats"]["unique_graphs"] >= 1  # it did run compiled


@pytest.mark.parametrize(
    "overrides,message",
    [
        ((), r"which model\? Give run=<a training run's folder> or model.pretrained="),
        (("run={tmp}", "model.pretrained=gpt2"), r"both name a model: give one"),
        (("run={tmp}/nowhere",), r"no such folder; give the folder of a training run"),
        (("run={tmp}",), r"there is no checkpoint at .*checkpoint.pt"),
        (("run={tmp}", "prompt=a", "prompt_file=b.txt"), r"both give the prompt: give one"),
        (("run={tmp}", "temperature=0"), r"temperature must be a number >= 1e-06, got 0"),
        (("run={tmp}", "dtype=float8"), r"dtype='float8': choose auto, float32, float16, bfloat16"),
    ],
)
def test_sample_bad_input_ends_in_one_line(tmp_path, overrides, message) -> None:
    cfg = tool_cfg("sample", *(o.format(tmp=tmp_path) for o in overrides))
    with pytest.raises(SystemExit, match=rf"^sample\.py: (.* )?{message}"):
        sample_app.main.__wrapped__(cfg)


def test_sample_cli_reports_bad_input_in_one_line(tmp_path) -> None:
    done = subprocess.run(
        [python(), "sample.py", f"run={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and not done.stdout
    assert done.stderr.splitlines() == [
        f"sample.py: error: there is no checkpoint at {tmp_path}/checkpoint.pt: point at the "
        "folder of a run that saved one (train.checkpoint_interval > 0, or a run that reached its "
        "end or was stopped)"
    ]


# ---- tools/evaluate.py


def test_evaluate_equals_the_runs_logged_val_loss_under_its_stages(tmp_path) -> None:
    # bfloat16 amp: evaluating in float32 instead would give another number.
    tiny_run(tmp_path, "train.max_steps=3", "+opt=amp", "opt.amp.dtype=bfloat16",
             "sample.num_samples=0", *QUIET)  # fmt: skip
    out = tmp_path / "eval.json"
    result = evaluate_app.evaluate_model(tool_cfg("evaluate", f"run={tmp_path}", f"out={out}"))
    assert result["val/loss"] == logged(tmp_path, "val/loss")[-1]
    assert result["stages"] == ["amp"] and result["eval_sequences"] == 8
    assert json.loads(out.read_text()) == result
    assert result["val/perplexity"] == pytest.approx(torch.tensor(result["val/loss"]).exp().item())


def test_evaluate_on_other_data_and_windows(run) -> None:
    own = evaluate_app.evaluate_model(tool_cfg("evaluate", f"run={run}"))
    assert own["val/loss"] == logged(run, "val/loss")[-1] and own["data"] == "shakespeare"
    other = evaluate_app.evaluate_model(
        tool_cfg("evaluate", f"run={run}", "data=synthetic", "eval_sequences=4", "block_size=16")
    )
    assert (other["data"], other["eval_sequences"], other["block_size"]) == ("synthetic", 4, 16)
    assert other["val/loss"] != own["val/loss"]


def test_evaluate_hugging_face_weights_on_their_positions(hf_dir) -> None:
    folder, _ = hf_dir
    result = evaluate_app.evaluate_model(
        tool_cfg("evaluate", f"model.pretrained={folder}", "eval_sequences=4")
    )
    assert result["block_size"] == 64 and result["model"] == f"model.pretrained={folder}"
    assert 10 < result["val/loss"] < 11.5  # random weights: about ln(50257) = 10.8


def test_evaluate_refuses_a_window_longer_than_the_model(run) -> None:
    with pytest.raises(SystemExit, match=r"^evaluate.py: error: block_size=64 exceeds the model"):
        evaluate_app.main.__wrapped__(tool_cfg("evaluate", f"run={run}", "block_size=64"))


# ---- tools/export_hf.py


@pytest.mark.parametrize("bias", [True, False])
def test_export_round_trip_through_transformers(tmp_path, bias) -> None:
    from transformers import AutoTokenizer, GPT2LMHeadModel, pipeline

    run_dir, out = tmp_path / "run", tmp_path / "exported"
    tiny_run(run_dir, "train.max_steps=2", f"model.bias={str(bias).lower()}",
             "sample.num_samples=0", *QUIET)  # fmt: skip
    export_app.export_run(tool_cfg("export_hf", f"run={run_dir}", f"out={out}"))
    ours, _ = checkpointing.load_model(run_dir)
    hf = GPT2LMHeadModel.from_pretrained(out).eval()
    assert hf.config.vocab_size == 50257 and hf.config.n_positions == 32
    idx = torch.randint(0, 50257, (2, 32))
    with torch.no_grad():
        assert (ours.eval()(idx)[0] - hf(idx).logits).abs().max().item() <= 1e-4
        back = GPT.from_pretrained(out).eval()  # and back: what model.pretrained= reads
        assert (ours(idx)[0] - back(idx)[0]).abs().max().item() <= 1e-4

    text = "ROMEO: But, soft! what light through yonder window breaks?<|endoftext|>"
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.encode(text) == gpt2_encoding().encode(text, allowed_special="all")
    generated = pipeline("text-generation", model=str(out))("ROMEO:", max_new_tokens=4)
    assert generated[0]["generated_text"].startswith("ROMEO:")  # offline: HF_HUB_OFFLINE=1


def test_training_from_an_export_starts_where_the_run_ended(run, tmp_path) -> None:
    out = tmp_path / "exported"
    export_app.export_run(tool_cfg("export_hf", f"run={run}", f"out={out}", "check=false"))
    summary = train(
        tiny_cfg(f"model.pretrained={out}", "model.n_layer=1", "train.max_steps=1",
                 "sample.num_samples=0", *QUIET),
        tmp_path / "fine-tune",
    )  # fmt: skip
    assert logged(tmp_path / "fine-tune", "val/loss")[0] == logged(run, "val/loss")[-1]
    state = checkpointing.read(tmp_path / "fine-tune")
    assert state["model_config"]["n_layer"] == 2  # the export's shape, not model.n_layer=1
    assert summary["completed"]


def test_export_refuses_a_folder_with_other_files_and_a_foreign_vocabulary(run, tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match=r"^export_hf.py: error: out=.* holds files that are not"):
        export_app.main.__wrapped__(tool_cfg("export_hf", f"run={run}", f"out={tmp_path}"))
    small = tmp_path / "small"
    tiny_run(small, "data=synthetic", "data.vocab_size=64", "model.vocab_size=64",
             "train.max_steps=1", "sample.num_samples=0", *QUIET)  # fmt: skip
    with pytest.raises(SystemExit, match=r"predicts 64 tokens, not GPT-2's 50257"):
        export_app.main.__wrapped__(tool_cfg("export_hf", f"run={small}", f"out={tmp_path}/x"))


# ---- on a GPU (skipped here; run with `pytest -m gpu tests/runs/test_after_training.py`)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("stages", ["+opt=[amp,compile]", "+opt=[amp,custom_op]"])
def test_gpu_evaluate_and_sample_a_run_trained_on_the_gpu(tmp_path, stages) -> None:
    tiny_run(tmp_path, "device=cuda", stages, "opt.amp.dtype=bfloat16", "train.max_steps=3",
             "sample.num_samples=2", "sample.max_new_tokens=6", *QUIET)  # fmt: skip
    result = evaluate_app.evaluate_model(tool_cfg("evaluate", f"run={tmp_path}", "device=cuda"))
    assert result["val/loss"] == logged(tmp_path, "val/loss")[-1]
    settings = (f"run={tmp_path}", "num_samples=2", "max_new_tokens=6", "device=cuda")
    eager = sample_app.sample(tool_cfg("sample", *settings))  # dtype auto: bfloat16, as trained
    assert (tmp_path / "samples.txt").read_text() == "# step 3\n" + generate.show("\n", eager)
    compiled = sample_app.sample(tool_cfg("sample", *settings, "compile=true"))
    assert len(compiled) == 2 and all(compiled)
