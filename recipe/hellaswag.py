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

import contextlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed
from omegaconf import DictConfig

from data.tokenizer import gpt2_encoding
from recipe.distributed import Distributed
from recipe.errors import ConfigError, MissingFile, Unusable
from recipe.files import write_text_atomically

HUB_PATH = "Rowan/hellaswag"  # the dataset lm-evaluation-harness reads, split "validation"
CONVENTIONS = ("acc", "acc_norm", "acc_token_mean")
FIELDS = ("activity_label", "ctx_a", "ctx_b", "ctx", "endings", "label")
Pairs = list[tuple[list[int], list[int]]]  # (context tokens, continuation tokens) per row


# ---- the items


def load_items(
    task_file: str | None, cache_dir: str, limit: int | None = None, key: str = "task_file"
) -> list[dict]:
    """The validation items of `task_file` (a jsonl in the dataset's format; `key` is the setting
    that named it), or of the hub dataset, saved as a jsonl in `cache_dir` on first use; the
    first `limit` (>= 1) if given."""
    if task_file is None:
        return read_jsonl(cached_hub_file(cache_dir, key))[:limit]
    return read_task_file(task_file, key, "HellaSwag", checked)[:limit]


def read_task_file(
    task_file: str, key: str, task: str, check: Callable[[str, str], dict]
) -> list[dict]:
    """The items of a local jsonl, each line checked by `check(line, where)`; refused in one line
    naming `key` when the file is missing or holds no item."""
    path = Path(str(task_file)).expanduser()
    if not path.is_file():
        raise MissingFile(f"{key}={task_file}: no such file; give a {task} jsonl")
    items = read_jsonl(path, check)
    if not items:
        raise ConfigError(f"{key}={task_file}: no items in it; give a {task} jsonl")
    return items


def cached_hub_file(cache_dir: str, key: str = "task_file") -> Path:
    """`<cache_dir>/hellaswag/validation.jsonl`, downloaded from the hub the first time (copy it
    to a machine without network, or pass it as `key`=)."""
    path = Path(cache_dir).expanduser() / "hellaswag" / "validation.jsonl"
    hint = f"{key}=<HellaSwag's validation jsonl, e.g. hellaswag_val.jsonl of rowanz/hellaswag>"
    return hub_split_file(path, (HUB_PATH, None, "validation"), ("ind", *FIELDS), hint)


def hub_split_file(
    path: Path, hub: tuple[str, str | None, str], fields: tuple[str, ...], hint: str
) -> Path:
    """`path`, first written as a jsonl of the `fields` of the hub dataset's (path, config,
    split) when it is not there yet; refused in one line saying to pass `hint` when the hub
    cannot be reached."""
    if path.is_file():
        return path
    try:
        import datasets

        rows = datasets.load_dataset(hub[0], hub[1], split=hub[2])
    except Exception as e:  # datasets raises many types for "offline"/"not found"
        raise Unusable(
            f"could not load {hub[0]} from the Hugging Face hub ({type(e).__name__}): pass {hint}"
        ) from e
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(
        path, "".join(json.dumps({k: row[k] for k in fields}) + "\n" for row in rows)
    )
    return path


def read_jsonl(path: Path, check: Callable[[str, str], dict] | None = None) -> list[dict]:
    """The items of a jsonl, blank lines skipped, each checked (HellaSwag's `checked` unless
    `check` is given) naming its line."""
    check = check or checked
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        bad_line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}:{bad_line}: not UTF-8 text ({e.reason}); give a jsonl in UTF-8"
        ) from None
    items = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            items.append(check(line, f"{path}:{n}"))
    return items


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


