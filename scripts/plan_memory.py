"""`python scripts/plan_memory.py`: a run's peak GPU memory predicted from its shapes and stages
(measure/plan_memory.py says how)."""

import sys

from measure import plan_memory

if __name__ == "__main__":
    sys.exit(plan_memory.cli(sys.argv[1:]))
