"""docs/protocol.md stays true to the API: every RPC is covered, and the defaults it
quotes are the daemon's defaults."""

from __future__ import annotations

import re
from pathlib import Path

import grpc

from fulcrum.config import Settings
from fulcrum.v1 import descriptors

DOC = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()


def test_every_rpc_of_the_protos_is_in_the_guide() -> None:
    missing = []
    for file in descriptors.file_protos().values():
        for service in file.service:
            if service.name not in DOC:
                missing.append(service.name)
            for method in service.method:
                if f"`{method.name}" not in DOC and f"{method.name}`" not in DOC:
                    missing.append(f"{service.name}.{method.name}")
    assert missing == []


def test_every_status_code_the_daemon_returns_is_explained() -> None:
    names = {code.name for code in grpc.StatusCode}
    quoted = set(re.findall(r"`([A-Z][A-Z_]{2,})`", DOC))
    codes = quoted & names
    assert {"INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "ALREADY_EXISTS",
            "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "UNAVAILABLE"} <= codes


def test_defaults_quoted_by_the_guide() -> None:
    s = Settings()
    quoted = {
        "`heartbeat_interval_ms` (default 1000)": s.fleet.heartbeat_interval_ms == 1000,
        "`heartbeat_timeout_ms` (default 5000)": s.fleet.heartbeat_timeout_ms == 5000,
        "`fleet.sweep_interval_ms`, 250 ms": s.fleet.sweep_interval_ms == 250,
        "`server.max_call_s` (60 s)": s.server.max_call_s == 60,
        "`prefill.submit_wait_ms`, 30 s": s.prefill.submit_wait_ms == 30_000,
        "`prefill.max_submit_wait_ms`, 55 s": s.prefill.max_submit_wait_ms == 55_000,
        "the default long poll is 1 s": s.prefill.pull_wait_ms == 1000,
        "`decode.lease_ms`, default 600 s": s.decode.lease_ms == 600_000,
        "(default 120 s)": s.vision.lease_ms == 120_000,
        "`127.0.0.1:50051` by default": (s.server.host, s.server.port) == ("127.0.0.1", 50051),
    }
    for phrase, holds in quoted.items():
        assert phrase in DOC, phrase
        assert holds, f"docs/protocol.md says {phrase!r}, the default differs"
