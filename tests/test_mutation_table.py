"""docs/mutation/report.md's scores table is what scripts/mutation_table.py
writes from docs/mutation/scores.csv (like the golden-coverage table of
docs/fork-patches.md), and the CSV's counts add up."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("mutation_table", ROOT / "scripts" / "mutation_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _block(page: str, script) -> str:
    return page.split(script.BEGIN)[1].split(script.END)[0]


def test_the_scores_table_in_the_report_is_the_csvs():
    script = _script()
    page = script.REPORT.read_text()
    assert _block(page, script).strip() == script.scores_table(), "python scripts/mutation_table.py --write"


def test_control_a_changed_count_is_seen(tmp_path):
    script = _script()
    changed = tmp_path / "scores.csv"
    changed.write_text(script.SCORES.read_text().replace(",177,177,176,1,0,", ",177,177,175,2,0,", 1))
    assert script.scores_table(changed) != script.scores_table()
    assert "| 98.9 % |" in script.scores_table(changed)


def test_each_runs_counts_add_up():
    with (ROOT / "docs" / "mutation" / "scores.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        mutants, run, killed, survived, not_equivalent = (
            int(row[key]) for key in ("mutants", "run", "killed", "survived", "not_equivalent")
        )
        assert killed + survived == run <= mutants, row
        assert not_equivalent <= survived, row


def test_writing_replaces_only_the_block():
    script = _script()
    page = f"# t\n\nbefore\n{script.BEGIN}old\n{script.END}\nafter\n"
    assert script.with_table(page, "new") == f"# t\n\nbefore\n{script.BEGIN}new\n{script.END}\nafter\n"
