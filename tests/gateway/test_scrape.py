"""Scraping engines' Prometheus endpoints corrects the decode view (vLLM, SGLang)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fulcrum.gateway.scrape import RankLoad, parse_metrics
from fulcrum.state.decode import DecodeState
from fulcrum.testing import running_server

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


@contextlib.asynccontextmanager
async def metrics_server(text: str) -> AsyncIterator[int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        body = text.encode()
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
