"""The README's quickstart, run as written: `make run` in one process, then each command
of "terminal 2" in a shell from the repository root, on free ports in place of
50051/9464 (the only change), then the daemon's Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
pytestmark = pytest.mark.timeout(240)


def _blocks() -> list[str]:
    section = README[README.index("## Quickstart") :]
    section = section[: section.index("\n## ", 5)]
    return re.findall(r"```sh\n(.*?)```", section, re.S)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child_of(pid: int) -> int:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "fulcrum").exists(), reason="needs make's .venv")
def test_the_readme_quickstart_works_as_written() -> None:
    first, second = _blocks()
    assert first.split("#")[0].strip() == "make run"
    grpc_port, metrics_port = _free_port(), _free_port()
    make = subprocess.Popen(
        ["make", "--no-print-directory", "run",
         f"ARGS=--port {grpc_port} --metrics-port {metrics_port}"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert make.stdout is not None
    try:
        for _ in range(200):  # bounded: make's command line, then the daemon's log lines
            line = make.stdout.readline()
            assert line, "make run exited before the daemon started"
            if line.startswith("{") and json.loads(line).get("event") == "daemon_started":
                break
        else:
            raise AssertionError("no daemon_started line")
        outputs = []
        for cmd in (c for c in second.splitlines() if c.strip()):
            cmd = cmd.replace("50051", str(grpc_port)).replace("9464", str(metrics_port))
            out = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], cwd=ROOT,
                                 capture_output=True, text=True, timeout=150)
            assert out.returncode == 0, f"{cmd}\n{out.stdout}\n{out.stderr}"
            outputs.append(out.stdout)
        health, decode, prefill, metrics, sim = outputs
        assert health.strip() == "SERVING"
        assert "registered" in decode and "registered" in prefill
        assert "fulcrum_decode_placements_total" in metrics
        assert "fulcrum_prefill_submits_total" in metrics
        assert "default" in sim and "round_robin" in sim
        # Ctrl-C in terminal 1 (the daemon's SIGINT): it drains and exits 0, so does make.
        os.kill(_child_of(make.pid), signal.SIGINT)
        assert make.wait(timeout=60) == 0
    finally:
        if make.poll() is None:
            make.kill()
            make.wait()
