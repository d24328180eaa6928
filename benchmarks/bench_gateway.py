"""Gateway benchmark: HTTP requests through a real Envoy on loopback, three ways.

- **Fulcrum EPP**: Envoy's ext_proc asks the Fulcrum daemon (``fulcrum serve`` with the
  gateway on, its own process) for each request's destination: body read in
  FULL_DUPLEX_STREAMED mode, prompt + max_tokens parsed, decode placement held for the
  life of the request, response body streamed back through the picker (the example
  bootstrap deploy/envoy/envoy.yaml, ports replaced).
- **no-op picker**: the same Envoy bootstrap and the same stack (grpc.aio on uvloop,
  xds-protos messages, body collected and sent back, response echoed) in its own
  process, answering round robin without parsing or placing anything. The baseline the
  picker is measured against (aim: >= 0.8x its throughput).
- **Envoy round robin**: the same Envoy without the ext_proc filter (no picker at all).

Four upstreams in the load generator's process answer after a fixed 20 ms (simulated
model latency). ``workers`` closed-loop clients on keep-alive connections send an
OpenAI completion (1,000-character prompt, max_tokens 64). Figures: requests/s, latency
added over the 20 ms p50/p99 (client side), and CPU per request of Envoy + picker
(``/proc/<pid>/stat``; the load generator and upstreams are not counted). Runs are
interleaved (RR, no-op, Fulcrum, repeated) and summed per setup.

Run alone: ``.venv/bin/python benchmarks/bench_gateway.py [--quick] [--baseline-src DIR]
[--rounds N]`` (``--rounds``: interleaved rounds per setup, default 2).
``--baseline-src``: the ``src`` directory of another tree (e.g. a ``git worktree`` of an
older commit); its daemon runs as two more setups in the same run ("baseline tree", full
and lean), and the CPU aim is then judged against the baseline's full mode ("today's").
Under ``make bench``, the environment variable ``FULCRUM_BENCH_BASELINE_SRC`` does the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # pragma: no cover - direct execution
    sys.path.insert(0, str(ROOT))

from benchmarks.common import fmt_rate, md_table, percentiles, progress, ratio  # noqa: E402

UPSTREAM_DELAY_S = 0.020
#: Setups, run interleaved in this order each round. "lean": the processing mode of
#: fulcrum.gateway.testing.LEAN_MODE (one ext_proc message per request).
SETUPS = (
    "Envoy round robin",
    "no-op picker",
    "Fulcrum EPP",
    "no-op picker, lean",
    "Fulcrum EPP, lean",
    "no-op picker, unary",
    "Fulcrum EPP, unary",
    "no-op picker, http",
    "Fulcrum EPP, http",
)
BODY = json.dumps({"model": "m", "prompt": "x" * 1000, "max_tokens": 64}).encode()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 30.0
    while True:
        if proc.poll() is not None:
            err = proc.stderr.read().decode() if proc.stderr else ""
            raise RuntimeError(f"{what} exited early: {err[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not listen in 30 s")
        time.sleep(0.05)


@contextlib.contextmanager
def _process(args: list[str], port: int, what: str, src: str | None = None) -> Iterator[int]:
    env = {**os.environ, "PYTHONPATH": src} if src else None
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        _wait_port(port, proc, what)
        yield proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def fulcrum_picker(
    upstream_ports: list[int], src: str | None = None, http_port: int | None = None
) -> Iterator[tuple[int, int]]:
    """The daemon with the gateway on (``src``: run the package of that source tree;
    ``http_port``: its HTTP picker's port, ``gateway.authz_http_port``); yields (ext_proc
    port, pid)."""
    port = _free_port()
    cfg = {
        "server": {"host": "127.0.0.1", "port": _free_port(), "seed": 7},
        "metrics": {"enabled": False},
        "logging": {"level": "error", "format": "json"},
        "gateway": {
            "enabled": True,
            "port": port,
            "health_port": _free_port(),
            "pool": {"decode": [{"id": "d0", "host": "127.0.0.1", "ports": upstream_ports}]},
        },
    }
    if http_port is not None:
        cfg["gateway"]["authz_http_port"] = http_port  # type: ignore[index]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fulcrum.yaml"
        path.write_text(yaml.safe_dump(cfg))
        args = [sys.executable, "-m", "fulcrum.cli", "serve", "--config", str(path)]
        with _process(args, port, "fulcrum", src) as pid:
            yield port, pid


@contextlib.contextmanager
def noop_picker(
    upstream_ports: list[int], http_port: int | None = None
) -> Iterator[tuple[int, int]]:
    """The no-op picker of the same stack, in its own process (``http_port``: also its
    HTTP picker there); yields (gRPC port, pid)."""
    port = _free_port()
    http = ["--http", str(http_port)] if http_port is not None else []
    args = [sys.executable, __file__, "--noop-picker", str(port), *http,
            *map(str, upstream_ports)]
    with _process(args, port, "no-op picker") as pid:
        yield port, pid


def serve_noop(port: int, upstream_ports: list[int], http_port: int | None = None) -> None:
    """The no-op picker: round robin, no parsing. ext_proc: the body collected and
    returned; unary mode: ext_authz ``Check`` answers the destination, the access log
    stream reads each entry's token; HTTP mode (``http_port``): the same answer to
    ext_authz over HTTP/1.1 from a bare asyncio protocol."""
    import grpc
    import uvloop
    from envoy.config.core.v3 import base_pb2
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
    from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
    from envoy.service.auth.v3 import external_auth_pb2 as ea
    from envoy.service.auth.v3 import external_auth_pb2_grpc as ea_grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
    from google.protobuf import struct_pb2
    from google.rpc import status_pb2

    ok = status_pb2.Status(code=0)
    tokens = itertools.count(1)
    BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
    addrs = itertools.cycle([f"127.0.0.1:{p}" for p in upstream_ports])
    key = "x-gateway-destination-endpoint"

    def dest(addr: str) -> tuple[ep.CommonResponse, struct_pb2.Struct]:
        common = ep.CommonResponse(
            header_mutation=ep.HeaderMutation(
                set_headers=[
                    base_pb2.HeaderValueOption(
                        header=base_pb2.HeaderValue(key=key, raw_value=addr.encode())
                    )
                ]
            ),
            clear_route_cache=True,
        )
        md = struct_pb2.Struct()
        md.fields["envoy.lb"].struct_value.fields[key].string_value = addr
        return common, md

    class Noop(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
        async def Process(self, it, context):  # type: ignore[no-untyped-def]
            chunks: list[bytes] = []
            buffered = False
            async for req in it:
                kind = req.WhichOneof("request")
                if req.HasField("protocol_config"):
                    buffered = req.protocol_config.request_body_mode == BUFFERED
                if buffered and kind == "request_headers":  # lean: pick on the body
                    yield ep.ProcessingResponse(request_headers=ep.HeadersResponse())
                    continue
                if buffered and kind == "request_body":
                    common, md = dest(next(addrs))
                    yield ep.ProcessingResponse(
                        request_body=ep.BodyResponse(response=common), dynamic_metadata=md
                    )
                    continue
                if kind == "request_headers":
                    if req.request_headers.end_of_stream:
                        common, md = dest(next(addrs))
                        yield ep.ProcessingResponse(
                            request_headers=ep.HeadersResponse(response=common),
                            dynamic_metadata=md,
                        )
                elif kind == "request_body":
                    chunks.append(req.request_body.body)
                    if req.request_body.end_of_stream:
                        common, md = dest(next(addrs))
                        yield ep.ProcessingResponse(
                            request_headers=ep.HeadersResponse(response=common),
                            dynamic_metadata=md,
                        )
                        yield ep.ProcessingResponse(
                            request_body=ep.BodyResponse(
                                response=ep.CommonResponse(
                                    body_mutation=ep.BodyMutation(
                                        streamed_response=ep.StreamedBodyResponse(
                                            body=b"".join(chunks), end_of_stream=True
                                        )
                                    )
                                )
                            )
                        )
                elif kind == "response_headers":
                    yield ep.ProcessingResponse(response_headers=ep.HeadersResponse())
                elif kind == "response_body":
                    rb = req.response_body
                    yield ep.ProcessingResponse(
                        response_body=ep.BodyResponse(
                            response=ep.CommonResponse(
                                body_mutation=ep.BodyMutation(
                                    streamed_response=ep.StreamedBodyResponse(
                                        body=rb.body, end_of_stream=rb.end_of_stream
                                    )
                                )
                            )
                        )
                    )
                elif kind == "request_trailers":
                    yield ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
                elif kind == "response_trailers":
                    yield ep.ProcessingResponse(response_trailers=ep.TrailersResponse())

    class NoopCheck(ea_grpc.AuthorizationServicer):  # type: ignore[misc]
        """Unary mode: the destination and a placement token on the OK answer."""

        async def Check(self, req, context):  # type: ignore[no-untyped-def]
            return ea.CheckResponse(
                status=ok,
                ok_response=ea.OkHttpResponse(
                    headers=[
                        base_pb2.HeaderValueOption(
                            header=base_pb2.HeaderValue(key=key, value=next(addrs))
                        ),
                        base_pb2.HeaderValueOption(
                            header=base_pb2.HeaderValue(
                                key="x-fulcrum-placement", value=str(next(tokens))
                            )
                        ),
                    ]
                ),
            )

    class NoopLog(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
        """Unary mode: reads each entry's token, as a release would."""

        async def StreamAccessLogs(self, it, context):  # type: ignore[no-untyped-def]
            async for msg in it:
                for e in msg.http_logs.log_entry:
                    e.request.request_headers.get("x-fulcrum-placement")
            return als_pb2.StreamAccessLogsResponse()

    class NoopHttp(asyncio.Protocol):
        """HTTP mode: each request (head and Content-Length body) gets a 200 with the
        destination and a placement token."""

        def connection_made(self, transport):  # type: ignore[no-untyped-def]
            self.t, self.buf = transport, b""

        def data_received(self, data: bytes) -> None:
            self.buf += data
            while (i := self.buf.find(b"\r\n\r\n")) >= 0:
                n = 0
                for line in self.buf[:i].split(b"\r\n")[1:]:
                    k, _, v = line.partition(b":")
                    if k.strip().lower() == b"content-length":
                        n = int(v)
                if len(self.buf) < i + 4 + n:
                    return
                self.buf = self.buf[i + 4 + n:]
                self.t.write(b"HTTP/1.1 200 OK\r\n" + key.encode() + b": "
                             + next(addrs).encode() + b"\r\nx-fulcrum-placement: "
                             + str(next(tokens)).encode() + b"\r\ncontent-length: 0\r\n\r\n")

    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        ep_grpc.add_ExternalProcessorServicer_to_server(Noop(), server)
        ea_grpc.add_AuthorizationServicer_to_server(NoopCheck(), server)
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(NoopLog(), server)
        if http_port is not None:
            await asyncio.get_running_loop().create_server(NoopHttp, "127.0.0.1", http_port)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    uvloop.run(main())


