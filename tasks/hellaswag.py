"""HellaSwag, zero-shot, on the 10,042 validation items: which of four endings the model finds
most likely, scored by the three conventions the field reports under these names.

- `acc`, `acc_norm`: as EleutherAI's lm-evaluation-harness scores its `hellaswag` task
  (lm_eval/tasks/hellaswag/utils.py and hellaswag.yaml; lm_eval/api/task.py, ConfigurableTask's
  construct_requests and process_results for `multiple_choice`; lm_eval/api/model.py's
  _encode_pair; read at commit 4e7e0d47). The context is
  preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize()), each choice
  preprocess(ending), scored as the continuation " " + choice. acc picks the highest summed
  log-likelihood of the continuation's tokens; acc_norm that sum divided by len(choice) in
  characters (the choice without the leading space: process_results' `completion_len`).
- `acc_token_mean`: as build-nanogpt's and llm.c's hellaswag.py score it: the tokens of `ctx`
  followed by those of " " + ending, each encoded alone; the lowest mean cross-entropy per
  ending token. The number their training logs call acc_norm.

Each item is one forward of 8 rows (4 endings x 2 conventions' tokens), right-padded; a row
longer than the model's window loses tokens from the left, as the harness truncates. Under
DDP/FSDP item i is scored on data-parallel rank i % dp_size and the counts are summed (the
ranks of a tensor-parallel group score the same items together: counted once).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import DictConfig

from base.errors import ConfigError
from data.tokenizer import gpt2_encoding
from tasks.jsonl import hub_split_file, read_jsonl, read_task_file
from tasks.scoring import Pairs, encode_pair, scored_continuations
from tasks.task import Task

HUB_PATH = "Rowan/hellaswag"  # the dataset lm-evaluation-harness reads, split "validation"
CONVENTIONS = ("acc", "acc_norm", "acc_token_mean")
FIELDS = ("activity_label", "ctx_a", "ctx_b", "ctx", "endings", "label")


# ---- the items


def load_items(
    task_file: str | None, cache_dir: str, limit: int | None = None, key: str = "task_file"
) -> list[dict]:
    """The validation items of `task_file` (a jsonl in the dataset's format; `key` is the setting
    that named it), or of the hub dataset, saved as a jsonl in `cache_dir` on first use; the
    first `limit` (>= 1) if given."""
    if task_file is None:
        return read_jsonl(cached_hub_file(cache_dir, key), checked)[:limit]
    return read_task_file(task_file, key, "HellaSwag", checked)[:limit]


def cached_hub_file(cache_dir: str, key: str = "task_file") -> Path:
    """`<cache_dir>/hellaswag/validation.jsonl`, downloaded from the hub the first time (copy it
    to a machine without network, or pass it as `key`=)."""
    path = Path(cache_dir).expanduser() / "hellaswag" / "validation.jsonl"
    hint = f"{key}=<HellaSwag's validation jsonl, e.g. hellaswag_val.jsonl of rowanz/hellaswag>"
    return hub_split_file(path, (HUB_PATH, None, "validation"), ("ind", *FIELDS), hint)


def checked(line: str, where: str) -> dict:
    """One item, refused naming its line unless it has the dataset's fields: texts, four endings
    and a label (an int, or the hub's string) among them. An empty `ctx` or ending is refused
    too: it has no tokens (or characters) to score, and its score would be NaN or -inf."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not JSON ({e}); give one HellaSwag item per line") from e
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: not a JSON object; give one HellaSwag item per line")
    missing = [k for k in FIELDS if k not in item]
    if missing:
        raise ConfigError(f"{where}: no {', '.join(missing)}; give HellaSwag's fields {FIELDS}")
    for key in ("activity_label", "ctx_a", "ctx_b", "ctx"):
        if not isinstance(item[key], str):
            raise ConfigError(f"{where}: {key} must be a text, got {item[key]!r}")
    if not item["ctx"].strip():
        raise ConfigError(f"{where}: ctx is empty; give the context the endings continue")
    endings, label = item["endings"], str(item["label"])
    if not (isinstance(endings, list) and len(endings) == 4):
        raise ConfigError(f"{where}: endings must be a list of 4 texts, got {endings!r}")
    if not all(isinstance(ending, str) and preprocess(ending).strip() for ending in endings):
        raise ConfigError(f"{where}: endings must be 4 non-empty texts, got {endings!r}")
    if label not in ("0", "1", "2", "3"):
        raise ConfigError(f"{where}: label must be 0, 1, 2 or 3, got {item['label']!r}")
    return {**item, "label": int(label)}


