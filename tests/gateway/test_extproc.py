"""The ext_proc protocol through a real gRPC channel (no Envoy): message sequences of
FULL_DUPLEX_STREAMED and BUFFERED modes, subset hints as list or string, served
endpoint, immediate responses, release on end of stream and on a broken stream, metrics,
and the adapter's masking leaving the decode view exactly as it was."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2

from fulcrum.gateway.testing import wait_for
from fulcrum.service.server import Daemon
from fulcrum.state.decode import DecodeState
from fulcrum.testing import running_server
from tests.service.test_server import scrape

ADDRS = ["10.0.0.1:8000", "10.0.0.1:8001", "10.0.0.1:8002", "10.0.0.1:8003"]
DUPLEX = pm.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = pm.ProcessingMode.BUFFERED


def overrides(**gw: object) -> dict[str, object]:
    engine = {"id": "d0", "host": "10.0.0.1", "ports": [8000, 8001, 8002, 8003]}
    engine.update(gw.pop("engine", {}))  # type: ignore[call-overload]
    return {
        "gateway": {
            "enabled": True,
            "port": 0,
            "health_port": 0,
            "pool": {"decode": [engine]},
            **gw,
        }
    }


def headers_msg(
    mode: int = DUPLEX, eos: bool = False, subset: struct_pb2.Value | None = None
) -> ep.ProcessingRequest:
    req = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[
                    base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
                    base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
                ]
            ),
            end_of_stream=eos,
        ),
        protocol_config=ep.ProtocolConfiguration(request_body_mode=mode, response_body_mode=DUPLEX),
    )
    if subset is not None:
        req.metadata_context.filter_metadata["envoy.lb.subset_hint"].fields[
            "x-gateway-destination-endpoint-subset"
        ].CopyFrom(subset)
    return req


def body_msg(body: bytes, eos: bool) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=eos))


def completion(chars: int, max_tokens: int = 10) -> bytes:
    return json.dumps({"prompt": "p" * chars, "max_tokens": max_tokens}).encode()


class Stream:
    """One Process stream driven message by message."""

    def __init__(self, stub: ep_grpc.ExternalProcessorStub) -> None:
        self.queue: asyncio.Queue[ep.ProcessingRequest | None] = asyncio.Queue()

        async def gen() -> AsyncIterator[ep.ProcessingRequest]:
            while True:
                m = await self.queue.get()
                if m is None:
                    return
                yield m

        self.call = stub.Process(gen())

    async def send(self, m: ep.ProcessingRequest) -> None:
        await self.queue.put(m)

    async def recv(self) -> ep.ProcessingResponse:
        r = await asyncio.wait_for(self.call.read(), 10)
        assert r is not grpc.aio.EOF
        return r

    async def close(self) -> None:
        await self.queue.put(None)


async def with_stub(daemon: Daemon) -> tuple[grpc.aio.Channel, ep_grpc.ExternalProcessorStub]:
    ch = grpc.aio.insecure_channel(daemon.gateway.address)
    return ch, ep_grpc.ExternalProcessorStub(ch)


def dest(resp: ep.ProcessingResponse, part: str) -> str:
    common = getattr(resp, part).response
    assert common.clear_route_cache
    (h,) = common.header_mutation.set_headers
    assert h.header.key == "x-gateway-destination-endpoint"
    value = h.header.raw_value.decode()
    md = resp.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert md["x-gateway-destination-endpoint"].string_value == value  # same value both ways
    return value


@pytest.fixture
async def gw() -> AsyncIterator[Daemon]:
    async with running_server(overrides()) as d:
        yield d


async def test_full_duplex_pick_after_the_body_then_release_at_response_end(gw: Daemon) -> None:
    state: DecodeState = gw.app.components["decode"]
    ch, stub = await with_stub(gw)
    async with ch:
        s = Stream(stub)
        await s.send(headers_msg())
        await s.send(body_msg(completion(300)[:20], False))
        await s.send(body_msg(completion(300)[20:], False))
        await s.send(body_msg(b"", True))
        r1 = await s.recv()
        assert r1.WhichOneof("response") == "request_headers"
        addr = dest(r1, "request_headers")
        assert addr in ADDRS
        r2 = await s.recv()
        sr = r2.request_body.response.body_mutation.streamed_response
        assert sr.body == completion(300) and sr.end_of_stream  # the whole body, once
        assert state.held == 1
        assert state.gpu_load("d0", ADDRS.index(addr)) == (1, 75 + 10)
        served = ep.ProcessingRequest(response_headers=ep.HttpHeaders())
        served.metadata_context.filter_metadata["envoy.lb"].fields[
            "x-gateway-destination-endpoint-served"
        ].string_value = addr
        await s.send(served)
        assert (await s.recv()).WhichOneof("response") == "response_headers"
        await s.send(
            ep.ProcessingRequest(response_body=ep.HttpBody(body=b"tok", end_of_stream=False))
        )
        echo = (await s.recv()).response_body.response.body_mutation.streamed_response
        assert echo.body == b"tok" and not echo.end_of_stream
        assert state.held == 1
        await s.send(ep.ProcessingRequest(response_body=ep.HttpBody(end_of_stream=True)))
        await s.recv()
        await wait_for(lambda: state.held == 0, what="released")
        await s.close()
        m = scrape(gw)
        assert m[("fulcrum_gateway_releases_total", (("reason", "response_end"),))] >= 1
        assert m[("fulcrum_gateway_pick_seconds_count", ())] >= 1
        assert m[("fulcrum_gateway_endpoints", ())] == 4


async def test_buffered_mode_answers_headers_at_once_and_picks_on_the_body(gw: Daemon) -> None:
    ch, stub = await with_stub(gw)
    async with ch:
        s = Stream(stub)
        await s.send(headers_msg(BUFFERED))
        r = await s.recv()
        assert r.WhichOneof("response") == "request_headers"
        assert not r.request_headers.response.header_mutation.set_headers
        await s.send(body_msg(completion(40), True))
        r = await s.recv()
        assert dest(r, "request_body") in ADDRS
        assert not r.request_body.response.body_mutation.HasField("streamed_response")
        await s.close()


async def test_subset_hint_as_list_and_as_string(gw: Daemon) -> None:
    ch, stub = await with_stub(gw)
    async with ch:
        as_list = struct_pb2.Value(
            list_value=struct_pb2.ListValue(values=[struct_pb2.Value(string_value=ADDRS[3])])
        )
        as_str = struct_pb2.Value(string_value=f"{ADDRS[1]}, {ADDRS[2]}")
        streams = []
        for subset, allowed in ((as_list, {ADDRS[3]}), (as_str, {ADDRS[1], ADDRS[2]})):
            for _ in range(3):  # held: the policy would spread them over all four
                s = Stream(stub)
                await s.send(headers_msg(eos=True, subset=subset))
                assert dest(await s.recv(), "request_headers") in allowed
                streams.append(s)
        # Empty list or unknown endpoints: 503 with nothing held.
        state: DecodeState = gw.app.components["decode"]
        held = state.held
        for bad in (
            struct_pb2.Value(list_value=struct_pb2.ListValue()),
            struct_pb2.Value(string_value="1.2.3.4:5"),
        ):
            s = Stream(stub)
            await s.send(headers_msg(eos=True, subset=bad))
            r = await s.recv()
            assert r.immediate_response.status.code == 503
            assert json.loads(r.immediate_response.body)["error"]["type"] == "no_endpoint"
        assert state.held == held
        for s in streams:
            await s.close()
        await wait_for(lambda: state.held == 0, what="released at stream end")
        state.view.check()  # the masking left every derived field consistent


async def test_broken_stream_releases(gw: Daemon) -> None:
    state: DecodeState = gw.app.components["decode"]
    ch, stub = await with_stub(gw)
    s = Stream(stub)
    await s.send(headers_msg(eos=True))
    await s.recv()
    assert state.held == 1
    s.call.cancel()
    await wait_for(lambda: state.held == 0, what="released on cancel")
    await ch.close()
    assert gw.gateway.picker.in_flight == 0


async def test_429_and_413_and_400() -> None:
    ov = overrides(max_in_flight=1, max_body_bytes=2048, engine={"max_concurrency": 1})
    ov["decode"] = {"max_request_kv_tokens": 5000}
    async with running_server(ov) as d:
        key = "fulcrum_gateway_immediate_responses_total"
        before = {c: scrape(d)[(key, (("code", c),))] for c in ("429", "413", "400")}
        ch, stub = await with_stub(d)
        async with ch:
            s = Stream(stub)
            await s.send(headers_msg(eos=True))
            await s.recv()
            s2 = Stream(stub)
            await s2.send(headers_msg(eos=True))
            r = (await s2.recv()).immediate_response
            assert r.status.code == 429
            assert any(h.header.key == "retry-after" for h in r.headers.set_headers)
            await s.close()
            await wait_for(lambda: d.gateway.picker.in_flight == 0, what="released")
            s3 = Stream(stub)
            await s3.send(headers_msg())
            await s3.send(body_msg(b"x" * 3000, True))
            assert (await s3.recv()).immediate_response.status.code == 413
            s4 = Stream(stub)
            await s4.send(headers_msg())
            await s4.send(body_msg(completion(400, 4950), True))
            r4 = (await s4.recv()).immediate_response
            assert r4.status.code == 400
            assert b"max_request_kv_tokens" in r4.body
            after = scrape(d)
            for code in ("429", "413", "400"):
                assert after[(key, (("code", code),))] == before[code] + 1


async def test_every_gpu_full_is_429_with_the_decode_reason() -> None:
    async with running_server(overrides(engine={"max_concurrency": 1})) as d:
        ch, stub = await with_stub(d)
        async with ch:
            streams = []
            for _ in range(4):
                s = Stream(stub)
                await s.send(headers_msg(eos=True))
                await s.recv()
                streams.append(s)
            s = Stream(stub)
            await s.send(headers_msg(eos=True))
            r = (await s.recv()).immediate_response
            assert r.status.code == 429
            assert b"max_concurrency" in r.body
            for s in streams:
                await s.close()


async def test_gateway_off_by_default() -> None:
    async with running_server() as d:
        assert d.gateway is None
        assert "gateway" not in d.app.components


async def test_reload_applies_the_gateway_keys() -> None:
    from fulcrum.config import with_overrides

    async with running_server(overrides()) as d:
        ch, stub = await with_stub(d)
        async with ch:
            state: DecodeState = d.app.components["decode"]

            async def kv_of(body: bytes) -> int:
                s = Stream(stub)
                await s.send(headers_msg())
                await s.send(body_msg(body, True))
                addr = dest(await s.recv(), "request_headers")
                await s.recv()
                kv = state.gpu_load("d0", ADDRS.index(addr))[1]
                await s.close()
                await wait_for(lambda: state.held == 0, what="released")
                return kv

            assert await kv_of(completion(400)) == 100 + 10
            new = with_overrides(
                d.app.settings,
                {"gateway": {"chars_per_token": 2.0, "default_max_tokens": 7, "max_in_flight": 1}},
            )
            for hook in d.app.reload_hooks:
                hook(new)
            assert await kv_of(completion(400)) == 200 + 10
            assert await kv_of(json.dumps({"prompt": "p" * 40}).encode()) == 20 + 7
            s = Stream(stub)
            await s.send(headers_msg(eos=True))
            await s.recv()
            s2 = Stream(stub)
            await s2.send(headers_msg(eos=True))
            assert (await s2.recv()).immediate_response.status.code == 429  # max_in_flight 1
            await s.close()


async def test_full_duplex_request_with_trailers_is_picked_at_the_trailers(gw: Daemon) -> None:
    ch, stub = await with_stub(gw)
    async with ch:
        s = Stream(stub)
        await s.send(headers_msg())
        await s.send(body_msg(completion(80), False))
        await s.send(ep.ProcessingRequest(request_trailers=ep.HttpTrailers()))
        assert dest(await s.recv(), "request_headers") in ADDRS
        sr = (await s.recv()).request_body.response.body_mutation.streamed_response
        assert sr.body == completion(80) and not sr.end_of_stream
        assert (await s.recv()).WhichOneof("response") == "request_trailers"
        await s.close()
