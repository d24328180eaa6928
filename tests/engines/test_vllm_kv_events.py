"""Exact mode on REAL engines: vLLM 0.32 CPU engines started with ``--kv-events-config``
(enable_kv_cache_events, zmq, a non-wildcard endpoint: the engine connects; topic = its
address) send BlockStored batches to the gateway's bound subscriber."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest

from fulcrum.config import with_overrides
from fulcrum.gateway import pick_metrics as pm
from fulcrum.testing import running_server
from fulcrum.testing import test_settings as base_settings
from tests.engines.conftest import KV_PORT
from tests.engines.test_vllm_cache_e2e import gateway_settings
from tests.engines.vllm_fleet import MODEL_NAME, VllmFleet

pytestmark = pytest.mark.timeout(600)


def complete(port: int, prompt: str) -> None:
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2}).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", body, {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200


async def test_engines_kv_events_reach_the_gateway(vllm_fleet: VllmFleet) -> None:
    ports = vllm_fleet.ports
    gw = gateway_settings(ports)
    gw["cache"] = {"enabled": True,
                   "kv_events": {"enabled": True, "endpoint": f"tcp://127.0.0.1:{KV_PORT}"}}
    settings = with_overrides(base_settings(), {"gateway": gw})
    async with running_server(settings=settings) as daemon:
        g = daemon.gateway
        assert g is not None and g.picker.cache is not None
        sink = g.picker.cache.kv
        assert sink is not None and g.kv_endpoint == f"tcp://127.0.0.1:{KV_PORT}"
        topics = [f"127.0.0.1:{p}" for p in ports]

        async def stored_everywhere(rnd: int) -> bool:
            # Each round a prompt of > 3 blocks per engine that no earlier round sent (a
            # repeated prompt hits the engine's cache and stores no block, so it sends no
            # event); the engine's PUB socket reconnects to the bound subscriber on its own,
            # batches before that are lost.
            for i, p in enumerate(ports):
                await asyncio.to_thread(complete, p, f"kv round {rnd} engine {i} " + "w " * 200)
            return all(t in sink.engines and sink.engines[t].stored > 0 for t in topics)

        # Bounded by time, not by a count of rounds: a round takes ~0.1 s on an idle
        # machine, and a count of rounds that fitted there (20) ran out on a loaded CI
        # machine before one engine's PUB socket had reconnected and taken the
        # subscription (one engine had delivered one batch, the other none).
        start = time.monotonic()
        rnd = 0
        while not await stored_everywhere(rnd) and time.monotonic() - start < 120.0:
            rnd += 1
        waited = f"{rnd + 1} rounds in {time.monotonic() - start:.1f} s"
        assert all(t in sink.engines for t in topics), (waited, topics, sink.engines)
        assert all(sink.engines[t].stored > 0 for t in topics), sink.engines
        assert not any(e.degraded for e in sink.engines.values())
        assert pm.KV_EVENT_SENDERS.labels("reporting")._value.get() == len(ports)
