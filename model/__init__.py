"""GPT-2: `from model import GPT, GPTConfig`."""

from model.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
