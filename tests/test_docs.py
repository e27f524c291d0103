"""The docs hold together. Every relative link in README.md and the docs
opens a file of the repository (pages get merged and moved: in issue 42 docs/speed.md took in
docs/performance.md, and the mutation report moved to docs/mutation/)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# [text](target) with no scheme: a page, a figure or a file of the tree.
LINK = re.compile(r"\]\(([^)\s]+)\)")


def broken_links(page: Path, text: str) -> list[str]:
    """The relative link targets in ``text`` (read from ``page``) that name
    no file or folder; anchors are dropped, web addresses skipped."""
    broken = []
    for target in LINK.findall(text):
        path = target.split("#", 1)[0]
        if not path or re.match(r"[a-z]+:", path):
            continue
        if not (page.parent / path).exists():
            broken.append(target)
    return broken


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_relative_link_of_the_readme_and_the_docs_opens_a_file():
    found = {
        str(page.relative_to(ROOT)): broken
        for page in pages()
        if (broken := broken_links(page, page.read_text()))
    }
    assert found == {}


def test_control_a_link_to_a_merged_page_is_broken():
    text = "see [speed](speed.md), [performance](performance.md#top) and [vLLM](https://docs.vllm.ai)"
    assert broken_links(ROOT / "docs" / "speed.md", text) == ["performance.md#top"]
    assert len(pages()) > 10


def test_the_helpers_docstring_names_every_helper_module():
    """tests/helpers/__init__.py is the index of what the tests share."""
    helpers = ROOT / "tests" / "helpers"
    listed = set(re.findall(r"^- ``(\w+)``", (helpers / "__init__.py").read_text(), re.MULTILINE))
    assert listed == {p.stem for p in helpers.glob("*.py")} - {"__init__"}


def _commands_table() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Commands\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| `kvsim ")]


def test_the_readmes_commands_table_names_every_command_in_short_rows():
    """Every command of ``kvsim --help`` has a row (``calibrate`` two), and
    a row stays under 200 characters: the details live in the docs and in
    each command's ``--help``."""
    import argparse

    from sim.cli import build_parser

    parser = build_parser()
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    rows = _commands_table()
    named = {row.split("`kvsim ", 1)[1].split()[0].rstrip("`") for row in rows}
    assert named == set(subparsers.choices)
    assert [row for row in rows if len(row) > 200] == []
