"""FleetService over real gRPC: admission, heartbeats, lapses, bounds, bad input."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.client import FulcrumClient, MemberSession
from fulcrum.service.server import Daemon
from fulcrum.testing import running_server
from fulcrum.v1 import fleet_pb2 as pb


def decode_instance(member_id: str, gpus: int = 2) -> pb.RegisterRequest:
    return pb.RegisterRequest(
        member_id=member_id,
        decode_instance=pb.DecodeInstanceShape(
            gpus=[pb.DecodeGpuCapacity(max_concurrency=64, max_kv_tokens=1 << 20)] * gpus
        ),
    )


class FakeClock:
    def __init__(self, now: int = 10**12) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


async def test_register_heartbeat_list_deregister(client: FulcrumClient) -> None:
    reply = await client.fleet.Register(decode_instance("dec-0"))
    assert reply.incarnation > 0 and reply.heartbeat_timeout_ms == 5000
    load = pb.DecodeInstanceLoad(gpus=[pb.DecodeGpuLoad(concurrency=3, kv_tokens=100)] * 2)
    await client.fleet.Heartbeat(
        pb.HeartbeatRequest(member_id="dec-0", incarnation=reply.incarnation, decode_instance=load)
    )
    listed = await client.fleet.ListMembers(pb.ListMembersRequest())
    assert [(m.member_id, m.kind, m.gpus) for m in listed.members] == [
        ("dec-0", pb.MEMBER_KIND_DECODE_INSTANCE, 2)
    ]
    await client.fleet.Deregister(
        pb.DeregisterRequest(member_id="dec-0", incarnation=reply.incarnation)
    )
    listed = await client.fleet.ListMembers(pb.ListMembersRequest())
    assert list(listed.members) == []


async def test_reregister_gets_new_incarnation_and_old_one_is_refused(
    client: FulcrumClient,
) -> None:
    first = await client.fleet.Register(decode_instance("dec-1"))
    second = await client.fleet.Register(decode_instance("dec-1"))
    assert second.incarnation > first.incarnation
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.fleet.Heartbeat(
            pb.HeartbeatRequest(member_id="dec-1", incarnation=first.incarnation)
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_lapsed_member_leaves_and_session_reregisters(daemon: Daemon) -> None:
    clock = FakeClock()
    daemon.app.clock = clock
    async with FulcrumClient(daemon.address) as client:
        session = MemberSession(
            client,
            pb.RegisterRequest(
                member_id="pf-0", prefill_engine=pb.PrefillEngineShape(dp_ranks=4)
            ),
        )
        first = await session.register()
        clock.now += 6_000_000_000  # past the 5 s timeout
        assert [m.member_id for m in daemon.app.fleet.expire(clock.now)] == ["pf-0"]
        listed = await client.fleet.ListMembers(pb.ListMembersRequest())
        assert list(listed.members) == []
        await session.heartbeat()  # NOT_FOUND -> registers again on its own
        assert session.incarnation > first and session.registrations == 2
        listed = await client.fleet.ListMembers(
            pb.ListMembersRequest(kind=pb.MEMBER_KIND_PREFILL_ENGINE)
        )
        assert [m.member_id for m in listed.members] == ["pf-0"]


async def test_lapse_is_detected_on_access_before_the_sweep(daemon: Daemon) -> None:
    clock = FakeClock()
    daemon.app.clock = clock
    async with FulcrumClient(daemon.address) as client:
        reply = await client.fleet.Register(decode_instance("dec-2"))
        clock.now += 5_000_000_001
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.fleet.Heartbeat(
                pb.HeartbeatRequest(member_id="dec-2", incarnation=reply.incarnation)
            )
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(
    ("request_", "code", "needle"),
    [
        (pb.RegisterRequest(member_id="x"), grpc.StatusCode.INVALID_ARGUMENT, "shape"),
        (
            pb.RegisterRequest(
                member_id="bad id", prefill_engine=pb.PrefillEngineShape(dp_ranks=1)
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "member_id",
        ),
        (
            pb.RegisterRequest(member_id="p", prefill_engine=pb.PrefillEngineShape(dp_ranks=0)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "prefill_engine.dp_ranks",
        ),
        (
            pb.RegisterRequest(member_id="d", decode_instance=pb.DecodeInstanceShape()),
            grpc.StatusCode.INVALID_ARGUMENT,
            "decode_instance.gpus",
        ),
        (
            pb.RegisterRequest(
                member_id="d",
                decode_instance=pb.DecodeInstanceShape(
                    gpus=[pb.DecodeGpuCapacity(max_concurrency=1, max_kv_tokens=0)]
                ),
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "decode_instance.gpus[0].max_kv_tokens",
        ),
        (
            pb.RegisterRequest(member_id="v", vision_machine=pb.VisionMachineShape(gpus=0)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "vision_machine.gpus",
        ),
    ],
)
async def test_bad_registration_is_refused_and_changes_nothing(
    client: FulcrumClient, request_: pb.RegisterRequest, code: grpc.StatusCode, needle: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.fleet.Register(request_)
    assert err.value.code() == code
    assert needle in (err.value.details() or "")
    listed = await client.fleet.ListMembers(pb.ListMembersRequest())
    assert list(listed.members) == []


async def test_heartbeat_load_of_wrong_kind_or_size_is_refused(client: FulcrumClient) -> None:
    reply = await client.fleet.Register(decode_instance("dec-3", gpus=2))
    bad = [
        pb.HeartbeatRequest(
            member_id="dec-3",
            incarnation=reply.incarnation,
            vision_machine=pb.VisionMachineLoad(patches_in_flight=[1, 2]),
        ),
        pb.HeartbeatRequest(
            member_id="dec-3",
            incarnation=reply.incarnation,
            decode_instance=pb.DecodeInstanceLoad(gpus=[pb.DecodeGpuLoad()]),
        ),
    ]
    for request in bad:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.fleet.Heartbeat(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.fleet.Heartbeat(pb.HeartbeatRequest(member_id="nobody", incarnation=1))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_same_id_with_another_kind_already_exists(client: FulcrumClient) -> None:
    await client.fleet.Register(decode_instance("m-1"))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.fleet.Register(
            pb.RegisterRequest(member_id="m-1", vision_machine=pb.VisionMachineShape(gpus=8))
        )
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS


async def test_member_table_bound_gives_resource_exhausted_with_retry_hint() -> None:
    async with (
        running_server({"fleet": {"max_members": 2}}) as d,
        FulcrumClient(d.address) as client,
    ):
        await client.fleet.Register(decode_instance("a"))
        await client.fleet.Register(decode_instance("b"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.fleet.Register(decode_instance("c"))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailing = dict(err.value.trailing_metadata() or ())
        assert int(trailing["retry-after-ms"]) > 0
        # re-registering an existing member is still allowed at the bound
        await client.fleet.Register(decode_instance("a"))


# -- reload, kinds and messages -------------------------------------------------------


def test_reloaded_heartbeat_timeout_applies_to_live_members() -> None:
    """fleet.heartbeat_timeout_ms applies at once: a member that was live under the old
    5 s timeout lapses under the reloaded 1 s one (at access and at the sweep)."""
    from fulcrum.config.server import FleetSettings
    from fulcrum.core.types import PrefillEngineShape
    from fulcrum.errors import NotFound
    from fulcrum.state.fleet import Fleet

    fleet = Fleet(FleetSettings())
    t0 = 10**12
    a, _ = fleet.register("a", PrefillEngineShape(dp_ranks=1), t0)
    fleet.register("b", PrefillEngineShape(dp_ranks=1), t0)
    t1 = t0 + 2_000_000_000  # 2 s: live under 5 s
    fleet.heartbeat("a", a.incarnation, None, t1)
    assert fleet.expire(t1) == []
    fleet.apply_settings(FleetSettings(heartbeat_timeout_ms=1000))
    t2 = t1 + 1_500_000_000
    with pytest.raises(NotFound, match="lapsed"):
        fleet.heartbeat("a", a.incarnation, None, t2)
    assert [m.member_id for m in fleet.expire(t2)] == ["b"]
    # a lower max_members refuses new members, evicts none
    fleet.register("c", PrefillEngineShape(dp_ranks=1), t2)
    fleet.register("d", PrefillEngineShape(dp_ranks=1), t2)
    fleet.apply_settings(FleetSettings(max_members=1))
    assert fleet.count() == 2
    from fulcrum.errors import ResourceExhausted

    with pytest.raises(ResourceExhausted):
        fleet.register("e", PrefillEngineShape(dp_ranks=1), t2)


def test_heartbeat_for_another_kind_is_refused_and_not_counted() -> None:
    """A call that stands for a heartbeat of one kind (a prefill Pull) does not refresh a
    member of another kind (a decode instance's id)."""
    from fulcrum.config.server import FleetSettings
    from fulcrum.core.types import DecodeInstanceShape, MemberKind
    from fulcrum.errors import NotFound
    from fulcrum.state.fleet import Fleet

    fleet = Fleet(FleetSettings())
    t0 = 10**12
    dec, _ = fleet.register("dec", DecodeInstanceShape((8,), (1000,)), t0)
    t1 = t0 + 4_000_000_000
    with pytest.raises(NotFound, match="engine_id: 'dec' is not a registered prefill_engine"):
        fleet.heartbeat("dec", dec.incarnation, None, t1, kind=MemberKind.PREFILL_ENGINE,
                        field="engine_id")
    # not refreshed: it lapses 5 s after its registration, not after the refused call
    assert [m.member_id for m in fleet.expire(t0 + 5_000_000_001)] == ["dec"]


async def test_refused_pull_is_not_a_heartbeat(daemon: Daemon) -> None:
    from fulcrum.v1 import prefill_pb2

    clock = FakeClock()
    daemon.app.clock = clock
    daemon.app.components["prefill"]._clock = clock  # the prefill state's own clock
    async with FulcrumClient(daemon.address) as client:
        reply = await client.fleet.Register(decode_instance("dec-p"))
        clock.now += 4_000_000_000
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.prefill.Pull(
                prefill_pb2.PullRequest(engine_id="dec-p", incarnation=reply.incarnation),
                timeout=5,
            )
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        clock.now += 1_000_000_001  # 5 s after registration, 1 s after the refused pull
        assert [m.member_id for m in daemon.app.fleet.expire(clock.now)] == ["dec-p"]


async def test_largest_kv_tokens_is_accepted_and_range_is_named(client: FulcrumClient) -> None:
    """max_kv_tokens = 2^64-1 is in range (it was refused as "must be > 0")."""
    top = (1 << 64) - 1
    await client.fleet.Register(pb.RegisterRequest(
        member_id="dec-big",
        decode_instance=pb.DecodeInstanceShape(
            gpus=[pb.DecodeGpuCapacity(max_concurrency=1, max_kv_tokens=top)])))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.fleet.Register(pb.RegisterRequest(
            member_id="dec-zero",
            decode_instance=pb.DecodeInstanceShape(
                gpus=[pb.DecodeGpuCapacity(max_concurrency=1, max_kv_tokens=0)])))
    assert err.value.details() == (
        "decode_instance.gpus[0].max_kv_tokens: must be in [1, 2^64-1]")


async def test_prefill_heartbeat_with_load_names_the_pull(client: FulcrumClient) -> None:
    reply = await client.fleet.Register(pb.RegisterRequest(
        member_id="pf-load", prefill_engine=pb.PrefillEngineShape(dp_ranks=2)))
    for load in ({"decode_instance": pb.DecodeInstanceLoad(gpus=[pb.DecodeGpuLoad()] * 2)},
                 {"vision_machine": pb.VisionMachineLoad(patches_in_flight=[0, 0])}):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.fleet.Heartbeat(pb.HeartbeatRequest(
                member_id="pf-load", incarnation=reply.incarnation, **load))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = err.value.details() or ""
        assert details.startswith("load: must be empty for a prefill engine"), details
        assert "decode instance" not in details


def test_lookups_name_the_callers_field_and_kind() -> None:
    from fulcrum.config.server import FleetSettings
    from fulcrum.core.types import DecodeInstanceShape, MemberKind
    from fulcrum.errors import NotFound
    from fulcrum.state.fleet import Fleet

    fleet = Fleet(FleetSettings())
    fleet.register("dec", DecodeInstanceShape((8,), (1000,)), 0)
    with pytest.raises(NotFound, match=r"^engine_id: .nobody. is not registered"):
        fleet.get_live("nobody", None, 1, field="engine_id")
    with pytest.raises(NotFound, match=r"^engine_id: .dec. is not a registered prefill_engine"):
        fleet.get_live("dec", None, 1, kind=MemberKind.PREFILL_ENGINE, field="engine_id")
    assert fleet.get_live("dec", None, 1, kind=MemberKind.DECODE_INSTANCE).member_id == "dec"


# -- ListMembers: kind-specific detail, pages ------------------------------------------


async def test_list_members_shows_each_kinds_tier_and_load(
    daemon: Daemon, client: FulcrumClient
) -> None:
    from fulcrum.v1 import decode_pb2, prefill_pb2, vision_pb2

    pf = await client.fleet.Register(
        pb.RegisterRequest(
            member_id="pf-0",
            prefill_engine=pb.PrefillEngineShape(dp_ranks=2, step_quota_ns=500_000_000),
        )
    )
    dec = await client.fleet.Register(decode_instance("dec-0", gpus=2))
    ve = await client.fleet.Register(
        pb.RegisterRequest(member_id="ve-0", vision_machine=pb.VisionMachineShape(gpus=2))
    )
    await client.fleet.Heartbeat(
        pb.HeartbeatRequest(
            member_id="dec-0",
            incarnation=dec.incarnation,
            decode_instance=pb.DecodeInstanceLoad(
                gpus=[
                    pb.DecodeGpuLoad(concurrency=3, kv_tokens=300),
                    pb.DecodeGpuLoad(concurrency=5, kv_tokens=100),
                ]
            ),
        )
    )
    await client.decode.PlaceDecode(decode_pb2.PlaceDecodeRequest(request_id="r", kv_tokens=40))
    await client.fleet.Heartbeat(
        pb.HeartbeatRequest(
            member_id="ve-0",
            incarnation=ve.incarnation,
            vision_machine=pb.VisionMachineLoad(patches_in_flight=[7, 9]),
        )
    )
    # a pull that finds no work reports the engine's rank loads (ns)
    await client.prefill.Pull(
        prefill_pb2.PullRequest(
            engine_id="pf-0",
            incarnation=pf.incarnation,
            remaining_quota_ns=10**9,
            rank_loads_ns=[2_000, 3_000],
            max_wait_ms=1,
        )
    )
    listed = await client.fleet.ListMembers(pb.ListMembersRequest())
    by_id = {m.member_id: m for m in listed.members}
    assert list(by_id) == ["dec-0", "pf-0", "ve-0"] and listed.next_page_token == ""

    p = by_id["pf-0"]
    assert p.WhichOneof("info") == "prefill_engine"
    prefill = daemon.app.components["prefill"]
    tier = prefill.engine_tier("pf-0")
    assert p.prefill_engine.has_tier and p.prefill_engine.tier == tier >= 0
    assert p.prefill_engine.tier_label == prefill.labels[tier]
    assert p.prefill_engine.dp_ranks == 2 and p.prefill_engine.step_quota_ns == 500_000_000
    assert p.prefill_engine.load_ns == 5_000

    d = by_id["dec-0"]
    assert d.WhichOneof("info") == "decode_instance"
    state = daemon.app.components["decode"]
    loads = [state.gpu_load("dec-0", g) for g in range(2)]
    assert (d.decode_instance.concurrency, d.decode_instance.kv_tokens) == (
        sum(c for c, _ in loads), sum(k for _, k in loads)
    )
    assert d.decode_instance.concurrency == 3 + 5 + 1  # the report plus the placement
    assert d.decode_instance.max_gpu_concurrency == max(c for c, _ in loads)
    assert d.decode_instance.max_gpu_kv_tokens == max(k for _, k in loads)

    v = by_id["ve-0"]
    assert v.WhichOneof("info") == "vision_machine"
    await client.vision.PlaceImages(
        vision_pb2.PlaceImagesRequest(
            request_id="img", images=[vision_pb2.Image(width=160, height=160)]
        )
    )
    listed = await client.fleet.ListMembers(
        pb.ListMembersRequest(kind=pb.MEMBER_KIND_VISION_MACHINE)
    )
    [v] = listed.members
    per_gpu, _, images = daemon.app.components["vision"].machine_load("ve-0")
    assert list(v.vision_machine.patches_in_flight) == per_gpu
    assert sum(per_gpu) == 7 + 9 + 100 and v.vision_machine.images == images == 1


async def test_list_members_pages_are_bounded(client: FulcrumClient) -> None:
    from fulcrum.service.fleet import MAX_MEMBERS_PAGE

    for i in (3, 0, 2, 1):
        await client.fleet.Register(decode_instance(f"dec-{i}", gpus=1))
    first = await client.fleet.ListMembers(pb.ListMembersRequest(page_size=3))
    assert [m.member_id for m in first.members] == ["dec-0", "dec-1", "dec-2"]
    assert first.next_page_token == "dec-2"
    rest = await client.fleet.ListMembers(
        pb.ListMembersRequest(page_size=3, page_token=first.next_page_token)
    )
    assert [m.member_id for m in rest.members] == ["dec-3"] and rest.next_page_token == ""
    for request, field in (
        (pb.ListMembersRequest(page_size=MAX_MEMBERS_PAGE + 1), "page_size"),
        (pb.ListMembersRequest(page_token="a b"), "page_token"),
        (pb.ListMembersRequest(kind=99), "kind"),  # type: ignore[arg-type]
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.fleet.ListMembers(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (err.value.details() or "").startswith(field + ":")


async def test_list_members_page_stops_at_the_gpu_bound(client: FulcrumClient) -> None:
    from fulcrum.service.fleet import MAX_MEMBERS_PAGE_GPUS

    n = MAX_MEMBERS_PAGE_GPUS // 1024 + 1
    for i in range(n):
        await client.fleet.Register(
            pb.RegisterRequest(
                member_id=f"ve-{i}", vision_machine=pb.VisionMachineShape(gpus=1024)
            )
        )
    first = await client.fleet.ListMembers(pb.ListMembersRequest())
    assert len(first.members) == n - 1 and first.next_page_token == f"ve-{n - 2}"
    assert sum(len(m.vision_machine.patches_in_flight) for m in first.members) == (
        MAX_MEMBERS_PAGE_GPUS
    )
    rest = await client.fleet.ListMembers(pb.ListMembersRequest(page_token=f"ve-{n - 2}"))
    assert [m.member_id for m in rest.members] == [f"ve-{n - 1}"]


# -- MemberSession: single-flight re-register, load resent -----------------------------


def _decode_load(concurrency: int, kv: int) -> Callable[[pb.HeartbeatRequest], None]:
    def fill(request: pb.HeartbeatRequest) -> None:
        request.decode_instance.gpus.add(concurrency=concurrency, kv_tokens=kv)

    return fill


async def test_concurrent_heartbeats_after_a_restart_register_once_and_resend_load() -> None:
    from fulcrum.v1 import decode_pb2

    async with running_server() as first:
        port = int(first.address.rsplit(":", 1)[1])
        client = FulcrumClient(first.address, timeout_s=10.0)
        session = MemberSession(client, decode_instance("dec-0", gpus=1), _decode_load(4, 400))
        await session.register()
        await session.heartbeat()
        assert first.app.components["decode"].gpu_load("dec-0", 0) == (4, 400)
    # Same port, fresh daemon: it has forgotten the instance.
    async with running_server({"server": {"port": port}}) as second:
        registers = 0
        inner = client.fleet.Register

        async def counting(request: pb.RegisterRequest, **kw: object) -> pb.RegisterResponse:
            nonlocal registers
            registers += 1
            return await inner(request, **kw)  # type: ignore[arg-type]

        client.fleet.Register = counting  # type: ignore[method-assign]
        await asyncio.gather(session.heartbeat(), session.heartbeat(), session.heartbeat())
        assert registers == 1 and session.registrations == 2
        listed = await client.fleet.ListMembers(pb.ListMembersRequest())
        [member] = listed.members
        assert member.incarnation == session.incarnation
        # the load was resent under the new incarnation at once (no heartbeat since)
        state = second.app.components["decode"]
        assert state.gpu_load("dec-0", 0) == (4, 400)
        # a placement on the instance survives the heartbeats that follow
        placed = await client.decode.PlaceDecode(
            decode_pb2.PlaceDecodeRequest(request_id="r", kv_tokens=10)
        )
        assert placed.incarnation == session.incarnation
        await asyncio.gather(session.heartbeat(), session.heartbeat())
        assert session.registrations == 2
        await client.decode.ReleaseDecode(decode_pb2.ReleaseDecodeRequest(request_id="r"))
        await session.stop()
        await client.close()


async def test_a_heartbeat_refused_for_a_replaced_incarnation_does_not_register_again(
    daemon: Daemon, client: FulcrumClient
) -> None:
    session = MemberSession(client, decode_instance("dec-0", gpus=1))
    old = await session.register()
    await client.fleet.Deregister(pb.DeregisterRequest(member_id="dec-0", incarnation=old))
    # both heartbeats carry the old incarnation; the first to fail registers, the second
    # joins that registration instead of replacing it
    await asyncio.gather(session.heartbeat(), session.heartbeat())
    assert session.registrations == 2 and session.incarnation > old
    listed = await client.fleet.ListMembers(pb.ListMembersRequest())
    assert [m.incarnation for m in listed.members] == [session.incarnation]


_fleet_ops = st.lists(st.tuples(
    st.sampled_from(["register", "deregister", "touch", "expire"]),
    st.integers(0, 4),  # member
    st.integers(0, 2),  # kind on registration
    st.integers(0, 3),  # seconds passed first (the timeout is 2 s)
), max_size=40)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(_fleet_ops)
def test_members_per_kind_are_counted_through_every_join_and_leave(
        ops: list[tuple[str, int, int, int]]) -> None:
    """:meth:`Fleet.count` per kind (kept with every join, replacement, deregistration,
    lapse at access and sweep) equals a count over the live members."""
    from fulcrum.config.server import FleetSettings
    from fulcrum.core.types import (
        DecodeInstanceShape,
        MemberKind,
        PrefillEngineShape,
        VisionMachineShape,
    )
    from fulcrum.errors import AlreadyExists, FailedPrecondition, NotFound
    from fulcrum.state.fleet import Fleet

    shapes = (PrefillEngineShape(dp_ranks=1), DecodeInstanceShape((4,), (1_000,)),
              VisionMachineShape(gpus=1))
    fleet = Fleet(FleetSettings(heartbeat_timeout_ms=2_000))
    now = 10**12
    incs: dict[str, int] = {}
    for op, k, kind, wait_s in ops:
        now += wait_s * 1_000_000_000
        mid = f"m{k}"
        try:
            if op == "register":
                incs[mid] = fleet.register(mid, shapes[kind], now)[0].incarnation
            elif op == "deregister":
                fleet.deregister(mid, incs.get(mid, 0), now)
            elif op == "touch":
                fleet.heartbeat(mid, incs.get(mid, 0), None, now)
            else:
                fleet.expire(now)
        except (AlreadyExists, NotFound, FailedPrecondition):
            pass  # refused: changes nothing
        for kind_ in MemberKind:
            assert fleet.count(kind_) == sum(
                1 for e in fleet._members.values() if e.member.kind is kind_)
        assert fleet.count() == sum(fleet.count(k_) for k_ in MemberKind)
