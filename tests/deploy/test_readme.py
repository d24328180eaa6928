"""The README stays true: the two commands, links that resolve, and a current
configuration reference (moved from the README to docs/configuration.md, generated from
the settings models)."""

from __future__ import annotations

import re
from pathlib import Path

from fulcrum.tools import configref

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CONFIG_DOC = ROOT / "docs" / "configuration.md"
# Written on other branches and merged with this one (the lead fixes links at merge).
PENDING: set[str] = set()


def test_readme_names_the_two_commands() -> None:
    text = README.read_text()
    assert "make run" in text and "make test" in text


def test_readme_is_short() -> None:
    assert len(README.read_text().splitlines()) <= 210


def test_configuration_reference_is_current() -> None:
    text = CONFIG_DOC.read_text()
    assert configref.render() in text, (
        "run `python -m fulcrum.tools.configref --write docs/configuration.md`"
    )
    assert "docs/configuration.md" in README.read_text()


def test_local_links_resolve() -> None:
    missing = []
    for doc in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            path = (doc.parent / target).resolve()
            rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else target
            if not path.exists() and rel not in PENDING:
                missing.append(f"{doc.name}: {target}")
    assert missing == []


def test_user_facing_docs_name_no_machine_paths() -> None:
    for doc in [README, ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]:
        found = re.findall(r"/work/|/home/\w+|/root/|/opt/\w+", doc.read_text())
        assert found == [], f"{doc.name}: {found}"
