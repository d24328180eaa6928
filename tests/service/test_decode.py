"""DecodeBalancerService through a real daemon on loopback.

Acceptance (SPEC.md sections 4, 8, 9): the worked example's 100K-token decode goes to the
GPU with the smallest total KV even when another GPU has fewer requests; a fleet filled
with long requests steers later long requests away from the full GPUs. Also: capacity,
errors naming the field, release, leases, instances leaving or lapsing, heartbeats,
metrics and every policy by configuration.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import pytest

from fulcrum.client import FulcrumClient
from fulcrum.core.decode import POLICY_NAMES
from fulcrum.core.decode.copies import copy_view
from fulcrum.service.server import Daemon
from fulcrum.state.decode import DecodeState
from fulcrum.testing import running_server
from fulcrum.v1 import decode_pb2 as pb
from fulcrum.v1 import fleet_pb2 as fpb
from tests.service.test_server import scrape

GPU = tuple[int, int]  # (max_concurrency, max_kv_tokens)
LOAD = tuple[int, int]  # (concurrency, kv_tokens)


async def add_instance(
    client: FulcrumClient,
    instance_id: str,
    gpus: Sequence[GPU] = ((64, 1_000_000),) * 4,
    load: Sequence[LOAD] | None = None,
) -> int:
    """Register a decode instance (and report ``load`` per GPU); returns its incarnation."""
    reply = await client.fleet.Register(
        fpb.RegisterRequest(
            member_id=instance_id,
            decode_instance=fpb.DecodeInstanceShape(
                gpus=[fpb.DecodeGpuCapacity(max_concurrency=c, max_kv_tokens=k) for c, k in gpus]
            ),
        )
    )
    if load is not None:
        await report(client, instance_id, reply.incarnation, load)
    return int(reply.incarnation)


async def report(
    client: FulcrumClient, instance_id: str, incarnation: int, load: Sequence[LOAD]
) -> None:
    await client.fleet.Heartbeat(
        fpb.HeartbeatRequest(
            member_id=instance_id,
            incarnation=incarnation,
            decode_instance=fpb.DecodeInstanceLoad(
                gpus=[fpb.DecodeGpuLoad(concurrency=c, kv_tokens=k) for c, k in load]
            ),
        )
    )


def place(request_id: str, kv_tokens: int) -> pb.PlaceDecodeRequest:
    return pb.PlaceDecodeRequest(request_id=request_id, kv_tokens=kv_tokens)


def state_of(daemon: Daemon) -> DecodeState:
    state = daemon.app.components["decode"]
    assert isinstance(state, DecodeState)
    return state


class FakeClock:
    def __init__(self, now: int = 10**12) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


# --------------------------------------------------------------------------- acceptance


async def test_worked_example_100k_decode_goes_to_smallest_kv_not_fewest_requests(
    client: FulcrumClient,
) -> None:
    # d-a GPU 0 has the fewest requests (2) but lots of KV; d-b GPU 2 the smallest KV.
    await add_instance(
        client, "d-a", load=[(2, 400_000), (9, 300_000), (11, 250_000), (8, 350_000)]
    )
    await add_instance(
        client, "d-b", load=[(7, 280_000), (10, 220_000), (9, 120_000), (6, 500_000)]
    )
    reply = await client.decode.PlaceDecode(place("turn-3", 100_000))
    assert (reply.instance_id, reply.gpu_index) == ("d-b", 2)
    assert reply.branch == "long" and reply.policy == "dual"
    assert (reply.gpu_concurrency, reply.gpu_kv_tokens) == (10, 220_000)
    assert reply.lease_ms == 600_000 and reply.incarnation > 0


async def test_short_request_goes_to_low_concurrency_but_large_kv(
    client: FulcrumClient,
) -> None:
    await add_instance(client, "d-a", load=[(2, 400_000), (9, 30_000), (2, 100_000), (8, 35_000)])
    reply = await client.decode.PlaceDecode(place("short-1", 800))
    # GPUs 0 and 2 tie on 2 requests; GPU 0 holds more KV.
    assert (reply.instance_id, reply.gpu_index, reply.branch) == ("d-a", 0, "short")


FULL_OF_LONG = [(6, 600_000), (6, 600_000), (30, 50_000), (30, 50_000)]


async def test_fleet_full_of_long_requests_steers_later_long_ones_away(
    client: FulcrumClient,
) -> None:
    await add_instance(client, "d-a", load=FULL_OF_LONG)
    gpus = [
        (await client.decode.PlaceDecode(place(f"long-{i}", 100_000))).gpu_index for i in range(8)
    ]
    assert sorted(gpus) == [2, 2, 2, 2, 3, 3, 3, 3]  # never the GPUs full of long ones


async def test_least_requests_baseline_piles_long_requests_on_full_gpus() -> None:
    async with (
        running_server({"decode": {"policy": "least_requests"}}) as d,
        FulcrumClient(d.address) as c,
    ):
        await add_instance(c, "d-a", load=FULL_OF_LONG)
        gpus = [
            (await c.decode.PlaceDecode(place(f"long-{i}", 100_000))).gpu_index for i in range(4)
        ]
        assert set(gpus) <= {0, 1}  # what the dual rule avoids


async def test_long_placements_through_the_daemon_fill_kv_evenly(daemon: Daemon) -> None:
    async with FulcrumClient(daemon.address) as client:
        await add_instance(client, "d-a", gpus=[(64, 2_000_000)] * 4)
        await add_instance(client, "d-b", gpus=[(64, 2_000_000)] * 4)
        for i in range(40):
            kv = 120_000 if i % 5 == 0 else 3_000
            await client.decode.PlaceDecode(place(f"r{i}", kv))
    conc, kv_imb = state_of(daemon).imbalance()
    assert conc < 1.3 and kv_imb < 1.6


# --------------------------------------------------------------------------- capacity


async def test_capacity_is_never_exceeded_and_exhaustion_names_the_reason(
    client: FulcrumClient,
) -> None:
    await add_instance(client, "d-a", gpus=[(2, 10_000), (3, 9_000)])
    placed = []
    for i in range(5):
        r = await client.decode.PlaceDecode(place(f"r{i}", 2_000))
        placed.append((r.gpu_index, r.gpu_concurrency, r.gpu_kv_tokens))
    for gpu, conc, kv in placed:
        assert conc <= (2, 3)[gpu] and kv <= (10_000, 9_000)[gpu]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.decode.PlaceDecode(place("r-over", 2_000))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_concurrency" in (e.value.details() or "")
    await client.decode.ReleaseDecode(pb.ReleaseDecodeRequest(request_id="r0"))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.decode.PlaceDecode(place("r-big", 9_000))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "kv_tokens: 9000" in (e.value.details() or "")


async def test_no_instance_is_resource_exhausted(client: FulcrumClient) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.decode.PlaceDecode(place("r", 10))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "no live decode GPU" in (e.value.details() or "")


async def test_placement_table_bound() -> None:
    async with (
        running_server({"decode": {"max_placements": 2}}) as d,
        FulcrumClient(d.address) as c,
    ):
        await add_instance(c, "d-a")
        await c.decode.PlaceDecode(place("a", 1))
        await c.decode.PlaceDecode(place("b", 1))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await c.decode.PlaceDecode(place("c", 1))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "table full" in (e.value.details() or "")


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("request_id", "kv_tokens", "needle"),
    [
        ("", 10, "request_id"),
        ("has space", 10, "request_id"),
        ("x" * 129, 10, "request_id"),
        ("ok", 0, "kv_tokens"),
        ("ok", (1 << 32) + 1, "kv_tokens"),
    ],
)
async def test_invalid_place_names_the_field(
    client: FulcrumClient, request_id: str, kv_tokens: int, needle: str
) -> None:
    await add_instance(client, "d-a")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.decode.PlaceDecode(place(request_id, kv_tokens))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (e.value.details() or "").startswith(needle)


async def test_duplicate_and_unknown_ids(daemon: Daemon, client: FulcrumClient) -> None:
    await add_instance(client, "d-a")
    await client.decode.PlaceDecode(place("dup", 10))
    before = copy_view(state_of(daemon).view)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.decode.PlaceDecode(place("dup", 10))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert state_of(daemon).view.same_as(before)  # refused: nothing changed
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.decode.ReleaseDecode(pb.ReleaseDecodeRequest(request_id="nope"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.decode.ReleaseDecode(pb.ReleaseDecodeRequest(request_id=""))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_absurd_heartbeat_load_is_refused_naming_the_field(client: FulcrumClient) -> None:
    inc = await add_instance(client, "d-a", gpus=[(8, 1_000)] * 2)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await report(client, "d-a", inc, [(0, 0), (0, 1 << 41)])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "decode_instance.gpus[1].kv_tokens" in (e.value.details() or "")


# --------------------------------------------------------------------------- state


async def test_release_after_place_restores_the_view_exactly(
    daemon: Daemon, client: FulcrumClient
) -> None:
    await add_instance(client, "d-a", load=[(3, 30_000), (1, 90_000), (4, 5_000), (0, 0)])
    await add_instance(client, "d-b", gpus=[(16, 500_000)] * 2)
    before = copy_view(state_of(daemon).view)
    sizes = [100_000, 700, 2_000, 64_000, 15, 250_000, 9_999]
    for i, kv in enumerate(sizes):
        await client.decode.PlaceDecode(place(f"r{i}", kv))
    assert not state_of(daemon).view.same_as(before)
    for i in reversed(range(len(sizes))):
        r = await client.decode.ReleaseDecode(pb.ReleaseDecodeRequest(request_id=f"r{i}"))
        assert r.instance_id in ("d-a", "d-b")
    assert state_of(daemon).view.same_as(before)
    assert state_of(daemon).held == 0


async def test_heartbeat_replaces_view_and_placements_add_to_it(
    daemon: Daemon, client: FulcrumClient
) -> None:
    inc = await add_instance(client, "d-a", gpus=[(64, 1_000_000)])
    await client.decode.PlaceDecode(place("a", 1_000))
    await client.decode.PlaceDecode(place("b", 2_000))
    assert state_of(daemon).gpu_load("d-a", 0) == (2, 3_000)
    await report(client, "d-a", inc, [(5, 40_000)])  # engine truth, incl. generated tokens
    assert state_of(daemon).gpu_load("d-a", 0) == (5, 40_000)
    await client.decode.PlaceDecode(place("c", 500))
    assert state_of(daemon).gpu_load("d-a", 0) == (6, 40_500)
    await client.decode.ReleaseDecode(pb.ReleaseDecodeRequest(request_id="a"))
    assert state_of(daemon).gpu_load("d-a", 0) == (5, 39_500)
    await report(client, "d-a", inc, [(0, 100)])
    await client.decode.ReleaseDecode(pb.ReleaseDecodeRequest(request_id="b"))
    assert state_of(daemon).gpu_load("d-a", 0) == (0, 0)  # never below 0


async def test_unreleased_placements_expire_and_are_counted(daemon: Daemon) -> None:
    state = state_of(daemon)
    key = ("fulcrum_decode_expirations_total", ())
    before = scrape(daemon).get(key, 0.0)
    async with FulcrumClient(daemon.address) as client:
        await add_instance(client, "d-a", gpus=[(64, 1_000_000)])
        await client.decode.PlaceDecode(place("forgotten", 5_000))
    now = daemon.app.clock()
    assert state.expire(now) == 0
    assert state.expire(now + 600_000 * 1_000_000 + 1) == 1
    assert state.gpu_load("d-a", 0) == (0, 0)  # capacity does not leak
    assert state.held == 0
    assert scrape(daemon)[key] == before + 1
    async with FulcrumClient(daemon.address) as client:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.decode.ReleaseDecode(pb.ReleaseDecodeRequest(request_id="forgotten"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


async def test_instance_leaving_loses_its_placements(daemon: Daemon, client: FulcrumClient) -> None:
    key = ("fulcrum_decode_lost_placements_total", (("reason", "deregistered"),))
    before = scrape(daemon).get(key, 0.0)
    inc_a = await add_instance(client, "d-a", gpus=[(64, 1_000_000)])
    await add_instance(client, "d-b", gpus=[(64, 1_000_000)], load=[(40, 900_000)])
    on_a = []
    for i in range(3):
        r = await client.decode.PlaceDecode(place(f"r{i}", 10_000))
        assert r.instance_id == "d-a"
        on_a.append(f"r{i}")
    await client.fleet.Deregister(fpb.DeregisterRequest(member_id="d-a", incarnation=inc_a))
    assert scrape(daemon)[key] == before + 3
    assert state_of(daemon).held == 0
    for rid in on_a:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.decode.ReleaseDecode(pb.ReleaseDecodeRequest(request_id=rid))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    r = await client.decode.PlaceDecode(place("after", 10_000))
    assert r.instance_id == "d-b"
    # re-registering comes back fresh: no double counting
    await add_instance(client, "d-a", gpus=[(64, 1_000_000)])
    assert state_of(daemon).gpu_load("d-a", 0) == (0, 0)


async def test_lapsed_instance_is_not_chosen_even_before_the_sweep(daemon: Daemon) -> None:
    clock = FakeClock()
    daemon.app.clock = clock
    key = ("fulcrum_decode_lost_placements_total", (("reason", "lapsed"),))
    before = scrape(daemon).get(key, 0.0)
    async with FulcrumClient(daemon.address) as client:
        await add_instance(client, "d-a", gpus=[(64, 1_000_000)])
        await client.decode.PlaceDecode(place("on-a", 1_000))
        clock.now += 3_000_000_000
        inc_b = await add_instance(client, "d-b", gpus=[(64, 1_000_000)], load=[(50, 900_000)])
        clock.now += 3_000_000_000  # d-a is 6 s silent (> 5 s timeout); d-b 3 s
        for i in range(4):
            reply = await client.decode.PlaceDecode(place(f"r{i}", 1_000))
            assert reply.instance_id == "d-b"
        assert [i for i, *_ in state_of(daemon).gpu_loads()] == ["d-b"]
        assert scrape(daemon)[key] == before + 1
        await client.fleet.Heartbeat(fpb.HeartbeatRequest(member_id="d-b", incarnation=inc_b))


# --------------------------------------------------------------------------- metrics


async def test_metrics_gauges_and_counters(daemon: Daemon, client: FulcrumClient) -> None:
    placed = (
        "fulcrum_decode_placements_total",
        (("branch", "long"), ("outcome", "placed"), ("policy", "dual")),
    )
    refused = (
        "fulcrum_decode_placements_total",
        (("branch", ""), ("outcome", "invalid_argument"), ("policy", "dual")),
    )
    m0 = scrape(daemon)
    await add_instance(client, "d-a", gpus=[(64, 1_000_000)] * 2, load=[(1, 1_000), (3, 3_000)])
    await client.decode.PlaceDecode(place("big", 100_000))
    with pytest.raises(grpc.aio.AioRpcError):
        await client.decode.PlaceDecode(place("bad", 0))
    with pytest.raises(grpc.aio.AioRpcError):
        await client.decode.PlaceDecode(place("too-big", 999_000))
    m = scrape(daemon)
    exhausted = (
        "fulcrum_decode_placements_total",
        (("branch", "long"), ("outcome", "resource_exhausted"), ("policy", "dual")),
    )
    assert m[exhausted] == m0.get(exhausted, 0.0) + 1
    assert m[placed] == m0.get(placed, 0.0) + 1
    assert m[refused] == m0.get(refused, 0.0) + 1
    assert m[("fulcrum_decode_gpu_concurrency", (("decode_instance", "d-a"), ("gpu", "0")))] == 2
    kv_key = ("fulcrum_decode_gpu_kv_tokens", (("decode_instance", "d-a"), ("gpu", "0")))
    assert m[kv_key] == 101_000
    imb = m[("fulcrum_decode_imbalance", (("dimension", "kv_tokens"), ("policy", "dual")))]
    assert imb == pytest.approx(101_000 / ((101_000 + 3_000) / 2))
    assert m[("fulcrum_decode_placements_held", ())] == 1


# --------------------------------------------------------------------------- policies


@pytest.mark.parametrize("policy", POLICY_NAMES)
async def test_every_policy_places_within_capacity(policy: str) -> None:
    async with (
        running_server({"decode": {"policy": policy}}) as d,
        FulcrumClient(d.address) as c,
    ):
        await add_instance(c, "d-a", gpus=[(4, 50_000)] * 2)
        await add_instance(c, "d-b", gpus=[(4, 50_000)] * 2)
        for i in range(16):
            r = await c.decode.PlaceDecode(place(f"r{i}", 3_000))
            assert r.policy == policy
            assert r.gpu_concurrency <= 4 and r.gpu_kv_tokens <= 50_000
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await c.decode.PlaceDecode(place("r16", 3_000))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_step_time_coefficients_come_from_configuration() -> None:
    # Only KV counts (d1 = 0): goes to the least KV although it has the most requests.
    async with (
        running_server({"decode": {"policy": "step_time", "step_time": {"d1_ns": 0.0}}}) as d,
        FulcrumClient(d.address) as c,
    ):
        await add_instance(c, "d-a", gpus=[(64, 1_000_000)] * 2, load=[(1, 9_000), (20, 100)])
        r = await c.decode.PlaceDecode(place("r", 10))
        assert r.gpu_index == 1


async def test_same_seed_same_decisions_through_the_daemon() -> None:
    async def run() -> list[tuple[str, int]]:
        async with (
            running_server({"decode": {"policy": "power_of_two"}}) as d,
            FulcrumClient(d.address) as c,
        ):
            for name in ("d-a", "d-b", "d-c"):
                await add_instance(c, name, gpus=[(64, 1_000_000)] * 4)
            out = []
            for i in range(30):
                r = await c.decode.PlaceDecode(place(f"r{i}", 1_000 + 37 * i))
                out.append((r.instance_id, r.gpu_index))
            return out

    assert await run() == await run()


async def test_unknown_policy_in_configuration_is_refused() -> None:
    from fulcrum.config import ConfigError, parse_settings

    with pytest.raises(ConfigError, match=r"decode\.policy"):
        parse_settings({"decode": {"policy": "fewest_requests"}})


async def test_reload_switches_policy_for_the_next_decision(
    daemon: Daemon, client: FulcrumClient
) -> None:
    from fulcrum.config import with_overrides

    await add_instance(client, "d-a", load=FULL_OF_LONG)
    r = await client.decode.PlaceDecode(place("before", 100_000))
    assert (r.policy, r.gpu_index) == ("dual", 2)
    new = with_overrides(daemon.app.settings, {"decode": {"policy": "least_requests"}})
    for hook in daemon.app.reload_hooks:
        hook(new)
    r = await client.decode.PlaceDecode(place("after", 100_000))
    assert (r.policy, r.gpu_index) == ("least_requests", 0)
    await client.decode.ReleaseDecode(pb.ReleaseDecodeRequest(request_id="before"))


async def test_per_gpu_series_disappear_with_the_instance(
    daemon: Daemon, client: FulcrumClient
) -> None:
    inc = await add_instance(client, "d-gone", gpus=[(8, 1_000)] * 2)
    series = ("fulcrum_decode_gpu_concurrency", (("decode_instance", "d-gone"), ("gpu", "1")))
    assert series in scrape(daemon)
    await client.fleet.Deregister(fpb.DeregisterRequest(member_id="d-gone", incarnation=inc))
    assert series not in scrape(daemon)
