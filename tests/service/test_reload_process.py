"""Issue 22 rows 12 and 13 with a real ``fulcrum serve`` process: a reload of a file that
names no setting is refused, and a SIGHUP the moment the port accepts TCP is safe."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import yaml

from tests.service.test_daemon_process import FULCRUM, Proc, metric_value, wait_metric


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.05):
            return True
    except OSError:
        return False


async def test_reload_of_a_file_naming_no_setting_is_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "fulcrum.yaml"
    cfg.write_text(yaml.safe_dump({
        "server": {"port": 0, "grace_period_s": 5}, "metrics": {"port": 0},
        "logging": {"format": "json"}, "fleet": {"heartbeat_timeout_ms": 600_000},
    }))
    proc = Proc(cfg)
    try:
        texts = ["", "# only a comment\n# and another\n", "{}\n"]
        for n, text in enumerate(texts, start=1):
            cfg.write_text(text)
            proc.p.send_signal(signal.SIGHUP)
            labels = {"outcome": "refused"}
            got = await wait_metric(proc.metrics_port, "fulcrum_config_reloads_total", labels, n)
            assert got == n, text
        assert metric_value(proc.metrics_port, "fulcrum_config_reloads_total",
                            {"outcome": "restart_required"}) == 0
        assert metric_value(proc.metrics_port, "fulcrum_config_restart_required", {}) == 0
        proc.p.send_signal(signal.SIGTERM)
        lines = proc.rest(timeout=20)
    finally:
        if proc.p.poll() is None:
            proc.p.kill()
            proc.p.wait()
    assert proc.p.returncode == 0
    events = [e.get("event") for e in lines]
    assert "config_reload_refused" in events and "config_reloaded" not in events


def test_sighup_as_soon_as_the_port_accepts_tcp_is_safe(tmp_path: Path) -> None:
    """4 of 4 starts died before the fix: the port was bound before the handlers."""
    for _ in range(2):
        port = _free_port()
        cfg = tmp_path / "fulcrum.yaml"
        cfg.write_text(yaml.safe_dump({
            "server": {"port": port, "grace_period_s": 5}, "metrics": {"port": 0},
            "logging": {"format": "json"},
        }))
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        p = subprocess.Popen([*FULCRUM, "serve", "--config", str(cfg)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env)
        try:
            deadline = time.monotonic() + 60
            while not _accepts(port):
                assert p.poll() is None, "daemon exited before binding"
                assert time.monotonic() < deadline, "port never accepted TCP"
            p.send_signal(signal.SIGHUP)
            assert p.stdout is not None
            events = []
            for line in p.stdout:
                if line.startswith("{"):
                    events.append(json.loads(line).get("event"))
                if "config_reloaded" in events:
                    break
            assert "config_reloaded" in events, events  # the SIGHUP reloaded, late
            assert p.poll() is None
            p.send_signal(signal.SIGTERM)
            p.communicate(timeout=20)
            assert p.returncode == 0
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()

