"""Correct the decode view from the engines' own Prometheus metrics (vLLM, SGLang).

After every pause of ``gateway.scrape.interval_ms`` the scraper fetches
``http://host:port/metrics`` of every DP rank of every pool engine (over one kept-alive
HTTP/1.1 connection per rank) and parses it with prometheus_client's parser, both in a
worker thread (never on the event loop), engine after engine. Each engine's figures
come back to the loop as they come, where an engine whose ranks all answered gets a
heartbeat on its behalf with, per rank:

- requests = running + waiting (``vllm:num_requests_running`` +
  ``vllm:num_requests_waiting``; SGLang ``sglang:num_running_reqs`` +
  ``sglang:num_queue_reqs``), summed over the samples of the page;
- KV tokens = KV cache usage (``vllm:kv_cache_usage_perc``, older
  ``vllm:gpu_cache_usage_perc``, SGLang ``sglang:token_usage``; a fraction in [0, 1])
  times the rank's configured ``max_kv_tokens``;
- the process's start time (``process_start_time_seconds``, prometheus_client's own):
  when it changes, the engine restarted and its prefix cache is empty
  (:meth:`fulcrum.gateway.cache_pick.CachePicker.scraped`).

The report replaces the rank's figures in the decode view like an engine's own heartbeat
(placements made since are the engine's to count from then on; releases lower the view).
"""

from __future__ import annotations

import asyncio
import functools
import http.client
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final

import structlog
from prometheus_client.parser import text_string_to_metric_families

from fulcrum.config.gateway import GatewaySettings, PoolEngine
from fulcrum.core.types import DecodeInstanceLoad
from fulcrum.gateway import metrics as gm
from fulcrum.gateway.pool import StaticPool

log = structlog.get_logger(__name__)

RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
#: vLLM's info gauge whose labels give the KV cache size (num_gpu_blocks x block_size).
CACHE_INFO = "vllm:cache_config_info"
#: prometheus_client's process collector: the engine process's start (s since the epoch).
STARTED = "process_start_time_seconds"
_KIND_PREFIX = {"vllm": "vllm:", "sglang": "sglang:", "auto": ""}
#: Worker threads fetching and parsing pages. The parse holds the GIL (about 1 ms of CPU
#: per vLLM page), and the event loop waits for it behind every busy thread: at 1,024
#: ranks, pick p99 27 ms with 4 threads, 12 ms with 2, 6 ms with 1 (BENCHMARKS.md, "The
#: cache-aware pick against the pool's size"). One: engine after engine.
SCRAPE_THREADS: Final = 1
#: Largest metrics page read, bytes (a vLLM page is ~100 KiB).
MAX_PAGE_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class RankLoad:
    """One rank's figures: requests running and waiting, KV usage fraction."""

    running: int
    waiting: int
    kv_usage: float
    #: KV cache capacity the engine reports (tokens; 0 when the page does not say).
    kv_capacity_tokens: int = 0
    #: The engine process's start time (s since the epoch; 0 when the page does not say).
    started_s: float = 0.0


def _capacity(labels: dict[str, str]) -> int:
    try:
        return max(0, int(labels["num_gpu_blocks"]) * int(labels["block_size"]))
    except (KeyError, ValueError):
        return 0


#: The families read from a page (every other line is dropped before parsing).
WANTED: tuple[str, ...] = (*RUNNING, *WAITING, *KV_USAGE, CACHE_INFO, STARTED)


def wanted_lines(text: str) -> str:
    """The lines of ``text`` (an exposition page) that belong to the :data:`WANTED`
    families: their samples and their ``# HELP`` / ``# TYPE`` lines. A vLLM page is
    mostly histograms nobody here reads; parsing only these lines costs a few percent of
    parsing the page (a 130 KiB page: 25 ms -> about 1 ms)."""
    keep = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) >= 3 and parts[2] in WANTED:
                keep.append(line)
        elif line.startswith(WANTED) and _name(line) in WANTED:
            keep.append(line)
    return "\n".join(keep) + "\n"


