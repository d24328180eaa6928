"""vLLM KV events into the prefix index (gateway.cache.kv_events): frames encoded by vLLM
0.32's own classes (tests/data/kv_events, made with vllm.distributed.kv_events), garbage
and unknown engines degrade (logged once) and never stop picks; through a real ZMQ socket
and a real Envoy."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import pytest
import structlog.testing
import zmq

from fulcrum.gateway import pick_metrics as pm
from fulcrum.gateway.kv_events import BadFrame, KvEventSink, decode
from fulcrum.gateway.prefix_index import PrefixIndex
from tests.gateway.helpers import gateway_stack
from tests.polling import until

pytestmark = pytest.mark.timeout(120)

DATA = Path(__file__).resolve().parents[1] / "data" / "kv_events"


def frames(name: str, seq: int, topic: str = "10.0.0.1:8000") -> list[bytes]:
    return [topic.encode(), seq.to_bytes(8, "big"), (DATA / f"{name}.msgpack").read_bytes()]


def test_vllm_frames_decode() -> None:
    topic, b = decode(frames("stored", 0))
    assert topic == "10.0.0.1:8000" and (b.seq, b.stored, b.removed, b.cleared) == (0, 3, 0, False)
    _, b = decode(frames("removed", 1))
    assert (b.stored, b.removed, b.cleared) == (0, 2, False)
    assert decode(frames("cleared", 2))[1].cleared


@pytest.mark.parametrize(
    "bad",
    [
        [b"t", b"x"],  # two frames
        [b"t", b"1234", b"\x90"],  # short sequence number
        [b"t", bytes(8), b"\xc1"],  # not msgpack
        [b"t", bytes(8), b"\x93\x01\x02\x03"],  # events not a list
        [b"t", bytes(8), b"\x92\x01\x91\x81\xa4type\xa3Foo"],  # unknown event type
        [b"\xff", bytes(8), b"\x92\x01\x90"],  # topic not utf-8
    ],
)
def test_garbage_is_a_bad_frame(bad: list[bytes]) -> None:
    with pytest.raises(BadFrame):
        decode(bad)


def test_removals_evict_the_oldest_and_a_reset_clears_and_garbage_degrades_once() -> None:
    idx = PrefixIndex()
    slot = idx.add(100)
    idx.record(slot, [1, 2, 3, 4, 5])
    sink = KvEventSink({"10.0.0.1:8000": slot}.get, idx.evict_oldest, idx.clear)
    sink.handle(frames("stored", 0))
    sink.handle(frames("removed", 1))  # two blocks dropped: the two least recently used,
    # the prompt's tail (its head was touched last, as the engine's own cache keeps it)
    assert idx.match([1, 2, 3, 4, 5]).tolist() == [3] and idx.match([4, 5]).tolist() == [0]
    assert idx.held(slot) == 3
    garbage = pm.KV_EVENTS.labels("garbage")._value.get()
    with structlog.testing.capture_logs() as cap:
        for _ in range(3):
            sink.handle([b"10.0.0.1:8000", bytes(8), b"junk"])
        sink.handle(frames("stored", 0, topic="10.9.9.9:1"))
    logs = [e["event"] for e in cap]
    assert pm.KV_EVENTS.labels("garbage")._value.get() == garbage + 3
    assert logs == ["gateway_kv_events_degraded"] * 2  # once per engine
    sink.handle(frames("cleared", 2))
    assert idx.held(slot) == 0 and idx.size() == 0
    idx.record(slot, [7, 8])
    assert idx.match([7, 8]).tolist() == [2]


def senders() -> tuple[float, float]:
    return (pm.KV_EVENT_SENDERS.labels("reporting")._value.get(),
            pm.KV_EVENT_SENDERS.labels("degraded")._value.get())


def test_engines_heard_from_are_logged_once_and_counted_by_state() -> None:
    """An engine's first batch is one info line and one more sender reporting; a bad frame
    moves it to degraded; a topic naming no pool endpoint is a degraded sender, never a
    reporting one."""
    idx = PrefixIndex()
    a, b = idx.add(100), idx.add(100)
    sink = KvEventSink({"10.0.0.1:8000": a, "10.0.0.2:8000": b}.get, idx.evict_oldest,
                       idx.clear)
    before = structlog.get_config()  # test daemons log at warning: info lines too here
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: structlog.configure(**before))
        cap = stack.enter_context(structlog.testing.capture_logs())
        sink.handle(frames("stored", 0))
        sink.handle(frames("stored", 1))
        assert senders() == (1, 0)
        sink.handle(frames("stored", 0, topic="10.0.0.2:8000"))
        assert senders() == (2, 0)
        sink.handle([b"10.0.0.2:8000", bytes(8), b"junk"])
        assert senders() == (1, 1)
        sink.handle(frames("stored", 0, topic="10.9.9.9:1"))
        assert senders() == (1, 2)
    assert [(e["event"], e["log_level"]) for e in cap] == [
        ("gateway_kv_events_engine_reporting", "info"),
        ("gateway_kv_events_engine_reporting", "info"),
        ("gateway_kv_events_degraded", "warning"),
        ("gateway_kv_events_degraded", "warning"),
    ]


async def test_events_through_zmq_reach_the_index_and_garbage_never_stops_picks() -> None:
    gw = {"cache": {"enabled": True, "block_tokens": 8,
                    "kv_events": {"enabled": True, "endpoint": "tcp://127.0.0.1:0"}}}
    async with gateway_stack(gateway=gw) as st_:
        g = st_.gateway
        cache = g.picker.cache
        assert cache is not None and g.kv_endpoint.startswith("tcp://127.0.0.1:")
        body = {"model": "m", "max_tokens": 4,
                "messages": [{"role": "user", "content": "kv events " * 60}]}
        r = await st_.post("/v1/chat/completions", body)
        assert r.status == 200
        rid, placement = st_.picks[-1]
        await st_.wait_released(rid)
        slot = cache._slots[placement.address]
        assert cache.index.held(slot) > 0
        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        pub.connect(g.kv_endpoint)  # as vLLM does with a non-wildcard endpoint
        try:
            ok = pm.KV_EVENTS.labels("ok")._value.get()
            garbage = pm.KV_EVENTS.labels("garbage")._value.get()

            def sent_and_seen() -> bool:  # PUB drops until the subscription arrives
                pub.send_multipart([placement.address.encode(), bytes(8), b"garbage"])
                return pm.KV_EVENTS.labels("garbage")._value.get() > garbage

            await until(sent_and_seen, "garbage frame received")
            r = await st_.post("/v1/chat/completions", body)  # picks go on
            assert r.status == 200
            await st_.wait_released(st_.picks[-1][0])
            pub.send_multipart(frames("cleared", 1, topic=placement.address))
            await until(lambda: pm.KV_EVENTS.labels("ok")._value.get() > ok, "cleared batch")
            assert cache.index.held(slot) == 0
        finally:
            pub.close(linger=0)
            ctx.term()
