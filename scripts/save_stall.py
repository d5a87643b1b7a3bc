"""`python scripts/save_stall.py`: how long a checkpoint save holds the loop
(measure/save_stall.py says how)."""

import base.errors
from measure import save_stall

if __name__ == "__main__":
    base.errors.main(save_stall.main)  # bad input in one line
