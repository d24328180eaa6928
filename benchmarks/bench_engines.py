"""Real engines: routers in front of the same real vLLM servers (CPU build, tiny MoE).

Routers: **Fulcrum** (Envoy + Fulcrum's picker with ``gateway.cache`` on, scraping the
engines; ``fulcrum serve`` in its own process), **smg cache_aware** and **smg round_robin**
(PyPI ``smg``, its own venv ``.venv-peers``), **Envoy round robin** (the example bootstrap
without the ext_proc filter). All on loopback, one after the other on the same engines.

Workloads (streaming chat completions, ``max_tokens`` 8):

- ``multi-turn``: C conversations of T turns, conversations concurrent, turns in order;
- ``shared-system``: N requests with one long system prompt, distinct questions, 8 at once;
- ``no-reuse``: N requests with distinct prompts, 8 at once.

Fresh text every run: every text starts with a nonce of (router, workload, time), so a
cache left warm by a previous router gives nothing. Figures: the engines' own hit ratio
(deltas of ``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total``), TTFT p50
and p99 (time to the first streamed chunk, client side), wall time, requests per engine
(deltas of ``vllm:request_success_total``), and the router's CPU per request (Envoy and
picker processes, ``/proc/<pid>/stat`` deltas over the workload).

Run: ``nice .venv/bin/python benchmarks/bench_engines.py [--ports P1,P2] [--quick]
[--routers Fulcrum,Envoy] [--workloads no-reuse]``
(needs ``tests/engines/install_vllm.sh`` and ``.venv-peers/bin/pip install smg``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.engines.vllm_fleet import (  # noqa: E402
    MODEL_NAME,
    VllmFleet,
    free_port,
    make_model,
    metric_sum,
)

PEERS = ROOT / ".venv-peers" / "bin" / "smg"


@dataclass
class Run:
    router: str
    workload: str
    ttft_s: list[float] = field(default_factory=list)
    errors: int = 0
    wall_s: float = 0.0
    hit_ratio: float = float("nan")
    per_engine: list[int] = field(default_factory=list)
    router_cpu_s: float = 0.0


async def stream_ttft(port: int, body: dict[str, object]) -> tuple[float, str]:
    """POST a streaming chat completion; returns (seconds to first chunk, answer text)."""
    payload = json.dumps({**body, "stream": True}).encode()
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n".encode()
        + payload
    )
    await writer.drain()
    first = float("nan")
    data = b""
    while True:
        chunk = await asyncio.wait_for(reader.read(65536), 120)
        if not chunk:
            break
        if first != first and b'"content"' in chunk:
            first = time.perf_counter() - t0
        data += chunk
    writer.close()
    if not data.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(data[:200].decode("latin-1"))
    text = "".join(
        json.loads(line[5:])["choices"][0]["delta"].get("content") or ""
        for line in data.decode("latin-1").split("\n")
        if line.startswith("data: {") and '"choices":[{' in line
    )
    return first, text


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(5000)}" for _ in range(n))


def workloads(quick: bool) -> dict[str, Callable[[int, str, Run], Awaitable[None]]]:
    convs, turns, n = (4, 3, 12) if quick else (8, 4, 24)

    async def send(port: int, msgs: list[dict[str, str]], run: Run) -> str:
        try:
            ttft, text = await stream_ttft(port, {"model": MODEL_NAME, "messages": msgs,
                                                  "max_tokens": 8})
        except (RuntimeError, OSError, TimeoutError):
            run.errors += 1
            return ""
        run.ttft_s.append(ttft)
        return text

    async def multi_turn(port: int, nonce: str, run: Run) -> None:
        rng = random.Random(nonce)
        chats = [[{"role": "system", "content": f"{nonce} chat {c} " + words(rng, 250)}]
                 for c in range(convs)]

        async def one(c: int) -> None:
            for _ in range(turns):
                chats[c].append({"role": "user", "content": words(rng, 40)})
                chats[c].append({"role": "assistant", "content": await send(port, chats[c], run)})

        await asyncio.gather(*(one(c) for c in range(convs)))

    async def batched(port: int, prompts: list[list[dict[str, str]]], run: Run) -> None:
        sem = asyncio.Semaphore(8)

        async def one(msgs: list[dict[str, str]]) -> None:
            async with sem:
                await send(port, msgs, run)

        await asyncio.gather(*(one(m) for m in prompts))

    async def shared_system(port: int, nonce: str, run: Run) -> None:
        rng = random.Random(nonce)
        system = f"{nonce} " + words(rng, 400)
        await batched(port, [[{"role": "system", "content": system},
                              {"role": "user", "content": words(rng, 30)}] for _ in range(n)], run)

    async def no_reuse(port: int, nonce: str, run: Run) -> None:
        rng = random.Random(nonce)
        await batched(port, [[{"role": "user", "content": f"{nonce} {i} " + words(rng, 300)}]
                             for i in range(n)], run)

    return {"multi-turn": multi_turn, "shared-system": shared_system, "no-reuse": no_reuse}


#: Processes of the router under test whose CPU a run counts (Envoy, the picker).
ROUTER_PIDS: list[int] = []


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (``/proc/<pid>/stat``)."""
    import os

    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.asynccontextmanager
