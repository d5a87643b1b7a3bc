"""LAMBADA (tasks/lambada.py): on passages written here, the module's batched scoring gives,
passage by passage, what a plain token-by-token scorer written here gives (lm-evaluation-harness's
lambada_openai: the last word after a space, acc = greedy decoding writes it, ppl = exp of minus
the mean summed log-likelihood), for a tiny random GPT and for a Hugging Face GPT-2 folder (scored
by transformers itself); tools.evaluate task=lambada writes those numbers; the split over ranks
sums to the one-process totals; a bad task file is refused in one line."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir

from base.distributed import Distributed
from data.tokenizer import gpt2_encoding
from helpers import CONF, write_line
from model import GPT, GPTConfig
from tasks import Task, lambada
from tools import evaluate as evaluate_app

CPU = torch.device("cpu")

# Passages as LAMBADA's: narrative, the last word after a space (names of several tokens among
# them), punctuation and quotes inside, a double space (split(" ") keeps an empty word), one
# longer than the tiny model's 32 positions.
PASSAGES = [
    'She opened the door and saw her brother standing in the rain. "Come in," said Meredith',
    "The old man looked at the sea for a long time. Then he went back to his grandmother's",
    "He put the key in the lock, turned it twice, and pushed open the heavy wooden door of the "
    "house where he had grown up, where his mother had cooked and his father had read the "
    "evening paper by the window every night of his childhood. Nothing had changed in the",
    '"Where is the map?" asked Tom.  Anna pointed to the',
    "They walked along the river until the sun went down behind the",
    "I can't believe you ate all of the",
]


def greedy_word(logits_of, context: str, rank: int) -> str | None:
    """The model's `rank`-th most likely next token after `context`, if it is a space and a word
    (a passage ending with it is scored greedy at rank 0 and not at rank 1)."""
    enc = gpt2_encoding()
    with torch.no_grad():
        logits = logits_of(torch.tensor([enc.encode_ordinary(context)]))[0, -1]
    word = enc.decode([int(logits.argsort(descending=True)[rank])])
    return word if word[:1] == " " and word[1:].isalpha() else None


def passages(logits_of) -> list[dict]:
    """PASSAGES, and passages whose last word is the model's first (or second) choice, so that
    the accuracy is neither 0 nor 1 even for a random model, or starts with its first choice
    and goes on with "ly" (a word greedy decoding writes only in part)."""
    items = [{"text": text} for text in PASSAGES]
    for context in ("Once upon a time there was a", "The weather today is", "My favourite"):
        for rank, suffix in ((0, ""), (1, ""), (0, "ly")):
            word = greedy_word(logits_of, context, rank)
            if word is not None:
                items.append({"text": context + word + suffix})
    return items


# ---- the independent scorer: the harness's definition, one token at a time


def reference(logits_of, items: list[dict], window: int) -> tuple[list, dict]:
    """Per passage (whether each target token is the most likely there, the summed
    log-likelihood of the last word) and the metrics."""
    enc = gpt2_encoding().encode_ordinary
    scored = []
    for item in items:
        words = item["text"].split(" ")
        context, target = " ".join(words[:-1]), " " + words[-1]
        head = enc(context)
        tokens = enc(context + target)
        wanted = len(tokens) - len(head)
        tokens = tokens[-(window + 1) :]  # the harness keeps the last window + 1 tokens
        with torch.no_grad():
            logits = logits_of(torch.tensor([tokens[:-1]]))[0].double()
        greedy, total = [], 0.0
        for j in range(len(tokens) - wanted, len(tokens)):
            row = logits[j - 1]
            greedy.append(int(row.argmax()) == tokens[j])
            total += row.log_softmax(-1)[tokens[j]].item()
        scored.append((greedy, total))
    metrics = {
        "acc": sum(all(g) for g, _ in scored) / len(items),
        "ppl": math.exp(-sum(t for _, t in scored) / len(items)),
        "items": len(items),
    }
    return scored, metrics


def write_jsonl(path: Path, items: list[dict]) -> Path:
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return path


def assert_telling(scored: list, metrics: dict) -> None:
    """The passages tell a right scorer from a wrong one: some last word is written greedily and
    some not, one only in part (all tokens, not any), and the words have several tokens (a sum
    per word, not a mean)."""
    assert 0 < metrics["acc"] < 1
    assert any(greedy[0] and not all(greedy) for greedy, _ in scored)


def assert_scored_alike(ours: dict, expected: dict) -> None:
    assert ours["items"] == expected["items"] and ours["acc"] == expected["acc"]
    assert math.isclose(ours["ppl"], expected["ppl"], rel_tol=1e-5)


@pytest.fixture(scope="module")
def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32)).eval()


# ---- the tests


def test_tiny_model_scores_as_a_token_by_token_scorer(tiny_gpt, tmp_path) -> None:
    logits_of = lambda idx: tiny_gpt(idx)[0]  # noqa: E731
    items = passages(logits_of)
    scored, expected = reference(logits_of, items, window=32)
    assert_telling(scored, expected)
    ours = lambada.scores(tiny_gpt, items, 32, CPU).tolist()
    assert [bool(greedy) for greedy, _ in ours] == [all(greedy) for greedy, _ in scored]
    assert [ll for _, ll in ours] == pytest.approx([ll for _, ll in scored], rel=1e-5)
    loaded = lambada.load_items(str(write_jsonl(tmp_path / "l.jsonl", items)), "unused")
    result = lambada.TASK.evaluate(tiny_gpt, loaded, block_size=32, dist=Distributed(0, 0, 1, CPU))
    assert_scored_alike(result, expected)


def test_ranks_split_the_items_and_sum_to_one_process(tiny_gpt) -> None:
    # 6 passages on 4 ranks, one a forward: 2, 2, 1 and 1 each, so ranks 2 and 3 run a spare.
    task = dataclasses.replace(lambada.TASK, items_per_forward=1)
    items = [{"text": text} for text in PASSAGES]
    forwards: list[int] = []
    hook = tiny_gpt.register_forward_hook(lambda *_: forwards.append(1))
    try:
        alone = task.sums(tiny_gpt, items, block_size=32, device=CPU)
        per_rank = []
        for rank in range(4):
            forwards.clear()
            per_rank.append(
                task.sums(tiny_gpt, items, block_size=32, device=CPU, rank=rank, world_size=4)
            )
            assert len(forwards) == 2  # FSDP gathers the weights in every forward: as many each
    finally:
        hook.remove()
    torch.testing.assert_close(torch.stack(per_rank).sum(0), alone, rtol=1e-12, atol=1e-9)


def test_ranks_sums_are_reduced_and_a_tp_group_counted_once(monkeypatch) -> None:
    """4 processes as 2 dp x 2 tp: the passages split in 2 (a tp group scores the same ones),
    and the world's sum holds each group's sums twice."""
    mine = {0: [3.0, -30.0], 1: [1.0, -10.0]}  # each dp rank's greedy count and log-likelihood
    calls = []

    def sums(self, model, items, *, rank, world_size, **_) -> torch.Tensor:
        calls.append((rank, world_size))
        return torch.tensor(mine[rank], dtype=torch.float64)

    def all_reduce(t: torch.Tensor) -> None:  # the sum over the 4 ranks: each dp rank twice
        t.copy_(2 * torch.tensor(mine[0]) + 2 * torch.tensor(mine[1]))

    monkeypatch.setattr(Task, "sums", sums)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    dist = SimpleNamespace(device=CPU, enabled=True, world_size=4, dp_rank=1, dp_size=2)
    result = lambada.TASK.evaluate(None, [{}] * 8, block_size=8, dist=dist)  # type: ignore[arg-type]
    assert calls == [(1, 2)]
    assert result == {"acc": 4 / 8, "ppl": math.exp(40 / 8), "items": 8}


def evaluate_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("evaluate", overrides=["device=cpu", "task=lambada", *overrides])


def test_evaluate_py_writes_acc_and_ppl_of_a_hugging_face_folder(hf_dir, tmp_path) -> None:
    folder, hf = hf_dir
    logits_of = lambda idx: hf(idx).logits  # noqa: E731
    items = passages(logits_of)
    scored, expected = reference(logits_of, items, window=64)
    assert_telling(scored, expected)
    task_file, out = write_jsonl(tmp_path / "lambada.jsonl", items), tmp_path / "result.json"
    result = evaluate_app.evaluate_model(
        evaluate_cfg(f"model.pretrained={folder}", f"task_file={task_file}", f"out={out}")
    )
    assert json.loads(out.read_text()) == result
    ours = {k: result[f"lambada/{k}"] for k in ("acc", "ppl", "items")}
    assert_scored_alike(ours, expected)
    limited = evaluate_app.evaluate_model(
        evaluate_cfg(f"model.pretrained={folder}", f"task_file={task_file}", "limit=2")
    )
    assert limited["lambada/items"] == 2


def test_the_hub_dataset_is_read_from_the_cache_or_asked_for_in_one_line(tmp_path) -> None:
    with pytest.raises(
        RuntimeError, match=r"^could not load EleutherAI/lambada_openai .*: pass task_file="
    ):
        lambada.load_items(None, str(tmp_path))
    cached = tmp_path / "lambada_openai" / "test.jsonl"
    cached.parent.mkdir()
    write_jsonl(cached, [{"text": text} for text in PASSAGES])
    assert [item["text"] for item in lambada.load_items(None, str(tmp_path), 2)] == PASSAGES[:2]


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", r"lambada.jsonl:1: not JSON .*; give one LAMBADA passage per line$"),
        (json.dumps({"passage": "a b"}), r"lambada.jsonl:1: no text of two words or more"),
        (json.dumps({"text": "word"}), r"lambada.jsonl:1: no text of two words or more"),
        (json.dumps(["a b"]), r"lambada.jsonl:1: no text"),
        (b'{"text": "caf\xe9 au lait"}\n', r"lambada.jsonl:1: not UTF-8 text .*; give a jsonl"),
    ],
)
def test_a_bad_task_file_is_refused_naming_its_line(tmp_path, line, message) -> None:
    path = write_line(tmp_path / "lambada.jsonl", line)
    with pytest.raises(ValueError, match=message):
        lambada.load_items(str(path), "unused")


def test_a_missing_or_empty_task_file_is_named_by_its_setting(hf_dir, tmp_path) -> None:
    folder, _ = hf_dir
    missing = r"^evaluate.py: error: task_file=nowhere.jsonl: no such file; give a LAMBADA jsonl$"
    with pytest.raises(SystemExit, match=missing):
        evaluate_app.main.__wrapped__(
            evaluate_cfg(f"model.pretrained={folder}", "task_file=nowhere.jsonl")
        )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=r"empty.jsonl: no items in it; give a LAMBADA jsonl"):
        lambada.load_items(str(empty), "unused")
