"""The unary mode's two services through a real gRPC channel (no Envoy): ext_authz
``Check`` picks and answers the destination and a placement token, the access-log stream
releases by that token, and nothing else releases a placement: an unknown token, a
token already released, a refusal. Leases end at ``gateway.max_hold_s``; a Check
cancelled after its pick releases at once."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from envoy.data.accesslog.v3 import accesslog_pb2 as al
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.auth.v3 import external_auth_pb2 as ea
from envoy.service.auth.v3 import external_auth_pb2_grpc as ea_grpc
from google.protobuf import struct_pb2

from fulcrum.gateway import authz
from fulcrum.gateway.testing import wait_for
from fulcrum.service.server import Daemon
from fulcrum.testing import running_server
from tests.gateway.test_extproc import completion, overrides
from tests.service.test_server import scrape

pytestmark = pytest.mark.timeout(60)


def check_request(
    body: bytes,
    path: str = "/v1/completions",
    headers: dict[str, str] | None = None,
    subset: list[str] | None = None,
) -> ea.CheckRequest:
    req = ea.CheckRequest()
    http = req.attributes.request.http
    http.path = path
    http.method = "POST"
    http.raw_body = body
    for k, v in (headers or {}).items():
        http.headers[k] = v
    if subset is not None:
        v = struct_pb2.Value()
        v.list_value.values.add().string_value = ",".join(subset)
        req.attributes.metadata_context.filter_metadata["envoy.lb.subset_hint"].fields[
            "x-gateway-destination-endpoint-subset"
        ].CopyFrom(v)
    return req


def ok_headers(resp: ea.CheckResponse) -> dict[str, str]:
    assert resp.status.code == 0, resp
    assert resp.HasField("ok_response")
    return {h.header.key: h.header.value for h in resp.ok_response.headers}


def entries(*tokens: str) -> als_pb2.StreamAccessLogsMessage:
    msg = als_pb2.StreamAccessLogsMessage()
    for t in tokens:
        e = al.HTTPAccessLogEntry()
        if t:
            e.request.request_headers[authz.PLACEMENT_HEADER] = t
        msg.http_logs.log_entry.append(e)
    return msg


class Stubs:
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.channel = grpc.aio.insecure_channel(daemon.gateway.address)
        self.check = ea_grpc.AuthorizationStub(self.channel).Check
        self.logs = als_pb2_grpc.AccessLogServiceStub(self.channel).StreamAccessLogs

    async def log(self, *batches: als_pb2.StreamAccessLogsMessage) -> None:
        """One access-log stream carrying ``batches``, closed by the client."""

        async def gen() -> AsyncIterator[als_pb2.StreamAccessLogsMessage]:
            for b in batches:
                yield b

        await self.logs(gen())

    @property
    def releases(self) -> dict[str, float]:
        m = scrape(self.daemon)
        return {
            labels[0][1]: v
            for (name, labels), v in m.items()
            if name == "fulcrum_gateway_releases_total"
        }


@pytest.fixture
async def stubs() -> AsyncIterator[Stubs]:
    async with running_server(overrides()) as d:
        s = Stubs(d)
        async with s.channel:
            yield s


async def test_check_picks_and_the_access_log_releases(stubs: Stubs) -> None:
    picker = stubs.daemon.gateway.picker
    key = "fulcrum_gateway_access_log_entries_total"
    m0 = scrape(stubs.daemon)  # the counters are the process's: compare deltas
    h = ok_headers(await stubs.check(check_request(completion(400))))
    assert h["x-gateway-destination-endpoint"].startswith("10.0.0.1:800")
    token = h[authz.PLACEMENT_HEADER]
    assert picker.in_flight == 1
    before = stubs.releases
    # Entries of other requests (no token, an unknown one) release nothing.
    await stubs.log(entries("", "gw-999"))
    assert picker.in_flight == 1
    await stubs.log(entries(token))
    assert picker.in_flight == 0
    after = stubs.releases
    assert after["access_log"] == before["access_log"] + 1
    # The same entry again (Envoy retrying a batch) is not a second release.
    await stubs.log(entries(token))
    assert stubs.releases == after
    m = scrape(stubs.daemon)
    for outcome, n in (("released", 1), ("unknown", 3)):
        label = (key, (("outcome", outcome),))
        assert m[label] - m0[label] == n


async def test_a_token_cannot_be_guessed_from_the_request_id(stubs: Stubs) -> None:
    # Anyone on the picker's port can send access-log entries: the sequential request id
    # alone (gw-N) names nothing; the token carries 64 random bits.
    picks: list[str] = []
    stubs.daemon.gateway.picker.pick_hooks.append(lambda r, p: picks.append(r))
    h = ok_headers(await stubs.check(check_request(completion(10))))
    token = h[authz.PLACEMENT_HEADER]
    (request_id,) = picks
    rid, _, salt = token.partition(".")
    assert rid == request_id and len(salt) == 16 and int(salt, 16) >= 0
    await stubs.log(entries(request_id, request_id + ".0000000000000000"))
    assert stubs.daemon.gateway.picker.in_flight == 1
    await stubs.log(entries(token))
    assert stubs.daemon.gateway.picker.in_flight == 0


async def test_each_check_gets_its_own_token_and_batches_release_them_all(
    stubs: Stubs,
) -> None:
    picker = stubs.daemon.gateway.picker
    tokens = [
        ok_headers(await stubs.check(check_request(completion(100))))[authz.PLACEMENT_HEADER]
        for _ in range(6)
    ]
    assert len(set(tokens)) == 6 and picker.in_flight == 6
    await stubs.log(entries(*tokens[:4]), entries(*tokens[4:]))
    assert picker.in_flight == 0
    assert stubs.daemon.app.components["decode"].held == 0


async def test_subset_hint_and_tenancy_headers_reach_the_pick(stubs: Stubs) -> None:
    picks: list[Any] = []
    stubs.daemon.gateway.picker.pick_hooks.append(lambda r, p: picks.append(p))
    for _ in range(4):
        h = ok_headers(await stubs.check(check_request(completion(50), subset=["10.0.0.1:8002"])))
        assert h["x-gateway-destination-endpoint"] == "10.0.0.1:8002"
    assert [p.address for p in picks] == ["10.0.0.1:8002"] * 4


async def test_refusals_answer_the_http_status_and_hold_nothing() -> None:
    ov = overrides(max_in_flight=1, max_body_bytes=2048)
    ov["decode"] = {"max_request_kv_tokens": 5000}
    async with running_server(ov) as d:
        s = Stubs(d)
        async with s.channel:
            key = "fulcrum_gateway_immediate_responses_total"
            before = {c: scrape(d)[(key, (("code", c),))] for c in ("429", "413", "400")}
            token = ok_headers(await s.check(check_request(completion(100))))[
                authz.PLACEMENT_HEADER]
            full = await s.check(check_request(completion(100)))
            assert full.status.code != 0 and full.denied_response.status.code == 429
            hdrs = {h.header.key: h.header.value for h in full.denied_response.headers}
            assert hdrs["retry-after"] == "1"
            assert json.loads(full.denied_response.body)["error"]["type"] == "shed"
            await s.log(entries(token))
            big = await s.check(check_request(b"x" * 3000))
            assert big.denied_response.status.code == 413
            kv = await s.check(check_request(completion(400, 4950)))
            assert kv.denied_response.status.code == 400
            assert "max_request_kv_tokens" in kv.denied_response.body
            deep = await s.check(check_request(b"[" * 600 + b"]" * 600))
            assert deep.denied_response.status.code == 400
            assert d.gateway.picker.in_flight == 0
            after = scrape(d)
            assert after[(key, (("code", "429"),))] == before["429"] + 1
            assert after[(key, (("code", "413"),))] == before["413"] + 1
            assert after[(key, (("code", "400"),))] == before["400"] + 2


async def test_a_lease_with_no_entry_is_released_at_max_hold() -> None:
    # A hold of 1 us: the first placement has expired by the time the next call arrives
    # (any gRPC round trip takes longer), and the sweep on that call releases it.
    async with running_server(overrides(max_hold_s=1e-6)) as d:
        s = Stubs(d)
        async with s.channel:
            first = ok_headers(await s.check(check_request(completion(10))))[
                authz.PLACEMENT_HEADER]
            assert d.gateway.picker.in_flight == 1
            ok_headers(await s.check(check_request(completion(10))))
            assert d.gateway.picker.in_flight == 1  # the first expired, the second held
            assert s.releases["expired"] == 1
            # Its entry arriving late releases nothing more; the stream's own sweep
            # after the batch expires the second.
            await s.log(entries(first, ""))
            r = s.releases
            assert (r["expired"], r["access_log"], d.gateway.picker.in_flight) == (2, 0, 0)


class FakeContext:
    """A servicer context whose call ends cancelled or not, when the test says."""

    def __init__(self) -> None:
        self.callbacks: list[Any] = []
        self.was_cancelled = False

    def add_done_callback(self, cb: Any) -> None:
        self.callbacks.append(cb)

    def cancelled(self) -> bool:
        return self.was_cancelled

    def end(self, cancelled: bool) -> None:
        self.was_cancelled = cancelled
        for cb in self.callbacks:
            cb(self)


async def test_a_check_cancelled_after_its_pick_releases_at_once(stubs: Stubs) -> None:
    # Envoy gave up on the call (timeout, client gone) after the pick: the token never
    # reached the request, so no access-log entry will name it.
    picker = stubs.daemon.gateway.picker
    servicer = authz.AuthzServicer(picker, authz.Leases(picker), stubs.daemon.app.clock)
    done, gone = FakeContext(), FakeContext()
    ok_headers(await servicer.Check(check_request(completion(10)), done))
    ok_headers(await servicer.Check(check_request(completion(10)), gone))
    assert picker.in_flight == 2
    done.end(cancelled=False)  # answered: the access log releases it later
    gone.end(cancelled=True)
    assert picker.in_flight == 1
    assert stubs.releases["check_cancelled"] == 1


async def test_access_log_stream_cut_mid_way_keeps_what_it_released(stubs: Stubs) -> None:
    picker = stubs.daemon.gateway.picker
    t1 = ok_headers(await stubs.check(check_request(completion(10))))[authz.PLACEMENT_HEADER]
    t2 = ok_headers(await stubs.check(check_request(completion(10))))[authz.PLACEMENT_HEADER]

    async def gen() -> AsyncIterator[als_pb2.StreamAccessLogsMessage]:
        yield entries(t1)
        await wait_for(lambda: picker.in_flight == 1, what="first batch released")
        call.cancel()  # Envoy resets the stream

    call = stubs.logs(gen())
    with pytest.raises(asyncio.CancelledError):
        await call
    assert picker.in_flight == 1
    await stubs.log(entries(t2))
    assert picker.in_flight == 0


async def test_stop_ends_the_access_log_streams_instead_of_waiting_its_grace() -> None:
    # An Envoy stays connected for ever: without ending its stream, the server's stop
    # would wait the whole grace period (an hour here) for it.
    async with running_server(overrides()) as d:
        s = Stubs(d)
        async with s.channel:
            never = asyncio.Event()

            async def gen() -> AsyncIterator[als_pb2.StreamAccessLogsMessage]:
                yield entries("")
                await never.wait()

            call = s.logs(gen())
            await wait_for(lambda: d.gateway.access_log.open_streams == 1, what="stream open")
            await asyncio.wait_for(d.gateway.stop(3600.0), 30)
            assert isinstance(await call, als_pb2.StreamAccessLogsResponse)  # answered
            assert d.gateway.access_log.open_streams == 0
            never.set()


def timed(token: str, ttft_us: str) -> als_pb2.StreamAccessLogsMessage:
    """One entry naming ``token`` with ``ttft_us`` in the time-to-first-byte tag."""
    msg = entries(token)
    msg.http_logs.log_entry[0].common_properties.custom_tags[authz.TTFT_TAG] = ttft_us
    return msg


def chat(stream: bool = True) -> bytes:
    return json.dumps({"model": "m", "stream": stream, "max_tokens": 8,
                       "messages": [{"role": "user", "content": "hello there " * 30}]}).encode()


def ttft_counts(d: Daemon) -> dict[str, float]:
    """The access-log TTFT outcomes, the learner's samples and the observed-TTFT
    histogram's count and buckets (cumulative) at 0.1 and 0.25 s."""
    m = scrape(d)
    out = {o: m[("fulcrum_gateway_access_log_ttft_total", (("outcome", o),))]
           for o in ("read", "missing", "malformed")}
    for o in ("kept", "dropped"):
        out[o] = m[("fulcrum_gateway_cost_samples_total", (("result", o),))]
    h = "fulcrum_gateway_cache_observed_ttft_seconds"
    out["seen"] = m[(h + "_count", ())]
    for le in ("0.1", "0.25"):
        out[le] = m[(h + "_bucket", (("le", le),))]
    return out


