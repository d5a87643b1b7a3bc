"""HellaSwag (tasks/hellaswag.py): on items written here in the dataset's format, the module's
batched scoring picks, item by item, what a plain token-by-token scorer written here picks, for
each convention (lm-evaluation-harness's acc and acc_norm, build-nanogpt's acc_token_mean), for a
tiny random GPT and for a Hugging Face GPT-2 folder (scored by transformers itself); tools.evaluate
task=hellaswag and train.hellaswag=true report those numbers; the split over ranks sums to the
one-process totals."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from base.distributed import Distributed
from data.tokenizer import gpt2_encoding
from helpers import CONF, ROOT, TINY, logged, tiny_run, write_line
from launch.torchrun import torchrun
from model import GPT, GPTConfig
from tasks import hellaswag
from tools import evaluate as evaluate_app

CPU = torch.device("cpu")

# Varied as the real items are: ActivityNet's lower-case ctx_b, WikiHow's [title]/[step]/[header]
# markers and empty ctx_b, double spaces, a bracket ending the context (a trailing space the
# harness moves into the continuation), string labels (the hub's), long contexts (cut to fit
# the tiny model's 32 positions), endings of very different lengths.
ITEMS: list[dict[str, Any]] = [
    {"ind": 24, "activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.",
     "ctx_b": "he", "ctx": "A man is sitting on a roof. he", "label": 3,
     "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                 "is holding a rubik's cube.", "starts pulling up roofing on a roof."]},
    {"ind": 92, "activity_label": "Personal Care and Style",
     "ctx_a": "[header] How to dye your hair [title] Pick a color. [step] Go to a store that "
              "sells hair dye and look at the boxes.", "ctx_b": "",
     "ctx": "[header] How to dye your hair [title] Pick a color. [step] Go to a store that sells "
            "hair dye and look at the boxes.", "label": "2",
     "endings": ["[substeps] Choose a shade close to your own.  Avoid bleach.",
                 "Eat the box.", "[title] Read the instructions on the box. [step] Wear gloves.",
                 "Paint the walls of the store a bright and cheerful shade of orange today."]},
    {"ind": 7, "activity_label": "Cooking", "ctx_a": "Clean the pan with hot water. [step]",
     "ctx_b": "", "ctx": "Clean the pan with hot water. [step]", "label": "0",
     "endings": ["Dry it with a towel.", "then", "The cat sings a long song about the moon and "
                 "the stars and the sea.", "Put it away."]},
    {"ind": 311, "activity_label": "Playing guitar", "ctx_a": "A boy holds a guitar on a stage "
     "in front of a large crowd of people who are clapping and cheering loudly for him.",
     "ctx_b": "then the boy", "ctx": "A boy holds a guitar on a stage in front of a large crowd "
     "of people who are clapping and cheering loudly for him. then the boy", "label": 1,
     "endings": ["eats.", "strums the strings and plays a song for the crowd.", "flies away.",
                 "puts the guitar down and walks off the stage without a word."]},
    {"ind": 5, "activity_label": "Bathing dog", "ctx_a": "A woman  washes a dog in a tub.",
     "ctx_b": "the dog", "ctx": "A woman  washes a dog in a tub. the dog", "label": 0,
     "endings": ["shakes water all over her.", "reads a book.", "is  dried with a towel.",
                 "barks."]},
    {"ind": 1001, "activity_label": "Home and Garden", "ctx_a": "[header] How to plant a tree "
     "[title] Dig a hole. [step] The hole should be twice as wide as the root ball.",
     "ctx_b": "", "ctx": "[header] How to plant a tree [title] Dig a hole. [step] The hole "
     "should be twice as wide as the root ball.", "label": "3",
     "endings": ["[substeps] Use a shovel.", "Water it.", "Plant the seed in the sky.",
                 "[title] Place the tree in the hole. [step] Fill it with soil."]},
]  # fmt: skip


@pytest.fixture(scope="module")
def task_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hellaswag") / "hellaswag_val.jsonl"
    path.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    return path


@pytest.fixture(scope="module")
def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32)).eval()


@pytest.fixture(scope="module")
def hf_reference(hf_dir):
    """The independent scorer's picks and accuracies for the Hugging Face model."""
    return reference_accuracy(lambda idx: hf_dir[1](idx).logits, window=64)


