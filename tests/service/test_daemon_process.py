"""The daemon as an operator runs it: a subprocess started by the ``fulcrum`` command."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from fulcrum.client import FulcrumClient
from fulcrum.v1 import diagnostics_pb2

FULCRUM = [sys.executable, "-m", "fulcrum.cli"]


def in_flight(port: int) -> float:
    return metric_value(port, "fulcrum_rpc_in_flight", {})


def write_config(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "fulcrum.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


class Proc:
    def __init__(self, config: Path) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.p = subprocess.Popen(
            [*FULCRUM, "serve", "--config", str(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[dict[str, object]] = []
        self.address = ""
        assert self.p.stdout is not None
        for line in self.p.stdout:  # JSON log lines (stdout is not a terminal)
            event = json.loads(line)
            self.lines.append(event)
            if event.get("event") == "daemon_started":
                self.address = str(event["address"])
                self.metrics_port = int(str(event["metrics_port"]))
                break
        assert self.address, f"daemon did not start: {self.lines}"

    def rest(self, timeout: float) -> list[dict[str, object]]:
        out, _ = self.p.communicate(timeout=timeout)
        return self.lines + [json.loads(x) for x in out.splitlines() if x.startswith("{")]


@pytest.fixture
def proc(tmp_path: Path) -> Iterator[Proc]:
    cfg = write_config(
        tmp_path,
        {"server": {"port": 0, "grace_period_s": 5}, "metrics": {"port": 0},
         "logging": {"format": "json"}},
    )
    p = Proc(cfg)
    yield p
    if p.p.poll() is None:
        p.p.kill()
        p.p.wait()


async def test_sigterm_exits_zero_after_call_in_flight_completes(proc: Proc) -> None:
    async with FulcrumClient(proc.address) as client:
        await client.diagnostics.Ping(diagnostics_pb2.PingRequest())
        slow = asyncio.ensure_future(
            client.diagnostics.Ping(diagnostics_pb2.PingRequest(payload=b"z", delay_ms=1500))
        )
        # Poll the in-flight gauge (a condition with a bounded deadline, not a sleep).
        for _ in range(500):
            if in_flight(proc.metrics_port) >= 1:
                break
            await asyncio.sleep(0.002)
        assert in_flight(proc.metrics_port) == 1
        proc.p.send_signal(signal.SIGTERM)
        assert (await slow).payload == b"z"
    lines = proc.rest(timeout=10)
    assert proc.p.returncode == 0
    events = [e.get("event") for e in lines]
    assert "daemon_draining" in events and "daemon_stopped" in events


def test_health_command_against_running_daemon(proc: Proc) -> None:
    out = subprocess.run(
        [*FULCRUM, "health", "--target", proc.address], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "SERVING"
    proc.p.send_signal(signal.SIGINT)
    proc.rest(timeout=10)
    assert proc.p.returncode == 0


def test_health_command_without_daemon_fails() -> None:
    out = subprocess.run(
        [*FULCRUM, "health", "--target", "127.0.0.1:1", "--timeout", "1"],
        capture_output=True, text=True, timeout=30,
    )
    assert out.returncode == 1
    assert out.stdout.strip() in {"UNAVAILABLE", "DEADLINE_EXCEEDED"}


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"server": {"bogus": 1}}, "server.bogus: unknown key"),
        ({"sever": {}}, "sever: unknown key"),
        ({"server": {"port": -1}}, "server.port"),
        ({"server": {"port": "abc"}}, "server.port"),
        ({"fleet": {"heartbeat_timeout_ms": "soon"}}, "fleet.heartbeat_timeout_ms"),
        ([1, 2], "<root>"),
    ],
)
@pytest.mark.parametrize("command", ["serve", "check-config"])
def test_bad_config_exits_2_naming_the_key(
    tmp_path: Path, data: object, needle: str, command: str
) -> None:
    cfg = write_config(tmp_path, data)
    args = ["serve", "--config", str(cfg)] if command == "serve" else ["check-config", str(cfg)]
    out = subprocess.run([*FULCRUM, *args], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert needle in out.stderr


def test_check_config_accepts_the_shipped_configs() -> None:
    root = Path(__file__).resolve().parents[2]
    files = [root / "deploy" / "fulcrum.yaml"]
    for f in files:
        out = subprocess.run([*FULCRUM, "check-config", str(f)], capture_output=True, text=True,
                             timeout=30)
        assert out.returncode == 0, out.stderr


def test_unreachable_port_is_a_clean_failure() -> None:
    # A call to a dead port ends UNAVAILABLE quickly (the client retries, then gives up).
    async def call() -> grpc.StatusCode:
        async with FulcrumClient("127.0.0.1:1", timeout_s=2) as c:
            try:
                await c.diagnostics.Ping(diagnostics_pb2.PingRequest())
            except grpc.aio.AioRpcError as err:
                return err.code()
        return grpc.StatusCode.OK

    assert asyncio.run(call()) in {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


def metric_value(port: int, name: str, labels: dict[str, str]) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for family in text_string_to_metric_families(r.read().decode()):
            for s in family.samples:
                if s.name == name and s.labels == labels:
                    return float(s.value)
    return 0.0


async def wait_metric(port: int, name: str, labels: dict[str, str], want: float) -> float:
    """Poll a metric until it reaches ``want`` (bounded), return the last value."""
    value = 0.0
    for _ in range(500):
        value = metric_value(port, name, labels)
        if value >= want:
            break
        await asyncio.sleep(0.01)
    return value


async def test_sighup_reloads_policy_and_refuses_a_bad_file(tmp_path: Path) -> None:
    from fulcrum.v1 import decode_pb2, fleet_pb2

    data = {
        "server": {"port": 0, "grace_period_s": 5},
        "metrics": {"port": 0},
        "logging": {"format": "json"},
        "decode": {"policy": "dual"},
    }
    cfg = write_config(tmp_path, data)
    proc = Proc(cfg)
    try:
        async with FulcrumClient(proc.address) as client:
            await client.fleet.Register(
                fleet_pb2.RegisterRequest(
                    member_id="dec-0",
                    decode_instance=fleet_pb2.DecodeInstanceShape(
                        gpus=[fleet_pb2.DecodeGpuCapacity(max_concurrency=8, max_kv_tokens=10**6)]
                    ),
                )
            )
            first = await client.decode.PlaceDecode(
                decode_pb2.PlaceDecodeRequest(request_id="r1", kv_tokens=100)
            )
            assert first.policy == "dual"

            data["decode"] = {"policy": "least_kv"}
            cfg.write_text(yaml.safe_dump(data))
            proc.p.send_signal(signal.SIGHUP)
            applied = {"outcome": "applied"}
            assert await wait_metric(
                proc.metrics_port, "fulcrum_config_reloads_total", applied, 1
            ) == 1
            second = await client.decode.PlaceDecode(
                decode_pb2.PlaceDecodeRequest(request_id="r2", kv_tokens=100)
            )
            assert second.policy == "least_kv"

            cfg.write_text("decode: {policy: no_such_policy}\n")
            proc.p.send_signal(signal.SIGHUP)
            refused = {"outcome": "refused"}
            assert await wait_metric(
                proc.metrics_port, "fulcrum_config_reloads_total", refused, 1
            ) == 1
            third = await client.decode.PlaceDecode(
                decode_pb2.PlaceDecodeRequest(request_id="r3", kv_tokens=100)
            )
            assert third.policy == "least_kv"  # the old configuration stays
        proc.p.send_signal(signal.SIGTERM)
        lines = proc.rest(timeout=10)
    finally:
        if proc.p.poll() is None:
            proc.p.kill()
            proc.p.wait()
    assert proc.p.returncode == 0
    events = [e.get("event") for e in lines]
    assert "config_reloaded" in events and "config_reload_refused" in events
    refusal = next(e for e in lines if e.get("event") == "config_reload_refused")
    assert "decode.policy" in str(refusal["problems"])


async def test_sighup_reports_restart_only_keys_and_applies_the_rest(tmp_path: Path) -> None:
    """A SIGHUP that changes a restart-only key (server.max_concurrent_streams) and a
    reloadable one (fleet.heartbeat_timeout_ms) applies the second, keeps the first, names
    it in the log and counts outcome="restart_required"."""
    from fulcrum.v1 import fleet_pb2

    data: dict[str, Any] = {
        "server": {"port": 0, "grace_period_s": 5},
        "metrics": {"port": 0},
        "logging": {"format": "json"},
        "fleet": {"heartbeat_timeout_ms": 5000},
    }
    cfg = write_config(tmp_path, data)
    proc = Proc(cfg)
    try:
        async with FulcrumClient(proc.address) as client:
            data["server"]["max_concurrent_streams"] = 16
            data["fleet"]["heartbeat_timeout_ms"] = 1234
            cfg.write_text(yaml.safe_dump(data))
            proc.p.send_signal(signal.SIGHUP)
            outcome = {"outcome": "restart_required"}
            assert await wait_metric(
                proc.metrics_port, "fulcrum_config_reloads_total", outcome, 1
            ) == 1
            assert metric_value(proc.metrics_port, "fulcrum_config_restart_required", {}) == 1
            reply = await client.fleet.Register(fleet_pb2.RegisterRequest(
                member_id="pf-0", prefill_engine=fleet_pb2.PrefillEngineShape(dp_ranks=1)))
            assert reply.heartbeat_timeout_ms == 1234
        proc.p.send_signal(signal.SIGTERM)
        lines = proc.rest(timeout=10)
    finally:
        if proc.p.poll() is None:
            proc.p.kill()
            proc.p.wait()
    assert proc.p.returncode == 0
    warn = next(e for e in lines if e.get("event") == "config_restart_required")
    assert warn["keys"] == ["server.max_concurrent_streams"]
    done = next(e for e in lines if e.get("event") == "config_reloaded")
    assert done["outcome"] == "restart_required"
