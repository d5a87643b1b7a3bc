"""How the tasks score text: lm-evaluation-harness's tokens of a (context, continuation) pair,
and the log-likelihood of continuations in one right-padded forward."""

from __future__ import annotations

from collections.abc import Callable

import torch

Pairs = list[tuple[list[int], list[int]]]  # (context tokens, continuation tokens) per row


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