# ---- the independent scorer: each convention as its sources describe it, one token at a time


def harness_clean(text: str) -> str:
    """lm-evaluation-harness's preprocess, written out by hand."""
    text = text.strip().replace(" [title]", ". ")
    while "[" in text and "]" in text[text.index("[") :]:
        start = text.index("[")
        text = text[:start] + text[text.index("]", start) + 1 :]
    return text.replace("  ", " ")


def log_likelihoods(logits_of, context: list[int], continuation: list[int], window: int):
    """log p(token | the tokens before it) for each continuation token, read one at a time from
    the logits of the row alone (no batch, no padding). The row is its last `window + 1` tokens,
    as the harness cuts it."""
    tokens = (context + continuation)[-(window + 1) :]
    logits = logits_of(torch.tensor([tokens[:-1]]))[0].double()
    out = []
    for j in range(max(1, len(tokens) - len(continuation)), len(tokens)):
        out.append(logits[j - 1].log_softmax(-1)[tokens[j]].item())
    return out


def reference_scores(logits_of, item: dict, window: int) -> dict[str, list[float]]:
    """Each convention's scores of the four endings (higher: more likely)."""
    enc = gpt2_encoding().encode_ordinary
    query = harness_clean(f"{item['activity_label']}: {item['ctx_a']} {item['ctx_b'].capitalize()}")
    sums, norms, means = [], [], []
    for ending in item["endings"]:
        choice = harness_clean(ending)
        # The harness moves the context's trailing spaces into the continuation.
        context, continuation = query.rstrip(), query[len(query.rstrip()) :] + " " + choice
        head = enc(context)
        lls = log_likelihoods(logits_of, head, enc(context + continuation)[len(head) :], window)
        sums.append(sum(lls))
        norms.append(sum(lls) / len(choice))
        nano = log_likelihoods(logits_of, enc(item["ctx"]), enc(" " + ending), window)
        means.append(sum(nano) / len(nano))
    return {"acc": sums, "acc_norm": norms, "acc_token_mean": means}


def reference_accuracy(logits_of, window: int):
    """Per item each convention's scores and pick (the first best), and the accuracies."""
    with torch.no_grad():
        scored = [reference_scores(logits_of, item, window) for item in ITEMS]
    picks = [{c: s.index(max(s)) for c, s in item.items()} for item in scored]
    labels = [int(item["label"]) for item in ITEMS]
    accuracy = {
        c: sum(p[c] == y for p, y in zip(picks, labels, strict=True)) / len(ITEMS)
        for c in hellaswag.CONVENTIONS
    }
    return scored, picks, accuracy


def assert_scored_alike(model, reference, window: int) -> None:
    """The module's scores equal the reference's (to float32 rounding), its picks exactly."""
    scored, picks, _ = reference
    items = [hellaswag.checked(json.dumps(item), "test") for item in ITEMS]
    for item, expected in zip(items, scored, strict=True):
        ours = hellaswag.scores(model, item, window, CPU)
        for c in hellaswag.CONVENTIONS:
            torch.testing.assert_close(
                ours[c], torch.tensor(expected[c], dtype=torch.float64), rtol=1e-5, atol=1e-5
            )
    assert [hellaswag.choices(model, item, window, CPU) for item in items] == picks
    # The conventions disagree on some item: the comparison tells them apart.
    assert any(len(set(p.values())) > 1 for p in picks)


# ---- the tests