async def fulcrum_router(
    ports: list[int], lean: bool = False, unary: bool = False,
    recompute_weight: float | None = None,
) -> AsyncIterator[int]:
    """``fulcrum serve`` in its own process (not the load generator's loop), gateway.cache
    on, scraping the engines; a real Envoy in front (``lean``: the lean processing mode,
    request headers and buffered body only, release on stream close; ``unary``: ext_authz
    Check with the body, release by the gRPC access log; in both nothing is learnt from
    the response). ``recompute_weight``: ``gateway.cache.recompute_weight`` (None: the
    default)."""
    import yaml

    from fulcrum.gateway.testing import render_envoy_config, start_envoy, wait_for

    port = free_port()
    cfg = {
        "server": {"host": "127.0.0.1", "port": free_port(), "seed": 7},
        "metrics": {"enabled": False},
        "logging": {"level": "error", "format": "json"},
        "gateway": {
            "enabled": True, "port": port, "health_port": free_port(),
            "pool": {"decode": [{"id": f"v{i}", "host": "127.0.0.1", "ports": [p],
                                 "max_kv_tokens": 20_000} for i, p in enumerate(ports)]},
            "scrape": {"enabled": True, "interval_ms": 250},
            "cache": {"enabled": True},
        },
    }
    if recompute_weight is not None:
        cfg["gateway"]["cache"]["recompute_weight"] = recompute_weight  # type: ignore[index]
    tmp = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    (tmp / "fulcrum.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "fulcrum.cli", "serve", "--config",
                             str(tmp / "fulcrum.yaml")], stdout=subprocess.DEVNULL,
                            stderr=open(tmp / "fulcrum.log", "wb"))  # noqa: SIM115

    def listening() -> bool:
        assert proc.poll() is None, f"fulcrum exited: {tmp / 'fulcrum.log'}"
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return True
        return False

    try:
        await wait_for(listening, tries=600, interval_s=0.1, what="fulcrum ext_proc port")
        env = await start_envoy(render_envoy_config(port, [*ports, *ports], lean=lean,
                                                    unary=unary),
                                concurrency=1, log_level="error")
        ROUTER_PIDS[:] = [proc.pid, env.proc.pid]
        try:
            yield env.port
        finally:
            env.stop()
    finally:
        ROUTER_PIDS.clear()
        proc.terminate()
        proc.wait(timeout=30)


