"""The README's headline is the main job's real output (issues 10 and 38):
the ``./kvsim compare`` block in README.md is compared line by line with
the agent bench's headline from a fresh run of every seed, so the README
and the code cannot drift apart. ``python tests/test_readme.py`` rewrites
the block after an intended change (then check the prose around it)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from sim.analysis.agent_bench import CARD_V250, CARD_V251, bench_headline, headline_text
from sim.commands.common import MAIN_SCENARIO
from sim.commands.run import DEFAULT_SEEDS

README = Path(__file__).resolve().parent.parent / "README.md"
FRAMES_LINE = "frames written to"


def readme_compare_block(text: str) -> list[str]:
    """The lines between ``$ ./kvsim compare`` and the frames line: the
    scenario line, the table and what it is."""
    lines = text.splitlines()
    start = lines.index("$ ./kvsim compare") + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith(FRAMES_LINE))
    return lines[start:end]


def with_block(text: str, block: list[str]) -> str:
    """``text`` with the compare block replaced by ``block``."""
    lines = text.splitlines(keepends=True)
    start = [line.rstrip("\n") for line in lines].index("$ ./kvsim compare") + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith(FRAMES_LINE))
    return "".join(lines[:start] + [f"{line}\n" for line in block] + lines[end:])


@pytest.fixture(scope="module")
def headline():
    """What ``./kvsim compare`` prints: the default scenario, both layouts
    and the card's earlier release, over the default seeds (~25 s)."""
    return bench_headline(MAIN_SCENARIO, [], DEFAULT_SEEDS)


def test_the_readme_block_is_found_and_parsed():
    """The parser reads the README's block: the scenario line, a header
    with kvsim's and the card's columns, the card's eight figures (a README
    reshuffle that loses the block fails here, not silently)."""
    block = readme_compare_block(README.read_text())
    assert re.fullmatch(r"kvsim: agent-sessions: .+", block[0])
    assert block[1].split() == ["off", "on", "card", "v2.5.1", "v2.5.0", "card", "v2.5.0"]
    assert [re.split(r"\s{2,}", line.strip())[0] for line in block[2:10]] == [
        "requests",
        "follow-ups",
        "reuse (%)",
        "follow-up TTFT p50 (s)",
        "follow-up TTFT p90 (s)",
        "full re-prefills",
        "pool peak, logged (%)",
        "preemptions",
    ]


def test_readme_headline_matches_the_main_job(headline):
    """Every line of the README's block, as ``kvsim compare`` prints it,
    equals a fresh headline. If this fails after an intended change, run
    ``python tests/test_readme.py`` and check the prose near the block."""
    assert readme_compare_block(README.read_text()) == headline_text(headline).splitlines()


def test_control_a_changed_figure_is_seen(headline):
    """FAILING CONTROL: every seed's ``on`` run one request more (what an
    allocator mutant that admits differently does) no longer matches."""
    rows = headline.rows.copy()
    rows.loc[rows["column"] == "on", "num_requests"] += 1
    changed = headline_text(type(headline)(**{**headline.__dict__, "rows": rows}))
    assert readme_compare_block(README.read_text()) != changed.splitlines()


@pytest.mark.parametrize(
    ("column", "figures"),
    [
        (CARD_V251, (107, 99, 0.925, 1.61, None, 4, 0.992, 2)),
        (CARD_V250, (88, 80, 0.906, 3.54, None, 0, 0.992, 0)),
    ],
)
def test_the_card_columns_are_the_cards(column, figures):
    """The card's section 5, typed from the card (halt95/qwen38-flash-next-
    3090s, benchmarks/2026-10-06/BENCH-CARD.md): requests started within
    300 s (of them follow-ups), reuse, median follow-up TTFT, follow-up
    TTFT p90 (not stated), full re-prefills, KV pool peak, preemptions."""
    assert tuple(column.figures.values()) == figures


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
    in_package = {
        n
        for n in named
        for pkg in (sim_dir / "sched", sim_dir / "fork")
        if (pkg / f"{n}.py").exists() or (pkg / n).is_dir()
    }
    unknown = named - real - in_package
    assert unknown == set(), f"names in the README's map that are no module: {sorted(unknown)}"
    assert "sim/cli.py" in readme_map_block(README.read_text())


if __name__ == "__main__":  # rewrite the README's block from a fresh run
    block = headline_text(bench_headline(MAIN_SCENARIO, [], DEFAULT_SEEDS)).splitlines()
    README.write_text(with_block(README.read_text(), block))
    sys.exit(0)
