"""The lean processing mode through a REAL Envoy (issue 20 item 3): two ext_proc messages
per request (the headers, answered at once, and the buffered body; trailers and the whole
response skipped),
the pick rides on the body answer, and the placement is held until Envoy closes the
stream at the end of the HTTP stream (release on stream close)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2

from fulcrum.gateway import extproc
from fulcrum.gateway.testing import LEAN_HEADERS, LEAN_MODE, HttpClient, render_envoy_config
from tests.gateway.helpers import gateway_stack
from tests.gateway.test_envoy_e2e import completion, hold

pytestmark = pytest.mark.timeout(120)


def test_lean_config_sets_every_mode() -> None:
    cfg = render_envoy_config(9002, [1, 2, 3, 4], lean=True)
    for key, value in LEAN_MODE.items():
        assert f"{key}: {value}" in cfg


async def test_lean_mode_holds_until_the_response_ends_then_releases_on_close() -> None:
    async with gateway_stack(lean=True) as st:
        c = await hold(st, "lean", completion(4000, 100))
        request_id, placement = st.picks[-1]
        u = st.upstream(placement.address)
        where = [x.port for x in st.ups if "lean" in x.held_now]
        assert "lean" in u.held_now, (placement.address, where, st.picks)
        # The response is open upstream: the placement is still held.
        assert st.decode.gpu_load(*placement.gpu) == (1, 1000 + 100)
        assert not any(r == request_id for r, _ in st.releases)
        u.release_hold("lean")
        r = await c.receive()
        assert r.status == 200
        await c.close()
        assert await st.wait_released(request_id) == "stream_closed"
        assert st.decode.held == 0 and st.gateway.picker.in_flight == 0


async def test_lean_mode_releases_when_the_client_disconnects() -> None:
    async with gateway_stack(lean=True) as st:
        c = await hold(st, "gone", completion(4000))
        request_id, _placement = st.picks[-1]
        c.abort()
        assert await st.wait_released(request_id) == "stream_closed"
        assert st.decode.held == 0


async def test_lean_mode_forwards_only_the_path_and_the_tenancy_headers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Envoy's forward_rules: the picker gets :path and the tenancy headers, nothing else
    # (fewer bytes per message on both sides); the fairness id still reaches the pick.
    seen: list[list[str]] = []
    scan = extproc._scan

    def spy(headers: Iterable[base_pb2.HeaderValue], names: frozenset[str]) -> Any:
        got = list(headers)
        seen.append(sorted(h.key for h in got))
        return scan(got, names)

    monkeypatch.setattr(extproc, "_scan", spy)
    async with gateway_stack(lean=True) as st:
        c = HttpClient("127.0.0.1", st.envoy.port)
        r = await c.request("POST", "/v1/completions", json.dumps(completion(400)).encode(),
                            {"x-gateway-inference-fairness-id": "team-a",
                             "x-other": "1", "user-agent": "test"})
        await c.close()
        assert r.status == 200
    assert seen == [[":path", "x-gateway-inference-fairness-id"]]


def test_lean_config_lists_the_forwarded_headers() -> None:
    cfg = render_envoy_config(9002, [1, 2, 3, 4], lean=True)
    assert "forward_rules:" in cfg
    for h in LEAN_HEADERS:
        assert f'- exact: "{h}"' in cfg
    assert "forward_rules:" not in render_envoy_config(9002, [1, 2, 3, 4])
