"""``fulcrum gateway --worker-urls ... --scrape`` in front of REAL vLLM engines (issue 25):
the one-line command a user runs, as a subprocess; chat requests through the printed URL
are answered by the engines (their own request counters rise); SIGTERM stops it."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys

import pytest

from fulcrum.gateway.testing import http_request
from tests.engines.vllm_fleet import MODEL_NAME, VllmFleet, metric_sum
from tests.gateway.helpers import line_with

pytestmark = pytest.mark.timeout(300)
FULCRUM = [sys.executable, "-m", "fulcrum.cli"]
DONE = "vllm:request_success_total"


async def test_one_line_gateway_serves_real_engines_and_stops(vllm_fleet: VllmFleet) -> None:
    ports = vllm_fleet.ports
    before = sum(metric_sum(p, DONE) for p in ports)
    proc = await asyncio.create_subprocess_exec(
        *FULCRUM, "gateway", "--worker-urls", *[f"http://127.0.0.1:{p}" for p in ports],
        "--scrape", "--port", "0", "--grpc-port", "0", "--metrics-port", "0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd="/",
    )
    seen: list[str] = []
    try:
        line = await line_with(proc, "send requests to", seen, timeout_s=120.0)
        found = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert found
        port = int(found.group(1))
        for i in range(6):
            body = {"model": MODEL_NAME, "max_tokens": 4,
                    "messages": [{"role": "user", "content": f"hello {i} " * 20}]}
            r = await http_request(port, "POST", "/v1/chat/completions",
                                   json.dumps(body).encode())
            assert r.status == 200, r.body[:300]
            assert json.loads(r.body)["choices"][0]["message"]["role"] == "assistant"
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert "fulcrum gateway: stopped" in out.decode()
    assert sum(metric_sum(p, DONE) for p in ports) - before == 6
