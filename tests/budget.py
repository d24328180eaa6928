"""Example counts that follow the active Hypothesis profile (tests/conftest.py).

An explicit ``@settings(max_examples=N)`` wins over every profile, so a test whose count
must grow in CI and under ``--hypothesis-profile=deep`` takes it from :func:`examples`.
"""

from __future__ import annotations

from hypothesis import settings


def profile() -> str:
    """Name of the active Hypothesis profile (``fulcrum``, ``ci`` or ``deep``)."""
    return settings.get_current_profile_name()


def examples(fast: int, ci: int = 200, deep: int = 1_000) -> int:
    """``max_examples`` for the active profile: ``fast`` locally (derandomized), ``ci``
    under CI=true (fresh draws every run), ``deep`` under ``--hypothesis-profile=deep``."""
    return {"ci": ci, "deep": deep}.get(profile(), fast)
