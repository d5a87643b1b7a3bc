"""Prepares a corpus ahead of training, e.g. a hub dataset on a machine with network access, or
before a multi-GPU launch. Takes the trainer's overrides:

    python scripts/prepare_data.py data=openwebtext
    python scripts/prepare_data.py data=text data.files='notes/*.txt'
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runnable from a checkout without installing

from hydra import compose, initialize_config_dir  # noqa: E402

from data import prepare  # noqa: E402


def main(overrides: list[str]) -> Path | None:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    folder = prepare(cfg.data)
    print(f"{cfg.data.name}: {folder or 'nothing to prepare (synthetic tokens)'}")
    return folder


if __name__ == "__main__":
    main(sys.argv[1:])
