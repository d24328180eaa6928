"""Real engines: routers in front of the same real vLLM servers (CPU build, tiny MoE).

Routers: **Fulcrum** (``fulcrum gateway`` as a user runs it, every setting its default;
and Envoy + Fulcrum's picker, ``fulcrum serve`` in its own process, scraping the engines,
in each Envoy mode), **smg cache_aware** and **smg round_robin**
(PyPI ``smg``, its own venv ``.venv-peers``), **vllm-router cache_aware** (PyPI
``vllm-router``, same venv), **Envoy round robin** (the example bootstrap
without the ext_proc filter). All on loopback, one after the other on the same engines.

Workloads (streaming chat completions, ``max_tokens`` 8):

- ``multi-turn``: C conversations of T turns, conversations concurrent, turns in order;
- ``shared-system``: N requests with one long system prompt, distinct questions, 8 at once;
- ``no-reuse``: N requests with distinct prompts, 8 at once;
- ``shared-chats``: C conversations of T turns as ``multi-turn``, all opening with one
  system prompt (a chat service's): the prompt is shared, each history is private;
- ``shared-system-arrivals``: N requests as ``shared-system``, arriving one by one at
  random (Poisson, :data:`ARRIVALS_PER_S`) instead of eight at once: users as a service
  sees them. Its wall is the arrivals' span: read its TTFT and requests per engine;
- ``shared-chats-arrivals``: C conversations as ``shared-chats``, starting one by one at
  random (:data:`CHATS_PER_S`), the user pausing :data:`THINK_S` between turns;
- ``mooncake-replay`` (only where Mooncake's synthetic trace is, ``$FULCRUM_TRACES``: not
  in the repository, a held-out check): the trace's first N requests in order, at its
  timestamps sped up :data:`REPLAY_SPEEDUP` times, each 512-token hash block as
  :data:`REPLAY_WORDS` words seeded by its id (requests that share leading blocks share
  that prefix), at most :data:`REPLAY_BLOCKS` blocks a request.

Fresh text every run: every text starts with a nonce (16 symbols seeded by router,
workload and time, 16 tokens for every router), so a cache left warm by a previous router
gives nothing; after it, every router in a round gets the same text (:func:`workloads`).
Figures: the engines' own hit ratio (deltas of ``vllm:prefix_cache_hits_total /
vllm:prefix_cache_queries_total``), TTFT p50 and p99 (time to the first streamed chunk,
client side), wall time, requests per engine (deltas of ``vllm:request_success_total``)
with each engine's own mean TTFT, and the router's CPU per request (Envoy and picker
processes, ``/proc/<pid>/stat`` deltas over the workload).

Each round starts a fresh daemon. At the default sizes a round sends about 40 streamed
requests per engine, under the online refit's 64 samples: ``--size 32,6,96`` passes them
in the first workload, as a deployment does in its first minute (BENCHMARKS.md, stop 41;
only requests picked alone on their engine teach the refit, 9-21 a round at this load).

Run: ``.venv/bin/python benchmarks/bench_engines.py [--ports P1,P2] [--quick]
[--routers Fulcrum,Envoy] [--workloads no-reuse] [--rounds N] [--save FILE]
[--engines N] [--kv-blocks N]`` (needs
``tests/engines/install_vllm.sh`` and ``.venv-peers/bin/pip install smg vllm-router``).
``--save`` appends every round's walls to a JSON lines file; ``--pool FILE[,FILE]``
prints the paired table over every round saved there, runs apart
(``benchmarks/results/no_reuse_rounds_stop37.jsonl``, ``..._stop38`` and ``..._stop39``: the
no-reuse rounds behind BENCHMARKS.md's pooled figures).

Where the engines run: the bench's own engines have each one core for their whole
process tree (``VllmFleet(pin_processes=True)``), at niceness +10 below the routers and
the load generator, which float over every core. In production a router has CPUs of its
own; on a machine where it shares the engines' cores, every hop of a request (Envoy, the
picker's gRPC thread, its event loop) would otherwise wait for an engine's time slice.
The same for every router. Engines given with ``--ports`` keep whatever their starter
set.
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
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from tests.engines.vllm_fleet import (  # noqa: E402
    MODEL_NAME,
    VllmFleet,
    free_port,
    free_ports,
    make_model,
    metric_sum,
)

PEERS = ROOT / ".venv-peers" / "bin" / "smg"
VLLM_ROUTER = ROOT / ".venv-peers" / "bin" / "vllm-router"


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
    #: Each engine's own mean TTFT over the run (ms, its ``vllm:time_to_first_token``
    #: histogram): how fast each engine answered, next to how many requests it got.
    engine_ttft_ms: list[float] = field(default_factory=list)
    #: The round it ran in (rounds are interleaved: every router once per round).
    round: int = 0


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


#: Characters the tiny model's tokenizer never saw together (its corpus is words and
#: digits): each is one token and no two merge, so a nonce of them has a fixed length.
NONCE_CHARS = "!#$%&()*+,-./:;<=>?@[]^_{|}~"


def nonce(key: str) -> str:
    """16 symbols seeded by ``key``: fresh for every run (no router finds a cache left
    warm by another) and 16 tokens long for every router. (The router's name used to open
    the text: a longer name shared more tokens by every request of a run, a cached block
    more for "Fulcrum (gateway.cache, ...)" than for "smg cache_aware".)"""
    rng = random.Random(key)
    return "".join(rng.choice(NONCE_CHARS) for _ in range(16))


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(5000)}" for _ in range(n))


Workload = Callable[[int, str, str, Run], Awaitable[None]]
#: ``shared-system-arrivals``: requests a second, Poisson (open loop). The two CPU engines
#: serve about 65 a second of these prompts in the 8-at-once rounds; at 25 one engine alone
#: keeps up, slower (BENCHMARKS.md, "Real engines", stop 42).
ARRIVALS_PER_S = 25.0
#: ``shared-chats-arrivals``: conversations starting a second (Poisson), and the user's
#: pause between an answer and the next turn (s).
CHATS_PER_S = 8.0
THINK_S = 0.2
#: ``mooncake-replay``: the trace's 512-token hash blocks as this many words each (about
#: 4.3 tokens a word for the tiny model's tokenizer, 103 a block), at most this many
#: leading blocks a request (2,463 tokens; the engines' context is 4,096), arrivals this
#: many times faster than the trace's timestamps (1: about 3.5 requests a second, 1,350
#: tokens each on average; at 2 the two CPU engines were saturated, queue time 0.2 s).
REPLAY_WORDS = 24
REPLAY_BLOCKS = 24
REPLAY_SPEEDUP = 1.0
REPLAY_TRACE = "mooncake_synthetic_trace.jsonl"
#: ``many-docs``: documents of this many words (about 600 tokens each), questions about
#: them drawn uniformly, ``MANY_DOCS_PER_REQUEST`` x the size's requests in all, 8 at once.
#: Meant for engines whose KV cache holds fewer than all of them and more than half
#: (``--kv-blocks 256``: 8,192 tokens an engine, 20 documents of about 600 tokens): the
#: deployment where a cache-aware router doubles the cache by splitting the documents.
MANY_DOCS = 20
MANY_DOCS_WORDS = 140
MANY_DOCS_PER_REQUEST = 8
#: ``many-docs-arrivals``: the same questions arriving one by one, Poisson, this many a
#: second (the two CPU engines at 256 blocks answered about 24 a second 8 at once).
DOCS_PER_S = 16.0
#: Workloads run only when ``--workloads`` names them (they need engines set up for them).
OPT_IN = frozenset({"many-docs", "many-docs-arrivals"})


def replay_rows(n: int) -> list[tuple[float, list[int]]] | None:
    """The first ``n`` requests of Mooncake's synthetic trace as (arrival s, leading hash
    ids), or None without the trace (``$FULCRUM_TRACES``, else ``../shared/traces``: it is
    not in the repository, so users without it get no such workload)."""
    from fulcrum.sim.workload import read_mooncake, traces_dir

    path = traces_dir() / REPLAY_TRACE
    if not path.exists():
        return None
    return [(r.arrival_ns / 1e9, list(r.hash_ids[:REPLAY_BLOCKS]))
            for r in read_mooncake(path, limit=n)]


def workloads(quick: bool, size: tuple[int, int, int] | None = None) -> dict[str, Workload]:
    """Each workload is called with the router's port, the run's nonce, the round's text
    seed and the run. Every router in a round gets the same text after its own nonce, and
    a conversation's assistant turns are text of the seed too (two words, about the 8
    tokens asked for), not the model's sampled answer: so the prompts every router sends
    are the same tokens, and a difference in hit ratio is the routing's, not the text's.
    ``size``: conversations, turns each, and requests of the other workloads (default
    8, 4, 24; ``quick`` 4, 3, 12)."""
    convs, turns, n = size or ((4, 3, 12) if quick else (8, 4, 24))

    async def send(port: int, msgs: list[dict[str, str]], run: Run) -> None:
        try:
            ttft, _ = await stream_ttft(port, {"model": MODEL_NAME, "messages": msgs,
                                               "max_tokens": 8})
        except (RuntimeError, OSError, TimeoutError):
            run.errors += 1
            return
        run.ttft_s.append(ttft)

    async def multi_turn(port: int, nonce: str, seed: str, run: Run) -> None:
        async def one(c: int) -> None:
            rng = random.Random(f"{seed}-{c}")  # one per conversation: order-independent
            chat = [{"role": "system", "content": f"{nonce} chat {c} " + words(rng, 250)}]
            for _ in range(turns):
                chat.append({"role": "user", "content": words(rng, 40)})
                await send(port, chat, run)
                chat.append({"role": "assistant", "content": words(rng, 2)})

        await asyncio.gather(*(one(c) for c in range(convs)))

    async def batched(port: int, prompts: list[list[dict[str, str]]], run: Run) -> None:
        sem = asyncio.Semaphore(8)

        async def one(msgs: list[dict[str, str]]) -> None:
            async with sem:
                await send(port, msgs, run)

        await asyncio.gather(*(one(m) for m in prompts))

    async def shared_system(port: int, nonce: str, seed: str, run: Run) -> None:
        rng = random.Random(seed)
        system = f"{nonce} " + words(rng, 400)
        await batched(port, [[{"role": "system", "content": system},
                              {"role": "user", "content": words(rng, 30)}] for _ in range(n)], run)

    async def no_reuse(port: int, nonce: str, seed: str, run: Run) -> None:
        rng = random.Random(seed)
        await batched(port, [[{"role": "user", "content": f"{nonce} {i} " + words(rng, 300)}]
                             for i in range(n)], run)

    async def chat_under(port: int, system: str, seed: str, c: int, run: Run,
                         think_s: float = 0.0) -> None:
        """Conversation ``c`` under ``system``: ``turns`` turns, ``think_s`` apart."""
        rng = random.Random(f"{seed}-{c}")
        chat = [{"role": "system", "content": system}]
        for _ in range(turns):
            chat.append({"role": "user", "content": words(rng, 40)})
            await send(port, chat, run)
            chat.append({"role": "assistant", "content": words(rng, 2)})
            if think_s:
                await asyncio.sleep(think_s)

    async def shared_chats(port: int, nonce: str, seed: str, run: Run) -> None:
        system = f"{nonce} " + words(random.Random(seed), 400)  # one for every chat
        await asyncio.gather(*(chat_under(port, system, seed, c, run) for c in range(convs)))

    async def open_loop(port: int, prompts: list[list[dict[str, str]]], gaps: list[float],
                        run: Run) -> None:
        """Each prompt sent without waiting for the ones before, ``gaps`` s apart (the
        same gaps for every router: drawn from the round's seed)."""
        tasks = []
        for msgs, gap in zip(prompts, gaps, strict=True):
            tasks.append(asyncio.create_task(send(port, msgs, run)))
            await asyncio.sleep(gap)
        await asyncio.gather(*tasks)

    async def shared_system_arrivals(port: int, nonce: str, seed: str, run: Run) -> None:
        rng = random.Random(seed)
        system = f"{nonce} " + words(rng, 400)
        gaps = [rng.expovariate(ARRIVALS_PER_S) for _ in range(n)]
        await open_loop(port, [[{"role": "system", "content": system},
                                {"role": "user", "content": words(rng, 30)}] for _ in gaps],
                        gaps, run)

    async def shared_chats_arrivals(port: int, nonce: str, seed: str, run: Run) -> None:
        system = f"{nonce} " + words(random.Random(seed), 400)  # one for every chat
        starts = random.Random(f"{seed}-starts")
        tasks = []
        for c in range(convs):
            tasks.append(asyncio.create_task(chat_under(port, system, seed, c, run, THINK_S)))
            await asyncio.sleep(starts.expovariate(CHATS_PER_S))
        await asyncio.gather(*tasks)

    def doc_questions(nonce: str, rng: random.Random) -> list[list[dict[str, str]]]:
        docs = [f"{nonce} doc {d} " + words(rng, MANY_DOCS_WORDS) for d in range(MANY_DOCS)]
        return [[{"role": "system", "content": rng.choice(docs)},
                 {"role": "user", "content": words(rng, 20)}]
                for _ in range(MANY_DOCS_PER_REQUEST * n)]

    async def many_docs(port: int, nonce: str, seed: str, run: Run) -> None:
        await batched(port, doc_questions(nonce, random.Random(seed)), run)

    async def many_docs_arrivals(port: int, nonce: str, seed: str, run: Run) -> None:
        rng = random.Random(seed)
        prompts = doc_questions(nonce, rng)
        await open_loop(port, prompts, [rng.expovariate(DOCS_PER_S) for _ in prompts], run)

    out: dict[str, Workload] = {
        "multi-turn": multi_turn, "shared-system": shared_system, "no-reuse": no_reuse,
        "shared-chats": shared_chats, "shared-system-arrivals": shared_system_arrivals,
        "shared-chats-arrivals": shared_chats_arrivals, "many-docs": many_docs,
        "many-docs-arrivals": many_docs_arrivals}
    rows = replay_rows(n)
    if rows is None:
        return out

    async def mooncake_replay(port: int, nonce: str, seed: str, run: Run) -> None:
        blocks: dict[int, str] = {}  # a hash id's text: the same wherever the id recurs

        def text(ids: list[int]) -> str:
            for h in ids:
                if h not in blocks:
                    blocks[h] = words(random.Random(f"{seed}-{h}"), REPLAY_WORDS)
            return " ".join(blocks[h] for h in ids)

        loop = asyncio.get_running_loop()
        start, t0 = loop.time(), rows[0][0]
        tasks = []
        for ts, ids in rows:
            delay = (ts - t0) / REPLAY_SPEEDUP - (loop.time() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            msgs = [{"role": "user", "content": f"{nonce} {text(ids)}"}]
            tasks.append(asyncio.create_task(send(port, msgs, run)))
        await asyncio.gather(*tasks)

    out["mooncake-replay"] = mooncake_replay
    return out


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


def port_open(port: int) -> bool:
    """Something accepts connections on loopback ``port``."""
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
        return True
    return False


@contextlib.asynccontextmanager
async def fulcrum_router(
    ports: list[int], lean: bool = False, unary: bool = False,
    recompute_weight: float | None = None, http: bool = False,
) -> AsyncIterator[int]:
    """``fulcrum serve`` in its own process (not the load generator's loop), scraping the
    engines, every other setting the daemon's default (``gateway.cache`` on) (scrape every 1,000 ms,
    the KV size each engine's page reports; /metrics on a free port); a real Envoy in front
    (``lean``: the lean processing mode, request headers and buffered body only, release on
    stream close; ``unary``: ext_authz Check with the body, release by the gRPC access log;
    in both nothing is learnt from the response; ``http``: the unary mode with its ext_authz
    over plain HTTP/1.1 to ``gateway.authz_http_port``). ``recompute_weight``:
    ``gateway.cache.recompute_weight`` (None: the default)."""
    import yaml

    from fulcrum.gateway.testing import render_envoy_config, start_envoy, wait_for

    port, grpc_port, health_port, http_port = free_ports(4)
    cfg = {
        "server": {"host": "127.0.0.1", "port": grpc_port, "seed": 7},
        # /metrics on any free port: the default 9464 fails the start next to a running daemon
        "metrics": {"port": 0},
        "gateway": {
            "enabled": True, "port": port, "health_port": health_port,
            "pool": {"decode": [{"id": f"v{i}", "host": "127.0.0.1", "ports": [p]}
                                for i, p in enumerate(ports)]},
            "scrape": {"enabled": True},
        },
    }
    if recompute_weight is not None:
        cfg["gateway"]["cache"] = {"recompute_weight": recompute_weight}  # type: ignore[index]
    if http:
        cfg["gateway"]["authz_http_port"] = http_port  # type: ignore[index]
    tmp = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    (tmp / "fulcrum.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "fulcrum.cli", "serve", "--config",
                             str(tmp / "fulcrum.yaml")], stdout=subprocess.DEVNULL,
                            stderr=open(tmp / "fulcrum.log", "wb"))  # noqa: SIM115

    def listening() -> bool:
        assert proc.poll() is None, f"fulcrum exited: {tmp / 'fulcrum.log'}"
        return port_open(port)

    try:
        await wait_for(listening, tries=600, interval_s=0.1, what="fulcrum ext_proc port")
        env = await start_envoy(render_envoy_config(port, [*ports, *ports], lean=lean,
                                                    unary=unary,
                                                    http_authz_port=http_port if http else None),
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
async def fulcrum_gateway_command(ports: list[int]) -> AsyncIterator[int]:
    """``fulcrum gateway --worker-urls ...`` as a user runs it, every setting its default
    (the cache-aware pick, scraping, the HTTP Envoy mode; :mod:`fulcrum.gateway.launch`):
    the daemon in its own process, Envoy its child; both counted."""
    from fulcrum.gateway.testing import wait_for

    port, grpc_port = free_ports(2)
    tmp = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    log = open(tmp / "fulcrum-gateway.log", "wb")  # noqa: SIM115 - owned by the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "fulcrum.cli", "gateway", "--worker-urls",
         *[f"http://127.0.0.1:{p}" for p in ports], "--port", str(port), "--grpc-port",
         str(grpc_port), "--metrics-port", "0"], stdout=log, stderr=subprocess.STDOUT)
    log.close()

    def listening() -> bool:
        assert proc.poll() is None, f"fulcrum gateway exited: {tmp / 'fulcrum-gateway.log'}"
        return port_open(port)

    try:  # Envoy listens once the daemon is up: the launcher starts them in that order
        await wait_for(listening, tries=600, interval_s=0.1, what="fulcrum gateway's Envoy")
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        ROUTER_PIDS[:] = [proc.pid, *map(int, children)]
        yield port
    finally:
        ROUTER_PIDS.clear()
        proc.terminate()
        proc.wait(timeout=30)


