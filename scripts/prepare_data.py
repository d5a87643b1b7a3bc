"""Prepares a corpus ahead of training, e.g. a hub dataset on a machine with network access, or
before a multi-GPU launch; `--verify` then hashes every prepared file whole against meta.json
(loading a corpus hashes small files whole, large ones by sampled blocks). Takes the trainer's
overrides:

    python scripts/prepare_data.py data=openwebtext
    python scripts/prepare_data.py data=text data.files='notes/*.txt'
    python scripts/prepare_data.py data=openwebtext --verify
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hydra import compose, initialize_config_dir

from base import errors
from data import prepare, verify

ROOT = Path(__file__).resolve().parents[1]


def main(overrides: list[str], check: bool = False) -> Path | None:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    folder = prepare(cfg.data)
    if folder is not None and check:
        counts = verify(folder)
        tokens = ", ".join(f"{split} {c['tokens']:,} tokens" for split, c in counts.items())
        print(f"{cfg.data.name}: every file matches meta.json ({tokens})")
    print(f"{cfg.data.name}: {folder or 'nothing to prepare (synthetic tokens)'}")
    return folder


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="the trainer's overrides, e.g. data=text")
    parser.add_argument("--verify", action="store_true", help="hash every prepared file whole")
    args = parser.parse_args()
    errors.main(lambda: main(args.overrides, check=args.verify))  # bad input in one line
