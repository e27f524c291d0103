"""Print the table of what each golden recording exercises (docs/fork-patches.md,
between its 'golden-coverage' markers; tests/test_fork_golden.py checks it)."""

from sim.conformance.golden import coverage_table
from sim.paths import PROJECT_ROOT

if __name__ == "__main__":
    print(coverage_table(PROJECT_ROOT / "tests" / "data" / "fork-golden"))
