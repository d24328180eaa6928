"""The unary mode through a REAL Envoy (issue 20 item 3): ext_authz ``Check`` picks (one
unary call per request, the body in it), the placement is held until the request ends,
and Envoy's gRPC access log releases it (reason ``access_log``). A client cannot name a
placement, refusals come back as HTTP answers, and the bootstrap validates. The hold and
release tests run the lean ext_proc mode too (released on stream close)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from fulcrum.gateway import authz
from fulcrum.gateway.testing import HttpClient, envoy_binary, render_envoy_config, wait_for
from tests.gateway.helpers import gateway_stack
from tests.gateway.test_envoy_e2e import completion, hold

pytestmark = pytest.mark.timeout(120)


def assert_envoy_validates(cfg: str, tmp_path: Path) -> None:
    """Envoy's own ``--mode validate`` accepts the bootstrap ``cfg``."""
    path = tmp_path / "envoy.yaml"
    path.write_text(cfg)
    out = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_unary_config_replaces_ext_proc_and_validates(tmp_path: Path) -> None:
    cfg = render_envoy_config(9002, [8101, 8102, 8103, 8104], unary=True)
    assert "envoy.filters.http.ext_proc" not in cfg
    assert "envoy.filters.http.ext_authz" in cfg and "envoy.access_loggers.http_grpc" in cfg
    assert "remove: x-fulcrum-placement" in cfg  # a client's token never reaches Check
    assert_envoy_validates(cfg, tmp_path)
    with pytest.raises(ValueError, match="choose one"):
        render_envoy_config(9002, [1, 2, 3, 4], unary=True, lean=True)


#: The two lean Envoy modes and how each releases a placement at the request's end.
MODES = [({"lean": True}, "stream_closed"), ({"unary": True}, "access_log")]


@pytest.mark.parametrize(("mode", "reason"), MODES, ids=["lean", "unary"])
async def test_held_until_the_response_ends_then_released(
    mode: dict[str, bool], reason: str
) -> None:
    async with gateway_stack(**mode) as st:
        c = await hold(st, "held", completion(4000, 100))
        request_id, placement = st.picks[-1]
        u = st.upstream(placement.address)
        assert "held" in u.held_now
        # The unary mode's token rides on the request to the engine; the lean mode has
        # none (the ext_proc stream itself is the handle).
        (got,) = [r for r in u.received if r.headers.get("x-test-hold") == "held"]
        token = got.headers.get(authz.PLACEMENT_HEADER)
        if "unary" in mode:
            assert token is not None and token.startswith(request_id + ".")
        else:
            assert token is None
        # The response is open upstream: the placement is still held.
        assert st.decode.gpu_load(*placement.gpu) == (1, 1000 + 100)
        assert not any(r == request_id for r, _ in st.releases)
        u.release_hold("held")
        r = await c.receive()
        assert r.status == 200
        await c.close()
        assert await st.wait_released(request_id) == reason
        assert st.decode.held == 0 and st.gateway.picker.in_flight == 0


@pytest.mark.parametrize(("mode", "reason"), MODES, ids=["lean", "unary"])
async def test_released_when_the_client_disconnects(mode: dict[str, bool], reason: str) -> None:
    async with gateway_stack(**mode) as st:
        c = await hold(st, "gone", completion(4000))
        request_id, _placement = st.picks[-1]
        c.abort()
        assert await st.wait_released(request_id) == reason
        assert st.decode.held == 0


async def test_a_client_cannot_name_a_placement() -> None:
    # A refused request gets no OK answer, so its access-log entry logs its headers as
    # the client sent them: without the early header mutation, a request built to be
    # refused (JSON nested too deep: 400) carrying another request's token would release
    # that placement when its entry arrives.
    from fulcrum.gateway import metrics as gm

    unknown = gm.ACCESS_LOG_ENTRIES.labels("unknown")
    async with gateway_stack(unary=True) as st:
        c = await hold(st, "victim", completion(400))
        victim, placement = st.picks[-1]
        # The forger knows the victim's whole token (as the engine that received it).
        (seen,) = [r for r in st.upstream(placement.address).received
                   if r.headers.get("x-test-hold") == "victim"]
        token = seen.headers[authz.PLACEMENT_HEADER]
        before = unknown._value.get()
        r = await st.post("/v1/completions", b"[" * 600 + b"]" * 600,
                          {authz.PLACEMENT_HEADER: token})
        assert r.status == 400
        # Its entry has arrived (and named nothing held): the victim is still held.
        await wait_for(lambda: unknown._value.get() > before, what="the refused entry")
        assert st.gateway.picker.in_flight == 1
        assert not any(r == victim for r, _ in st.releases)
        st.upstream(placement.address).release_hold("victim")
        assert (await c.receive()).status == 200
        await c.close()
        assert await st.wait_released(victim) == "access_log"


@pytest.mark.parametrize("mode", ["unary", "http"])
async def test_ext_authz_refusals_are_http_answers_through_envoy(mode: str) -> None:
    # Both ext_authz transports (gRPC Check, HTTP/1.1) answer a refusal the same way.
    async with gateway_stack(**{mode: True}, gateway={"max_in_flight": 1}) as st:
        c = await hold(st, "one", completion(400))
        r = await st.post("/v1/completions", completion(400))
        assert r.status == 429
        assert r.headers.get("retry-after") == "1"
        assert json.loads(r.body)["error"]["type"] == "shed"
        assert st.gateway.picker.in_flight == 1
        st.upstream(st.picks[-1][1].address).release_hold("one")
        await c.receive()
        await c.close()
        await st.wait_released(st.picks[-1][0])
        assert st.gateway.picker.in_flight == 0


@pytest.mark.parametrize("mode", ["unary", "http"])
async def test_forwards_the_path_and_the_tenancy_headers_only(
    mode: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Both ext_authz transports (gRPC Check, HTTP/1.1) reach the same pick.
    seen: list[dict[str, str]] = []
    check = authz.check

    async def spy(picker: Any, leases: Any, clock: Any, body: bytes, path: str,
                  subset: Any, headers: Any) -> Any:
        seen.append({"path": path, **dict(headers)})
        return await check(picker, leases, clock, body, path, subset, headers)

    check_now = authz.check_now  # the HTTP mode's picks that need not wait

    def spy_now(picker: Any, leases: Any, clock: Any, body: bytes, path: str,
                subset: Any, headers: Any) -> Any:
        seen.append({"path": path, **dict(headers)})
        return check_now(picker, leases, clock, body, path, subset, headers)

    monkeypatch.setattr(authz, "check", spy)
    monkeypatch.setattr(authz, "check_now", spy_now)
    async with gateway_stack(**{mode: True}) as st:
        c = HttpClient("127.0.0.1", st.envoy.port)
        try:
            r = await c.request(
                "POST", "/v1/chat/completions",
                json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(),
                {"x-gateway-inference-fairness-id": "team-a", "x-other": "1"},
            )
        finally:
            await c.close()
        assert r.status == 200
    (got,) = seen
    assert got["path"] == "/v1/chat/completions"
    assert got.get("x-gateway-inference-fairness-id") == "team-a"
    assert "x-other" not in got and "user-agent" not in got
