"""Print the mutation scores table of docs/mutation/report.md from its data,
docs/mutation/scores.csv (one row per run: a module or some of its
functions, on one date); ``--write`` puts it between the page's
'mutation-scores' markers. tests/test_mutation_table.py checks the page
holds what this prints.

    python scripts/mutation_table.py           # the table, on stdout
    python scripts/mutation_table.py --write   # into docs/mutation/report.md

A new run is a new row of the CSV (mutmut's counts as `scripts/mutation.sh`
prints them; a timeout or a mutant killed by hand counts as killed), then
``--write``.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCORES = ROOT / "docs" / "mutation" / "scores.csv"
REPORT = ROOT / "docs" / "mutation" / "report.md"
BEGIN, END = "<!-- mutation-scores -->\n", "<!-- /mutation-scores -->"

HEADER = (
    "| Module | Scope | Date | Issue | Mutants | Run | Killed | Survived | Killed / run "
    "| Not equivalent | Since |\n"
    "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"
)


def killed_share(killed: int, run: int) -> str:
    """Killed over run, one decimal, as the report always wrote it.

    >>> killed_share(176, 177), killed_share(69, 69), killed_share(0, 0)
    ('99.4 %', '100.0 %', '-')
    """
    return f"{100 * killed / run:.1f} %" if run else "-"


def table_row(row: dict[str, str]) -> str:
    counts = [int(row[key]) for key in ("mutants", "run", "killed", "survived", "not_equivalent")]
    mutants, run, killed, survived, not_equivalent = counts
    module = row["module"]
    module = f"`{module}`" if module.startswith("sim/") else module
    cells = [module, row["scope"], row["date"], row["issue"], mutants, run, killed, survived]
    cells += [killed_share(killed, run), not_equivalent, row["since"]]
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def scores_table(path: Path = SCORES) -> str:
    """The table, rows in the CSV's order (the modules by layer, each
    module's runs oldest first)."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    return "\n".join([HEADER, *(table_row(row) for row in rows)])


def with_table(page: str, table: str) -> str:
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}{table}\n{END}{tail}"


def main(argv: list[str]) -> int:
    table = scores_table()
    if argv == ["--write"]:
        written = REPORT.with_name(REPORT.name + ".tmp")
        written.write_text(with_table(REPORT.read_text(), table))
        written.replace(REPORT)  # atomic: the page is never half written
        return 0
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
