"""`python scripts/quality.py`: does the fastest configuration learn as well
(measure/quality.py says how)."""

import base.errors
from measure import quality

if __name__ == "__main__":
    base.errors.main(quality.main)  # bad input in one line
