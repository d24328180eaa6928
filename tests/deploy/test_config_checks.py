"""Configuration files get cross-field checks and messages in the CLI's words."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fulcrum.config import ConfigError, load_settings, parse_settings

ROOT = Path(__file__).resolve().parents[2]


def problems(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    return info.value.problems


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("fleet: {heartbeat_interval_ms: 10000, heartbeat_timeout_ms: 1000}",
         ["fleet.heartbeat_interval_ms: 10000 must be below fleet.heartbeat_timeout_ms"]),
        ("fleet: {sweep_interval_ms: 6000}", ["fleet.sweep_interval_ms: 6000"]),
        ("prefill: {max_submit_wait_ms: 70000}", ["prefill.max_submit_wait_ms", "max_call_s"]),
        ("metrics: {port: 50051}", ["metrics.port: 50051 is also server.port"]),
        ("servr: {port: 1}", ["servr: unknown key (did you mean 'server'?)"]),
        ("fleet: {heartbeat_timout_ms: 1}",
         ["fleet.heartbeat_timout_ms: unknown key (did you mean 'heartbeat_timeout_ms'?)"]),
        ("gateway: {pool: {decode: [{id: a, host: 127.0.0.1, ports: [1], prots: 2}]}}",
         ["gateway.pool.decode.0.prots: unknown key (did you mean 'ports'?)"]),
        ("prefill: {submit_wait_ms: 60000, max_submit_wait_ms: 1000}",
         ["prefill: submit_wait_ms: must be <= max_submit_wait_ms"]),
    ],
)
def test_problem_names_the_key_and_rule(tmp_path: Path, text: str, words: list[str]) -> None:
    found = problems(tmp_path, text)
    for w in words:
        assert any(w in p for p in found), found
    assert not any("Value error" in p for p in found), found


def test_shipped_configurations_pass() -> None:
    for path in (ROOT / "deploy" / "fulcrum.yaml", ROOT / "deploy" / "envoy" / "fulcrum.yaml"):
        load_settings(path)
    load_settings(None)
    parse_settings({"fleet": {"heartbeat_timeout_ms": 200}})  # in code: key by key only


def test_check_config_prints_them(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("fleet: {heartbeat_interval_ms: 10000, heartbeat_timeout_ms: 1000}\n")
    out = subprocess.run([sys.executable, "-m", "fulcrum.cli", "check-config", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.startswith("config error: fleet.heartbeat_interval_ms: 10000")
