"""Exports a training run to the Hugging Face format: a `save_pretrained` folder of
`transformers.GPT2LMHeadModel` with GPT-2's tokenizer files, which the rest of the ecosystem
reads (`from_pretrained`, `pipeline("text-generation")`, `train.py model.pretrained=<out>`).

    python -m tools.export_hf run=outputs/<date>/<time>-<pid> out=exported/

Our GPT-2 has Hugging Face's module names, so the export is a copy, except that Hugging Face
stores the attention and MLP weights as Conv1D (transposed), has no padded vocabulary rows (ours
are rounded up to a multiple of 64 for fast matmuls and never predicted: they are dropped), and
always has biases (a model trained with model.bias=false gets zero biases: the same function).
The tokenizer is the offline GPT-2 vocabulary the trainer uses (data/tokenizer.py), as
vocab.json + merges.txt. By default the written folder is loaded back and its logits compared.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from omegaconf import DictConfig

import checkpointing
from base import errors
from data.tokenizer import VOCAB_SIZE, gpt2_encoding, verify_vocab, vocab_dir
from model import GPT
from model.gpt import HF_TRANSPOSED
from recipe import config, rundir
from tools import loading

config.register_resolvers()  # --help: conf/export_hf.yaml with its comments

TOLERANCE = 1e-4  # the largest logit difference the check accepts


@errors.app(config_name="export_hf")  # @hydra.main, its errors in one line
def main(cfg: DictConfig) -> None:
    export_run(cfg)


MARK = "gpt2_recipe_export.json"  # written into every export: an earlier one may be replaced


def output_folder(out: str | None, force: bool) -> Path:
    """`out=`, checked before any work: a new or empty folder, or an earlier export of ours (it
    holds MARK); another folder's files are replaced only with `force=true`."""
    if out is None:
        raise errors.ConfigError("out=<folder> is missing: where to write the Hugging Face folder")
    path = Path(str(out)).expanduser()
    if path.exists() and not path.is_dir():
        raise errors.FileRefused(f"out={path} is a file: give a new or empty folder")
    foreign = path.is_dir() and any(path.iterdir()) and not (path / MARK).is_file()
    if foreign and not force:
        raise errors.FileRefused(
            f"out={path} holds files that are not an export of this recipe (it has no {MARK}): "
            "give a new or empty folder, or add force=true to overwrite them"
        )
    return path


def to_transformers(model: GPT):  # -> transformers.GPT2LMHeadModel (imported lazily: slow)
    """Our GPT as `GPT2LMHeadModel`: the same weights, transposed where Hugging Face uses
    Conv1D, the vocabulary without its padding rows, zero biases where ours has none."""
    from transformers import GPT2Config, GPT2LMHeadModel

    c = model.config
    if c.vocab_size != VOCAB_SIZE:
        raise errors.ConfigError(
            f"the model predicts {c.vocab_size} tokens, not GPT-2's {VOCAB_SIZE}: the export "
            "carries GPT-2's tokenizer, which would not fit (train with model.vocab_size=50257)"
        )
    hf_config = GPT2Config(
        vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer,
        n_head=c.n_head, activation_function="gelu_new", layer_norm_epsilon=1e-5,
        resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.dropout,
        tie_word_embeddings=True, architectures=["GPT2LMHeadModel"],
    )  # fmt: skip
    hf = GPT2LMHeadModel(hf_config)
    ours = model.state_dict()
    with torch.no_grad():
        for name, param in hf.state_dict().items():
            if name == "lm_head.weight":
                continue  # tied to transformer.wte.weight
            if name.endswith(".bias") and not c.bias:  # model.bias=false: a zero bias is none
                param.zero_()
                continue
            src = ours[name]
            if name.endswith(HF_TRANSPOSED):
                src = src.t()
            if name == "transformer.wte.weight":
                src = src[: c.vocab_size]  # the padding rows go
            param.copy_(src)
    return hf.eval()


def write_tokenizer(out: Path) -> None:
    """GPT-2's vocabulary files, as transformers names them (vocab.json is encoder.json,
    merges.txt is vocab.bpe), then the tokenizer's own files from them. (Constructing
    GPT2TokenizerFast from the two paths would give an empty tokenizer in transformers 5.)"""
    from transformers import GPT2TokenizerFast  # type: ignore[attr-defined]  # a lazy export

    source = vocab_dir()
    verify_vocab(source)
    shutil.copyfile(source / "encoder.json", out / "vocab.json")
    shutil.copyfile(source / "vocab.bpe", out / "merges.txt")
    tokenizer = GPT2TokenizerFast.from_pretrained(out)
    text = "Hello world! <|endoftext|> ROMEO: But, soft!"
    if tokenizer.encode(text) != gpt2_encoding().encode(text, allowed_special="all"):
        raise RuntimeError(f"the tokenizer written to {out} does not encode as GPT-2's does")
    tokenizer.save_pretrained(out)


def check_logits(model: GPT, out: Path) -> float:
    """Loads `out` back with transformers; the largest logit difference with ours."""
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(out).eval()
    idx = torch.randint(0, model.config.vocab_size, (2, min(16, model.config.block_size)))
    with torch.no_grad():
        ours, _ = model.eval()(idx)
        theirs = hf(idx).logits
    gap = (ours - theirs).abs().max().item()
    if gap > TOLERANCE:
        raise RuntimeError(f"{out}: its logits differ from the run's by {gap:.2e} (> {TOLERANCE})")
    return gap


def export_run(cfg: DictConfig) -> Path:
    """Writes the run's model and the tokenizer to `out`; returns the folder."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # one line per export, no bars
    if cfg.run is None:
        raise errors.ConfigError("run=<folder> is missing: the training run to export")
    out = output_folder(cfg.out, cfg.force)
    run_dir = loading.run_dir(cfg.run)
    model, _ = checkpointing.load_model(run_dir, "cpu", verify=cfg.verify, which=cfg.checkpoint)
    hf = to_transformers(model)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARK).write_text(json.dumps({"run": str(run_dir.resolve())}) + "\n")  # ours from now
    hf.save_pretrained(out)
    write_tokenizer(out)
    c = model.config
    checked = f"; logits equal ours within {check_logits(model, out):.1e}" if cfg.check else ""
    print(
        f"[export] {out}: GPT2LMHeadModel, {c.n_layer} layers x {c.n_embd}, {c.n_head} heads, "
        f"{c.block_size} positions, {c.vocab_size} tokens{checked}\n"
        f"  sample:    {rundir.command('python', 'sample.py', f'model.pretrained={out}')}\n"
        f"  fine-tune: {rundir.command('python', 'train.py', f'model.pretrained={out}')}"
    )
    return out


if __name__ == "__main__":
    main()
