"""GetDecodeLoad over real gRPC: the decode table per instance and GPU, paged, bounded."""

from __future__ import annotations

import grpc
import pytest

from fulcrum.client import FulcrumClient
from fulcrum.service.decode import MAX_LOAD_PAGE, MAX_LOAD_PAGE_GPUS
from fulcrum.service.server import Daemon
from fulcrum.v1 import decode_pb2 as dpb
from fulcrum.v1 import fleet_pb2 as fpb


def instance(member_id: str, caps: list[tuple[int, int]]) -> fpb.RegisterRequest:
    return fpb.RegisterRequest(
        member_id=member_id,
        decode_instance=fpb.DecodeInstanceShape(
            gpus=[fpb.DecodeGpuCapacity(max_concurrency=c, max_kv_tokens=k) for c, k in caps]
        ),
    )


async def heartbeat(
    client: FulcrumClient, member_id: str, incarnation: int, loads: list[tuple[int, int]]
) -> None:
    await client.fleet.Heartbeat(
        fpb.HeartbeatRequest(
            member_id=member_id,
            incarnation=incarnation,
            decode_instance=fpb.DecodeInstanceLoad(
                gpus=[fpb.DecodeGpuLoad(concurrency=c, kv_tokens=k) for c, k in loads]
            ),
        )
    )


def table(reply: dpb.GetDecodeLoadResponse) -> list[tuple[str, list[tuple[int, ...]]]]:
    """(instance, [(gpu, concurrency, kv, max_concurrency, max_kv), ...]) per instance."""
    return [
        (
            i.instance_id,
            [
                (g, *t)
                for g, t in enumerate(
                    zip(i.concurrency, i.kv_tokens, i.max_concurrency, i.max_kv_tokens,
                        strict=True)
                )
            ],
        )
        for i in reply.instances
    ]


async def test_load_per_instance_and_gpu_is_the_balancers_table(
    daemon: Daemon, client: FulcrumClient
) -> None:
    a = await client.fleet.Register(instance("dec-a", [(8, 10_000), (4, 5_000)]))
    b = await client.fleet.Register(instance("dec-b", [(16, 1 << 40)]))
    await heartbeat(client, "dec-a", a.incarnation, [(3, 3_000), (1, 700)])
    await heartbeat(client, "dec-b", b.incarnation, [(2, 900)])
    placed = await client.decode.PlaceDecode(dpb.PlaceDecodeRequest(request_id="r1", kv_tokens=50))

    reply = await client.decode.GetDecodeLoad(dpb.GetDecodeLoadRequest())
    state = daemon.app.components["decode"]
    expected = {}
    for iid in ("dec-a", "dec-b"):
        caps = {"dec-a": [(8, 10_000), (4, 5_000)], "dec-b": [(16, 1 << 40)]}[iid]
        expected[iid] = [(g, *state.gpu_load(iid, g), *caps[g]) for g in range(len(caps))]
    assert table(reply) == [("dec-a", expected["dec-a"]), ("dec-b", expected["dec-b"])]
    assert reply.next_page_token == ""
    # the placement shows on the chosen GPU (report + placements since it)
    chosen = next(i for i in reply.instances if i.instance_id == placed.instance_id)
    g = placed.gpu_index
    assert (chosen.concurrency[g], chosen.kv_tokens[g]) == (
        placed.gpu_concurrency, placed.gpu_kv_tokens
    )
    sums = {
        i.instance_id: (i.total_concurrency, i.total_kv_tokens, i.incarnation)
        for i in reply.instances
    }
    assert sums["dec-a"][:2] == (
        sum(g[1] for g in expected["dec-a"]), sum(g[2] for g in expected["dec-a"])
    )
    assert sums["dec-a"][2] == a.incarnation and sums["dec-b"][2] == b.incarnation
    assert sums["dec-a"][0] + sums["dec-b"][0] == 3 + 1 + 2 + 1

    one = await client.decode.GetDecodeLoad(dpb.GetDecodeLoadRequest(instance_id="dec-b"))
    assert table(one) == [("dec-b", expected["dec-b"])] and one.next_page_token == ""