def test_preprocess_is_the_harness_clean_up() -> None:
    text = " Personal Care: [header] How to dye hair [title] Pick a color. [step] Go  out. "
    assert hellaswag.preprocess(text) == "Personal Care: How to dye hair. Pick a color. Go out."
    for item in ITEMS:
        for text in (item["ctx_a"], *item["endings"]):
            assert hellaswag.preprocess(text) == harness_clean(text)


def test_tiny_model_scores_as_a_token_by_token_scorer(tiny_gpt, task_file) -> None:
    reference = reference_accuracy(lambda idx: tiny_gpt(idx)[0], window=32)
    assert_scored_alike(tiny_gpt, reference, window=32)
    items = hellaswag.load_items(str(task_file), "unused")
    result = hellaswag.TASK.evaluate(tiny_gpt, items, block_size=32, dist=Distributed(0, 0, 1, CPU))
    assert result == reference[2] | {"items": len(ITEMS)}


def test_hugging_face_folder_scores_as_transformers(hf_dir, hf_reference, task_file) -> None:
    model = GPT.from_pretrained(hf_dir[0]).eval()
    assert_scored_alike(model, hf_reference, window=64)
    items = hellaswag.load_items(str(task_file), "unused")
    result = hellaswag.TASK.evaluate(model, items, block_size=64, dist=Distributed(0, 0, 1, CPU))
    assert result == hf_reference[2] | {"items": len(ITEMS)}


def evaluate_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("evaluate", overrides=["device=cpu", "task=hellaswag", *overrides])


def test_evaluate_py_writes_the_three_accuracies(hf_dir, hf_reference, task_file, tmp_path):
    folder, _ = hf_dir
    out = tmp_path / "result.json"
    result = evaluate_app.evaluate_model(
        evaluate_cfg(f"model.pretrained={folder}", f"task_file={task_file}", f"out={out}")
    )
    accuracy = hf_reference[2]
    assert json.loads(out.read_text()) == result
    assert {k: result[f"hellaswag/{k}"] for k in hellaswag.CONVENTIONS} == accuracy
    assert result["hellaswag/items"] == len(ITEMS) and result["block_size"] == 64
    limited = evaluate_app.evaluate_model(
        evaluate_cfg(f"model.pretrained={folder}", f"task_file={task_file}", "limit=2")
    )
    assert limited["hellaswag/items"] == 2


def test_training_logs_hellaswag_and_evaluate_py_repeats_it(task_file, tmp_path) -> None:
    tiny_run(
        tmp_path, "train.max_steps=2", "train.hellaswag=true", "train.hellaswag_items=4",
        f"train.hellaswag_file={task_file}", "sample.num_samples=0", "wandb.mode=disabled",
    )  # fmt: skip
    for c in hellaswag.CONVENTIONS:
        assert len(logged(tmp_path, f"val/hellaswag_{c}")) == 2  # at step 0 and at the end
    result = evaluate_app.evaluate_model(
        evaluate_cfg(f"run={tmp_path}", f"task_file={task_file}", "limit=4")
    )
    for c in hellaswag.CONVENTIONS:
        assert result[f"hellaswag/{c}"] == logged(tmp_path, f"val/hellaswag_{c}")[-1]


