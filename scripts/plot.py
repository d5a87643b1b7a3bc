"""`python scripts/plot.py`: pictures of your own runs: loss, tokens/s and memory against steps
(measure/plot.py says how)."""

import sys

import base.errors
from measure import plot

if __name__ == "__main__":
    base.errors.main(lambda: plot.main(sys.argv[1:]))  # bad input in one line
