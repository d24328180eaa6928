"""``fulcrum simulate --goodput`` shows progress when stderr is a terminal (a real pty):
probe k of n, the rate probed, ETA; nothing of it when stderr is not a terminal."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from tests.sim.test_sim_cli import tiny_trace

pytestmark = pytest.mark.timeout(120)


def run(trace: Path, jobs: int, tty: bool) -> tuple[str, str]:
    argv = [sys.executable, "-m", "fulcrum.cli", "simulate", "--trace", str(trace),
            "--goodput", "--jobs", str(jobs), "--policies", "default,least_work",
            "--fixed-load", "0.3", "--goodput-runs", "4", "--drain", "600"]
    if not tty:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=100)
        assert out.returncode == 0, out.stderr
        return out.stdout, out.stderr
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    chunks = []
    while select.select([master], [], [], 60)[0]:  # bounded: 60 s without output ends it
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    stdout = proc.stdout.read().decode() if proc.stdout else ""
    assert proc.wait(timeout=60) == 0
    return stdout, b"".join(chunks).decode(errors="replace")


@pytest.mark.parametrize("jobs", [1, 2])
def test_progress_on_a_terminal(tmp_path: Path, jobs: int) -> None:
    trace = tiny_trace(tmp_path / "t.jsonl")
    stdout, err = run(trace, jobs, tty=True)
    assert "goodput" in stdout  # the table still goes to stdout
    assert "probe 1 of 4" in err and "req/s" in err and "SLO" in err
    assert "<" in err or "?" in err  # tqdm's [elapsed<remaining] ETA field


def test_no_bar_when_stderr_is_not_a_terminal(tmp_path: Path) -> None:
    trace = tiny_trace(tmp_path / "t.jsonl")
    _, err = run(trace, 1, tty=False)
    assert "probe 1 of" not in err and "goodput" in err
