"""`python scripts/step_budget.py`: where a training step's GPU time goes, by kernel family
(measure/step_budget.py says how)."""

from measure import step_budget

if __name__ == "__main__":
    step_budget.main()