@contextlib.asynccontextmanager
async def envoy_rr(ports: list[int]) -> AsyncIterator[int]:
    from fulcrum.gateway.testing import render_envoy_config, start_envoy

    text = render_envoy_config(9002, [*ports, *ports])
    start = text.index("                  # 2. Ask the picker.\n")
    end = text.index("                  - name: envoy.filters.http.router\n")
    env = await start_envoy(text[:start] + text[end:], concurrency=1, log_level="error")
    ROUTER_PIDS[:] = [env.proc.pid]
    try:
        yield env.port
    finally:
        ROUTER_PIDS.clear()
        env.stop()


def smg_router(policy: str) -> Callable[[list[int]], contextlib.AbstractAsyncContextManager[int]]:
    @contextlib.asynccontextmanager
    async def start(ports: list[int]) -> AsyncIterator[int]:
        port = free_port()
        log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the router
        proc = subprocess.Popen(
            [str(PEERS), "launch", "--host", "127.0.0.1", "--port", str(port), "--policy",
             policy, "--worker-urls", *[f"http://127.0.0.1:{p}" for p in ports]],
            stdout=log, stderr=subprocess.STDOUT,
        )
        ROUTER_PIDS[:] = [proc.pid]
        try:
            for _ in range(240):  # bounded wait for a first answer through the router
                try:
                    await stream_ttft(port, {"model": MODEL_NAME, "max_tokens": 1,
                                             "messages": [{"role": "user", "content": "up"}]})
                    break
                except (OSError, RuntimeError, TimeoutError):
                    await asyncio.sleep(0.5)
            else:
                raise RuntimeError(f"smg {policy} did not come up")
            yield port
        finally:
            ROUTER_PIDS.clear()
            proc.terminate()
            proc.wait(timeout=30)

    return start


def engine_figures(ports: list[int]) -> tuple[float, float, list[float]]:
    hits = sum(metric_sum(p, "vllm:prefix_cache_hits_total") for p in ports)
    queries = sum(metric_sum(p, "vllm:prefix_cache_queries_total") for p in ports)
    return hits, queries, [metric_sum(p, "vllm:request_success_total") for p in ports]


async def bench(ports: list[int], quick: bool, only_routers: str = "",
                only_workloads: str = "", rounds: int = 1) -> list[Run]:
    routers: dict[str, Callable[[list[int]], contextlib.AbstractAsyncContextManager[int]]] = {
        "Fulcrum (gateway.cache)": fulcrum_router,
        "Fulcrum (gateway.cache, lean Envoy mode)": functools.partial(fulcrum_router, lean=True),
        "Fulcrum (gateway.cache, unary Envoy mode)": functools.partial(
            fulcrum_router, unary=True),
        "Fulcrum (gateway.cache, unary Envoy mode, least TTFT alone)": functools.partial(
            fulcrum_router, unary=True, recompute_weight=0.0),
        "smg cache_aware": smg_router("cache_aware"),
        "smg round_robin": smg_router("round_robin"),
        "Envoy round robin": envoy_rr,
    }
    rng = random.Random(time.time_ns())
    for p in ports:  # warm every engine (first requests compile kernels), not measured
        warm = Run("warm-up", "warm-up")
        for _ in range(3):
            msgs = [{"role": "user", "content": words(rng, 300)}]
            await stream_ttft(p, {"model": MODEL_NAME, "messages": msgs, "max_tokens": 8})
            warm.ttft_s.append(0.0)
    runs = []
    chosen = [(n, r) for n, r in routers.items()
              if not only_routers or any(w in n for w in only_routers.split(","))]
    for name, router in [pair for _ in range(rounds) for pair in chosen]:
        async with router(ports) as port:
            for wname, work in workloads(quick).items():
                if only_workloads and wname not in only_workloads.split(","):
                    continue
                run = Run(name, wname)
                h0, q0, r0 = engine_figures(ports)
                c0 = sum(cpu_s(p) for p in ROUTER_PIDS)
                t0 = time.perf_counter()
                await work(port, f"{name}-{wname}-{time.time_ns()}", run)
                run.wall_s = time.perf_counter() - t0
                run.router_cpu_s = sum(cpu_s(p) for p in ROUTER_PIDS) - c0
                h1, q1, r1 = engine_figures(ports)
                run.hit_ratio = (h1 - h0) / (q1 - q0) if q1 > q0 else float("nan")
                run.per_engine = [round(b - a) for a, b in zip(r0, r1, strict=True)]
                runs.append(run)
                print(table([run]).splitlines()[-1], flush=True)
    return runs