def _round_robin_config(text: str) -> str:
    """The example bootstrap without the ext_proc filter (Envoy alone, round robin)."""
    start = text.index("                  # 2. Ask the picker.\n")
    end = text.index("                  - name: envoy.filters.http.router\n")
    return text[:start] + text[end:]


@dataclass
class Figures:
    name: str
    requests: int = 0
    errors: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.requests / self.wall_s if self.wall_s else float("nan")

    @property
    def cpu_per_request_s(self) -> float:
        return self.cpu_s / self.requests if self.requests else float("nan")


async def _load(port: int, workers: int, duration_s: float, fig: Figures, pids: list[int]) -> None:
    from fulcrum.gateway.testing import HttpClient

    clients = [HttpClient("127.0.0.1", port) for _ in range(workers)]
    for c in clients:  # warm: connections up, first picks done
        r = await c.request("POST", "/v1/completions", BODY)
        if r.status != 200:
            raise RuntimeError(f"{fig.name}: warm-up answered {r.status}")
    cpu0 = sum(_cpu_s(p) for p in pids)
    t0 = time.perf_counter()
    deadline = t0 + duration_s

    async def worker(c: HttpClient) -> None:
        while True:
            s = time.perf_counter()
            if s >= deadline:
                return
            r = await c.request("POST", "/v1/completions", BODY)
            fig.latencies_s.append(time.perf_counter() - s)
            fig.requests += 1
            if r.status != 200:
                fig.errors += 1

    await asyncio.gather(*(worker(c) for c in clients))
    fig.wall_s += time.perf_counter() - t0
    fig.cpu_s += sum(_cpu_s(p) for p in pids) - cpu0
    for c in clients:
        await c.close()