async def test_the_access_logs_time_to_first_body_byte_is_a_learner_sample() -> None:
    # The unary and HTTP modes see no response message: Envoy's entry carries the time
    # from the first byte sent upstream to the first body byte, and that is the sample.
    async with running_server(overrides(cache={"enabled": True})) as d:
        s = Stubs(d)
        async with s.channel:
            c0 = ttft_counts(d)
            token = ok_headers(await s.check(check_request(chat(), "/v1/chat/completions")))[
                authz.PLACEMENT_HEADER]
            await s.log(timed(token, "150000"))  # 150 ms
            assert d.gateway.picker.in_flight == 0  # released as well
            c1 = ttft_counts(d)
            delta = {k: c1[k] - c0[k] for k in c0}
            assert delta["read"] == 1 and delta["seen"] == 1
            assert delta["kept"] + delta["dropped"] == 1
            assert delta["0.1"] == 0 and delta["0.25"] == 1  # 0.15 s, not the pick's own time
            # A non-streamed answer's first body byte is the whole answer: read, no sample.
            token = ok_headers(await s.check(check_request(chat(False), "/v1/chat/completions")))[
                authz.PLACEMENT_HEADER]
            await s.log(timed(token, "150000"))
            c2 = ttft_counts(d)
            assert c2["read"] == c1["read"] + 1 and c2["seen"] == c1["seen"]


@pytest.mark.parametrize(
    ("value", "outcome"),
    [("", "missing"), ("12a", "malformed"), ("-5", "malformed"), ("1.5", "malformed"),
     ("\uff11\uff12", "malformed"), ("3600000001", "malformed"), ("99999999999", "malformed")],
)
async def test_a_bad_time_in_an_entry_is_counted_and_only_the_release_happens(
    value: str, outcome: str
) -> None:
    async with running_server(overrides(cache={"enabled": True})) as d:
        s = Stubs(d)
        async with s.channel:
            token = ok_headers(await s.check(check_request(chat(), "/v1/chat/completions")))[
                authz.PLACEMENT_HEADER]
            c0 = ttft_counts(d)
            await s.log(timed(token, value))
            assert d.gateway.picker.in_flight == 0
            c1 = ttft_counts(d)
            assert {k: c1[k] - c0[k] for k in c0 if c1[k] != c0[k]} == {outcome: 1}
            # An entry naming no held placement is not read at all.
            await s.log(timed("gw-1.0", "150000"))
            assert ttft_counts(d) == c1
