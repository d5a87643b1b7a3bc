"""Prints the README's commands that CI runs: every ```bash block that follows a `<!-- ci -->`
line, in order. `.ci/run` executes them verbatim in a fresh virtual environment, so the
README's set-up and test lines are what CI checks and cannot drift from it.

    python3 .ci/readme_commands.py README.md
"""

from __future__ import annotations

import sys
from pathlib import Path

MARK = "<!-- ci -->"


def commands(readme: str) -> list[str]:
    """The lines of the marked ```bash blocks (comments and blank lines included)."""
    lines = [line.strip() for line in readme.splitlines()]
    found = []
    for number, line in enumerate(lines):
        if line != MARK:
            continue
        start = number + 2  # the block's first line, after its ```bash
        if lines[number + 1 : start] != ["```bash"] or "```" not in lines[start:]:
            raise SystemExit(f"README line {number + 1}: {MARK} must precede a ```bash block")
        found += readme.splitlines()[start : lines.index("```", start)]
    return found


if __name__ == "__main__":
    print("\n".join(commands(Path(sys.argv[1]).read_text())))
