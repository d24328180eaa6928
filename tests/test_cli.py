"""The ``fulcrum`` command as a user meets it: ``--version``, ``serve`` flags over the
YAML, and a busy port (held by a real process) as one line and exit 2."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

import fulcrum
from fulcrum import cli

FULCRUM = [sys.executable, "-m", "fulcrum.cli"]
HOLDER = (
    "import socket, sys\n"
    "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
    "print(s.getsockname()[1], flush=True); sys.stdin.read()\n"
)


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port held by another process (listening) for the test's duration."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        yield int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"fulcrum {fulcrum.__version__}"


def test_serve_flags_override_the_yaml() -> None:
    args = cli.build_parser().parse_args(
        ["serve", "--host", "0.0.0.0", "--port", "6000", "--metrics-port", "6001"])
    s = cli._load("deploy/fulcrum.yaml", cli.serve_overrides(args))
    assert (s.server.host, s.server.port, s.metrics.port) == ("0.0.0.0", 6000, 6001)
    args = cli.build_parser().parse_args(["serve"])
    assert cli.serve_overrides(args) == {}


@pytest.mark.parametrize(("flag", "key"), [("--port", "server.port"),
                                           ("--metrics-port", "metrics.port")])
def test_a_busy_port_is_one_line_and_exit_2(busy_port: int, flag: str, key: str) -> None:
    other = "--metrics-port" if flag == "--port" else "--port"
    out = subprocess.run([*FULCRUM, "serve", flag, str(busy_port), other, "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert f"127.0.0.1:{busy_port}" in lines[0] and key in lines[0]
    assert "Another fulcrum running?" in lines[0]


def test_bind_failure_leaves_other_errors_alone() -> None:
    s = cli._load(None)
    assert cli.bind_failure(RuntimeError("something else"), s) is None
    assert cli.bind_failure(OSError(2, "No such file"), s) is None
