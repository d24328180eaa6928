"""The lean processing mode through a REAL Envoy (issue 20 item 3): two ext_proc messages
per request (the headers, answered at once, and the buffered body; trailers and the whole
response skipped),
the pick rides on the body answer, and the placement is held until Envoy closes the
stream at the end of the HTTP stream (release on stream close; those tests run for both
lean modes in test_envoy_unary.py)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2

from fulcrum.gateway import extproc
from fulcrum.gateway.testing import LEAN_HEADERS, LEAN_MODE, HttpClient, render_envoy_config
from tests.gateway.helpers import gateway_stack
from tests.gateway.test_envoy_e2e import completion

pytestmark = pytest.mark.timeout(120)


def test_lean_config_sets_every_mode() -> None:
    cfg = render_envoy_config(9002, [1, 2, 3, 4], lean=True)
    for key, value in LEAN_MODE.items():
        assert f"{key}: {value}" in cfg


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
