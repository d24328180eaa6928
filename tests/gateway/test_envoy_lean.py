"""The lean processing mode through a REAL Envoy (issue 20 item 3): two ext_proc messages
per request (the headers, answered at once, and the buffered body; trailers and the whole
response skipped),
the pick rides on the body answer, and the placement is held until Envoy closes the
stream at the end of the HTTP stream (release on stream close)."""

from __future__ import annotations

import pytest

from fulcrum.gateway.testing import LEAN_MODE, render_envoy_config
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