@contextlib.asynccontextmanager
async def noop_unary(ports: list[int], http: bool = False) -> AsyncIterator[int]:
    """The unary Envoy mode in front of ``bench_gateway``'s no-op picker (round robin, no
    parsing, same grpc.aio + uvloop stack, its own process): what the Envoy and gRPC hop
    of the unary mode costs, without Fulcrum's pick. ``http``: the HTTP mode, the same
    no-op answering ext_authz over HTTP/1.1 from a bare asyncio protocol. Either way it
    reads the same gRPC access log as Fulcrum does."""
    from bench_gateway import noop_picker

    from fulcrum.gateway.testing import render_envoy_config, start_envoy

    (http_port,) = free_ports(1)
    with noop_picker(ports, http_port if http else None) as (port, pid):
        env = await start_envoy(
            render_envoy_config(port, [*ports, *ports], unary=not http,
                                http_authz_port=http_port if http else None),
            concurrency=1, log_level="error")
        ROUTER_PIDS[:] = [pid, env.proc.pid]
        try:
            yield env.port
        finally:
            ROUTER_PIDS.clear()
            env.stop()


@contextlib.asynccontextmanager
async def envoy_rr(ports: list[int]) -> AsyncIterator[int]:
    from fulcrum.gateway.testing import render_envoy_config, start_envoy

    if 4 % len(ports):  # the template's four upstream slots, each engine as often
        raise ValueError(f"Envoy round robin: 1, 2 or 4 engines, got {len(ports)}")
    text = render_envoy_config(9002, ports * (4 // len(ports)))
    start = text.index("                  # 2. Ask the picker.\n")
    end = text.index("                  - name: envoy.filters.http.router\n")
    env = await start_envoy(text[:start] + text[end:], concurrency=1, log_level="error")
    ROUTER_PIDS[:] = [env.proc.pid]
    try:
        yield env.port
    finally:
        ROUTER_PIDS.clear()
        env.stop()


def peer_router(
    binary: Path, policy: str, launch: tuple[str, ...] = ()
) -> Callable[[list[int]], contextlib.AbstractAsyncContextManager[int]]:
    """A peer router from PyPI (``smg launch`` or ``vllm-router``) with one ``--policy``,
    its other settings at their defaults."""

    @contextlib.asynccontextmanager
    async def start(ports: list[int]) -> AsyncIterator[int]:
        port = free_port()
        log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the router
        proc = subprocess.Popen(
            [str(binary), *launch, "--host", "127.0.0.1", "--port", str(port), "--policy",
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
                raise RuntimeError(f"{binary.name} {policy} did not come up")
            yield port
        finally:
            ROUTER_PIDS.clear()
            proc.terminate()
            proc.wait(timeout=30)

    return start


def engine_figures(ports: list[int]) -> np.ndarray:
    """Per engine (rows): prefix-cache hits, queries, finished requests, TTFT sum (s) and
    count, from each engine's own counters."""
    names = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
             "vllm:request_success_total", "vllm:time_to_first_token_seconds_sum",
             "vllm:time_to_first_token_seconds_count")
    return np.array([[metric_sum(p, n) for n in names] for p in ports])


async def bench(ports: list[int], quick: bool, only_routers: str = "",
                only_workloads: str = "", rounds: int = 1,
                size: tuple[int, int, int] | None = None) -> list[Run]:
    routers: dict[str, Callable[[list[int]], contextlib.AbstractAsyncContextManager[int]]] = {
        "Fulcrum (fulcrum gateway, its defaults)": fulcrum_gateway_command,
        "Fulcrum (gateway.cache)": fulcrum_router,
        "Fulcrum (gateway.cache, lean Envoy mode)": functools.partial(fulcrum_router, lean=True),
        "Fulcrum (gateway.cache, unary Envoy mode)": functools.partial(
            fulcrum_router, unary=True),
        "Fulcrum (gateway.cache, unary Envoy mode, least TTFT alone)": functools.partial(
            fulcrum_router, unary=True, recompute_weight=0.0),
        "Fulcrum (gateway.cache, HTTP Envoy mode)": functools.partial(fulcrum_router, http=True),
        "no-op picker (unary Envoy mode)": noop_unary,
        "no-op picker (HTTP Envoy mode)": functools.partial(noop_unary, http=True),
        "smg cache_aware": peer_router(PEERS, "cache_aware", ("launch",)),
        "smg round_robin": peer_router(PEERS, "round_robin", ("launch",)),
        "Envoy round robin": envoy_rr,
    }
    if VLLM_ROUTER.exists():  # a peer installed next to smg (older .venv-peers lack it)
        routers["vllm-router cache_aware"] = peer_router(VLLM_ROUTER, "cache_aware")
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
    session = time.time_ns()  # the rounds' text seeds: fresh per bench, shared in a round
    for rnd, (name, router) in [(i, pair) for i in range(rounds) for pair in chosen]:
        async with router(ports) as port:
            for wname, work in workloads(quick, size).items():
                if not wanted(wname, only_workloads):
                    continue
                run = Run(name, wname, round=rnd)
                f0 = engine_figures(ports)
                c0 = sum(cpu_s(p) for p in ROUTER_PIDS)
                t0 = time.perf_counter()
                await work(port, nonce(f"{name}-{wname}-{time.time_ns()}"),
                           f"{session}-{rnd}-{wname}", run)
                run.wall_s = time.perf_counter() - t0
                run.router_cpu_s = sum(cpu_s(p) for p in ROUTER_PIDS) - c0
                d = engine_figures(ports) - f0
                run.hit_ratio = d[:, 0].sum() / d[:, 1].sum() if d[:, 1].sum() else float("nan")
                run.per_engine = [round(x) for x in d[:, 2]]
                run.engine_ttft_ms = [1e3 * s / c if c else float("nan") for s, c in d[:, 3:]]
                runs.append(run)
                print(table([run]).splitlines()[-1], flush=True)
    return runs


def wanted(workload: str, only: str) -> bool:
    """Whether a run with ``--workloads only`` (comma-separated; "" = the default set)
    runs ``workload``: a named one always, an :data:`OPT_IN` one only when named."""
    if only:
        return workload in only.split(",")
    return workload not in OPT_IN


def balanced(per_engine: list[int], within: float = 0.10) -> bool:
    """Every engine's request count within ``within`` of the mean (issue 20's aim)."""
    mean = sum(per_engine) / max(len(per_engine), 1)
    return bool(per_engine) and all(abs(n - mean) <= within * mean for n in per_engine)


def pooled(runs: list[Run]) -> str:
    """One row per workload and router over every round: TTFT percentiles of all the
    requests together (one run's p99 of 32 requests is its maximum), hit ratio range,
    median wall time and router CPU per request."""
    out = ["| workload | router | runs | requests | hit ratio (min-max) | TTFT p50 (ms) | "
           "TTFT p90 (ms) | TTFT p99 (ms) | wall, median (s) | requests per engine (all "
           "rounds) | rounds within 10% | router CPU per request, median (ms) | errors |",
           "|---|---|---:|---:|---|---:|---:|---:|---:|---|---:|---:|---:|"]
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
                   f"{' / '.join(map(str, np.sum([r.per_engine for r in rs], axis=0)))} | "
                   f"{sum(balanced(r.per_engine) for r in rs)} | "
                   f"{float(np.median(cpu)):.2f} | {sum(r.errors for r in rs)} |")
    return "\n".join(out)


def paired(runs: list[Run], baseline: str = "Envoy round robin", aim: float = 1.05,
           seed: int = 20) -> str:
    """Wall time against ``baseline``'s in the same round, per workload and router: the
    median of the per-round ratios, a 90% bootstrap interval of that median (2,000
    resamples of the rounds, seeded) and the rounds at or under ``aim``. Pairing by round
    removes the drift of a shared machine between rounds, which an unpaired median of
    each router's walls keeps."""
    base = {(r.workload, r.round): r.wall_s for r in runs if r.router == baseline}
    groups: dict[tuple[str, str], list[float]] = {}
    for r in runs:
        b = base.get((r.workload, r.round))
        if r.router != baseline and b:
            groups.setdefault((r.workload, r.router), []).append(r.wall_s / b)
    rng = np.random.default_rng(seed)
    out = [f"| workload | router | rounds | wall / {baseline}'s, median of the rounds | "
           f"90% interval | rounds <= {aim:g}x |", "|---|---|---:|---:|---|---:|"]
    for (workload, router), ratios in sorted(groups.items()):
        x = np.array(ratios)
        boot = np.median(rng.choice(x, size=(2000, x.size)), axis=1)
        lo, hi = np.percentile(boot, [5, 95])
        out.append(f"| {workload} | {router} | {x.size} | {np.median(x):.3f} | "
                   f"{lo:.3f}-{hi:.3f} | {int((x <= aim).sum())} |")
    return "\n".join(out)


def save_rounds(runs: list[Run], path: Path, label: str) -> None:
    """Append every run's wall (s) to ``path``, one JSON line each: ``label`` (which bench
    run), ``round``, ``router``, ``workload``, ``wall_s``; :func:`load_rounds` reads them
    back for a :func:`paired` table over many runs."""
    with path.open("a") as fh:
        for r in runs:
            fh.write(json.dumps({"label": label, "round": r.round, "router": r.router,
                                 "workload": r.workload, "wall_s": r.wall_s}) + "\n")


def load_rounds(paths: list[Path]) -> list[Run]:
    """The rounds :func:`save_rounds` wrote, as runs whose ``round`` is unique per
    (file, label, round): rounds of different bench runs never pair with each other."""
    ids: dict[tuple[str, str, int], int] = {}
    out = []
    for path in paths:
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            d = json.loads(line)
            key = (str(path), str(d["label"]), int(d["round"]))
            rnd = ids.setdefault(key, len(ids))
            out.append(Run(str(d["router"]), str(d["workload"]), wall_s=float(d["wall_s"]),
                           round=rnd))
    return out


def table(runs: list[Run]) -> str:
    out = ["| workload | router | hit ratio | TTFT p50 (ms) | TTFT p99 (ms) | wall (s) | "
           "requests per engine | engines' own mean TTFT (ms) | router CPU per request (ms) "
           "| errors |",
           "|---|---|---:|---:|---:|---:|---|---|---:|---:|"]
    for r in runs:
        t = np.array([x for x in r.ttft_s if x == x]) * 1e3
        p50, p99 = (np.percentile(t, [50, 99]) if t.size else (float("nan"),) * 2)
        out.append(f"| {r.workload} | {r.router} | {r.hit_ratio:.3f} | {p50:.0f} | {p99:.0f} | "
                   f"{r.wall_s:.2f} | {' / '.join(map(str, r.per_engine))} | "
                   f"{' / '.join(f'{x:.0f}' for x in r.engine_ttft_ms)} | "
                   f"{1e3 * r.router_cpu_s / max(len(r.ttft_s), 1):.2f} | {r.errors} |")
    return "\n".join(out)


def _decode_pool(engines: int) -> tuple[Any, Any]:
    """A decode table and its gateway adapter over ``engines`` endpoints (8 DP ranks per
    engine, the last engine fewer), as the daemon builds them for a static pool."""
    from fulcrum.config.decode import DecodeSettings
    from fulcrum.config.server import FleetSettings
    from fulcrum.core.types import DecodeInstanceShape, MemberKind
    from fulcrum.gateway.adapter import DecodeAdapter
    from fulcrum.state.decode import DecodeState
    from fulcrum.state.fleet import Fleet

    fleet = Fleet(FleetSettings(heartbeat_timeout_ms=3_600_000))
    state = DecodeState(DecodeSettings(), np.random.default_rng(0))
    fleet.add_listener(MemberKind.DECODE_INSTANCE, state)
    addresses = {}
    for i, start in enumerate(range(0, engines, 8)):
        ranks = min(8, engines - start)
        fleet.register(f"e{i}", DecodeInstanceShape((256,) * ranks, (10**6,) * ranks), 0)
        for g in range(ranks):
            addresses[(f"e{i}", g)] = f"10.{i // 250}.{i % 250}.1:{8000 + g}"
    return state, DecodeAdapter(state, addresses)


#: The pick micro-benchmark's sizes: (endpoints, indexed blocks each, picks). The first is
#: issue 20's aim (under 1 ms); the second a pool at the configured bound's scale.
PICK_SIZES = ((64, 20_000, 2000), (4096, 200, 500))


def pick_micro(engines: int = 64, blocks: int = 20_000, picks: int = 2000) -> str:
    """Time of one cache-aware decision (CachePicker.choose, the decode table's pinned
    placement, CachePicker.placed) with ``engines`` endpoints of a real decode table
    whose indexes hold ``blocks`` blocks each; a 3,000-token chat prompt.

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
    state, adapter = _decode_pool(engines)
    cp = CachePicker(CacheSettings(enabled=True, index_blocks=blocks), 4.0, adapter)
    rng = random.Random(5)
    texts = [words(rng, 2500) for _ in range(64)]
    for address in adapter.candidates(1)[1]:  # fill every index to its bound
        slot = cp._slot(address)
        for j in range(blocks // 100 + 1):
            cp.index.record(slot, [hash((slot, j, k)) for k in range(100)])
    gc_after = full_gc_ms()
    shape_of = [RequestShape(3000, 8, True, text=t) for t in texts]
    wall, cpu = [], []
    for i in range(picks):
        t0, c0 = time.perf_counter(), time.thread_time()
        choice = cp.choose(adapter, shape_of[i % len(texts)], None, i * 1000)
        assert choice is not None
        adapter.place(f"r{i}", 3008, i * 1000, pin=choice.slot)
        cp.placed(f"r{i}", choice, 3000, i * 1000)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        state.release(f"r{i}", i * 1000)
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

    out = [pick_micro(*size) for size in PICK_SIZES]
    if quick or vllm_python() is None or not PEERS.exists():
        out.append("(real-engine table skipped: --quick, or no .venv-vllm / .venv-peers)")
        return "\n\n".join(out)
    fleet = VllmFleet(make_model(Path(tempfile.mkdtemp(prefix="tiny-moe-"))), n=2,
                      pin_processes=True, nice=10)
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
    ap.add_argument("--size", default="", help="conversations,turns,requests: the "
                    "multi-turn workload's conversations and turns, and the other "
                    "workloads' requests (default 8,4,24)")
    ap.add_argument("--engines", type=int, default=2, help="how many engines the bench "
                    "starts (one core each, in turn)")
    ap.add_argument("--kv-blocks", type=int, default=0, help="the bench's own engines "
                    "get this many KV blocks of 32 tokens each (vLLM's "
                    "--num-gpu-blocks-override; default: 1 GiB, about 2 million tokens)")
    ap.add_argument("--save", default="", help="append every round's walls to this JSON "
                    "lines file (labelled with the start time)")
    ap.add_argument("--pool", default="", help="no bench: the paired table over the rounds "
                    "saved in these files (comma-separated)")
    args = ap.parse_args()
    if args.pool:
        print(paired(load_rounds([Path(p) for p in args.pool.split(",")])))
        return
    size = tuple(int(x) for x in args.size.split(",")) if args.size else None
    if size is not None and (len(size) != 3 or min(size) < 1):
        ap.error("--size: three positive integers, conversations,turns,requests")
    if args.engines < 1 or args.kv_blocks < 0:
        ap.error("--engines: at least 1; --kv-blocks: 0 (vLLM's own) or more")
    if args.pick:
        for size in PICK_SIZES:
            print(pick_micro(*size))
        return
    fleet = None
    if args.ports:
        ports = [int(p) for p in args.ports.split(",")]
    else:
        blocks = ["--num-gpu-blocks-override", str(args.kv_blocks)] if args.kv_blocks else []
        fleet = VllmFleet(make_model(Path(tempfile.mkdtemp(prefix="tiny-moe-"))),
                          n=args.engines, pin_processes=True, nice=10,
                          extra_args=lambda i, port: blocks)
        fleet.start()
        fleet.wait_ready(600)
        ports = fleet.ports
    try:
        runs = asyncio.run(bench(ports, args.quick, args.routers, args.workloads,
                                 args.rounds, size))
    finally:
        if fleet is not None:
            fleet.stop()
    if args.save:
        save_rounds(runs, Path(args.save), time.strftime("%Y-%m-%dT%H:%M:%S"))
    print(table(sorted(runs, key=lambda r: r.workload)))
    if args.rounds > 1:
        print()
        print(pooled(runs))
        print()
        print(paired(runs))


if __name__ == "__main__":
    main()