async def test_unknown_or_wrong_kind_instance_is_not_found(client: FulcrumClient) -> None:
    await client.fleet.Register(
        fpb.RegisterRequest(member_id="ve-0", vision_machine=fpb.VisionMachineShape(gpus=1))
    )
    for iid in ("nope", "ve-0"):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.decode.GetDecodeLoad(dpb.GetDecodeLoadRequest(instance_id=iid))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "instance_id" in (err.value.details() or "")
    # no decode instance at all: an empty page, not an error
    reply = await client.decode.GetDecodeLoad(dpb.GetDecodeLoadRequest())
    assert list(reply.instances) == [] and reply.next_page_token == ""


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (dpb.GetDecodeLoadRequest(instance_id="bad id"), "instance_id"),
        (dpb.GetDecodeLoadRequest(page_size=MAX_LOAD_PAGE + 1), "page_size"),
        (dpb.GetDecodeLoadRequest(page_token="not a token"), "page_token"),
    ],
)
async def test_bad_requests_name_the_field(
    client: FulcrumClient, request_: dpb.GetDecodeLoadRequest, field: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.decode.GetDecodeLoad(request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith(field + ":")


async def test_pages_cover_every_instance_once_in_id_order(client: FulcrumClient) -> None:
    ids = [f"dec-{i:02d}" for i in (7, 1, 4, 0, 3)]
    for iid in ids:
        await client.fleet.Register(instance(iid, [(8, 1_000)]))
    seen: list[str] = []
    token = ""
    pages = 0
    while True:
        reply = await client.decode.GetDecodeLoad(
            dpb.GetDecodeLoadRequest(page_size=2, page_token=token)
        )
        pages += 1
        assert len(reply.instances) <= 2
        seen += [i.instance_id for i in reply.instances]
        token = reply.next_page_token
        if not token:
            break
        # an instance joining between pages shows up if it sorts after the token
        if pages == 1:
            await client.fleet.Register(instance("dec-99", [(8, 1_000)]))
    assert seen == sorted([*ids, "dec-99"]) and pages == 3


async def test_a_page_stops_at_the_gpu_bound(client: FulcrumClient) -> None:
    per = 1024  # fleet.max_gpus_per_member's default
    n = MAX_LOAD_PAGE_GPUS // per + 1
    for i in range(n):
        await client.fleet.Register(instance(f"big-{i}", [(1, 1)] * per))
    first = await client.decode.GetDecodeLoad(dpb.GetDecodeLoadRequest(page_size=MAX_LOAD_PAGE))
    assert len(first.instances) == n - 1
    assert sum(len(i.concurrency) for i in first.instances) == MAX_LOAD_PAGE_GPUS
    assert first.next_page_token == f"big-{n - 2}"
    rest = await client.decode.GetDecodeLoad(
        dpb.GetDecodeLoadRequest(page_token=first.next_page_token)
    )
    assert [i.instance_id for i in rest.instances] == [f"big-{n - 1}"]
    assert rest.next_page_token == ""


async def test_a_lapsed_instance_is_not_reported(daemon: Daemon, client: FulcrumClient) -> None:
    now = [10**12]
    daemon.app.clock = lambda: now[0]
    await client.fleet.Register(instance("dec-old", [(8, 1_000)]))
    now[0] += 3_000_000_000
    await client.fleet.Register(instance("dec-new", [(8, 1_000)]))
    now[0] += 3_000_000_000  # dec-old is past the 5 s timeout, dec-new is not
    reply = await client.decode.GetDecodeLoad(dpb.GetDecodeLoadRequest())
    assert [i.instance_id for i in reply.instances] == ["dec-new"]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.decode.GetDecodeLoad(dpb.GetDecodeLoadRequest(instance_id="dec-old"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
