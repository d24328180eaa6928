"""Issue 22, rows 1-4 and 11, through a real gRPC channel to a running daemon: the ext_proc
stream is a state machine with one pick at most, its bounds refuse and count, deep JSON is
400 (never UNKNOWN), a request no rank can hold is 400, the TLS warning, and the pool
classed restart-only. Ends with a hypothesis fuzz of message sequences."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fulcrum.config import with_overrides
from fulcrum.gateway.testing import wait_for
from fulcrum.service.server import Daemon
from fulcrum.state.decode import DecodeState
from fulcrum.testing import running_server
from tests.gateway.test_extproc import (
    Stream,
    body_msg,
    completion,
    headers_msg,
    overrides,
    with_stub,
)
from tests.service.test_server import scrape

TRAILERS = ep.ProcessingRequest(request_trailers=ep.HttpTrailers())


def refused(d: Daemon, reason: str) -> float:
    return scrape(d).get(("fulcrum_gateway_refused_total", (("reason", reason),)), 0.0)


def held(d: Daemon) -> int:
    state: DecodeState = d.app.components["decode"]
    return state.held


async def immediate(s: Stream) -> ep.ImmediateResponse:
    """Read answers until the immediate response (the stream's last answer)."""
    while True:
        r = await s.recv()
        if r.WhichOneof("response") == "immediate_response":
            return r.immediate_response


@pytest.fixture
async def gw() -> AsyncIterator[Daemon]:
    async with running_server(overrides()) as d:
        yield d


SECOND_EOS = {
    "headers eos twice": [headers_msg(eos=True), headers_msg(eos=True)],
    "headers eos then body": [headers_msg(eos=True), body_msg(completion(40), True)],
    "two bodies": [headers_msg(), body_msg(completion(40), True), body_msg(b"{}", True)],
    "trailers then body": [headers_msg(), body_msg(completion(40), False), TRAILERS,
                           body_msg(completion(40), True)],
    "body after the response": [
        headers_msg(eos=True),
        ep.ProcessingRequest(response_headers=ep.HttpHeaders(end_of_stream=True)),
        body_msg(b"{}", True),
    ],
}


@pytest.mark.parametrize("case", list(SECOND_EOS))
async def test_a_second_end_of_stream_is_400_and_releases(gw: Daemon, case: str) -> None:
    picker = gw.gateway.picker
    before = refused(gw, "out_of_order")
    ch, stub = await with_stub(gw)
    async with ch:
        s = Stream(stub)
        for m in SECOND_EOS[case]:
            await s.send(m)
        r = await immediate(s)
        assert r.status.code == 400
        assert b"out of order" in r.body
        assert await s.call.code() == grpc.StatusCode.OK
        await s.close()
    assert refused(gw, "out_of_order") == before + 1
    await wait_for(lambda: picker.in_flight == 0 and held(gw) == 0, what="released")


async def test_many_end_of_stream_bodies_take_one_pick(gw: Daemon) -> None:
    """Row 1: a stream of body(eos) messages took one pick per message and kept them."""
    picker = gw.gateway.picker
    picks: list[str] = []
    picker.pick_hooks.append(lambda rid, _p: picks.append(rid))
    ch, stub = await with_stub(gw)
    async with ch:
        s = Stream(stub)
        await s.send(headers_msg())
        for _ in range(200):
            await s.send(body_msg(completion(40), True))
        assert (await immediate(s)).status.code == 400
        await s.close()
        await wait_for(lambda: picker.in_flight == 0 and held(gw) == 0, what="released")
        assert len(picks) == 1
        for _ in range(20):  # legitimate requests are served afterwards
            s = Stream(stub)
            await s.send(headers_msg(eos=True))
            assert (await s.recv()).WhichOneof("response") == "request_headers"
            await s.close()


async def test_stream_bound_is_429_and_counted() -> None:
    async with running_server(overrides(max_streams=2)) as d:
        before = refused(d, "streams")
        ch, stub = await with_stub(d)
        async with ch:
            open_ = [Stream(stub) for _ in range(2)]
            for s in open_:
                await s.send(headers_msg())  # body pending: the stream stays open
            await wait_for(lambda: d.gateway.picker.streams == 2, what="two streams")
            extra = Stream(stub)
            await extra.send(headers_msg(eos=True))
            r = await immediate(extra)
            assert r.status.code == 429
            assert any(h.header.key == "retry-after" for h in r.headers.set_headers)
            for s in open_:
                await s.close()
        assert refused(d, "streams") == before + 1
        await wait_for(lambda: d.gateway.picker.streams == 0, what="streams closed")


async def test_pending_bytes_bound_is_429_and_given_back() -> None:
    async with running_server(overrides(max_pending_bytes=4096)) as d:
        picker = d.gateway.picker
        before = refused(d, "pending_bytes")
        ch, stub = await with_stub(d)
        async with ch:
            a = Stream(stub)
            await a.send(headers_msg())
            await a.send(body_msg(b"x" * 3000, False))
            await wait_for(lambda: picker.pending_bytes == 3000, what="3000 bytes pending")
            b = Stream(stub)
            await b.send(headers_msg())
            await b.send(body_msg(b"y" * 2000, False))
            assert (await immediate(b)).status.code == 429
            await a.close()
            await wait_for(lambda: picker.pending_bytes == 0, what="bytes given back")
        assert refused(d, "pending_bytes") == before + 1


async def test_body_assembly_time_bound_is_503() -> None:
    async with running_server(overrides(max_body_ms=50)) as d:
        picker = d.gateway.picker
        before = refused(d, "body_timeout")
        ch, stub = await with_stub(d)
        async with ch:
            s = Stream(stub)
            await s.send(headers_msg())
            await s.send(body_msg(b"x" * 100, False))  # and never the rest
            assert (await immediate(s)).status.code == 503
            await s.close()
        assert refused(d, "body_timeout") == before + 1
        await wait_for(lambda: picker.pending_bytes == 0 and picker.streams == 0, what="closed")


@pytest.mark.parametrize(
    "body",
    [b"[" * 900 + b"]" * 900, b'{"prompt":' + b"[" * 100_000, b'{"a":' * 50_000],
    ids=["900 deep", "100k deep prompt", "50k objects"],
)
async def test_deep_json_is_400_never_unknown(gw: Daemon, body: bytes) -> None:
    before = refused(gw, "too_deep")
    ch, stub = await with_stub(gw)
    async with ch:
        s = Stream(stub)
        await s.send(headers_msg())
        await s.send(body_msg(body, True))
        r = await immediate(s)
        assert r.status.code == 400
        assert b"nested deeper" in r.body
        assert await s.call.code() == grpc.StatusCode.OK
        await s.close()
    assert refused(gw, "too_deep") == before + 1
    assert gw.gateway.picker.in_flight == 0


async def test_a_request_no_rank_can_hold_is_400_not_429(gw: Daemon) -> None:
    """Row 4: 1e6 token ids + max_tokens exceed every rank's max_kv_tokens (1,000,000)."""
    body = json.dumps({"prompt": list(range(1_000_000)), "max_tokens": 16}).encode()
    ch, stub = await with_stub(gw)
    async with ch:
        s = Stream(stub)
        await s.send(headers_msg())
        await s.send(body_msg(body, True))
        r = await immediate(s)
        assert r.status.code == 400
        assert b"more than any endpoint can hold" in r.body
        await s.close()


async def test_warning_when_listening_beyond_loopback_without_tls(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with running_server(overrides()):
        pass
    assert "gateway_listens_without_tls" not in capsys.readouterr().out
    async with running_server(overrides(host="0.0.0.0")):
        pass
    assert '"event": "gateway_listens_without_tls"' in capsys.readouterr().out


async def test_pool_reload_is_restart_only_and_says_so(gw: Daemon) -> None:
    """Row 11: 2 -> 5 ports was reported applied while the endpoints stayed."""
    n = len(gw.gateway.pool.addresses)
    engine = {"id": "d0", "host": "10.0.0.1", "ports": [8000 + i for i in range(n + 1)]}
    new = with_overrides(gw.app.settings, {"gateway": {"pool": {"decode": [engine]}}})
    assert gw.reload(new) == "restart_required"
    assert len(gw.gateway.pool.addresses) == n
    assert len(gw.app.settings.gateway.pool.decode[0].ports) == n  # the running value


# -- fuzz ------------------------------------------------------------------------------

_MESSAGES = {
    "headers": lambda eos: headers_msg(eos=eos),
    "body": lambda eos: body_msg(completion(40), eos),
    "deep": lambda eos: body_msg(b"[" * 300, eos),
    "trailers": lambda _eos: TRAILERS,
    "resp_headers": lambda eos: ep.ProcessingRequest(
        response_headers=ep.HttpHeaders(end_of_stream=eos)),
    "resp_body": lambda eos: ep.ProcessingRequest(
        response_body=ep.HttpBody(body=b"ok", end_of_stream=eos)),
    "resp_trailers": lambda _eos: ep.ProcessingRequest(response_trailers=ep.HttpTrailers()),
    "empty": lambda _eos: ep.ProcessingRequest(),
}
_SEQ = st.lists(
    st.tuples(st.sampled_from(sorted(_MESSAGES)), st.booleans()), min_size=0, max_size=8
)


@settings(max_examples=40, suppress_health_check=list(HealthCheck), deadline=None)
@given(seqs=st.lists(_SEQ, min_size=1, max_size=4))
async def test_fuzz_message_sequences(gw: Daemon, seqs: list[list[tuple[str, bool]]]) -> None:
    """Any sequences on concurrent streams: the stream ends OK (never UNKNOWN or
    INTERNAL), at most one pick each, nothing stays held, in-flight == held."""
    picker = gw.gateway.picker
    picks: list[str] = []
    picker.pick_hooks.append(lambda rid, _p: picks.append(rid))
    try:
        ch, stub = await with_stub(gw)
        async with ch:
            streams = [Stream(stub) for _ in seqs]
            for s, seq in zip(streams, seqs, strict=True):
                for kind, eos in seq:
                    await s.send(_MESSAGES[kind](eos))
            assert picker.in_flight == held(gw)
            for s in streams:
                await s.close()
            for s in streams:
                while await asyncio.wait_for(s.call.read(), 10) is not grpc.aio.EOF:
                    pass
                assert await s.call.code() == grpc.StatusCode.OK
        assert len(picks) <= len(seqs)
        await wait_for(lambda: picker.streams == 0, what="streams closed")
        assert picker.in_flight == 0 == held(gw)
        assert picker.pending_bytes == 0
    finally:
        picker.pick_hooks.clear()


# -- reload: every picker key classed reloadable is applied (row 11) -------------------


async def _reloaded(d: Daemon, **gw: object) -> None:
    new = with_overrides(d.app.settings, {"gateway": gw})
    assert d.reload(new) == "applied"


async def _answer(stub: object, *msgs: ep.ProcessingRequest) -> ep.ProcessingResponse:
    s = Stream(stub)  # type: ignore[arg-type]
    for m in msgs:
        await s.send(m)
    r = await s.recv()
    await s.close()
    return r


async def test_reload_fallbacks_and_metadata_namespace(gw: Daemon) -> None:
    ch, stub = await with_stub(gw)
    async with ch:
        await _reloaded(gw, fallbacks=2, metadata_namespace="x.ns")
        r = await _answer(stub, headers_msg(eos=True))
        (h,) = r.request_headers.response.header_mutation.set_headers
        assert len(h.header.raw_value.decode().split(",")) == 3
        assert "x.ns" in r.dynamic_metadata.fields


async def test_reload_subset_namespace(gw: Daemon) -> None:
    from google.protobuf import struct_pb2

    ch, stub = await with_stub(gw)
    async with ch:
        await _reloaded(gw, subset_namespace="x.sub")
        m = headers_msg(eos=True)
        m.metadata_context.filter_metadata["x.sub"].fields[
            "x-gateway-destination-endpoint-subset"
        ].CopyFrom(struct_pb2.Value(string_value="10.0.0.1:8003"))
        for _ in range(3):
            r = await _answer(stub, m)
            (h,) = r.request_headers.response.header_mutation.set_headers
            assert h.header.raw_value == b"10.0.0.1:8003"
        await wait_for(lambda: held(gw) == 0, what="released")


@pytest.mark.parametrize(
    ("key", "value", "code"),
    [
        ("max_body_bytes", 2048, 413),
        ("max_pending_bytes", 2048, 429),
        ("max_streams", 1, 429),
        ("max_body_ms", 50, 503),
    ],
)
async def test_reload_applies_each_stream_bound(
    gw: Daemon, key: str, value: int, code: int
) -> None:
    ch, stub = await with_stub(gw)
    async with ch:
        await _reloaded(gw, **{key: value})
        keep = Stream(stub)
        await keep.send(headers_msg())  # one open stream, body pending
        await wait_for(lambda: gw.gateway.picker.streams >= 1, what="stream open")
        s = Stream(stub)
        await s.send(headers_msg())
        await s.send(body_msg(b"x" * 3000, False))
        assert (await immediate(s)).status.code == code
        await s.close()
        await keep.close()


async def test_reload_retry_after(gw: Daemon) -> None:
    ch, stub = await with_stub(gw)
    async with ch:
        await _reloaded(gw, max_in_flight=1, retry_after_s=7)
        first = Stream(stub)
        await first.send(headers_msg(eos=True))
        await first.recv()
        r = (await _answer(stub, headers_msg(eos=True))).immediate_response
        assert r.status.code == 429
        assert any(
            h.header.key == "retry-after" and h.header.raw_value == b"7"
            for h in r.headers.set_headers
        )
        await first.close()


async def test_in_flight_and_stream_gauges_follow_the_streams(gw: Daemon) -> None:
    """The two gauges are read when scraped: one held stream shows as 1 and 1, then 0."""
    picker = gw.gateway.picker

    def gauges() -> tuple[float, float]:
        got = scrape(gw)
        return got[("fulcrum_gateway_requests_in_flight", ())], got[("fulcrum_gateway_streams", ())]

    ch, stub = await with_stub(gw)
    async with ch:
        s = Stream(stub)
        await s.send(headers_msg(eos=True))
        assert (await s.recv()).WhichOneof("response") == "request_headers"
        assert gauges() == (1.0, 1.0)
        await s.close()
        await wait_for(lambda: picker.in_flight == 0 and picker.streams == 0, what="closed")
        assert gauges() == (0.0, 0.0)
