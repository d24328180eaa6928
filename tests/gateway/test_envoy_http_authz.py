"""The HTTP picker (``gateway.authz_http_port``) through a REAL Envoy: ext_authz over
plain HTTP/1.1 picks, the request carries the destination and the placement token, the
gRPC access log releases it; refusals come back as HTTP answers; and the listener's own
bounds, driven on a raw socket (bad request lines, chunked bodies, an oversize head or
body, pipelined requests, a connection gone before its answer)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from fulcrum.gateway import authz
from fulcrum.gateway.testing import render_envoy_config, wait_for
from tests.gateway.helpers import gateway_stack
from tests.gateway.test_envoy_e2e import completion, hold
from tests.gateway.test_envoy_unary import assert_envoy_validates

pytestmark = pytest.mark.timeout(120)


def test_http_config_replaces_the_grpc_check_and_validates(tmp_path: Path) -> None:
    cfg = render_envoy_config(9002, [8101, 8102, 8103, 8104], http_authz_port=9004)
    assert "envoy.filters.http.ext_proc" not in cfg
    assert "http_service:" in cfg and "fulcrum_authz_http" in cfg
    assert "envoy.access_loggers.http_grpc" in cfg  # the release stays on gRPC
    assert "metadata_context_namespaces" not in cfg
    assert_envoy_validates(cfg, tmp_path)


async def test_held_until_the_response_ends_then_released_by_the_access_log() -> None:
    async with gateway_stack(http=True) as st:
        c = await hold(st, "held", completion(4000, 100))
        request_id, placement = st.picks[-1]
        u = st.upstream(placement.address)
        (got,) = [r for r in u.received if r.headers.get("x-test-hold") == "held"]
        assert got.headers[authz.PLACEMENT_HEADER].startswith(request_id + ".")
        assert st.decode.gpu_load(*placement.gpu) == (1, 1000 + 100)
        u.release_hold("held")
        assert (await c.receive()).status == 200
        await c.close()
        assert await st.wait_released(request_id) == "access_log"
        assert st.decode.held == 0 and st.gateway.picker.in_flight == 0


async def test_requests_spread_and_a_bad_body_is_the_pickers_400() -> None:
    # The 429 path is test_envoy_unary's refusal test, run in this mode too.
    async with gateway_stack(http=True) as st:
        r = await st.post("/v1/completions", b"[" * 600 + b"]" * 600)
        assert r.status == 400  # JSON nested too deep: the picker's 400, through Envoy
        assert json.loads(r.body)["error"]["type"] == "too_deep"
        for i in range(8):  # eight prompts that share nothing: picked by load, so spread
            body = json.dumps({"prompt": f"{i} " * 200, "max_tokens": 10}).encode()
            r = await st.post("/v1/completions", body)
            assert r.status == 200
        assert len({p.address for _, p in st.picks}) > 1


async def _raw(port: int, data: bytes, answers: int = 1) -> list[bytes]:
    """Send ``data`` on a fresh connection; the first ``answers`` responses (heads and
    bodies), then whatever else arrives until the server closes (or 2 s pass)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    out = []
    try:
        for _ in range(answers):
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            n = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n")
                         if ln.lower().startswith(b"content-length")))
            out.append(head + await asyncio.wait_for(reader.readexactly(n), 10))
    finally:
        writer.close()
    return out


def _post(body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body)


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"NONSENSE\r\n\r\n", b"400"),
        (b"POST / SPDY/3\r\n\r\n", b"400"),
        (b"POST / HTTP/1.1\r\ncontent-length: 12abc\r\n\r\n", b"400"),
        (b"POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n", b"400"),
        (b"POST / HTTP/1.1\r\nbroken header\r\n\r\n", b"400"),
        (b"POST / HTTP/1.1\r\nx-big: " + b"a" * 70_000 + b"\r\n\r\n", b"431"),
        (b"POST / HTTP/1.1\r\ncontent-length: 99999999999\r\n\r\n", b"413"),
    ],
    ids=["request-line", "version", "content-length", "chunked", "header-line",
         "head-too-big", "body-too-big"],
)
async def test_bad_requests_are_answered_and_change_nothing(request_bytes: bytes,
                                                            status: bytes) -> None:
    async with gateway_stack(http=True) as st:
        (answer,) = await _raw(st.gateway.http_port, request_bytes)
        assert answer.split(b" ")[1] == status
        assert st.picks == [] and st.gateway.picker.in_flight == 0


