"""Scraping engines' Prometheus endpoints corrects the decode view (vLLM, SGLang)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fulcrum.gateway import scrape
from fulcrum.gateway.scrape import RankLoad, parse_metrics
from fulcrum.state.decode import DecodeState
from fulcrum.testing import running_server
from tests.polling import until

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 12345.0
"""
SGLANG = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 7
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 1
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.5
"""


def test_parse_vllm_and_sglang() -> None:
    assert parse_metrics(VLLM) == RankLoad(3, 2, 0.25)
    assert parse_metrics(SGLANG) == RankLoad(7, 1, 0.5)
    assert parse_metrics(SGLANG, "vllm") is None
    assert parse_metrics("# nothing\nother_metric 1\n") is None
    old = VLLM.replace("kv_cache_usage_perc", "gpu_cache_usage_perc")
    assert parse_metrics(old) == RankLoad(3, 2, 0.25)
    started = VLLM + STARTED.format(1.7966e9)
    assert parse_metrics(started) == RankLoad(3, 2, 0.25, 0, 1.7966e9)
    assert parse_metrics(VLLM + STARTED.format("NaN")) == RankLoad(3, 2, 0.25)


#: prometheus_client's process collector, as vLLM's page has it (s since the epoch).
STARTED = """# HELP process_start_time_seconds Start time of the process since unix epoch.
# TYPE process_start_time_seconds gauge
process_start_time_seconds {}
"""


@contextlib.asynccontextmanager
async def metrics_server(
    text: str | list[str], go: asyncio.Event | None = None
) -> AsyncIterator[int]:
    """A metrics page on loopback; a list holds one page that the caller may replace.
    ``go``: the page is answered only once it is set (a slow engine)."""
    page = text if isinstance(text, list) else [text]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if go is not None:
            await go.wait()
        body = page[0].encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nconnection: close\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        if go is not None:
            go.set()
        server.close()


async def test_scrape_replaces_the_ranks_figures_and_skips_a_failed_engine() -> None:
    async with metrics_server(VLLM) as p0, metrics_server(SGLANG) as p1:
        ov = {
            "gateway": {
                "enabled": True,
                "port": 0,
                "health_port": 0,
                "scrape": {"enabled": True, "interval_ms": 600_000, "timeout_ms": 2000},
                "pool": {
                    "decode": [
                        {"id": "a", "host": "127.0.0.1", "ports": [p0, p1], "max_kv_tokens": 1000},
                        {"id": "b", "host": "127.0.0.1", "ports": [1], "max_kv_tokens": 1000},
                    ]
                },
            }
        }
        async with running_server(ov) as d:
            state: DecodeState = d.app.components["decode"]
            scraper = d.gateway.scraper
            assert scraper is not None
            await scraper.scrape_once()  # the periodic task does the same every interval
            assert state.gpu_load("a", 0) == (5, 250)
            assert state.gpu_load("a", 1) == (8, 500)
            assert state.gpu_load("b", 0) == (0, 0)  # port 1 refuses: no report applied


async def test_each_engines_figures_apply_as_they_come_not_at_the_rounds_end() -> None:
    """A slow engine does not hold back the others' figures: each engine's report is
    applied on the loop when its pages are read, while the round goes on (applying the
    whole pool at the round's end held the loop 30-80 ms at 4,096 ranks)."""
    go = asyncio.Event()
    async with metrics_server(VLLM) as fast, metrics_server(VLLM, go) as slow:
        engines = [{"id": "a", "host": "127.0.0.1", "ports": [fast], "max_kv_tokens": 1000},
                   {"id": "b", "host": "127.0.0.1", "ports": [slow], "max_kv_tokens": 1000}]
        ov = {"gateway": {"enabled": True, "port": 0, "health_port": 0,
                          "scrape": {"enabled": True, "interval_ms": 600_000,
                                     "timeout_ms": 10_000},
                          "pool": {"decode": engines}}}
        async with running_server(ov) as d:
            state: DecodeState = d.app.components["decode"]
            scraper = d.gateway.scraper
            assert scraper is not None
            rounds = scraper.rounds
            task = asyncio.ensure_future(scraper.scrape_once())
            await until(lambda: state.gpu_load("a", 0) == (5, 250), "engine a applied")
            assert not task.done() and scraper.rounds == rounds  # b still being read
            assert state.gpu_load("b", 0) == (0, 0)
            go.set()
            await task
            assert state.gpu_load("b", 0) == (5, 250)
            assert scraper.rounds == rounds + 1


async def test_an_engine_seen_restarted_has_its_prefix_index_cleared() -> None:
    """The scrape reads the engine's process start (``process_start_time_seconds``): a
    change between two pages is a restart, whose prefix cache is empty, so the picker
    forgets what it routed there (one counter, one log line); the same start, or a
    page without one, changes nothing. Through the daemon's own scraper."""
    from fulcrum.gateway import pick_metrics as pm

    page = [VLLM + STARTED.format(1000.0)]
    async with metrics_server(page) as p0:
        ov = {
            "gateway": {
                "enabled": True, "port": 0, "health_port": 0,
                "cache": {"enabled": True},
                "scrape": {"enabled": True, "interval_ms": 600_000, "timeout_ms": 2000},
                "pool": {"decode": [{"id": "a", "host": "127.0.0.1", "ports": [p0],
                                     "max_kv_tokens": 1000}]},
            }
        }
        async with running_server(ov) as d:
            cache = d.gateway.picker.cache
            assert cache is not None
            scraper = d.gateway.scraper
            assert scraper is not None
            await scraper.scrape_once()
            slot = cache._slots[f"127.0.0.1:{p0}"]
            cache.index.record(slot, [11, 12, 13])
            before = pm.ENGINE_RESTARTS._value.get()
            await scraper.scrape_once()  # the same process
            page[0] = VLLM  # a page without the start: unknown, not a restart
            await scraper.scrape_once()
            assert cache.index.held(slot) == 3
            page[0] = VLLM + STARTED.format(2000.0)
            await scraper.scrape_once()
            assert cache.index.held(slot) == 0
            assert pm.ENGINE_RESTARTS._value.get() == before + 1


# Families a page may hold: the wanted gauges, look-alikes whose names start with a
# wanted name, an info gauge, histograms and counters (the bulk of a vLLM page).
_FAMILIES = [
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{engine="0"} 3.0\nvllm:num_requests_running{engine="1"} 1.0\n',
    "# TYPE vllm:num_requests_running_max gauge\nvllm:num_requests_running_max 9.0\n",
    "# HELP vllm:num_requests_waiting waiting\n# TYPE vllm:num_requests_waiting gauge\n"
    "vllm:num_requests_waiting 2.0\n",
    "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.5\n",
    "# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc 0.75\n",
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="32",num_gpu_blocks="100"} 1.0\n',
    "# TYPE vllm:e2e_request_latency_seconds histogram\n"
    'vllm:e2e_request_latency_seconds_bucket{le="0.1"} 1.0\n'
    'vllm:e2e_request_latency_seconds_bucket{le="+Inf"} 2.0\n'
    "vllm:e2e_request_latency_seconds_count 2.0\nvllm:e2e_request_latency_seconds_sum 0.3\n",
    "# TYPE vllm:prompt_tokens counter\nvllm:prompt_tokens_total 12.0\n",
    "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 7\n",
    "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds 1.5e9\n",
]


