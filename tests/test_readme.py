"""The README's headline table is the default scenario's real output
(issue 10): the ``./kvsim compare`` block in README.md is parsed and
compared line by line with the comparison table of a fresh run, so the
README and the code cannot drift apart."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pandas as pd
import pytest

from sim.commands.common import print_table

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_compare_block(text: str) -> list[str]:
    """The lines between ``$ ./kvsim compare`` and the frames line: the
    requests line and the table."""
    lines = text.splitlines()
    start = lines.index("$ ./kvsim compare") + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("frames written to"))
    return lines[start:end]


def printed_table(table: pd.DataFrame) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_table(table)
    return out.getvalue().splitlines()


def test_the_readme_block_is_found_and_parsed():
    """The parser reads the README's block: a requests line, a header and
    the eleven metrics of ``GAIN_METRICS`` (a README reshuffle that loses
    the block fails here, not silently)."""
    block = readme_compare_block(README.read_text())
    assert re.fullmatch(r"kvsim: default: \d+ requests per layout", block[0])
    assert block[1].split() == ["layout", "off", "on", "gain", "gain_perc"]
    assert [line.split()[0] for line in block[2:]] == [
        "kv_cache_tokens",
        "num_admitted",
        "num_finished",
        "peak_concurrency",
        "mean_concurrency",
        "num_preemptions",
        "prefix_cache_hit_rate",
        "prefix_cache_evicted_blocks",
        "output_throughput_tokens_per_s",
        "ttft_p50_s",
        "ttft_p99_s",
    ]


def test_readme_headline_table_matches_the_default_run(default_run_checked):
    """Every figure of the README's table, as ``kvsim compare`` prints it,
    equals the default scenario's run. If this fails after an intended
    change, paste the new ``./kvsim compare`` output into README.md (and
    check the prose below the block, which quotes its percentages)."""
    block = readme_compare_block(README.read_text())
    requests_per_layout = len(default_run_checked.requests) // len(default_run_checked.summary)
    assert block[0] == f"kvsim: default: {requests_per_layout} requests per layout"
    assert printed_table(default_run_checked.comparison()) == block[1:]


def test_control_a_changed_figure_is_seen(default_run_checked):
    """FAILING CONTROL: one figure of the run changed by one request (what
    an allocator mutant that admits differently does) no longer matches."""
    table = default_run_checked.comparison().copy()
    table.loc["num_admitted", "on"] += 1
    block = readme_compare_block(README.read_text())
    with pytest.raises(AssertionError):
        assert printed_table(table) == block[1:]


# ------------------------------------------------------------ the map


def readme_map_block(text: str) -> str:
    """The code block under README.md's "How it works"."""
    section = text[text.index("## How it works") :]
    return section[section.index("```") + 3 : section.index("```", section.index("```") + 3)]


def _named_paths(block: str) -> set[str]:
    """Every module or package the map names (``sim/x.py``, ``x.py``,
    ``sim/x/``, ``x/``), without the ``sim/`` prefix or the suffix."""
    return set(re.findall(r"(?:sim/)?([a-z_]+)(?:\.py\b|/)", block))


def test_the_map_names_every_module_of_sim_and_only_real_ones():
    """The map of the code cannot drift: every top-level module and package
    of ``sim/`` is named, and every name is a real one. (Control: a
    module left out is reported by name.)"""
    sim_dir = README.parent / "sim"
    real = {p.stem for p in sim_dir.glob("*.py") if p.stem != "__init__"}
    real |= {p.name for p in sim_dir.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    named = _named_paths(readme_map_block(README.read_text()))
    assert real - named == set(), f"modules the README's map does not name: {sorted(real - named)}"
    unknown = {n for n in named if n not in real and not (sim_dir / "sched" / f"{n}.py").exists()}
    assert unknown == set(), f"names in the README's map that are no module: {sorted(unknown)}"
    assert "sim/cli.py" in readme_map_block(README.read_text())
