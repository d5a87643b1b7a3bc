"""Sample text from a trained model: a training run's folder, or Hugging Face GPT-2 weights.

    python sample.py run=outputs/<date>/<time>-<pid> prompt="ROMEO:"
    python sample.py run=outputs/... prompt_file=prompt.txt num_samples=5 out=samples.txt
    python sample.py model.pretrained=exported/ device=cpu     # a save_pretrained dir
    python sample.py --help                                    # every key, conf/sample.yaml

The model is rebuilt from the run's checkpoint alone (its saved shape, then its weights), and
the text comes from the trainer's own generation function (tools/generate.py). `python sample.py`
(the root's entry point) and `python -m tools.sample` are the same program.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from base import errors
from base.distributed import resolve_device
from opt.compile import ready_inductor
from recipe import config
from recipe.precision import autocast
from tools import generate, loading

config.register_resolvers()  # --help: conf/sample.yaml with its comments

NUMBERS = {
    "num_samples": config.count(1),
    "max_new_tokens": config.count(1),
    "temperature": config.TEMPERATURE,
    "top_k": config.count(1, nullable=True),
    "seed": config.count(0),
}


@errors.app(config_name="sample")  # @hydra.main, its errors in one line
def main(cfg: DictConfig) -> None:
    sample(cfg)


def read_prompt(cfg: DictConfig) -> str:
    """`prompt=` or the text of `prompt_file=`; neither: a newline, as the trainer's samples."""
    if cfg.prompt is not None and cfg.prompt_file is not None:
        raise errors.ConfigError(
            f"prompt={cfg.prompt!r} and prompt_file={cfg.prompt_file} both give the prompt: "
            "give one"
        )
    if cfg.prompt_file is not None:
        path = Path(cfg.prompt_file).expanduser()
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise errors.ConfigError(
                f"prompt_file={path}: cannot read it as UTF-8 text ({e})"
            ) from e
    return "\n" if cfg.prompt is None else str(cfg.prompt)


def sample(cfg: DictConfig) -> list[str]:
    """Prints `num_samples` continuations of the prompt (and appends them to `out`); returns
    them."""
    config.check_numbers(cfg, NUMBERS)
    out = loading.output_file(cfg.out)  # checked before the model is read
    prompt = read_prompt(cfg)
    device = resolve_device(cfg.device)
    dtype = loading.dtype(cfg.dtype, device)
    model, _ = loading.load_model(cfg, device)
    if cfg.compile:
        ready_inductor(cache_dir=None)
        model.compile()  # in place; the context grows each token: compiled with dynamic shapes
    texts = generate.sample(
        model, prompt, num_samples=cfg.num_samples, max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature, top_k=cfg.top_k, seed=cfg.seed, device=device,
        autocast=autocast(dtype, device), eager=not cfg.compile,
    )  # fmt: skip
    heading = (
        f"{loading.source(cfg)} seed={cfg.seed} temperature={cfg.temperature} top_k={cfg.top_k}"
    )
    generate.write_samples(out, prompt, texts, heading, prefix="")
    return texts


if __name__ == "__main__":
    main()