def pooled(runs: list[Run]) -> str:
    """One row per workload and router over every round: TTFT percentiles of all the
    requests together (one run's p99 of 32 requests is its maximum), hit ratio range,
    median wall time and router CPU per request."""
    out = ["| workload | router | runs | requests | hit ratio (min-max) | TTFT p50 (ms) | "
           "TTFT p90 (ms) | TTFT p99 (ms) | wall, median (s) | router CPU per request, "
           "median (ms) | errors |",
           "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    groups: dict[tuple[str, str], list[Run]] = {}
    for r in runs:
        groups.setdefault((r.workload, r.router), []).append(r)
    for (workload, router), rs in sorted(groups.items()):
        t = np.array([x for r in rs for x in r.ttft_s if x == x]) * 1e3
        p50, p90, p99 = np.percentile(t, [50, 90, 99]) if t.size else (float("nan"),) * 3
        hits = [r.hit_ratio for r in rs]
        cpu = [1e3 * r.router_cpu_s / max(len(r.ttft_s), 1) for r in rs]
        out.append(f"| {workload} | {router} | {len(rs)} | {t.size} | {min(hits):.3f}-"
                   f"{max(hits):.3f} | {p50:.0f} | {p90:.0f} | {p99:.0f} | "
                   f"{float(np.median([r.wall_s for r in rs])):.2f} | "
                   f"{float(np.median(cpu)):.2f} | {sum(r.errors for r in rs)} |")
    return "\n".join(out)


def table(runs: list[Run]) -> str:
    out = ["| workload | router | hit ratio | TTFT p50 (ms) | TTFT p99 (ms) | wall (s) | "
           "requests per engine | router CPU per request (ms) | errors |",
           "|---|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in runs:
        t = np.array([x for x in r.ttft_s if x == x]) * 1e3
        p50, p99 = (np.percentile(t, [50, 99]) if t.size else (float("nan"),) * 2)
        out.append(f"| {r.workload} | {r.router} | {r.hit_ratio:.3f} | {p50:.0f} | {p99:.0f} | "
                   f"{r.wall_s:.2f} | {' / '.join(map(str, r.per_engine))} | "
                   f"{1e3 * r.router_cpu_s / max(len(r.ttft_s), 1):.2f} | {r.errors} |")
    return "\n".join(out)


class _Candidates:
    """Stand-in for the decode adapter's filter: every endpoint a candidate."""

    def __init__(self, n: int) -> None:
        self.slots = np.arange(n, dtype=np.int64)
        self.addrs = [f"10.0.0.{i}:8000" for i in range(n)]
        self.keys = np.zeros(n, dtype=np.int64)
        self.scrape_listeners: list[object] = []

    def candidates(self, _kv: int, _subset: object) -> tuple[object, list[str], object]:
        return self.slots, self.addrs, self.keys


def pick_micro(engines: int = 64, blocks: int = 20_000, picks: int = 2000) -> str:
    """Time of one cache-aware decision (CachePicker.choose + placed) with ``engines``
    endpoints whose indexes hold ``blocks`` blocks each; a 3,000-token chat prompt.

    Reports wall time and the thread's CPU time per pick (on a shared machine the wall
    p99 is mostly preemption), and the pause of a full cycle collection with the index
    built, next to the same collection before it (the index's share of a GC pause)."""
    import gc

    from fulcrum.config.cache import CacheSettings
    from fulcrum.gateway.body import RequestShape
    from fulcrum.gateway.cache_pick import CachePicker

    def full_gc_ms() -> float:
        gc.collect()  # the first one untracks the index's plain dicts
        t0 = time.perf_counter()
        gc.collect()
        return (time.perf_counter() - t0) * 1e3

    gc_before = full_gc_ms()
    fake = _Candidates(engines)
    cp = CachePicker(CacheSettings(enabled=True, index_blocks=blocks), 4.0, fake)  # type: ignore[arg-type]
    rng = random.Random(5)
    texts = [words(rng, 2500) for _ in range(64)]
    for e in range(engines):  # fill every index to its bound
        cp._slot(fake.addrs[e])
        for j in range(blocks // 100 + 1):
            cp.index.record(e, [hash((e, j, k)) for k in range(100)])
    gc_after = full_gc_ms()
    shape_of = [RequestShape(3000, 8, True, text=t) for t in texts]
    wall, cpu = [], []
    for i in range(picks):
        t0, c0 = time.perf_counter(), time.thread_time()
        choice = cp.choose(fake, shape_of[i % len(texts)], None, i * 1000)  # type: ignore[arg-type]
        assert choice is not None
        cp.placed(f"r{i}", choice, 3000, i * 1000)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        cp.released(f"r{i}", "response_end", i * 1000)
    w, c = np.array(wall) * 1e6, np.array(cpu) * 1e6
    return (f"pick at {engines} endpoints x {cp.index.held(0)} indexed blocks each: "
            f"CPU p50 {np.percentile(c, 50):.0f} us, p99 {np.percentile(c, 99):.0f} us; "
            f"wall p50 {np.percentile(w, 50):.0f} us, p99 {np.percentile(w, 99):.0f} us; "
            f"full GC {gc_after:.1f} ms with the index, {gc_before:.1f} ms without")


def run(quick: bool) -> str:
    """``make bench`` entry: the pick micro-benchmark, and (not quick, with the vLLM and
    smg venvs present) the real-engine table."""
    from tests.engines.vllm_fleet import vllm_python

    out = [pick_micro()]
    if quick or vllm_python() is None or not PEERS.exists():
        out.append("(real-engine table skipped: --quick, or no .venv-vllm / .venv-peers)")
        return "\n\n".join(out)
    fleet = VllmFleet(make_model(Path(tempfile.mkdtemp(prefix="tiny-moe-"))), n=2)
    fleet.start()
    try:
        fleet.wait_ready(600)
        runs = asyncio.run(bench(fleet.ports, quick))
    finally:
        fleet.stop()
    out.append(table(sorted(runs, key=lambda r: r.workload)))
    return "\n\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ports", default="", help="use running engines (comma-separated)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--pick", action="store_true", help="only the pick micro-benchmark")
    ap.add_argument("--routers", default="", help="only routers whose name contains one "
                    "of these (comma-separated), e.g. Fulcrum,Envoy")
    ap.add_argument("--workloads", default="", help="only these workloads (comma-separated)")
    ap.add_argument("--rounds", type=int, default=1, help="run every router this many "
                    "times (interleaved) and add a table pooling the rounds")
    args = ap.parse_args()
    if args.pick:
        print(pick_micro())
        return
    fleet = None
    if args.ports:
        ports = [int(p) for p in args.ports.split(",")]
    else:
        fleet = VllmFleet(make_model(Path(tempfile.mkdtemp(prefix="tiny-moe-"))), n=2)
        fleet.start()
        fleet.wait_ready(600)
        ports = fleet.ports
    try:
        runs = asyncio.run(bench(ports, args.quick, args.routers, args.workloads,
                                 args.rounds))
    finally:
        if fleet is not None:
            fleet.stop()
    print(table(sorted(runs, key=lambda r: r.workload)))
    if args.rounds > 1:
        print()
        print(pooled(runs))


if __name__ == "__main__":
    main()
