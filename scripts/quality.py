"""`python scripts/quality.py`: does the fastest configuration learn as well
(measure/quality.py says how)."""

import recipe.errors
from measure import quality

if __name__ == "__main__":
    recipe.errors.main(quality.main)  # bad input in one line