def _name(line: str) -> str:
    """The metric name a sample line starts with (up to ``{`` or a space)."""
    return line.split("{", 1)[0].split(" ", 1)[0]


@functools.lru_cache(maxsize=1024)
def _capacity_text(lines: str) -> int:
    """The KV capacity (tokens; 0: none) the :data:`CACHE_INFO` sample ``lines`` say,
    remembered by their exact text: an info gauge of the engine's configuration, the
    same on every scrape and every rank of a model, whose thousand characters of labels
    were 90% of a page's parse (0.6 ms)."""
    got = 0
    for family in text_string_to_metric_families(lines + "\n"):
        if family.name == CACHE_INFO:
            got = max((_capacity(x.labels) for x in family.samples), default=0)
    return got


def parse_metrics(text: str, kind: str = "auto") -> RankLoad | None:
    """Figures of one engine metrics page; None when it has none of the known gauges."""
    prefix = _KIND_PREFIX[kind]
    sums: dict[str, float] = {}
    started = 0.0
    kept = wanted_lines(text).splitlines()
    info = [x for x in kept if x.startswith(CACHE_INFO) and _name(x) == CACHE_INFO]
    capacity = _capacity_text("\n".join(info)) if info else 0
    rest = "\n".join(x for x in kept if not x.startswith(CACHE_INFO)) + "\n"
    for family in text_string_to_metric_families(rest):
        name = family.name
        if name == STARTED:
            started = max((float(x.value) for x in family.samples), default=0.0)
            continue
        if name not in RUNNING and name not in WAITING and name not in KV_USAGE:
            continue
        if prefix and not name.startswith(prefix):
            continue
        for sample in family.samples:
            if sample.name == name:
                sums[name] = sums.get(name, 0.0) + float(sample.value)
    if not sums:
        return None

    def first(names: tuple[str, ...]) -> float:
        for n in names:
            if n in sums:
                return sums[n]
        return 0.0

    running = max(0, round(first(RUNNING)))
    waiting = max(0, round(first(WAITING)))
    usage = min(max(first(KV_USAGE), 0.0), 1.0)
    return RankLoad(running, waiting, usage, capacity,
                    started if math.isfinite(started) and started > 0 else 0.0)


class Connections:
    """Keep-alive HTTP/1.1 connections to the engines' metrics ports, one per
    ``(host, port)``: a scrape every 250 ms of every rank would otherwise open (and leave
    in TIME_WAIT) a TCP connection per page. Used from the scrape's worker threads; an
    address is fetched by one thread at a time (one round at a time, an engine's ranks in
    turn), and a connection is taken out of the table while in use."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], http.client.HTTPConnection] = {}

    def fetch(self, host: str, port: int, path: str, timeout_s: float) -> str:
        """GET ``path``: the page's text (at most :data:`MAX_PAGE_BYTES`). A kept
        connection the engine has closed is replaced once (not one that timed out); any
        other failure raises (OSError, http.client.HTTPException, or ValueError for a
        status other than 200)."""
        key = (host, port)
        conn = self._idle.pop(key, None)
        if conn is not None:
            try:
                return self._get(key, conn, path, timeout_s)
            except (ConnectionError, http.client.BadStatusLine):
                pass  # closed by the engine since the last round: once more, anew
        return self._get(key, http.client.HTTPConnection(host, port, timeout=timeout_s),
                         path, timeout_s)

    def _get(self, key: tuple[str, int], conn: http.client.HTTPConnection, path: str,
             timeout_s: float) -> str:
        try:
            if conn.sock is not None:
                conn.sock.settimeout(timeout_s)
            conn.request("GET", path, headers={"Accept": "text/plain"})
            resp = conn.getresponse()
            data: bytes = resp.read(MAX_PAGE_BYTES)
        except BaseException:
            conn.close()
            raise
        if resp.status != 200:
            conn.close()
            raise ValueError(f"metrics page answered {resp.status}")
        if resp.isclosed() and not resp.will_close:
            self._idle[key] = conn  # read to its end: reusable
        else:
            conn.close()  # the engine closes it, or a page over the bound was cut short
        return data.decode("utf-8", "replace")

    def close(self) -> None:
        while self._idle:
            self._idle.popitem()[1].close()


def scrape_engine(engine: PoolEngine, timeout_s: float, kind: str,
                  conns: Connections | None = None) -> list[RankLoad] | None:
    """All ranks of one engine (worker thread); None when any rank fails. ``conns``: the
    scraper's kept connections (None: one connection per page)."""
    out = []
    pages = conns if conns is not None else Connections()
    try:
        for port in engine.ports:
            try:
                load = parse_metrics(
                    pages.fetch(engine.host, port, engine.metrics_path, timeout_s), kind
                )
            except Exception:
                return None
            if load is None:
                return None
            out.append(load)
    finally:
        if conns is None:
            pages.close()
    return out