async def test_pipelined_requests_are_answered_in_order_and_held() -> None:
    async with gateway_stack(http=True) as st:
        body = json.dumps(completion(400)).encode()
        answers = await _raw(st.gateway.http_port, _post(body) * 3, answers=3)
        assert [a.split(b" ")[1] for a in answers] == [b"200"] * 3
        tokens = [next(ln for ln in a.split(b"\r\n") if ln.startswith(b"x-fulcrum-placement"))
                  for a in answers]
        assert len(set(tokens)) == 3 and len(st.picks) == 3
        from fulcrum.metrics import REGISTRY
        assert REGISTRY.get_sample_value("fulcrum_gateway_authz_http_connections") is not None
        # Nobody sends their access-log entries: held until gateway.max_hold_s.
        assert st.gateway.picker.in_flight == 3


async def test_a_pick_whose_connection_is_gone_is_released(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gate = asyncio.Event()
    async with gateway_stack(http=True) as st:
        picker = st.gateway.picker
        pick_full = picker.pick_full

        async def slow(*args: Any, **kwargs: Any) -> Any:
            await gate.wait()  # the connection closes while the pick is under way
            return await pick_full(*args, **kwargs)

        monkeypatch.setattr(picker, "pick_full", slow)
        monkeypatch.setattr(picker, "answers_at_once", lambda body: False)  # the task path
        _reader, writer = await asyncio.open_connection("127.0.0.1", st.gateway.http_port)
        writer.write(_post(json.dumps(completion(400)).encode()))
        await writer.drain()
        await wait_for(lambda: picker.streams == 1, what="the pick under way")
        writer.close()
        await wait_for(lambda: not st.gateway.authz_http.connections,  # type: ignore[union-attr]
                       what="the connection gone")
        gate.set()
        await wait_for(lambda: len(st.releases) == 1, what="the release")
        assert st.releases[0][1] == "check_cancelled" and picker.in_flight == 0


class _Transport:
    """A transport that keeps what is written (a connection driven by hand)."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


async def test_a_pick_that_need_not_wait_is_answered_on_the_connections_own_callback(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # No task and no turn of the loop between the request and its answer; pipelined
    # requests are answered in order in the same callback. A pick that has to wait (here
    # forced) goes through a task, and what follows it in the buffer waits its turn.
    async with gateway_stack(http=True) as st:
        server = st.gateway.authz_http
        assert server is not None
        conn = server.protocol()
        t = _Transport()
        conn.connection_made(t)  # type: ignore[arg-type]
        body = json.dumps(completion(400)).encode()
        conn.data_received(_post(body) * 3)
        assert [w.split(b" ")[1] for w in t.written] == [b"200"] * 3
        assert len(st.picks) == 3

        monkeypatch.setattr(server.picker, "answers_at_once", lambda body: False)
        conn.data_received(_post(body) * 2)
        assert len(t.written) == 3  # nothing answered yet: the first pick is in a task
        await wait_for(lambda: len(t.written) == 5, what="both answers")
        assert [w.split(b" ")[1] for w in t.written[3:]] == [b"200"] * 2
        assert len(st.picks) == 5 and server.picker.in_flight == 5
        conn.connection_lost(None)


#: (case, body bytes, a tokenizer configured, P/D, answered at once)
AT_ONCE = [
    ("plain", 1_000, False, False, True),
    ("big body: parsed in a worker thread", 256 * 1024 + 1, False, False, False),
    ("tokenized in a worker thread", 1_000, True, False, False),
    ("nothing to tokenize", 0, True, False, True),
    ("P/D: waits for a prefill placement", 1_000, False, True, False),
]


async def test_which_picks_answer_at_once() -> None:
    async with gateway_stack(http=True) as st:
        picker = st.gateway.picker
        for case, size, tokenizer, prefill, at_once in AT_ONCE:
            with pytest.MonkeyPatch.context() as mp:
                if tokenizer:
                    mp.setattr(picker, "counter", object())
                if prefill:
                    mp.setattr(picker, "prefill", object())
                assert picker.answers_at_once(b"x" * size) is at_once, case
