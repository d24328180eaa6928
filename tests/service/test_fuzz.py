"""Fuzzing through the real server: every RPC of every Fulcrum service (found from the
proto descriptors, so services that land later are covered) receives random and extreme
field values, and raw malformed bytes on the wire. No call may end INTERNAL or UNKNOWN
(client side, and by the server's own per-code counter), and the daemon still answers
Ping and health afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import pkgutil
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import fulcrum.v1
from fulcrum.client import FulcrumClient
from fulcrum.metrics import REGISTRY
from fulcrum.service.server import Daemon
from fulcrum.testing import running_server
from fulcrum.v1 import diagnostics_pb2, expert_pb2, fleet_pb2, prefill_pb2, vision_pb2
from tests.budget import examples

BAD_CODES = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
#: Ids that exist in the daemon before fuzzing (see :func:`seed_state`), so that random
#: requests also reach code past the "unknown id" checks.
SEEDED_IDS = ("engine-0", "decode-0", "ve-0", "g")
#: Client deadline of each fuzzed call, seconds: long polls and streams end
#: DEADLINE_EXCEEDED (allowed), everything else answers at once.
CALL_TIMEOUT_S = 0.3


def all_methods() -> list[MethodDescriptor]:
    """Every method of every service declared in fulcrum.v1."""
    out: list[MethodDescriptor] = []
    for info in pkgutil.iter_modules(fulcrum.v1.__path__):
        if info.name.endswith("_pb2"):
            module = importlib.import_module(f"fulcrum.v1.{info.name}")
            for service in module.DESCRIPTOR.services_by_name.values():
                out.extend(service.methods)
    return sorted(out, key=lambda m: m.full_name)


METHODS = all_methods()


def path_of(m: MethodDescriptor) -> str:
    return f"/{m.containing_service.full_name}/{m.name}"


# -- strategies from descriptors --------------------------------------------------------

F = FieldDescriptor
_INT_RANGES = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1),
    F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_ENUM: (-(2**31), 2**31 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1),
    F.TYPE_SINT64: (-(2**63), 2**63 - 1),
    F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1),
    F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1),
    F.TYPE_FIXED64: (0, 2**64 - 1),
}
_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=24)
_STRINGS = st.one_of(
    st.sampled_from(["", "a", *SEEDED_IDS, " ", "a b", "\x00", "é", "../x", "x" * 129,
                     "y" * 4096]),
    _TEXT,
)
_BYTES = st.one_of(st.binary(max_size=48), st.sampled_from([b"", b"\x00" * 4096, b"\xff" * 7]))


def plausible_scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    """Values that pass most validation: seeded ids, small positive numbers, known enum
    values, so that requests reach the code behind the validators."""
    t = field.type
    if t == F.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values])
    if t in _INT_RANGES:
        return st.integers(1, 64) | st.sampled_from([1024, 4096, 100_000])
    if t in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return st.floats(0.0, 100.0)
    if t == F.TYPE_STRING:
        return st.sampled_from([*SEEDED_IDS, "r-1", "r-2", "int64", "float32", "least_kv"])
    return scalar(field)


def scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t in _INT_RANGES:
        lo, hi = _INT_RANGES[t]
        extremes = sorted({lo, hi, 0, 1, min(hi, 2**31), max(lo, -1)})
        known: list[int] = []
        if t == F.TYPE_ENUM:
            known = [v.number for v in field.enum_type.values]
        small = st.integers(max(lo, 0), min(hi, 64))  # plausible values pass validation
        return st.one_of(st.sampled_from(extremes + known), small, st.integers(lo, hi))
    if t in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return st.floats(allow_nan=True, allow_infinity=True, width=64 if t == F.TYPE_DOUBLE
                         else 32)
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_STRING:
        return _STRINGS
    if t == F.TYPE_BYTES:
        return _BYTES
    raise AssertionError(f"unhandled field type {t}")


def _huge_list(field: FieldDescriptor) -> st.SearchStrategy[list[Any]]:
    """A long repeated scalar (extreme length) of one repeated value."""
    return scalar(field).map(lambda v: [v] * 5000)


def message(
    desc: Descriptor, depth: int = 0, plausible: bool = False
) -> st.SearchStrategy[Message]:
    """Random messages of ``desc``: each field set or not; extreme values likely, or
    (``plausible``) values that pass validation."""
    value_of = plausible_scalar if plausible else scalar
    cls = message_factory.GetMessageClass(desc)
    parts: dict[str, st.SearchStrategy[Any]] = {}
    for field in desc.fields:
        repeated = field.is_repeated
        if field.type == F.TYPE_MESSAGE:
            if field.message_type.GetOptions().map_entry or depth >= 3:
                continue
            sub = message(field.message_type, depth + 1, plausible)
            parts[field.name] = st.lists(sub, max_size=4) if repeated else st.none() | sub
        elif repeated:
            lists = st.lists(value_of(field), max_size=8)
            parts[field.name] = lists if plausible else lists | _huge_list(field)
        else:
            parts[field.name] = st.none() | value_of(field)

    def build(values: dict[str, Any]) -> Message:
        msg = cls()
        for name, value in values.items():
            if value is None:
                continue
            field = desc.fields_by_name[name]
            if field.is_repeated:
                target = getattr(msg, name)
                if field.type == F.TYPE_MESSAGE:
                    for item in value:
                        target.add().CopyFrom(item)
                else:
                    target.extend(value)
            elif field.type == F.TYPE_MESSAGE:
                getattr(msg, name).CopyFrom(value)
            else:
                setattr(msg, name, value)
        return msg

    return st.fixed_dictionaries(parts).map(build)


def requests_for_all() -> st.SearchStrategy[list[tuple[MethodDescriptor, list[bytes]]]]:
    """One to three serialized requests for every method."""
    return st.tuples(
        *[
            st.lists(
                message(m.input_type) | message(m.input_type, plausible=True),
                min_size=1, max_size=3,
            ).map(
                lambda msgs, m=m: (m, [x.SerializeToString() for x in msgs])
            )
            for m in METHODS
        ]
    ).map(list)


# -- raw calls ------------------------------------------------------------------------


def _ident(b: bytes) -> bytes:
    return b


@dataclass
class Outcome:
    method: str
    code: grpc.StatusCode
    details: str
    trailers: tuple[tuple[str, Any], ...] = ()

    @property
    def retry_after_ms(self) -> int | None:
        value = dict(self.trailers).get("retry-after-ms")
        return None if value is None else int(value)


async def call_raw(
    channel: grpc.aio.Channel,
    m: MethodDescriptor,
    payloads: list[bytes],
    timeout: float = CALL_TIMEOUT_S,
) -> Outcome:
    """Call ``m`` with raw request bytes (one message for unary requests, all of them on a
    client stream); read every response until the end or the deadline."""
    path = path_of(m)
    kw: dict[str, Callable[[bytes], bytes]] = {
        "request_serializer": _ident, "response_deserializer": _ident}
    try:
        if m.client_streaming:

            async def gen() -> AsyncIterator[bytes]:
                for p in payloads:
                    yield p

            if m.server_streaming:
                call = channel.stream_stream(path, **kw)(gen(), timeout=timeout)
                async for _ in call:
                    pass
            else:
                await channel.stream_unary(path, **kw)(gen(), timeout=timeout)
        elif m.server_streaming:
            stream = channel.unary_stream(path, **kw)(payloads[0], timeout=timeout)
            async for _ in stream:
                pass
        else:
            await channel.unary_unary(path, **kw)(payloads[0], timeout=timeout)
    except grpc.aio.AioRpcError as err:
        return Outcome(path, err.code(), err.details() or "",
                       tuple(err.trailing_metadata() or ()))
    return Outcome(path, grpc.StatusCode.OK, "")


def server_bad_codes() -> float:
    """Calls the server itself counted as INTERNAL or UNKNOWN, all methods."""
    total = 0.0
    for family in REGISTRY.collect():
        if family.name != "fulcrum_rpc_requests":
            continue
        for s in family.samples:
            if s.name.endswith("_total") and s.labels.get("code") in ("INTERNAL", "UNKNOWN"):
                total += s.value
    return total


async def seed_state(client: FulcrumClient) -> None:
    """Register one member of each kind and an EP group under :data:`SEEDED_IDS`."""
    await client.fleet.Register(fleet_pb2.RegisterRequest(
        member_id="engine-0", prefill_engine=fleet_pb2.PrefillEngineShape(dp_ranks=2)))
    await client.fleet.Register(fleet_pb2.RegisterRequest(
        member_id="decode-0", decode_instance=fleet_pb2.DecodeInstanceShape(gpus=[
            fleet_pb2.DecodeGpuCapacity(max_concurrency=8, max_kv_tokens=1 << 20)] * 2)))
    await client.fleet.Register(fleet_pb2.RegisterRequest(
        member_id="ve-0", vision_machine=fleet_pb2.VisionMachineShape(
            gpus=2, max_patches_in_flight=100_000)))
    with contextlib.suppress(grpc.aio.AioRpcError):  # best effort: EPLB may not be there
        await client.expert.RegisterGroup(expert_pb2.RegisterGroupRequest(
            group_id="g", role=expert_pb2.GROUP_ROLE_DECODE, ep_size=4, num_layers=2,
            num_experts=8, expert_bytes=1024))


async def still_alive(client: FulcrumClient) -> None:
    """The daemon answers Ping, health and ListMembers, and every collector scrapes."""
    reply = await client.diagnostics.Ping(diagnostics_pb2.PingRequest(payload=b"ok"))
    assert reply.payload == b"ok"
    health = await client.health.Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    listed = await client.fleet.ListMembers(fleet_pb2.ListMembersRequest(page_size=256))
    assert all(m.member_id for m in listed.members)
    # Every collector still scrapes after the fuzz, and the exposition parses back: a
    # collector broken by odd state raises here (the fleet gauges are snapshots the loop
    # publishes, so their values may lag the live table by one publish).
    parsed = {f.name: f for f in text_string_to_metric_families(
        generate_latest(REGISTRY).decode())}
    for name in ("fulcrum_decode_gpus", "fulcrum_rpc_requests"):
        assert name in parsed, sorted(parsed)[:20]
    [gpus] = parsed["fulcrum_decode_gpus"].samples
    assert gpus.value >= 0 and float(gpus.value).is_integer(), gpus


#: What grpc-python's aio client reports when one of its own stream writes fails after the
#: call ended (here: its 0.3 s deadline passed mid-stream on a loaded machine): the client
#: overwrites the call's real status (grpc/grpc#36066, fix proposed in grpc/grpc#43486).
#: The daemon never sent it; :func:`server_bad_codes` counts what the daemon sent.
CLIENT_WRITE_FAILED = "Internal error from Core"
#: Deadline of the lone retry of such a call, seconds.
RETRY_TIMEOUT_S = 3.0


async def fire(channel: grpc.aio.Channel, batch: list[tuple[MethodDescriptor, list[bytes]]]
               ) -> list[Outcome]:
    """Every call of ``batch`` at once. A client-streaming call the client itself turned
    into INTERNAL (:data:`CLIENT_WRITE_FAILED`, no trailers) is sent again alone with a
    long deadline, and that answer is the outcome: a daemon that really answers INTERNAL
    does so again and still fails the test."""
    out = list(await asyncio.gather(*(call_raw(channel, m, p) for m, p in batch)))
    for i, ((m, p), o) in enumerate(zip(batch, out, strict=True)):
        if (m.client_streaming and o.code == grpc.StatusCode.INTERNAL
                and o.details == CLIENT_WRITE_FAILED and not o.trailers):
            out[i] = await call_raw(channel, m, p, timeout=RETRY_TIMEOUT_S)
    return out


def assert_clean(outcomes: list[Outcome]) -> None:
    bad = [o for o in outcomes if o.code in BAD_CODES]
    assert not bad, bad[:5]


# -- tests ----------------------------------------------------------------------------


@pytest.fixture
async def daemon() -> AsyncIterator[Daemon]:
    """A daemon with the test settings, without the metrics endpoint (collectors are
    still read in-process)."""
    async with running_server({"metrics": {"enabled": False}}) as d:
        yield d


@pytest.fixture
async def client(daemon: Daemon) -> AsyncIterator[FulcrumClient]:
    async with FulcrumClient(daemon.address, timeout_s=10.0) as c:
        yield c


def test_every_service_is_fuzzed() -> None:
    services = {m.containing_service.name for m in METHODS}
    assert services >= {"DiagnosticsService", "FleetService", "PrefillBalancerService",
                        "DecodeBalancerService", "VisionBalancerService",
                        "ExpertBalancerService"}


#: One daemon serves every example of a test (the fixture is function-scoped on purpose)
#: and a batch of real RPCs is slow next to Hypothesis' expectations.
FUZZ_HEALTH = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
               HealthCheck.data_too_large]


@settings(max_examples=examples(fast=12, ci=200, deep=1_000), suppress_health_check=FUZZ_HEALTH)
@given(batch=requests_for_all())
async def test_random_and_extreme_fields(
    daemon: Daemon, client: FulcrumClient, batch: list[tuple[MethodDescriptor, list[bytes]]]
) -> None:
    await seed_state(client)
    before = server_bad_codes()
    outcomes = await fire(client.channel, batch)
    assert_clean(outcomes)
    assert server_bad_codes() == before
    await still_alive(client)


@settings(max_examples=examples(fast=10, ci=200, deep=1_000), suppress_health_check=FUZZ_HEALTH)
@given(payloads=st.lists(
    st.one_of(
        st.binary(min_size=1, max_size=64),
        # a field tag with a truncated length-delimited value
        st.sampled_from([b"\x0a\xff\xff\xff\xff\x0f", b"\x0a\x05ab", b"\xff" * 9,
                         b"\x08" + b"\xff" * 10, b"\x12\x02\xc3\x28"]),
    ),
    min_size=len(METHODS), max_size=len(METHODS),
))
async def test_malformed_bytes_on_the_wire(
    daemon: Daemon, client: FulcrumClient, payloads: list[bytes]
) -> None:
    before = server_bad_codes()
    batch = [(m, [p]) for m, p in zip(METHODS, payloads, strict=True)]
    outcomes = await fire(client.channel, batch)
    assert_clean(outcomes)
    assert server_bad_codes() == before
    await still_alive(client)


async def test_known_malformed_message_is_invalid_argument(client: FulcrumClient) -> None:
    """A string field holding invalid UTF-8 does not parse: INVALID_ARGUMENT, not UNKNOWN."""
    ping = next(m for m in METHODS if m.name == "Ping")
    register = next(m for m in METHODS if m.name == "Register")
    for m in (ping, register):
        out = await call_raw(client.channel, m, [b"\x0a\x02\xc3\x28"])
        if m is ping:  # bytes field: any bytes parse
            assert out.code == grpc.StatusCode.OK
        else:
            assert out.code == grpc.StatusCode.INVALID_ARGUMENT, out
            assert "protobuf" in out.details
    stream = next(m for m in METHODS if m.name == "PingStream")
    out = await call_raw(client.channel, stream, [b"\x0a\x01x", b"\x0a\xff"])
    assert out.code == grpc.StatusCode.INVALID_ARGUMENT, out


def _register_of_size(size: int) -> bytes:
    """A valid RegisterRequest (engine "abc", 2 DP ranks) of about ``size`` bytes: the bulk
    is an unknown length-delimited field (number 1000) of zero bytes, which parses (and is
    ignored) like any field a newer client may send."""
    head = fleet_pb2.RegisterRequest(
        member_id="abc", prefill_engine=fleet_pb2.PrefillEngineShape(dp_ranks=2)
    ).SerializeToString()
    tag = _varint((1000 << 3) | 2)
    fill = max(0, size - len(head) - len(tag) - len(_varint(size)))
    payload = head + tag + _varint(fill) + b"\x00" * fill
    assert fleet_pb2.RegisterRequest.FromString(payload).member_id == "abc"
    return payload


@pytest.mark.parametrize("size", [1 << 20, 17 << 20, 33 << 20])
async def test_oversized_message(daemon: Daemon, client: FulcrumClient, size: int) -> None:
    """Past server.max_message_bytes (16 MiB) the answer is RESOURCE_EXHAUSTED: up to twice
    the bound from the daemon, naming the bound, with a retry-after-ms trailer; beyond
    twice the bound gRPC's transport refuses the message before any of our code runs
    (RESOURCE_EXHAUSTED "Received message larger than max", no trailer). Below, a valid
    message is served."""
    limit = daemon.app.settings.server.max_message_bytes
    register = next(m for m in METHODS if m.name == "Register")
    out = await call_raw(client.channel, register, [_register_of_size(size)], timeout=10.0)
    if size <= limit:
        assert out.code == grpc.StatusCode.OK, out
        listed = await client.fleet.ListMembers(fleet_pb2.ListMembersRequest())
        assert [m.member_id for m in listed.members] == ["abc"]
    else:
        assert out.code == grpc.StatusCode.RESOURCE_EXHAUSTED, out
    if limit < size <= 2 * limit:
        assert "server.max_message_bytes=16777216" in out.details, out
        assert out.retry_after_ms is not None and out.retry_after_ms > 0, out
    if size > 2 * limit:
        assert "larger than max" in out.details, out
        assert out.retry_after_ms is None
    if size > limit:  # refused: nothing registered
        listed = await client.fleet.ListMembers(fleet_pb2.ListMembersRequest())
        assert list(listed.members) == []
    # the same bound on a client stream, message by message
    stream = next(m for m in METHODS if m.name == "PingStream")
    if limit < size <= 2 * limit:
        out = await call_raw(client.channel, stream, [b"\x0a\x01x", b"\x0a" + _varint(size)
                                                     + b"\x00" * size], timeout=10.0)
        assert out.code == grpc.StatusCode.RESOURCE_EXHAUSTED, out
        assert out.retry_after_ms is not None, out
    await still_alive(client)


async def test_corrupt_message_under_the_size_bound_is_invalid_argument(
    client: FulcrumClient,
) -> None:
    """Zero bytes inside field 2 (a PrefillEngineShape) are corrupt wire format (field
    number 0): refused INVALID_ARGUMENT naming the protobuf decoding, whatever the size
    below the bound, and nothing is registered."""
    register = next(m for m in METHODS if m.name == "Register")
    for size in (16, 1 << 20):
        payload = b"\x0a\x03abc" + b"\x12" + _varint(size) + b"\x00" * size
        with pytest.raises(DecodeError):
            fleet_pb2.RegisterRequest.FromString(payload)
        out = await call_raw(client.channel, register, [payload], timeout=10.0)
        assert out.code == grpc.StatusCode.INVALID_ARGUMENT, out
        assert "protobuf" in out.details, out
    listed = await client.fleet.ListMembers(fleet_pb2.ListMembersRequest())
    assert list(listed.members) == []
    await still_alive(client)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


# -- every RPC's repeated fields at and beyond their bounds -------------------------------

U32 = (1 << 32) - 1


def _register_decode(n: int) -> fleet_pb2.RegisterRequest:
    return fleet_pb2.RegisterRequest(member_id="decode-x", decode_instance=fleet_pb2.
                                     DecodeInstanceShape(gpus=[fleet_pb2.DecodeGpuCapacity(
                                         max_concurrency=1, max_kv_tokens=1)] * n))


def _heartbeat_decode(n: int) -> fleet_pb2.HeartbeatRequest:
    return fleet_pb2.HeartbeatRequest(member_id="decode-0", incarnation=1,
                                      decode_instance=fleet_pb2.DecodeInstanceLoad(
                                          gpus=[fleet_pb2.DecodeGpuLoad()] * n))


def _heartbeat_vision(n: int) -> fleet_pb2.HeartbeatRequest:
    return fleet_pb2.HeartbeatRequest(member_id="ve-0", incarnation=1,
                                      vision_machine=fleet_pb2.VisionMachineLoad(
                                          patches_in_flight=[0] * n))


def _pull(n: int) -> prefill_pb2.PullRequest:
    return prefill_pb2.PullRequest(engine_id="engine-0", rank_loads_ns=[0] * n)


def _report(n: int) -> prefill_pb2.ReportStepTimesRequest:
    return prefill_pb2.ReportStepTimesRequest(
        engine_id="engine-0", samples=[prefill_pb2.StepSample(q=1, c=0, measured_ns=1)] * n)


def _images(n: int) -> vision_pb2.PlaceImagesRequest:
    return vision_pb2.PlaceImagesRequest(
        request_id="r-bound", images=[vision_pb2.Image(width=16, height=16, patch_size=16)] * n)


def _register_group(shape: list[int]) -> expert_pb2.RegisterGroupRequest:
    return expert_pb2.RegisterGroupRequest(
        group_id="g-bound", role=expert_pb2.GROUP_ROLE_DECODE, ep_size=4, num_layers=2,
        num_experts=8, expert_bytes=1024,
        initial_map=expert_pb2.Tensor(dtype="int64", shape=shape, data=b""))


def _report_load(shape: list[int]) -> expert_pb2.ReportLoadRequest:
    return expert_pb2.ReportLoadRequest(
        group_id="g", step_begin=0, step_end=1,
        load=expert_pb2.Tensor(dtype="int64", shape=shape, data=b""))


def _report_values(n: int) -> expert_pb2.ReportLoadRequest:
    return expert_pb2.ReportLoadRequest(group_id="g", step_begin=0, step_end=1,
                                        load_values=[1] * n)



#: (case, method name, request, field named in the answer, bound named in the answer
#: ("" when the bound is not a number of this daemon's settings))
BOUND_CASES = [
    pytest.param("Register", _register_decode(1025), "decode_instance.gpus", "1024",
                 id="Register.decode_instance.gpus=1025"),
    pytest.param("Register", _register_decode(200_000), "decode_instance.gpus", "1024",
                 id="Register.decode_instance.gpus=200000"),
    pytest.param("Heartbeat", _heartbeat_decode(1025), "decode_instance.gpus", "1024",
                 id="Heartbeat.decode_instance.gpus=1025"),
    pytest.param("Heartbeat", _heartbeat_vision(1_000_000), "vision_machine.patches_in_flight",
                 "1024", id="Heartbeat.vision_machine.patches_in_flight=1e6"),
    pytest.param("Pull", _pull(1_000_000), "rank_loads_ns", "", id="Pull.rank_loads_ns=1e6"),
    pytest.param("ReportStepTimes", _report(4097), "samples", "4096",
                 id="ReportStepTimes.samples=4097"),
    pytest.param("PlaceImages", _images(65), "images", "64", id="PlaceImages.images=65"),
    pytest.param("PlaceImages", _images(200_000), "images", "64",
                 id="PlaceImages.images=200000"),
    pytest.param("RegisterGroup", _register_group([1] * 65), "initial_map.shape", "",
                 id="RegisterGroup.initial_map.shape=65dims"),
    pytest.param("RegisterGroup", _register_group([0, U32, U32, U32]), "initial_map", "",
                 id="RegisterGroup.initial_map.shape=huge"),
    pytest.param("ReportLoad", _report_load([1] * 65), "load.shape", "",
                 id="ReportLoad.load.shape=65dims"),
    pytest.param("ReportLoad", _report_load([0, U32, U32, U32]), "load", "",
                 id="ReportLoad.load.shape=huge"),
    pytest.param("ReportLoad", _report_values(1_000_000), "load_values", "",
                 id="ReportLoad.load_values=1e6"),
]


@pytest.mark.parametrize(("method", "request_", "field", "bound"), BOUND_CASES)
async def test_repeated_fields_beyond_their_bounds(
    client: FulcrumClient, method: str, request_: Message, field: str, bound: str
) -> None:
    """A repeated field past its bound gets INVALID_ARGUMENT or RESOURCE_EXHAUSTED naming
    the field (and the bound when it is a setting), never INTERNAL; the daemon lives on."""
    await seed_state(client)
    m = next(x for x in METHODS if x.name == method)
    before = server_bad_codes()
    out = await call_raw(client.channel, m, [request_.SerializeToString()], timeout=10.0)
    assert out.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), out
    assert field in out.details, out
    assert bound in out.details, out
    assert server_bad_codes() == before
    await still_alive(client)


async def test_repeated_fields_at_their_bounds_are_served(client: FulcrumClient) -> None:
    """At the bound itself nothing is refused for its length."""
    reg = await client.fleet.Register(_register_decode(1024))
    assert reg.incarnation > 0
    listed = await client.fleet.ListMembers(fleet_pb2.ListMembersRequest(
        kind=fleet_pb2.MEMBER_KIND_DECODE_INSTANCE, page_size=256))
    [member] = [m for m in listed.members if m.member_id == "decode-x"]
    assert member.gpus == 1024
    await seed_state(client)
    report = await client.prefill.ReportStepTimes(_report(4096))
    assert report.accepted == 4096
    placed = await client.vision.PlaceImages(_images(64))
    assert len(placed.placements) == 64
    assert {p.machine_id for p in placed.placements} == {"ve-0"}
    assert sum(p.patches for p in placed.placements) == 64  # one 16x16 patch per image
    await still_alive(client)


async def test_stream_repeated_field_beyond_its_bound(client: FulcrumClient) -> None:
    """PlaceImagesStream answers a placement with too many images in-band (the unary
    call's code and message), and the stream goes on."""
    await seed_state(client)

    async def requests() -> AsyncIterator[vision_pb2.PlaceImagesStreamRequest]:
        yield vision_pb2.PlaceImagesStreamRequest(sequence=1, place=_images(65))
        yield vision_pb2.PlaceImagesStreamRequest(sequence=2, place=_images(1))

    replies = [r async for r in client.vision.PlaceImagesStream(requests(), timeout=10)]
    by_seq = {r.sequence: r for r in replies}
    assert by_seq[1].code in (grpc.StatusCode.INVALID_ARGUMENT.value[0],
                              grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]), by_seq[1]
    assert "images" in by_seq[1].message and "64" in by_seq[1].message, by_seq[1]
    assert by_seq[2].code == 0, by_seq[2]
    await still_alive(client)
