"""Fixtures: real vLLM engines (the session's two, started once in parallel, and a
module's one with a small KV cache). Tests that need them skip only when the vLLM venv is
absent, and fail instead under CI=true."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.engines.vllm_fleet import (
    VllmFleet,
    free_port_below_ephemeral,
    kv_events_args,
    make_model,
    vllm_python,
)

#: Where the session's engines send their KV events (the gateway binds it in
#: test_vllm_kv_events; until then the engines' PUB sockets retry and drop). Below the
#: ephemeral range: a retry there could self-connect and hold the port (a CI failure,
#: "address already in use"). The start varies by process so parallel runs differ.
KV_PORT = free_port_below_ephemeral(os.getpid() * 7919)

#: KV cache of the small-cache engine, blocks (of ``vllm_fleet.BLOCK_SIZE`` tokens).
SMALL_CACHE_BLOCKS = 48


@contextlib.contextmanager
def _running(tmp: pytest.TempPathFactory, n: int,
             extra_args: Callable[[int, int], list[str]]) -> Iterator[VllmFleet]:
    """``n`` engines of a fresh tiny model, ready; stopped on exit. Skips without the vLLM
    venv, fails under CI=true."""
    if vllm_python() is None:
        msg = "vLLM venv absent: run tests/engines/install_vllm.sh"
        if os.environ.get("CI") == "true":
            pytest.fail(msg + " (a skip in CI is a failure)")
        pytest.skip(msg)
    fleet = VllmFleet(make_model(Path(tmp.mktemp("tiny-moe"))), n=n, extra_args=extra_args)
    fleet.start()
    try:
        fleet.wait_ready()
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture(scope="session")
def vllm_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFleet]:
    with _running(tmp_path_factory, 2, kv_events_args(KV_PORT)) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def small_cache_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int]]:
    """(port, cache blocks) of one engine whose KV cache holds ``SMALL_CACHE_BLOCKS``."""
    args = ["--num-gpu-blocks-override", str(SMALL_CACHE_BLOCKS), "--max-model-len", "1024"]
    with _running(tmp_path_factory, 1, lambda _i, _p: args) as fleet:
        yield fleet.ports[0], SMALL_CACHE_BLOCKS
