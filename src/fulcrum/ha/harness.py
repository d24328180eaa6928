"""Real processes for the HA tests and ``benchmarks/bench_failover.py``: one etcd server
(Debian's ``etcd-server``) and ``fulcrum serve`` daemons on loopback, each on free ports.
Nothing here is used by the daemon itself."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

ETCD = shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").exists() else None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(cond: Any, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not reached in {timeout_s} s: {what}")
        time.sleep(0.01)


class EtcdProcess:
    """A single-member etcd on loopback with its data in a temporary directory."""

    def __init__(self, timeout_s: float = 20.0, port: int = 0) -> None:
        if ETCD is None:
            raise FileNotFoundError("etcd not found (apt-get install etcd-server)")
        self._dir = tempfile.mkdtemp(prefix="fulcrum-etcd-")
        self.port, peer = port or free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        client, peer_url = f"http://{self.endpoint}", f"http://127.0.0.1:{peer}"
        self.p = subprocess.Popen(
            [ETCD, "--name", "t", "--data-dir", self._dir, "--listen-client-urls", client,
             "--advertise-client-urls", client, "--listen-peer-urls", peer_url,
             "--initial-advertise-peer-urls", peer_url, "--initial-cluster", f"t={peer_url}",
             "--log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        _wait(self.healthy, "etcd healthy", timeout_s)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as r:
                return bool(json.loads(r.read()).get("health") == "true")
        except (OSError, ValueError):
            return False

    def pause(self) -> None:
        self.p.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.p.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGCONT)
            self.p.kill()
            self.p.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


def ha_config(endpoint: str, key: str, ttl_s: int = 3, renew_s: float = 2.0,
              **extra: Any) -> dict[str, Any]:
    """A daemon configuration with etcd election on ``endpoint`` and free ports."""
    cfg: dict[str, Any] = {
        "server": {"port": 0, "grace_period_s": 2, "drain_linger_s": 0},
        "metrics": {"port": 0},
        "logging": {"format": "json"},
        "ha": {"backend": "etcd", "election_key": key, "lease_ttl_s": ttl_s,
               "renew_deadline_s": renew_s, "retry_period_s": 0.1,
               "etcd": {"endpoints": [endpoint]}},
    }
    for section, values in extra.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


class DaemonProcess:
    """``fulcrum serve`` in a subprocess; its JSON log lines are collected by a thread."""

    def __init__(self, config: dict[str, Any], directory: Path, name: str,
                 timeout_s: float = 30.0) -> None:
        path = directory / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.p = subprocess.Popen(
            [sys.executable, "-m", "fulcrum.cli", "serve", "--config", str(path)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )
        self.lines: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()
        self.address = ""
        _wait(lambda: self.event("daemon_started") is not None or self.p.poll() is not None,
              f"{name} started", timeout_s)
        started = self.event("daemon_started")
        if started is None:
            raise RuntimeError(f"{name} did not start: {self.lines}")
        self.address = str(started["address"])
        self.metrics_port = int(started["metrics_port"])
        self._channel = grpc.insecure_channel(self.address)

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                event = {"event": "non_json", "line": line.rstrip()}
            with self._lock:
                self.lines.append(event)

    def events(self, name: str) -> list[dict[str, Any]]:
        with self._lock:
            return [e for e in self.lines if e.get("event") == name]

    def event(self, name: str) -> dict[str, Any] | None:
        found = self.events(name)
        return found[0] if found else None

    @property
    def channel(self) -> grpc.Channel:
        return self._channel

    def health(self, service: str = "", timeout_s: float = 0.5) -> str:
        """The health status name, or ``DOWN`` when the daemon does not answer."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service),
                               timeout=timeout_s)
        except grpc.RpcError:
            return "DOWN"
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

    def signal(self, sig: int) -> None:
        if self.p.poll() is None:
            self.p.send_signal(sig)

    def stop(self) -> None:
        self._channel.close()
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGCONT)
            self.p.kill()
        self.p.wait()
