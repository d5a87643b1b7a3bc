"""`python scripts/gpu_check.py`: `pytest -m gpu`, then the smoke ladder against check.json, in
one command or in parts (`--part tests|ladder`, then `--assemble`; measure/gpu_check.py says
how)."""

import sys

from measure import gpu_check

if __name__ == "__main__":
    sys.exit(gpu_check.main(sys.argv[1:]))
