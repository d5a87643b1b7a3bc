"""`python scripts/vs_nanogpt.py`: the recipe against nanoGPT's bench.py at equal work
(measure/vs_nanogpt.py says how)."""

from measure import vs_nanogpt

if __name__ == "__main__":
    vs_nanogpt.main()
