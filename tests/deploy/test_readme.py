"""The README stays true: the two commands, and a current configuration reference."""

from __future__ import annotations

from pathlib import Path

from fulcrum.tools import configref

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_names_the_two_commands() -> None:
    text = README.read_text()
    assert "make run" in text and "make test" in text


def test_configuration_reference_is_current() -> None:
    text = README.read_text()
    assert configref.render() in text, (
        "run `python -m fulcrum.tools.configref --write README.md`"
    )
