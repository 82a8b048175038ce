"""The README and the manual under docs/ stay true to the code: every
relative link resolves (to a file, and to a heading where it names one),
every page is reachable from the README, every flag of `strata serve` and
`strata generate` is documented, and every `--flag` the docs name exists."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from strata_server.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]+")
# Flags the docs give to other programs' commands: pip's and torchrun's.
OTHER_PROGRAMS = {"--no-deps", "--target", "--nproc-per-node", "--nnodes", "--node-rank", "--master-addr"}


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in page.read_text().splitlines() if line.startswith("#")}


def _flags_of(*command: str) -> set[str]:
    """The long options `strata COMMAND --help` lists (``()``: the top level's)."""
    parser = build_parser()
    if command:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[command[0]]
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--")} - {"--help"}


def _docs_text() -> str:
    return "\n".join(p.read_text() for p in PAGES)


def test_the_manual_has_pages_and_the_readme_stays_short():
    assert len(PAGES) >= 8, [p.name for p in PAGES]
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path):
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name} links to {target}, which does not exist"
        if anchor:
            assert anchor in _anchors(dest), f"{page.name} links to {target}: no such heading in {dest.name}"


def test_every_page_of_the_manual_is_linked_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in LINK.findall((ROOT / "README.md").read_text())}
    missing = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"docs pages the README's table does not list: {missing}"


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_flag_of_the_command_is_documented(command: str):
    documented = set(FLAG.findall("\n".join(p.read_text() for p in PAGES[1:])))
    missing = sorted(_flags_of(command) - documented)
    assert not missing, f"`strata {command}` flags no page under docs/ names: {missing}"


def test_every_flag_the_docs_name_exists():
    known = set(OTHER_PROGRAMS) | _flags_of()
    for command in ("generate", "chat", "serve", "info"):
        known |= _flags_of(command)
    for script in (ROOT / "bench").glob("*.py"):
        known |= set(re.findall(r"add_argument\(\s*\"(--[a-z][a-z0-9-]+)\"", script.read_text()))
    unknown = sorted(set(FLAG.findall(_docs_text())) - known)
    assert not unknown, f"the docs name flags no strata command or benchmark has: {unknown}"
