"""End to end with a real Prometheus (Debian's package): it scrapes a daemon on loopback,
loads the alert rules, and a Fulcrum series comes back through its HTTP API.

Skips, saying why, when the ``prometheus`` binary is missing. Waits are bounded polls.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fulcrum.client import FulcrumClient
from fulcrum.testing import running_server
from fulcrum.v1 import diagnostics_pb2

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "fulcrum-rules.yaml"
PROMETHEUS = shutil.which("prometheus")

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="prometheus not installed (apt-get install prometheus); .ci/run installs it",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    """A Prometheus process on loopback scraping one target every 0.5 s."""

    def __init__(self, tmp: Path, target: str) -> None:
        self.port = free_port()
        config = tmp / "prometheus.yml"
        config.write_text(
            json.dumps(  # JSON is YAML
                {
                    "global": {"scrape_interval": "500ms", "evaluation_interval": "500ms"},
                    "rule_files": [str(RULES)],
                    "scrape_configs": [
                        {"job_name": "fulcrum", "static_configs": [{"targets": [target]}]}
                    ],
                }
            )
        )
        assert PROMETHEUS is not None
        self.log = (tmp / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def get(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.loads(resp.read().decode()) if "/api/" in path else resp.read()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()


async def poll(check: Callable[[], Any], what: str, prom: Prometheus, timeout_s: float = 45.0
               ) -> Any:
    """Call ``check`` (in a thread) until it returns a truthy value or the bounded deadline
    passes; fails with Prometheus' log tail on timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        assert prom.proc.poll() is None, f"prometheus exited: {prom.proc.returncode}"
        try:
            result = await asyncio.to_thread(check)
        except OSError:
            result = None
        if result:
            return result
        if loop.time() > deadline:
            prom.log.flush()
            tail = (Path(prom.log.name).read_text())[-2000:]
            pytest.fail(f"timed out waiting for {what}; prometheus log tail:\n{tail}")
        await asyncio.sleep(0.2)


async def test_prometheus_scrapes_the_daemon(tmp_path: Path) -> None:
    async with running_server() as d, FulcrumClient(d.address) as c:
        for _ in range(5):
            await c.diagnostics.Ping(diagnostics_pb2.PingRequest(payload=b"x"))
        prom = Prometheus(tmp_path, f"127.0.0.1:{d.metrics_port}")
        try:
            await poll(lambda: prom.get("/-/ready"), "prometheus ready", prom)

            def query(q: str) -> list[dict[str, Any]]:
                body = prom.get("/api/v1/query", query=q)
                assert body["status"] == "success", body
                return list(body["data"]["result"])

            up = await poll(lambda: query('up{job="fulcrum"} == 1'), "target up", prom)
            assert up[0]["metric"]["instance"] == f"127.0.0.1:{d.metrics_port}"
            pings = await poll(
                lambda: query(
                    'fulcrum_rpc_requests_total{job="fulcrum", service="DiagnosticsService", '
                    'method="Ping", code="OK"} >= 5'
                ),
                "the Ping counter",
                prom,
            )
            assert float(pings[0]["value"][1]) >= 5
            info = query("fulcrum_build_info")
            assert info and info[0]["metric"]["version"]
            # the alert rules load into a real server
            rules = await poll(
                lambda: prom.get("/api/v1/rules")["data"]["groups"], "rules loaded", prom
            )
            assert {g["name"] for g in rules} >= {"fulcrum.availability", "fulcrum.balance"}
            assert all(r["health"] != "err" for g in rules for r in g["rules"]), rules
        finally:
            await asyncio.to_thread(prom.stop)