def encode_pair(
    context: str, continuation: str, encode: Callable[[str], list[int]]
) -> tuple[list[int], list[int]]:
    """The harness's tokens of a (context, continuation): trailing spaces of the context move to
    the continuation; the whole is encoded, and the continuation is what follows the context's
    own tokens (so a merge across the boundary is the tokenizer's, as in one text)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, head = encode(context + continuation), encode(context)
    return head, whole[len(head) :]


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


def scored_continuations(
    model: torch.nn.Module, pairs: Pairs, block_size: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per row, the log-probability of each continuation token given everything before it, and
    whether it is the most likely token there (the first of the largest logits, as the harness's
    argmax): one forward of the rows right-padded (padding only follows the tokens that count,
    and attention is causal), each row cut from the left to fit `block_size` inputs."""
    rows = [(context + continuation)[-(block_size + 1) :] for context, continuation in pairs]
    inputs = torch.zeros(len(rows), max(map(len, rows)) - 1, dtype=torch.long)
    targets = torch.zeros_like(inputs)
    for i, row in enumerate(rows):
        inputs[i, : len(row) - 1] = torch.tensor(row[:-1])
        targets[i, : len(row) - 1] = torch.tensor(row[1:])
    logits, _ = model(inputs.to(device))
    logprobs = logits.float().log_softmax(-1)
    greedy = (logprobs.argmax(-1) == targets.to(device)).cpu()
    logprobs = logprobs.gather(-1, targets.to(device).unsqueeze(-1)).squeeze(-1).cpu()
    out = []
    for i, (row, (_, continuation)) in enumerate(zip(rows, pairs, strict=True)):
        end = len(row) - 1  # the last target; the continuation's tokens end there
        start = end - min(len(continuation), end)
        out.append((logprobs[i, start:end], greedy[i, start:end]))
    return out


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


def correct_counts(
    model: torch.nn.Module,
    items: list[dict],
    *,
    block_size: int,
    device: torch.device,
    rank: int = 0,
    world_size: int = 1,
    autocast: contextlib.AbstractContextManager | None = None,
) -> torch.Tensor:
    """How many of this rank's items (i % world_size == rank) each convention gets right. Every
    rank runs the same number of forwards (a rank short of items repeats one, uncounted): under
    FSDP each forward gathers the weights from all ranks. Eager and in eval mode, as evaluate()."""
    mine = items[rank::world_size]
    rounds = -(-len(items) // world_size)
    correct = torch.zeros(len(CONVENTIONS), dtype=torch.long)
    was_training = model.training
    model.eval()
    with torch.compiler.set_stance("force_eager"), autocast or contextlib.nullcontext():
        for n in range(rounds):
            picked = choices(model, mine[n] if n < len(mine) else items[0], block_size, device)
            if n < len(mine):
                correct += torch.tensor([picked[c] == mine[n]["label"] for c in CONVENTIONS])
    model.train(was_training)
    return correct


def summed_over_ranks(
    score: Callable[..., torch.Tensor],
    model: torch.nn.Module,
    items: list[dict],
    block_size: int,
    dist: Distributed,
    autocast: contextlib.AbstractContextManager | None,
) -> torch.Tensor:
    """`score`'s sums over `items`, each data-parallel rank scoring its share, summed over the
    ranks (the ranks of a tensor-parallel group hold the same sums: counted once); every rank
    must call it. HellaSwag's and LAMBADA's evaluations share it."""
    total = score(
        model, items, block_size=block_size, device=dist.device, rank=dist.dp_rank,
        world_size=dist.dp_size, autocast=autocast,
    ).to(dist.device)  # fmt: skip
    if dist.enabled:
        torch.distributed.all_reduce(total)  # a sum
        total = total / (dist.world_size // dist.dp_size)  # each tp group's, from each rank
    return total


def evaluate(
    model: torch.nn.Module,
    items: list[dict],
    *,
    block_size: int,
    dist: Distributed,
    autocast: contextlib.AbstractContextManager | None = None,
) -> dict[str, Any]:
    """The three accuracies over `items` (split over the ranks) and the item count; every rank
    must call it."""
    correct = summed_over_ranks(correct_counts, model, items, block_size, dist, autocast)
    accuracy = {c: n / len(items) for c, n in zip(CONVENTIONS, correct.tolist(), strict=True)}
    return accuracy | {"items": len(items)}
