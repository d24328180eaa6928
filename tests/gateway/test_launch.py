"""``fulcrum gateway --worker-urls ...`` end to end: the command as a user runs it (a
subprocess), stand-in OpenAI-compatible engines, the real Envoy it starts; requests
through the printed URL reach the engines; SIGTERM stops Envoy and the daemon."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import sys
from pathlib import Path

import pytest
import yaml

from fulcrum.config import parse_settings
from fulcrum.gateway import launch
from fulcrum.gateway.testing import http_request, upstreams
from tests.gateway.helpers import line_with

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
FULCRUM = [sys.executable, "-m", "fulcrum.cli"]


@pytest.mark.parametrize("mode", ["full", "lean", "unary", "http", None])
async def test_one_command_routes_requests_and_stops_on_sigterm(mode: str | None) -> None:
    """``mode`` None: no ``--envoy-mode``, the command's default (the HTTP mode)."""
    flags = [] if mode is None else ["--envoy-mode", mode]
    workers = 2 if mode == "http" else 1  # --envoy-concurrency reaches Envoy; default 1
    flags += ["--envoy-concurrency", "2"] if workers == 2 else []
    async with upstreams(2) as ups:
        urls = [f"http://127.0.0.1:{u.port}" for u in ups]
        proc = await asyncio.create_subprocess_exec(
            *FULCRUM, "gateway", "--worker-urls", *urls, "--port", "0", "--grpc-port", "0",
            "--metrics-port", "0", *flags, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, cwd="/",
        )
        seen: list[str] = []
        try:
            line = await line_with(proc, "send requests to", seen)
            found = re.search(r"http://127\.0\.0\.1:(\d+)", line)
            assert found, line
            port = int(found.group(1))
            found_admin = re.search(r"Envoy admin 127\.0\.0\.1:(\d+)", line)
            assert found_admin, line
            admin = int(found_admin.group(1))
            info = await http_request(admin, "GET", "/server_info")
            assert json.loads(info.body)["command_line_options"]["concurrency"] == workers
            for i in range(4):
                body = json.dumps({"model": "m", "prompt": "hi " * (i + 1), "max_tokens": 4})
                r = await http_request(port, "POST", "/v1/completions", body.encode())
                assert r.status == 200, r.body
                assert json.loads(r.body)["port"] in {u.port for u in ups}
            assert sum(len(u.received) for u in ups) == 4
            # Fulcrum picked them: the picker's header reached the engine.
            assert all("x-gateway-destination-endpoint" in rec.headers
                       for u in ups for rec in u.received)
            # The unary and HTTP modes' placement token rides on each request (the access
            # log names it at the end); the ext_proc modes add none. (The HTTP mode runs
            # here on the daemon's own uvloop, as a user runs it.)
            tokens = {rec.headers.get("x-fulcrum-placement") for u in ups for rec in u.received}
            authz = mode in ("unary", "http", None)  # None: the default, the HTTP mode
            assert (len(tokens) == 4 and None not in tokens) if authz else tokens == {None}
            # A 2 MiB body in every mode: the full mode streams it to the picker, the
            # others have Envoy buffer it up to gateway.max_body_bytes, not its 1 MiB.
            big = json.dumps({"model": "m", "prompt": "w " * (1 << 20), "max_tokens": 1})
            r = await http_request(port, "POST", "/v1/completions", big.encode())
            assert r.status == 200, r.body[:200]
            assert max(len(rec.body) for u in ups for rec in u.received) == len(big)
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()[-2000:]
        assert "fulcrum gateway: stopped" in out.decode()
        with pytest.raises(OSError):  # Envoy is gone too
            await http_request(admin, "GET", "/ready")