def to_load(engine: PoolEngine, ranks: list[RankLoad]) -> DecodeInstanceLoad:
    """The heartbeat load of an engine from its ranks' figures."""
    return DecodeInstanceLoad(
        concurrency=tuple(min(r.running + r.waiting, (1 << 20) - 1) for r in ranks),
        kv_tokens=tuple(round(r.kv_usage * engine.max_kv_tokens) for r in ranks),
    )


class Scraper:
    """Periodic scrape of the pool (fetch + parse in threads, apply on the loop)."""

    def __init__(
        self, settings: GatewaySettings, pool: StaticPool, clock: Callable[[], int]
    ) -> None:
        self._settings = settings
        self._pool = pool
        self._clock = clock
        self._executor = ThreadPoolExecutor(SCRAPE_THREADS, thread_name_prefix="gw-scrape")
        self._conns = Connections()
        self.rounds = 0

    def apply_settings(self, settings: GatewaySettings) -> None:
        self._settings = settings

    async def scrape_once(self) -> None:
        """One round: every engine once, fetched and parsed in the worker threads (one
        engine per thread at a time), each engine's figures applied on the loop as they
        come: O(its ranks) at a time, where applying the whole pool at the end of the
        round held the loop for 30-80 ms at 4,096 ranks."""
        loop = asyncio.get_running_loop()
        s = self._settings
        timeout = s.scrape.timeout_ms / 1000
        engines = iter(self._pool.engines)

        async def worker() -> None:
            for engine in engines:  # shared: each engine goes to one worker
                ranks = await loop.run_in_executor(
                    self._executor, scrape_engine, engine, timeout, s.engine_kind, self._conns
                )
                self._apply(engine, ranks)

        await asyncio.gather(*(worker() for _ in range(SCRAPE_THREADS)))
        self.rounds += 1

    def _apply(self, engine: PoolEngine, ranks: list[RankLoad] | None) -> None:
        """One engine's figures (None: a rank failed) into the pool and the listeners."""
        if ranks is None:
            gm.SCRAPES.labels("error").inc()
            return
        gm.SCRAPES.labels("ok").inc()
        now = self._clock()
        self._pool.report(engine.id, to_load(engine, ranks), now)
        self._tell(engine, ranks, now)

    def _tell(self, engine: PoolEngine, ranks: list[RankLoad], now_ns: int) -> None:
        """Hand each rank's queue depth, KV capacity and process start, seen at
        ``now_ns``, to the adapter's listeners."""
        adapter = self._pool.adapter
        listeners = [] if adapter is None else adapter.scrape_listeners
        if listeners:
            for address, r in zip(engine.addresses(), ranks, strict=True):
                for fn in listeners:
                    fn(address, r.waiting, r.kv_capacity_tokens, now_ns, r.started_s)

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(self._settings.scrape.interval_ms / 1000)
                try:
                    await self.scrape_once()
                except Exception:
                    log.exception("gateway_scrape_failed")
        finally:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._conns.close()
