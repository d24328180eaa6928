"""Shared fixtures (a real daemon on loopback and a client connected to it), the
Hypothesis profiles and the CI rule that no test may skip (docs/testing.md).

Profiles: ``fulcrum`` (local default: derandomized, fast), ``ci`` (loaded when
``CI=true``: random draws, every failure printed with its reproduction blob) and ``deep``
(``--hypothesis-profile=deep``: many more examples). Tests whose example count must follow
the profile take it from :func:`tests.budget.examples`.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Generator

import pytest
from hypothesis import HealthCheck, settings

from fulcrum.client import FulcrumClient
from fulcrum.service.server import Daemon
from fulcrum.testing import running_server

#: CI runs (``.ci/run`` sets CI=true, as do the common CI services).
IN_CI = os.environ.get("CI", "").lower() in ("true", "1", "yes")

_QUIET = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
settings.register_profile("fulcrum", deadline=None, derandomize=True,
                          suppress_health_check=_QUIET)
settings.register_profile("ci", deadline=None, derandomize=False, print_blob=True,
                          database=None, suppress_health_check=_QUIET)
settings.register_profile("deep", deadline=None, derandomize=False, print_blob=True,
                          max_examples=1_000, suppress_health_check=_QUIET)
# ``--hypothesis-profile=NAME`` (Hypothesis' pytest plugin) overrides this afterwards.
settings.load_profile("ci" if IN_CI else "fulcrum")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, None]:
    """In CI a skipped test fails: CI installs every real part the suite uses (Prometheus,
    promtool, Node.js, Envoy, ...), so a skip there means a missing install or a skip
    condition that hides a failure. Covers skip markers, ``pytest.skip`` and
    ``importorskip`` in any test, including ones added later; xfail is left alone."""
    outcome = yield
    _fail_skip_in_ci(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, None]:
    """The same for a whole module skipped at import (``allow_module_level=True``)."""
    outcome = yield
    _fail_skip_in_ci(outcome.get_result())


def _fail_skip_in_ci(report: pytest.TestReport | pytest.CollectReport) -> None:
    if IN_CI and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = (
            f"skipped under CI=true ({reason}): CI must provide what this test needs; "
            "a skip here hides a missing install or a failure (docs/testing.md)"
        )


@pytest.fixture
async def daemon() -> AsyncIterator[Daemon]:
    """A daemon with the test settings (free ports, seed 1234)."""
    async with running_server() as d:
        yield d


@pytest.fixture
async def client(daemon: Daemon) -> AsyncIterator[FulcrumClient]:
    """A client on the ``daemon`` fixture."""
    async with FulcrumClient(daemon.address, timeout_s=10.0) as c:
        yield c