async def test_an_engine_url_it_cannot_use_is_one_line_and_exit_2() -> None:
    proc = await asyncio.create_subprocess_exec(
        *FULCRUM, "gateway", "--worker-urls", "ftp://127.0.0.1:1",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    assert err.decode().count("\n") == 1 and "http://HOST:PORT" in err.decode()


def test_overrides_make_a_valid_pool_and_scrape_switch() -> None:
    addrs = [launch.engine_address("http://localhost:8000"), ("10.0.0.2", 8001)]
    assert addrs[0] == ("127.0.0.1", 8000) or addrs[0][1] == 8000
    s = parse_settings(launch.gateway_overrides(addrs, scrape=True, grpc_port=0,
                                                metrics_port=None))
    assert s.gateway.enabled and s.gateway.scrape.enabled
    assert [e.addresses() for e in s.gateway.pool.decode][1] == ["10.0.0.2:8001"]


def test_the_commands_defaults_are_the_cache_aware_pick_scraping_in_the_http_mode() -> None:
    parser = argparse.ArgumentParser()
    launch.add_parser(parser.add_subparsers())
    args = parser.parse_args(["gateway", "--worker-urls", "http://127.0.0.1:8000"])
    assert args.envoy_mode == "http" and args.scrape is True
    assert parser.parse_args(["gateway", "--worker-urls", "x:1", "--no-scrape"]).scrape is False
    assert args.envoy_concurrency == 1
    for bad in ("-1", "two", "1025"):
        with pytest.raises(SystemExit):
            parser.parse_args(["gateway", "--worker-urls", "x:1", "--envoy-concurrency", bad])
    s = parse_settings(launch.gateway_overrides([("127.0.0.1", 8000)], scrape=args.scrape,
                                                grpc_port=0, metrics_port=None,
                                                mode=args.envoy_mode))
    assert s.gateway.cache.enabled and s.gateway.scrape.enabled
    assert s.gateway.authz_http_port == 0  # the HTTP picker on a free port
    addrs = [("127.0.0.1", 8000), ("127.0.0.1", 8001)]
    doc = yaml.safe_load(launch.envoy_config(9002, addrs, host="127.0.0.1", port=0,
                                             admin_port=0, http_port=9004,
                                             max_body_bytes=s.gateway.max_body_bytes))
    listener = doc["static_resources"]["listeners"][0]
    assert listener["per_connection_buffer_limit_bytes"] == 16 << 20
    full = yaml.safe_load(launch.envoy_config(9002, addrs, host="127.0.0.1", port=0,
                                              admin_port=0, mode="full",
                                              max_body_bytes=16 << 20))
    # The full mode streams the body to the picker; Envoy buffers none of it.
    assert "per_connection_buffer_limit_bytes" not in full["static_resources"]["listeners"][0]


def test_envoy_modes_and_a_mode_it_does_not_know() -> None:
    addrs = [("127.0.0.1", 8000), ("127.0.0.1", 8001)]
    unary = launch.envoy_config(9002, addrs, host="127.0.0.1", port=0, admin_port=0,
                                mode="unary")
    assert "ext_authz" in unary and "ext_proc" not in unary
    lean = launch.envoy_config(9002, addrs, host="127.0.0.1", port=0, admin_port=0,
                               mode="lean")
    assert "request_body_mode: BUFFERED" in lean
    http = launch.envoy_config(9002, addrs, host="127.0.0.1", port=0, admin_port=0,
                               mode="http", http_port=9004)
    assert "http_service" in http and "port_value: 9004" in http
    s = parse_settings(launch.gateway_overrides(addrs, scrape=False, grpc_port=0,
                                                metrics_port=None, mode="http"))
    assert s.gateway.authz_http_port == 0
    with pytest.raises(ValueError, match="envoy-mode"):
        launch.envoy_config(9002, addrs, host="127.0.0.1", port=0, admin_port=0, mode="x")


def test_the_packaged_envoy_bootstrap_is_the_example() -> None:
    packaged = ROOT / "src" / "fulcrum" / "gateway" / "envoy.yaml"
    assert packaged.read_text() == (ROOT / "deploy" / "envoy" / "envoy.yaml").read_text(), (
        "cp deploy/envoy/envoy.yaml src/fulcrum/gateway/envoy.yaml"
    )
