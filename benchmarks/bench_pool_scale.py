"""The cache-aware pick against the size of the decode pool, through the real daemon.

A fresh daemon (``fulcrum serve``, its own process, every default) has a static pool of
``n`` decode endpoints (engines of 8 DP ranks). Two ways: the scrape off (the addresses
serve nothing), and the scrape on (its default period), each endpoint a stand-in that
serves a real vLLM 0.32 ``/metrics`` page (``benchmarks/data``, 52 KB, from the CPU build
the real-engine tests run) from a process of its own. The gateway's HTTP picker
(``gateway.authz_http_port``, the mode ``fulcrum gateway`` runs) is asked for one pick
at a time on one kept-alive connection, as Envoy's ext_authz would: an OpenAI completion
whose 3,000-character prompt is one of 64 conversations, so the prefix index fills and
matches as picks go. Every pick counts, the first ones on a cold index too. Figures:
round-trip time of one pick (the HTTP exchange on loopback and the daemon's decision,
placement and bookkeeping) at p50, p99 and max, and the first pick's.

Run alone: ``.venv/bin/python benchmarks/bench_pool_scale.py [--quick] [--baseline-src
DIR]`` (``DIR``: the ``src`` of another tree, run in the same run as one more row per
size and way).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # pragma: no cover - direct execution
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_gateway import _free_port, _process  # noqa: E402
from benchmarks.common import md_table  # noqa: E402

SIZES = (64, 1024, 4096)
PAGE = Path(__file__).resolve().parent / "data" / "vllm-0.32-cpu-metrics.txt"


def _config(n: int, http_port: int, grpc_port: int,
            ports: list[int] | None = None) -> dict[str, object]:
    """``ports``: the stand-ins serving metrics (the scrape on); None: unserved
    addresses, the scrape off."""
    if ports is None:
        engines = [{"id": f"e{i}", "host": f"10.{i // 250}.{i % 250}.1",
                    "ports": list(range(8000, 8000 + min(8, n - 8 * i)))}
                   for i in range((n + 7) // 8)]
    else:
        engines = [{"id": f"e{i}", "host": "127.0.0.1", "ports": ports[8 * i : 8 * i + 8]}
                   for i in range((n + 7) // 8)]
    return {
        "server": {"host": "127.0.0.1", "port": _free_port()},
        "metrics": {"enabled": False},
        "gateway": {"enabled": True, "port": grpc_port, "health_port": _free_port(),
                    "authz_http_port": http_port, "scrape": {"enabled": ports is not None},
                    "pool": {"decode": engines}},
    }


def _raise_fd_limit() -> int:
    """The soft limit of open files up to the hard one, returned: 4,096 stand-ins listen
    in one process, and the daemon (a child, which inherits it) keeps a connection to
    each."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def serve_metrics(n: int) -> None:
    """``n`` stand-in engines' ``/metrics`` (the vLLM page, kept-alive HTTP/1.1), on
    ephemeral ports printed as one JSON line; runs until killed."""
    _raise_fd_limit()
    page = PAGE.read_bytes()
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(page), page)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while True:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(answer)
                await writer.drain()
        writer.close()

    async def main() -> None:
        servers = [await asyncio.start_server(handle, "127.0.0.1", 0) for _ in range(n)]
        print(json.dumps([s.sockets[0].getsockname()[1] for s in servers]), flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


@contextlib.contextmanager
def _metrics_stand_ins(n: int) -> Iterator[list[int]]:
    proc = subprocess.Popen([sys.executable, __file__, "--serve-metrics", str(n)],
                            stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        yield json.loads(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()


async def _picks(port: int, picks: int, duration_s: float) -> list[float]:
    """At least ``picks`` picks and ``duration_s`` of them (the scrape's rounds come
    every second and last about a second at 1,024 ranks: the picks must span several)."""
    from fulcrum.gateway.testing import HttpClient

    rng = random.Random(3)
    convs = ["".join(rng.choice("abcdefgh ") for _ in range(3000)) for _ in range(64)]
    client = HttpClient("127.0.0.1", port)
    out = []
    end = time.perf_counter() + duration_s
    try:
        for i in itertools.count():
            if i >= picks and time.perf_counter() >= end:
                break
            body = {"model": "m", "prompt": f"{convs[i % 64]} turn {i}", "max_tokens": 64}
            t0 = time.perf_counter()
            r = await client.request("POST", "/v1/completions", json.dumps(body).encode())
            out.append(time.perf_counter() - t0)
            if r.status != 200:
                raise RuntimeError(f"pick {i} answered {r.status}: {r.body[:200]!r}")
    finally:
        await client.close()
    return out


def measure(n: int, picks: int, src: str | None = None,
            ports: list[int] | None = None, duration_s: float = 4.0) -> list[float]:
    """Round-trip times (s) of sequential picks at ``n`` endpoints, at least ``picks``
    and ``duration_s`` of them (``ports``: stand-ins serving metrics, the scrape on)."""
    http_port, grpc_port = _free_port(), _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fulcrum.yaml"
        path.write_text(yaml.safe_dump(_config(n, http_port, grpc_port, ports)))
        args = [sys.executable, "-m", "fulcrum.cli", "serve", "--config", str(path)]
        with _process(args, http_port, "fulcrum", src):
            return asyncio.run(_picks(http_port, picks, duration_s))


def report(quick: bool, baseline_src: str | None = None) -> str:
    files = _raise_fd_limit()
    picks, duration = (300, 2.0) if quick else (1500, 5.0)
    trees = [("Fulcrum", None)] + ([("baseline tree", baseline_src)] if baseline_src else [])
    rows = []
    for n in SIZES:
        if n + 512 > files:  # the stand-ins' listening sockets, the daemon's connections
            rows.append([f"{n:,}", "-", f"skipped: open files limited to {files}",
                         "", "", "", ""])
            continue
        with _metrics_stand_ins(n) as ports:
            for scrape in (False, True):
                for name, src in trees:
                    got = measure(n, picks, src, ports if scrape else None, duration)
                    ms = np.array(got) * 1e3
                    rows.append([f"{n:,}", "on" if scrape else "off", name,
                                 f"{np.percentile(ms, 50):.2f}", f"{np.percentile(ms, 99):.2f}",
                                 f"{ms.max():.2f}", f"{ms[0]:.2f}"])
    table = md_table(["endpoints", "scrape", "tree", "p50 (ms)", "p99 (ms)", "max (ms)",
                      "first pick (ms)"], rows)
    return (
        "### The pick against the pool's size\n\n"
        f"A fresh daemon per row, its defaults, sequential picks over its HTTP picker for "
        f"at least {duration:.0f} s and {picks} picks, 64 conversations of 3,000 "
        "characters; scrape on: every endpoint serves a real vLLM 0.32 metrics page.\n\n"
        f"{table}\n\n"
        "Command: `.venv/bin/python benchmarks/bench_pool_scale.py [--baseline-src DIR]` "
        "(or `make bench`).\n"
    )


def run(quick: bool) -> str:
    """``make bench`` entry."""
    return report(quick)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve-metrics"]:
        serve_metrics(int(sys.argv[2]))
        sys.exit(0)
    flag = "--baseline-src"
    base = sys.argv[sys.argv.index(flag) + 1] if flag in sys.argv else None
    print(report("--quick" in sys.argv, base))