def test_ranks_split_the_items_and_sum_to_one_process(tiny_gpt) -> None:
    world_size = 4  # 6 items: 2, 2, 1 and 1 per rank
    items = [hellaswag.checked(json.dumps(item), "test") for item in ITEMS]
    forwards: list[int] = []
    hook = tiny_gpt.register_forward_hook(lambda *_: forwards.append(1))
    try:
        alone = hellaswag.TASK.sums(tiny_gpt, items, block_size=32, device=CPU)
        per_rank = []
        for rank in range(world_size):
            forwards.clear()
            per_rank.append(
                hellaswag.TASK.sums(
                    tiny_gpt, items, block_size=32, device=CPU, rank=rank, world_size=world_size
                )
            )
            # FSDP gathers the weights in every forward: each rank runs as many.
            assert len(forwards) == -(-len(items) // world_size)
    finally:
        hook.remove()
    assert torch.equal(torch.stack(per_rank).sum(0), alone)


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_on_two_processes_scores_as_one_process(task_file, tmp_path) -> None:
    # 5 items: 3 on rank 0, 2 on rank 1, which runs a spare forward (FSDP gathers in each).
    run = (
        "train.max_steps=1", "train.hellaswag=true", "train.hellaswag_items=5",
        f"train.hellaswag_file={task_file}", "sample.num_samples=0", "wandb.mode=disabled",
    )  # fmt: skip
    tiny_run(tmp_path / "one", *run)
    command = [*torchrun(2), "train.py", *TINY, *run, "+opt=fsdp"]
    done = subprocess.run(
        [*command, f"hydra.run.dir={tmp_path / 'fsdp'}"], cwd=ROOT, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for c in hellaswag.CONVENTIONS:
        key = f"val/hellaswag_{c}"
        assert logged(tmp_path / "fsdp", key)[0] == logged(tmp_path / "one", key)[0]


def test_the_hub_dataset_is_read_from_the_cache_or_asked_for_in_one_line(tmp_path) -> None:
    with pytest.raises(RuntimeError, match=r"^could not load Rowan/hellaswag .*: pass task_file="):
        hellaswag.load_items(None, str(tmp_path))
    cached = tmp_path / "hellaswag" / "validation.jsonl"
    cached.parent.mkdir()
    cached.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    assert [item["ind"] for item in hellaswag.load_items(None, str(tmp_path), limit=2)] == [24, 92]


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", r"hellaswag_val.jsonl:1: not JSON"),
        (json.dumps({**ITEMS[0], "label": 4}), r":1: label must be 0, 1, 2 or 3, got 4"),
        (json.dumps({k: v for k, v in ITEMS[0].items() if k != "ctx_b"}), r":1: no ctx_b"),
        (json.dumps({**ITEMS[0], "endings": ["a", "b"]}), r":1: endings must be a list of 4"),
        (json.dumps([ITEMS[0]]), r":1: not a JSON object"),
        (json.dumps({**ITEMS[0], "ctx_b": 7}), r":1: ctx_b must be a text, got 7"),
        (json.dumps({**ITEMS[0], "endings": ["a", "b", "c", 4]}), r":1: endings must be 4 non-"),
        (json.dumps({**ITEMS[0], "endings": ["a", "b", "c", " "]}), r":1: endings must be 4 non"),
        (json.dumps({**ITEMS[0], "ctx": ""}), r":1: ctx is empty"),
        (b"\n" + json.dumps(ITEMS[0]).encode("latin-1") + b"\xff", r":2: not UTF-8 text"),
    ],
)
def test_a_bad_task_file_is_refused_naming_its_line(tmp_path, line, message) -> None:
    path = write_line(tmp_path / "hellaswag_val.jsonl", line)
    with pytest.raises(ValueError, match=message):
        hellaswag.load_items(str(path), "unused")


def test_a_missing_task_file_is_named_by_its_setting(hf_dir) -> None:
    folder, _ = hf_dir
    train = {"hellaswag": True, "hellaswag_file": "nowhere.jsonl", "hellaswag_items": None}
    with pytest.raises(FileNotFoundError, match=r"^train.hellaswag_file=nowhere.jsonl: no such"):
        hellaswag.for_training(OmegaConf.create(train), "unused")
    assert hellaswag.for_training(OmegaConf.create({"hellaswag": False}), "unused") is None
    missing = r"^evaluate.py: error: task_file=nowhere.jsonl: no such file"
    with pytest.raises(SystemExit, match=missing):
        evaluate_app.main.__wrapped__(
            evaluate_cfg(f"model.pretrained={folder}", "task_file=nowhere.jsonl")
        )
