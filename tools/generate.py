"""Text from a model: the one generation function, used by the trainer's samples at the end of
training and by `sample.py`, so that the same model, settings and seed give the same text
from both."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from base.distributed import log
from data.tokenizer import EOT, gpt2_encoding
from model import GPT

SEPARATOR = "---"  # between samples, on the console and in the files


def sample(
    model: GPT,
    prompt: str,
    *,
    num_samples: int,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
    device: torch.device,
    autocast: contextlib.AbstractContextManager | None = None,
    eager: bool = True,
) -> list[str]:
    """`num_samples` continuations of `prompt` (an empty prompt starts a new document after
    <|endoftext|>), decoded without the prompt.

    `autocast`: the precision context to run in (the trainer's amp, or sample.py's dtype).
    `eager`: run a model that was compiled for training eagerly, without compiling inference
    graphs for every context length; False uses its compiled forward (sample.py compile=true).
    The model is left in the mode it was in."""
    encoding = gpt2_encoding()
    tokens = encoding.encode(prompt, allowed_special="all") or [EOT]
    idx = torch.tensor([tokens] * num_samples, device=device)
    generator = torch.Generator(device).manual_seed(seed)
    stance = torch.compiler.set_stance("force_eager") if eager else contextlib.nullcontext()
    was_training = model.training
    model.eval()
    with stance, autocast or contextlib.nullcontext():
        out = model.generate(idx, max_new_tokens, temperature, top_k, generator)
    model.train(was_training)
    return [encoding.decode(row[len(tokens) :].tolist()) for row in out]


def show(prompt: str, texts: list[str], prefix: str = "") -> str:
    """The samples as printed and written: each one `prefix`, the prompt and its continuation,
    then a separator line."""
    return "".join(f"{prefix}{prompt}{text}\n{SEPARATOR}\n" for text in texts)


def write_samples(
    path: Path | None, prompt: str, texts: list[str], heading: str, prefix: str = "[sample] "
) -> None:
    """Prints the samples (each after `prefix`) and appends them to `path`, if any, under a
    `# <heading>` line."""
    log(show(prompt, texts, prefix).rstrip("\n"))
    if path is not None:
        with open(path, "a") as f:
            f.write(f"# {heading}\n{show(prompt, texts)}")
