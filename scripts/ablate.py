"""`python scripts/ablate.py`: runs an ablation ladder and publishes its results
(measure/ablate.py says how)."""

import sys

import base.errors
from measure import ablate

if __name__ == "__main__":
    base.errors.main(lambda: ablate.main(sys.argv[1:]))  # bad input in one line
