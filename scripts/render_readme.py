"""`python scripts/render_readme.py`: the README's measured numbers rendered from the results files
(measure/render_readme.py says how)."""

import sys

from measure import render_readme

if __name__ == "__main__":
    sys.exit(render_readme.main())