def test_the_kv_capacity_follows_the_info_lines_text() -> None:
    """The capacity info line is parsed once per distinct text (it is a thousand
    characters of labels on vLLM 0.32, the same on every scrape): a page whose line
    changed (a restarted engine with another cache) gives the new capacity."""
    head = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n"
    info = 'vllm:cache_config_info{{block_size="32",num_gpu_blocks="{}"}} 1.0\n'
    for blocks in (100, 200, 100, 7):
        got = parse_metrics(head + info.format(blocks))
        assert got is not None
        assert got.kv_capacity_tokens == 32 * blocks


@given(st.lists(st.sampled_from(range(len(_FAMILIES))), unique=True),
       st.sampled_from(["auto", "vllm", "sglang"]))
def test_parsing_only_the_wanted_lines_reads_what_the_whole_page_says(
    order: list[int], kind: str
) -> None:
    page = "".join(_FAMILIES[i] for i in order)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scrape, "wanted_lines", lambda text: text)
        whole = parse_metrics(page, kind)
    assert parse_metrics(page, kind) == whole
    kept = scrape.wanted_lines(page)
    assert "latency" not in kept and "prompt_tokens" not in kept and "_max" not in kept


@contextlib.asynccontextmanager
async def keepalive_server(text: str, drop_idle: list[bool]) -> AsyncIterator[list[int]]:
    """A metrics page over HTTP/1.1 keep-alive; yields the list of connections accepted
    (one int per connection). While ``drop_idle[0]`` is true, it closes a connection
    after each answer without saying so (as an engine restarting or timing out idle
    connections does)."""
    accepted: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        body = text.encode()
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n"
                             + f"content-length: {len(body)}\r\n\r\n".encode() + body)
                await writer.drain()
                if drop_idle[0]:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    accepted.insert(0, server.sockets[0].getsockname()[1])  # [port, 1, 1, ...]
    try:
        yield accepted
    finally:
        server.close()


async def test_scrape_keeps_one_connection_per_rank_and_replaces_a_dropped_one() -> None:
    drop = [False]
    async with keepalive_server(VLLM, drop) as seen:
        port = seen[0]
        ov = {
            "gateway": {
                "enabled": True, "port": 0, "health_port": 0,
                "scrape": {"enabled": True, "interval_ms": 600_000, "timeout_ms": 2000},
                "pool": {"decode": [{"id": "a", "host": "127.0.0.1", "ports": [port],
                                     "max_kv_tokens": 1000}]},
            }
        }
        async with running_server(ov) as d:
            state: DecodeState = d.app.components["decode"]
            scraper = d.gateway.scraper
            assert scraper is not None
            for _ in range(3):
                await scraper.scrape_once()
            assert len(seen) - 1 == 1  # three rounds, one TCP connection
            assert state.gpu_load("a", 0) == (5, 250)
            drop[0] = True  # the engine now closes after each answer, unannounced
            await scraper.scrape_once()  # the kept one still works this time
            errors = scrape_errors()
            for _ in range(2):
                await scraper.scrape_once()  # the kept one is gone: a new one, no error
            assert scrape_errors() == errors
            assert len(seen) - 1 == 3
            assert scraper.rounds == 6


def scrape_errors() -> float:
    from fulcrum.metrics import REGISTRY

    return REGISTRY.get_sample_value("fulcrum_gateway_scrapes_total", {"outcome": "error"}) or 0.0