@contextlib.asynccontextmanager
async def _envoy(config: str) -> AsyncIterator[tuple[int, int, Any]]:
    from fulcrum.gateway.testing import start_envoy

    env = await start_envoy(config, concurrency=1, log_level="error")
    try:
        yield env.port, env.proc.pid, env
    finally:
        env.stop()


async def _check_picked(env: Any, name: str) -> None:
    """An ext_authz setup whose picker failed would still answer every request: Envoy
    fails open (``failure_mode_allow``) and routes round robin, and the row would
    measure no picking at all (a void run at stop 36). Every Check must have been
    answered OK."""
    failed = sum([await env.stat("http.inference.ext_authz.error"),
                  await env.stat("http.inference.ext_authz.failure_mode_allowed")])
    if failed or not await env.stat("http.inference.ext_authz.ok"):
        raise RuntimeError(f"{name}: {failed} ext_authz checks failed (Envoy failed open)")


BASELINE = ("Fulcrum EPP, baseline tree", "Fulcrum EPP, lean, baseline tree")


async def _bench(
    quick: bool, baseline_src: str | None = None, rounds: int | None = None
) -> tuple[list[Figures], dict[str, object]]:
    from fulcrum.gateway.testing import render_envoy_config, upstreams

    duration = 2.0 if quick else 5.0
    rounds = rounds or (1 if quick else 2)
    workers = 32
    figs = {n: Figures(n) for n in (*SETUPS, *(BASELINE if baseline_src else ()))}
    async with upstreams(4) as ups:
        for u in ups:
            u.record = False
            u.delay_s = UPSTREAM_DELAY_S
        ports = [u.port for u in ups]
        modes = {
            "": render_envoy_config(9002, ports, listener_port=0, admin_port=0),
            ", lean": render_envoy_config(9002, ports, listener_port=0, admin_port=0, lean=True),
            ", unary": render_envoy_config(
                9002, ports, listener_port=0, admin_port=0, unary=True
            ),
            ", http": render_envoy_config(
                9002, ports, listener_port=0, admin_port=0, http_authz_port=9004
            ),
        }

        noop_http, epp_http = _free_port(), _free_port()

        def at(text: str, port: int) -> str:
            http = noop_http if port == noop_port else epp_http
            return text.replace("port_value: 9002", f"port_value: {port}").replace(
                "127.0.0.1:9004", f"127.0.0.1:{http}").replace(
                "port_value: 9004", f"port_value: {http}")

        with contextlib.ExitStack() as stack:
            noop_port, noop_pid = stack.enter_context(noop_picker(ports, noop_http))
            epp_port, epp_pid = stack.enter_context(fulcrum_picker(ports, http_port=epp_http))
            configs: dict[str, tuple[str, list[int]]] = {
                "Envoy round robin": (_round_robin_config(modes[""]), [])
            }
            for suffix, text in modes.items():  # in SETUPS order: no-op, then Fulcrum
                configs[f"no-op picker{suffix}"] = (at(text, noop_port), [noop_pid])
                configs[f"Fulcrum EPP{suffix}"] = (at(text, epp_port), [epp_pid])
            if baseline_src:
                old_port, old_pid = stack.enter_context(fulcrum_picker(ports, baseline_src))
                for name, suffix in zip(BASELINE, ("", ", lean"), strict=True):
                    configs[name] = (at(modes[suffix], old_port), [old_pid])
            for r in range(rounds):
                for name, (cfg, pids) in configs.items():
                    progress(f"gateway: {name}, round {r + 1}/{rounds}")
                    async with _envoy(cfg) as (port, envoy_pid, env):
                        await _load(port, workers, duration, figs[name], [envoy_pid, *pids])
                        if name.endswith((", unary", ", http")):
                            await _check_picked(env, name)
    meta: dict[str, object] = {"workers": workers, "duration_s": duration, "rounds": rounds}
    return list(figs.values()), meta


