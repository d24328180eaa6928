"""VisionBalancerService through a real daemon on loopback.

Acceptance (SPEC.md section 8): the 1280x800 screenshot at patch size 16 counts 4,000
patches and goes to the least-loaded GPU of the chosen VE machine. Also: multi-image
order, bad input naming the field, capacity, release, leases, machines leaving, metrics,
and the streaming call giving exactly the unary call's answers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import pytest

from fulcrum.client import FulcrumClient
from fulcrum.service.server import Daemon
from fulcrum.state.vision import VisionState
from fulcrum.testing import running_server
from fulcrum.v1 import fleet_pb2 as fpb
from fulcrum.v1 import vision_pb2 as pb
from tests.service.test_server import scrape

SCREENSHOT = pb.Image(width=1280, height=800)  # patch size from config: 16


async def add_machine(
    client: FulcrumClient,
    machine_id: str,
    gpus: int = 4,
    max_patches: int = 0,
    load: Sequence[int] | None = None,
) -> int:
    """Register a VE machine (and report ``load`` per GPU); returns its incarnation."""
    reply = await client.fleet.Register(
        fpb.RegisterRequest(
            member_id=machine_id,
            vision_machine=fpb.VisionMachineShape(gpus=gpus, max_patches_in_flight=max_patches),
        )
    )
    if load is not None:
        await client.fleet.Heartbeat(
            fpb.HeartbeatRequest(
                member_id=machine_id,
                incarnation=reply.incarnation,
                vision_machine=fpb.VisionMachineLoad(patches_in_flight=list(load)),
            )
        )
    return reply.incarnation


async def machine_load(client: FulcrumClient, machine_id: str) -> list[int]:
    reply = await client.vision.GetMachineLoad(pb.GetMachineLoadRequest(machine_id=machine_id))
    return list(reply.patches_in_flight)


def place_request(request_id: str, *images: pb.Image) -> pb.PlaceImagesRequest:
    return pb.PlaceImagesRequest(request_id=request_id, images=list(images))


def state_of(daemon: Daemon) -> VisionState:
    state = daemon.app.components["vision"]
    assert isinstance(state, VisionState)
    return state


# --------------------------------------------------------------------------- acceptance

LOADS = {
    "ve-a": [900, 300, 700, 500],  # least loaded: GPU 1
    "ve-b": [50, 60, 40, 70],  # GPU 2
    "ve-c": [0, 0, 10, 0],  # GPU 0 (tie with 1 and 3: lowest index)
}
BEST = {"ve-a": 1, "ve-b": 2, "ve-c": 0}


async def test_screenshot_counts_4000_patches_and_goes_to_least_loaded_gpu(
    client: FulcrumClient,
) -> None:
    for machine_id, load in LOADS.items():
        await add_machine(client, machine_id, load=load)
    chosen = set()
    for i in range(12):
        before = {m: await machine_load(client, m) for m in LOADS}
        reply = await client.vision.PlaceImages(place_request(f"shot-{i}", SCREENSHOT))
        assert reply.policy == "random_machine"
        assert reply.lease_ms == 120_000
        [p] = reply.placements
        assert p.patches == 4_000
        loads = before[p.machine_id]
        assert loads[p.gpu_index] == min(loads)
        assert p.gpu_index == loads.index(min(loads))
        after = await machine_load(client, p.machine_id)
        assert after[p.gpu_index] == loads[p.gpu_index] + 4_000
        chosen.add(p.machine_id)
        if i == 0:
            assert p.gpu_index == BEST[p.machine_id]
        await client.vision.ReleaseImages(pb.ReleaseImagesRequest(request_id=f"shot-{i}"))
        assert await machine_load(client, p.machine_id) == loads  # release restores exactly
    assert len(chosen) >= 2  # the machine is drawn at random, not always the emptiest


async def test_explicit_patch_size_and_rounding(client: FulcrumClient) -> None:
    await add_machine(client, "ve-0", gpus=1)
    reply = await client.vision.PlaceImages(
        place_request(
            "r",
            pb.Image(width=1280, height=800, patch_size=16),
            pb.Image(width=1281, height=800, patch_size=16),
            pb.Image(width=448, height=448, patch_size=14),
            pb.Image(width=1, height=1),
        )
    )
    assert [p.patches for p in reply.placements] == [4_000, 4_050, 1_024, 1]
    released = await client.vision.ReleaseImages(pb.ReleaseImagesRequest(request_id="r"))
    assert (released.images, released.patches) == (4, 4_000 + 4_050 + 1_024 + 1)
    assert await machine_load(client, "ve-0") == [0]


async def test_multi_image_request_keeps_order_and_folds(client: FulcrumClient) -> None:
    # One machine with two GPUs: each image sees the patches of the ones before it.
    await add_machine(client, "ve-0", gpus=2)
    sizes = [(1280, 800), (512, 512), (512, 512), (256, 256), (1920, 1080)]
    reply = await client.vision.PlaceImages(
        place_request("multi", *(pb.Image(width=w, height=h) for w, h in sizes))
    )
    assert [p.patches for p in reply.placements] == [4_000, 1_024, 1_024, 256, 8_160]
    assert [p.gpu_index for p in reply.placements] == [0, 1, 1, 1, 1]
    assert await machine_load(client, "ve-0") == [4_000, 1_024 * 2 + 256 + 8_160]
    load = await client.vision.GetMachineLoad(pb.GetMachineLoadRequest(machine_id="ve-0"))
    assert load.images == 5


async def test_heartbeat_report_is_the_base_of_the_view(client: FulcrumClient) -> None:
    inc = await add_machine(client, "ve-0", gpus=2)
    await client.vision.PlaceImages(place_request("a", SCREENSHOT))
    assert await machine_load(client, "ve-0") == [4_000, 0]
    # The machine reports what it really has; placements after the report add to it.
    await client.fleet.Heartbeat(
        fpb.HeartbeatRequest(
            member_id="ve-0",
            incarnation=inc,
            vision_machine=fpb.VisionMachineLoad(patches_in_flight=[4_000, 5_000]),
        )
    )
    assert await machine_load(client, "ve-0") == [4_000, 5_000]
    await client.vision.PlaceImages(place_request("b", SCREENSHOT))
    assert await machine_load(client, "ve-0") == [8_000, 5_000]
    await client.vision.ReleaseImages(pb.ReleaseImagesRequest(request_id="a"))
    await client.vision.ReleaseImages(pb.ReleaseImagesRequest(request_id="b"))
    assert await machine_load(client, "ve-0") == [0, 5_000]


# --------------------------------------------------------------------------- bad input


BAD_INPUT: list[tuple[Any, str, str]] = [
    (
        place_request("r", pb.Image(width=0, height=800)),
        "INVALID_ARGUMENT",
        "images[0].width: must be > 0",
    ),
    (
        place_request("r", SCREENSHOT, pb.Image(width=800, height=0)),
        "INVALID_ARGUMENT",
        "images[1].height: must be > 0",
    ),
    (
        place_request("r", pb.Image(width=20_000, height=800)),
        "INVALID_ARGUMENT",
        "images[0].width: must be <= 16384 (max side)",
    ),
    (
        place_request("r", pb.Image(width=800, height=4_000_000_000)),
        "INVALID_ARGUMENT",
        "images[0].height: must be <= 16384 (max side)",
    ),
    (
        place_request("r", pb.Image(width=800, height=800, patch_size=20_000)),
        "INVALID_ARGUMENT",
        "images[0].patch_size: must be <= 16384 (max side)",
    ),
    (place_request("r"), "INVALID_ARGUMENT", "images: must not be empty"),
    (
        place_request("r", *[SCREENSHOT] * 65),
        "INVALID_ARGUMENT",
        "images: must have at most 64 entries",
    ),
    (place_request("", SCREENSHOT), "INVALID_ARGUMENT", "request_id: must not be empty"),
    (
        place_request("a b", SCREENSHOT),
        "INVALID_ARGUMENT",
        "request_id: must be printable ASCII without spaces",
    ),
    (
        place_request("x" * 129, SCREENSHOT),
        "INVALID_ARGUMENT",
        "request_id: must be at most 128 characters",
    ),
    (
        place_request("held", SCREENSHOT),
        "ALREADY_EXISTS",
        "request_id: 'held' already holds a placement",
    ),
    (pb.ReleaseImagesRequest(request_id="nope"), "NOT_FOUND", "request_id: 'nope' holds"),
    (pb.ReleaseImagesRequest(request_id=""), "INVALID_ARGUMENT", "request_id: must not be empty"),
    (
        pb.GetMachineLoadRequest(machine_id="ve-zz"),
        "NOT_FOUND",
        "machine_id: 've-zz' is not a registered VE machine",
    ),
]


async def test_bad_input_names_the_field(client: FulcrumClient) -> None:
    """Table-driven (one daemon for the whole table)."""
    await add_machine(client, "ve-0")
    await client.vision.PlaceImages(place_request("held", SCREENSHOT))
    before = await machine_load(client, "ve-0")
    calls = {
        pb.PlaceImagesRequest: client.vision.PlaceImages,
        pb.ReleaseImagesRequest: client.vision.ReleaseImages,
        pb.GetMachineLoadRequest: client.vision.GetMachineLoad,
    }
    for request_, code, message in BAD_INPUT:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await calls[type(request_)](request_)
        assert err.value.code() == getattr(grpc.StatusCode, code), message
        assert err.value.details().startswith(message)
        assert await machine_load(client, "ve-0") == before  # nothing half-applied


async def test_no_machine_is_resource_exhausted(client: FulcrumClient) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.vision.PlaceImages(place_request("r", SCREENSHOT))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "no live VE machine" in err.value.details()


async def test_capacity_is_never_exceeded(client: FulcrumClient) -> None:
    await add_machine(client, "ve-0", gpus=2, max_patches=5_000)
    for i in range(2):
        await client.vision.PlaceImages(place_request(f"r{i}", SCREENSHOT))
    assert await machine_load(client, "ve-0") == [4_000, 4_000]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.vision.PlaceImages(place_request("r2", SCREENSHOT))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "room for 4000 patches" in err.value.details()
    # A small image still fits; a multi-image request that cannot fit whole is refused whole.
    await client.vision.PlaceImages(place_request("small", pb.Image(width=256, height=256)))
    with pytest.raises(grpc.aio.AioRpcError):
        await client.vision.PlaceImages(
            place_request("pair", pb.Image(width=256, height=256), SCREENSHOT)
        )
    assert await machine_load(client, "ve-0") == [4_256, 4_000]
    await client.vision.ReleaseImages(pb.ReleaseImagesRequest(request_id="r0"))
    reply = await client.vision.PlaceImages(place_request("r3", SCREENSHOT))
    assert reply.placements[0].gpu_index == 0


async def test_placement_table_is_bounded() -> None:
    async with (
        running_server({"vision": {"max_placements": 2}}) as d,
        FulcrumClient(d.address) as c,
    ):
        await add_machine(c, "ve-0")
        await c.vision.PlaceImages(place_request("a", SCREENSHOT))
        await c.vision.PlaceImages(place_request("b", SCREENSHOT))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.vision.PlaceImages(place_request("c", SCREENSHOT))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "vision.max_placements" in err.value.details()
        await c.vision.ReleaseImages(pb.ReleaseImagesRequest(request_id="a"))
        await c.vision.PlaceImages(place_request("c", SCREENSHOT))


# --------------------------------------------------------------------------- leases, leaving


async def test_unreleased_placements_expire_and_are_counted(
    daemon: Daemon, client: FulcrumClient
) -> None:
    await add_machine(client, "ve-0", gpus=1)
    state = state_of(daemon)
    key = ("fulcrum_vision_expirations_total", ())
    before = scrape(daemon).get(key, 0.0)
    await client.vision.PlaceImages(place_request("forgotten", SCREENSHOT))
    now = daemon.app.clock()
    assert state.expire(now) == 0
    assert state.expire(now + 120_000 * 1_000_000 + 1) == 1
    assert await machine_load(client, "ve-0") == [0]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.vision.ReleaseImages(pb.ReleaseImagesRequest(request_id="forgotten"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert scrape(daemon)[key] == before + 1


async def test_leaving_machine_loses_its_placements_at_once(
    daemon: Daemon, client: FulcrumClient
) -> None:
    inc = await add_machine(client, "ve-a", gpus=1)
    await add_machine(client, "ve-b", gpus=1)
    key = ("fulcrum_vision_lost_placements_total", (("reason", "deregistered"),))
    lost_before = scrape(daemon).get(key, 0.0)
    placed: dict[str, str] = {}
    for i in range(16):
        reply = await client.vision.PlaceImages(place_request(f"r{i}", SCREENSHOT))
        placed[f"r{i}"] = reply.placements[0].machine_id
    on_a = [r for r, m in placed.items() if m == "ve-a"]
    assert on_a  # with seed 1234 both machines are used
    await client.fleet.Deregister(fpb.DeregisterRequest(member_id="ve-a", incarnation=inc))
    assert scrape(daemon)[key] == lost_before + len(on_a)
    for request_id, machine_id in placed.items():
        if machine_id == "ve-a":
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.vision.ReleaseImages(pb.ReleaseImagesRequest(request_id=request_id))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
        else:
            await client.vision.ReleaseImages(pb.ReleaseImagesRequest(request_id=request_id))
    assert await machine_load(client, "ve-b") == [0]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.vision.GetMachineLoad(pb.GetMachineLoadRequest(machine_id="ve-a"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    for i in range(8):
        reply = await client.vision.PlaceImages(place_request(f"s{i}", SCREENSHOT))
        assert reply.placements[0].machine_id == "ve-b"


class FakeClock:
    def __init__(self, now: int = 10**12) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


async def test_lapsed_machine_is_not_chosen_even_before_the_sweep(daemon: Daemon) -> None:
    clock = FakeClock()
    daemon.app.clock = clock
    async with FulcrumClient(daemon.address) as client:
        await add_machine(client, "ve-a", gpus=1)
        clock.now += 3_000_000_000
        inc_b = await add_machine(client, "ve-b", gpus=1)
        clock.now += 3_000_000_000  # ve-a is 6 s silent (> 5 s timeout); ve-b 3 s
        for i in range(6):
            reply = await client.vision.PlaceImages(place_request(f"r{i}", SCREENSHOT))
            assert reply.placements[0].machine_id == "ve-b"
        assert state_of(daemon).machine_ids() == ["ve-b"]
        await client.fleet.Heartbeat(fpb.HeartbeatRequest(member_id="ve-b", incarnation=inc_b))


# --------------------------------------------------------------------------- policies


async def test_least_patches_policy_goes_to_global_least_loaded_gpu() -> None:
    async with (
        running_server({"vision": {"policy": "least_patches"}}) as d,
        FulcrumClient(d.address) as c,
    ):
        for machine_id, load in LOADS.items():
            await add_machine(c, machine_id, load=load)
        reply = await c.vision.PlaceImages(place_request("r", SCREENSHOT))
        assert reply.policy == "least_patches"
        assert (reply.placements[0].machine_id, reply.placements[0].gpu_index) == ("ve-c", 0)


async def test_power_of_two_policy_places_on_least_loaded_gpu_of_winner() -> None:
    async with (
        running_server({"vision": {"policy": "power_of_two"}}) as d,
        FulcrumClient(d.address) as c,
    ):
        for machine_id, load in LOADS.items():
            await add_machine(c, machine_id, load=load)
        for i in range(6):
            reply = await c.vision.PlaceImages(place_request(f"r{i}", SCREENSHOT))
            assert reply.policy == "power_of_two"
            p = reply.placements[0]
            assert p.machine_id != "ve-a"  # the most loaded machine never wins a pair
            await c.vision.ReleaseImages(pb.ReleaseImagesRequest(request_id=f"r{i}"))
            assert p.gpu_index == BEST[p.machine_id]


# --------------------------------------------------------------------------- streaming


def script() -> list[pb.PlaceImagesStreamRequest]:
    """A mixed sequence of placements, releases and errors."""
    ops: list[pb.PlaceImagesStreamRequest] = []
    seq = 0

    def add(**kw: Any) -> None:
        nonlocal seq
        seq += 1
        ops.append(pb.PlaceImagesStreamRequest(sequence=seq, **kw))

    for i in range(10):
        add(place=place_request(f"r{i}", SCREENSHOT, pb.Image(width=512, height=512)))
        if i % 3 == 2:
            add(release=pb.ReleaseImagesRequest(request_id=f"r{i - 1}"))
    add(place=place_request("bad", pb.Image(width=0, height=5)))
    add(place=place_request("r0", SCREENSHOT))  # duplicate
    add(release=pb.ReleaseImagesRequest(request_id="never"))
    add(release=pb.ReleaseImagesRequest(request_id="r1"))  # released above
    add()  # no op
    add(place=place_request("big", *[pb.Image(width=1920, height=1080)] * 3))
    return ops


async def run_unary(c: FulcrumClient, ops: list[pb.PlaceImagesStreamRequest]) -> list[Any]:
    out: list[Any] = []
    for op in ops:
        which = op.WhichOneof("op")
        try:
            if which == "place":
                out.append(("ok", (await c.vision.PlaceImages(op.place)).SerializeToString()))
            elif which == "release":
                out.append(("ok", (await c.vision.ReleaseImages(op.release)).SerializeToString()))
            else:
                out.append(
                    (
                        grpc.StatusCode.INVALID_ARGUMENT.value[0],
                        "op: one of place, release must be set",
                    )
                )
                continue
        except grpc.aio.AioRpcError as err:
            out.append((err.code().value[0], err.details()))
    return out


async def run_stream(c: FulcrumClient, ops: list[pb.PlaceImagesStreamRequest]) -> list[Any]:
    async def requests() -> AsyncIterator[pb.PlaceImagesStreamRequest]:
        for op in ops:
            yield op

    out: list[Any] = []
    seqs = []
    async for reply in c.vision.PlaceImagesStream(requests()):
        seqs.append(reply.sequence)
        if reply.code:
            out.append((reply.code, reply.message))
        else:
            which = reply.WhichOneof("result")
            assert which is not None
            out.append(("ok", getattr(reply, which).SerializeToString()))
    assert seqs == [op.sequence for op in ops]
    return out


async def test_streaming_gives_the_unary_answers() -> None:
    results = []
    for runner in (run_unary, run_stream):
        async with running_server() as d, FulcrumClient(d.address) as c:
            for machine_id, load in LOADS.items():
                await add_machine(c, machine_id, load=load)
            results.append(await runner(c, script()))
            results.append([await machine_load(c, m) for m in LOADS])
    unary, unary_loads, stream, stream_loads = results
    assert stream == unary
    assert stream_loads == unary_loads
    codes = [r[0] for r in unary]
    assert codes.count("ok") == 10 + 3 + 1  # places, releases, the final big place
    assert grpc.StatusCode.ALREADY_EXISTS.value[0] in codes
    assert grpc.StatusCode.NOT_FOUND.value[0] in codes


async def test_stream_stays_open_after_errors(client: FulcrumClient) -> None:
    await add_machine(client, "ve-0", gpus=1)

    async def requests() -> AsyncIterator[pb.PlaceImagesStreamRequest]:
        yield pb.PlaceImagesStreamRequest(
            sequence=1, place=place_request("x", pb.Image(width=0, height=1))
        )
        yield pb.PlaceImagesStreamRequest(sequence=2, place=place_request("y", SCREENSHOT))

    replies = [r async for r in client.vision.PlaceImagesStream(requests())]
    assert [r.code for r in replies] == [grpc.StatusCode.INVALID_ARGUMENT.value[0], 0]
    assert replies[0].message == "images[0].width: must be > 0"
    assert replies[1].place.placements[0].patches == 4_000


# --------------------------------------------------------------------------- metrics


async def test_metrics_per_gpu_imbalance_and_outcomes(
    daemon: Daemon, client: FulcrumClient
) -> None:
    await add_machine(client, "ve-0", gpus=2)
    placed_key = (
        "fulcrum_vision_placements_total",
        (("outcome", "placed"), ("policy", "random_machine")),
    )
    before = scrape(daemon).get(placed_key, 0.0)
    await client.vision.PlaceImages(place_request("r", SCREENSHOT))
    m = scrape(daemon)
    assert m[placed_key] == before + 1
    assert m[("fulcrum_vision_gpu_patches_in_flight", (("gpu", "0"), ("machine", "ve-0")))] == 4000
    assert m[("fulcrum_vision_gpu_patches_in_flight", (("gpu", "1"), ("machine", "ve-0")))] == 0
    assert m[("fulcrum_vision_imbalance", (("policy", "random_machine"),))] == 2.0
    assert m[("fulcrum_vision_placements_held", ())] == 1


async def test_absurd_heartbeat_load_is_refused_naming_the_field(client: FulcrumClient) -> None:
    inc = await add_machine(client, "ve-0", gpus=2, load=[10, 20])
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.fleet.Heartbeat(
            fpb.HeartbeatRequest(
                member_id="ve-0",
                incarnation=inc,
                vision_machine=fpb.VisionMachineLoad(patches_in_flight=[5, 1 << 60]),
            )
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("vision_machine.patches_in_flight[1]: must be in")
    assert await machine_load(client, "ve-0") == [10, 20]  # unchanged
