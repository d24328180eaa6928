"""``fulcrum simulate`` as a newcomer runs it: no trace named, no ../shared beside the
clone; a short --help that points to docs/simulator.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fulcrum.sim import cli

ROOT = Path(__file__).resolve().parents[2]


def test_no_trace_runs_the_builtin_synthetic_workload(tmp_path: Path) -> None:
    env = {"FULCRUM_TRACES": str(tmp_path / "nothing-here"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-m", "fulcrum.cli", "simulate", "--limit", "300", "--policies",
         "default", "--json", "--quiet"],
        capture_output=True, text=True, timeout=100, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["meta"]["trace"] == "synthetic" and doc["meta"]["requests"] == 300
    assert doc["runs"][0]["finished"] == 300


def test_help_is_short_with_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert len(out.splitlines()) <= 60
    assert "examples:" in out and "docs/simulator.md" in out
    assert (ROOT / "docs" / "simulator.md").exists()