def _cpu_us(f: Figures) -> str:
    return f"{f.cpu_per_request_s * 1e6:,.0f}"


def run(quick: bool) -> str:
    """``make bench`` entry; ``FULCRUM_BENCH_BASELINE_SRC`` = ``--baseline-src``."""
    return report(quick, os.environ.get("FULCRUM_BENCH_BASELINE_SRC") or None)


def report(quick: bool, baseline_src: str | None = None, rounds: int | None = None) -> str:
    figs, meta = asyncio.run(_bench(quick, baseline_src, rounds))
    by = {f.name: f for f in figs}
    noop, epp = by["no-op picker"], by["Fulcrum EPP"]
    lean, unary = by["Fulcrum EPP, lean"], by["Fulcrum EPP, unary"]
    http = by["Fulcrum EPP, http"]
    today = by.get(BASELINE[0], epp)  # "today's" full mode: the baseline tree's if run
    rows = []
    for f in figs:
        p50, p99 = percentiles(f.latencies_s)
        mode = next((m for m in ("lean", "unary", "http") if m in f.name), "")
        same_mode_noop = by[f"no-op picker, {mode}"] if mode else noop
        rows.append(
            [
                f.name,
                fmt_rate(f.rate),
                ratio(f.rate, noop.rate),
                f"{(p50 - UPSTREAM_DELAY_S) * 1e3:.2f}",
                f"{(p99 - UPSTREAM_DELAY_S) * 1e3:.2f}",
                _cpu_us(f),
                ratio(f.cpu_per_request_s, same_mode_noop.cpu_per_request_s),
                ratio(f.cpu_per_request_s, today.cpu_per_request_s),
                f.errors,
            ]
        )
    table = md_table(
        [
            "setup",
            "requests/s",
            "vs no-op picker",
            "added latency p50 (ms)",
            "added latency p99 (ms)",
            "CPU/request, Envoy + picker (us)",
            "CPU vs no-op, same mode",
            "CPU vs Fulcrum EPP full mode (the baseline tree's when run)",
            "errors",
        ],
        rows,
    )
    verdict = "met" if epp.rate >= 0.8 * noop.rate else "MISSED"
    cpu_ratio = lean.cpu_per_request_s / today.cpu_per_request_s
    cpu_verdict = "met" if cpu_ratio <= 0.6 else "MISSED"
    unary_ratio = unary.cpu_per_request_s / today.cpu_per_request_s
    unary_verdict = "met" if unary_ratio <= 0.6 else "MISSED"
    http_ratio = http.cpu_per_request_s / today.cpu_per_request_s
    http_verdict = "met" if http_ratio <= 0.6 else "MISSED"
    against = "the baseline tree's full mode" if today is not epp else "full mode"
    return (
        "### Gateway CPU per request\n\n"
        "HTTP through a real Envoy 1.40 on loopback (deploy/envoy/envoy.yaml with free ports;"
        f" Envoy --concurrency 1), {meta['workers']} closed-loop keep-alive clients, "
        f"{meta['rounds']} interleaved round(s) of {meta['duration_s']:.0f} s per setup, "
        "four upstreams answering after 20 ms, an OpenAI completion body (1,000-character "
        "prompt, max_tokens 64). Added latency = client latency - 20 ms. CPU counts Envoy "
        "and the picker process (not the load generator nor the upstreams). Full mode: the "
        "bootstrap as shipped (headers, FULL_DUPLEX_STREAMED bodies both ways, trailers); "
        "lean: `render_envoy_config(lean=True)` (request headers and the buffered body, "
        "nothing from the response; release on stream close); unary: "
        "`render_envoy_config(unary=True)` (one ext_authz Check with the body per request, "
        "release by the batched gRPC access log); http: `render_envoy_config("
        "http_authz_port=P)` (the unary mode's Check over plain HTTP/1.1 to "
        "`gateway.authz_http_port`, the same access log).\n\n"
        f"{table}\n\n"
        f"Aim: Fulcrum EPP >= 0.8x the no-op picker's throughput: **{verdict}** "
        f"({ratio(epp.rate, noop.rate)}). Aim: CPU per request, lean <= 0.6x {against}: "
        f"**{cpu_verdict}** ({cpu_ratio:.2f}x); unary <= 0.6x {against}: "
        f"**{unary_verdict}** ({unary_ratio:.2f}x); http <= 0.6x {against}: "
        f"**{http_verdict}** ({http_ratio:.2f}x).\n\n"
        "Command: `.venv/bin/python benchmarks/bench_gateway.py` "
        "(or `make bench`; `--quick` for 2 s runs).\n"
    )


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--noop-picker":
        rest = sys.argv[3:]
        http_port = None
        if rest[:1] == ["--http"]:
            http_port, rest = int(rest[1]), rest[2:]
        serve_noop(int(sys.argv[2]), [int(p) for p in rest], http_port)
    else:
        flag = "--baseline-src"
        base = sys.argv[sys.argv.index(flag) + 1] if flag in sys.argv else None
        n = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else None
        print(report("--quick" in sys.argv, base, n))