def for_training(train: DictConfig, cache_dir: str) -> list[dict] | None:
    """The items `train.hellaswag=true` scores at every evaluation (None when it is off)."""
    if train.get("hellaswag") not in (True, False, None):
        raise ConfigError(f"train.hellaswag must be true or false, got {train.hellaswag!r}")
    if not train.get("hellaswag"):
        return None
    return load_items(
        train.hellaswag_file, cache_dir, train.hellaswag_items, key="train.hellaswag_file"
    )


# ---- the two conventions' tokens


def preprocess(text: str) -> str:
    """lm-evaluation-harness's clean-up of HellaSwag's text (WikiHow's bracketed markers)."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def harness_text(item: dict) -> tuple[str, list[str]]:
    """The harness's context and choices (each scored after one space)."""
    context = f"{item['activity_label']}: {item['ctx_a']} {item['ctx_b'].capitalize()}"
    return preprocess(context), [preprocess(ending) for ending in item["endings"]]


def harness_pairs(item: dict, encode: Callable[[str], list[int]]) -> Pairs:
    context, choices = harness_text(item)
    return [encode_pair(context, " " + choice, encode) for choice in choices]


def token_mean_pairs(item: dict, encode: Callable[[str], list[int]]) -> Pairs:
    """build-nanogpt's tokens: `ctx`, then each " " + ending encoded alone."""
    context = encode(item["ctx"])
    return [(context, encode(" " + ending)) for ending in item["endings"]]


# ---- scoring


def continuation_logprobs(
    model: torch.nn.Module, pairs: Pairs, block_size: int, device: torch.device
) -> list[torch.Tensor]:
    """The log-probability of each continuation token given everything before it, per row."""
    return [logprobs for logprobs, _ in scored_continuations(model, pairs, block_size, device)]


@torch.no_grad()
def scores(
    model: torch.nn.Module, item: dict, block_size: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """Each convention's score of the four endings (higher: more likely), float64: the summed
    log-likelihood, that sum per character of the choice, the mean log-likelihood per token."""
    encode = gpt2_encoding().encode_ordinary
    logprobs = continuation_logprobs(
        model, harness_pairs(item, encode) + token_mean_pairs(item, encode), block_size, device
    )
    summed = torch.stack([lp.double().sum() for lp in logprobs[:4]])
    characters = torch.tensor([float(len(choice)) for choice in harness_text(item)[1]]).double()
    token_mean = torch.stack([lp.double().mean() for lp in logprobs[4:]])
    return dict(zip(CONVENTIONS, (summed, summed / characters, token_mean), strict=True))


def choices(
    model: torch.nn.Module, item: dict, block_size: int, device: torch.device
) -> dict[str, int]:
    """The ending each convention picks for one item (ties: the first, as numpy's argmax)."""
    return {c: int(s.argmax()) for c, s in scores(model, item, block_size, device).items()}


def correct(
    model: torch.nn.Module, items: list[dict], block_size: int, device: torch.device
) -> torch.Tensor:
    """Per item, whether each convention picks its labelled ending (1.0 or 0.0), float64."""
    picks = [choices(model, item, block_size, device) for item in items]
    return torch.tensor(
        [[float(pick[c] == item["label"]) for c in CONVENTIONS]
         for item, pick in zip(items, picks, strict=True)],
        dtype=torch.float64,
    )  # fmt: skip


def accuracies(correct_sums: list[float], count: int) -> dict[str, float]:
    return {c: n / count for c, n in zip(CONVENTIONS, correct_sums, strict=True)}


# One item a forward: its 8 rows (4 endings x 2 conventions' tokens).
TASK = Task("hellaswag", load_items, correct, accuracies, items_per_forward=1)
