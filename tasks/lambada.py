"""LAMBADA, zero-shot: the last word of each of the 5,153 passages of OpenAI's processed test
split, as EleutherAI's lm-evaluation-harness scores its `lambada_openai` task
(lm_eval/tasks/lambada/lambada_openai.yaml: dataset EleutherAI/lambada_openai, config default,
split test, output_type loglikelihood; lm_eval/api/task.py, ConfigurableTask's construct_requests
and process_results; lm_eval/models/huggingface.py's greedy check; lm_eval/api/metrics.py's
`perplexity` aggregation; read at commit 4e7e0d47).

The context is the passage's words but the last, `text.split(" ")[:-1]` joined by spaces; the
target is `" " + text.split(" ")[-1]`, tokenized as the harness does (tasks/scoring.py).

- `acc`: the share of passages whose every target token is the model's most likely token there
  (greedy decoding writes the word: the harness's `is_greedy`).
- `ppl`: exp of minus the mean over passages of the target's summed log-likelihood (per word,
  not per token: the harness's `perplexity`).

Several passages share a forward, right-padded, each cut from the left to fit the window (as
the harness truncates). Under DDP/FSDP passage i is scored on data-parallel rank i % dp_size and
the sums are added up (tasks/task.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from base.errors import ConfigError
from data.tokenizer import gpt2_encoding
from tasks.jsonl import hub_split_file, read_jsonl, read_task_file
from tasks.scoring import encode_pair, scored_continuations
from tasks.task import Task

HUB = ("EleutherAI/lambada_openai", "default", "test")  # what lm-evaluation-harness reads


# ---- the items


def load_items(
    task_file: str | None, cache_dir: str, limit: int | None = None, key: str = "task_file"
) -> list[dict]:
    """The passages of `task_file` (a jsonl with a `text` field; `key` is the setting that named
    it), or of the hub dataset, saved as a jsonl in `cache_dir` on first use; the first `limit`
    (>= 1) if given."""
    if task_file is None:
        return read_jsonl(cached_hub_file(cache_dir), checked)[:limit]
    return read_task_file(task_file, key, "LAMBADA", checked)[:limit]


def cached_hub_file(cache_dir: str) -> Path:
    """`<cache_dir>/lambada_openai/test.jsonl`, downloaded from the hub the first time (copy it
    to a machine without network, or pass it as task_file=)."""
    path = Path(cache_dir).expanduser() / "lambada_openai" / "test.jsonl"
    hint = 'task_file=<a jsonl of LAMBADA passages, one {"text": ...} per line>'
    return hub_split_file(path, HUB, ("text",), hint)


def checked(line: str, where: str) -> dict:
    """One passage, refused naming its line unless it is an object whose `text` has a last word
    after a space."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not JSON ({e}); give one LAMBADA passage per line") from e
    text = item.get("text") if isinstance(item, dict) else None
    if not isinstance(text, str) or " " not in text.strip():
        raise ConfigError(
            f'{where}: no text of two words or more; give {{"text": "<passage> <last word>"}}'
        )
    return item


def context_and_target(text: str) -> tuple[str, str]:
    """The harness's doc_to_text and doc_to_target."""
    words = text.split(" ")
    return " ".join(words[:-1]), " " + words[-1]


# ---- scoring


@torch.no_grad()
def scores(
    model: torch.nn.Module, items: list[dict], block_size: int, device: torch.device
) -> torch.Tensor:
    """Per passage: whether greedy decoding writes its last word (1.0 or 0.0), and that word's
    summed log-likelihood, float64."""
    encode = gpt2_encoding().encode_ordinary
    pairs = [encode_pair(*context_and_target(item["text"]), encode) for item in items]
    return torch.tensor(
        [[float(greedy.all()), logprobs.double().sum().item()]
         for logprobs, greedy in scored_continuations(model, pairs, block_size, device)],
        dtype=torch.float64,
    )  # fmt: skip


def accuracy_and_perplexity(sums: list[float], count: int) -> dict[str, float]:
    """The greedy share, and exp of minus the mean summed log-likelihood per passage."""
    correct, loglikelihood = sums
    return {"acc": correct / count, "ppl": math.exp(-loglikelihood / count)}


# Passages are short (a few hundred tokens at most): 16 rows a forward.
TASK = Task("lambada", load_items, scores, accuracy_and_perplexity, items_per_forward=16)
