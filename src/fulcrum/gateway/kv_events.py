"""vLLM KV cache events into the gateway's prefix index (``gateway.cache.kv_events``).

vLLM publishes its prefix cache's changes over ZMQ (``--kv-events-config``). What a
working setup needs, found with the real vLLM 0.32 CPU engine (docs/cache-aware.md):

* ``"enable_kv_cache_events": true`` in the engine's config. With only
  ``"publisher": "zmq"`` the publisher thread starts but the block pool records nothing
  (vLLM logs "KV cache events are disabled, but the scheduler is configured to publish
  them").
* ``"topic": "<the engine's ip:port as the gateway knows it>"``: one SUB socket serves
  every engine, and the topic says which one sent a batch.
* An endpoint that is not a wildcard (``tcp://GATEWAY:PORT``): the engine's PUB socket
  *connects* to this subscriber, which binds. A bound SUB socket sends its subscription
  to a PUB that connects later only when the application services the socket (a
  ``poll``/``recv`` processes the new pipe); a PUB drops every message for which it holds
  no subscription. A bound SUB left idle while requests run (a blocking test) so gets
  nothing, the earlier "no message within 5 s" -- this subscriber is always in ``recv``
  on the event loop, so the subscription goes out as the engine connects.

Frames: ``(topic, seq as 8-byte big-endian, msgpack payload)``; the payload is
``[ts, [event, ...], data_parallel_rank]``, each event a map tagged by ``type``:
``BlockStored`` (``block_hashes``, ``parent_block_hash``, ``token_ids``,
``block_size``, ...), ``BlockRemoved`` (``block_hashes``), ``AllBlocksCleared``.

The index hashes text chunks of the prompt, the engine token blocks of its chat template's
rendering, so block identities cannot be matched one to one. What the events give the
index exactly: ``AllBlocksCleared`` clears the engine's index; ``BlockRemoved`` of ``n``
blocks evicts that engine's ``n`` least recently used index blocks (the engine's own LRU
pressure, from decode KV growth too, which the routed prompts alone do not show);
``BlockStored`` counts. A frame that cannot be decoded, an unknown topic or a sequence gap
is counted; the first bad frame of an engine is logged once, and the index stays
approximate for it. The first batch of an engine is logged at info, and
``fulcrum_gateway_kv_event_senders{state}`` counts the engines reporting and degraded: an
engine of the pool missing from it sends nothing (its PUB socket never reached this one).
Nothing here can stop a pick: each frame is handled on its own and the receive loop ends
only on cancellation or a closed socket (logged once).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from fulcrum.gateway import pick_metrics as pm

log = structlog.get_logger(__name__)

#: Largest accepted payload (bytes); bigger frames are garbage.
MAX_FRAME_BYTES = 16 * 1024 * 1024


class BadFrame(ValueError):
    """A KV event frame that is not vLLM's format."""


@dataclass(frozen=True, slots=True)
class Batch:
    """One decoded batch: blocks stored and removed, whether the cache was cleared."""

    seq: int
    stored: int
    removed: int
    cleared: bool


def decode(frames: list[bytes]) -> tuple[str, Batch]:
    """``(topic, batch)`` of one ZMQ message; raises :class:`BadFrame`."""
    import msgpack

    if len(frames) != 3 or len(frames[1]) != 8 or len(frames[2]) > MAX_FRAME_BYTES:
        raise BadFrame("kv event: want 3 frames (topic, 8-byte seq, payload)")
    try:
        topic = frames[0].decode("utf-8")
        body = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
    except (ValueError, UnicodeDecodeError, msgpack.ExtraData) as err:
        raise BadFrame(f"kv event: {err}") from None
    if not isinstance(body, list) or len(body) < 2 or not isinstance(body[1], list):
        raise BadFrame("kv event: payload must be [ts, [events...], rank]")
    stored = removed = 0
    cleared = False
    for ev in body[1]:
        kind = ev.get("type") if isinstance(ev, dict) else None
        hashes = ev.get("block_hashes") if isinstance(ev, dict) else None
        if kind in ("BlockStored", "BlockRemoved") and not isinstance(hashes, list):
            raise BadFrame(f"kv event: {kind} without block_hashes")
        if kind == "BlockStored":
            stored += len(hashes)  # type: ignore[arg-type]
        elif kind == "BlockRemoved":
            removed += len(hashes)  # type: ignore[arg-type]
        elif kind == "AllBlocksCleared":
            cleared, stored, removed = True, 0, 0
        else:
            raise BadFrame(f"kv event: unknown type {kind!r}")
    return topic, Batch(int.from_bytes(frames[1], "big", signed=True), stored, removed, cleared)


@dataclass
class EngineEvents:
    """Per engine: last sequence number, blocks stored and removed, whether it degraded."""

    seq: int = -1
    stored: int = 0
    removed: int = 0
    degraded: bool = False


@dataclass
class KvEventSink:
    """Applies decoded batches to the picker's index (event loop only).

    ``slot_of(address)`` gives the engine's index slot (None: unknown engine);
    ``evict_oldest(slot, n)`` and ``clear(slot)`` change the index."""

    slot_of: Callable[[str], int | None]
    evict_oldest: Callable[[int, int], None]
    clear: Callable[[int], None]
    engines: dict[str, EngineEvents] = field(default_factory=dict)

    def handle(self, frames: list[bytes]) -> None:
        """One message; never raises."""
        try:
            topic, batch = decode(frames)
        except BadFrame as err:
            pm.KV_EVENTS.labels("garbage").inc()
            self._degrade(_topic(frames), str(err))
            return
        slot = self.slot_of(topic)
        if slot is None:
            pm.KV_EVENTS.labels("unknown_engine").inc()
            self._degrade(topic, "kv event: topic names no endpoint of the pool")
            return
        eng = self.engines.get(topic)
        if eng is None:  # bounded: slot_of knows only the pool's endpoints
            eng = self.engines[topic] = EngineEvents()
            log.info("gateway_kv_events_engine_reporting", engine=topic[:64])
            self._publish()
        if eng.seq >= 0 and batch.seq != eng.seq + 1:
            pm.KV_EVENTS.labels("gap").inc()
        eng.seq = batch.seq
        pm.KV_EVENTS.labels("ok").inc()
        if batch.cleared:
            self.clear(slot)
            eng.stored = eng.removed = 0
            return
        eng.stored += batch.stored
        eng.removed += batch.removed
        if batch.removed:
            self.evict_oldest(slot, batch.removed)

    def _degrade(self, topic: str, why: str) -> None:
        key = topic if len(self.engines) < 4096 else "?"
        eng = self.engines.setdefault(key, EngineEvents())
        if not eng.degraded:
            eng.degraded = True
            log.warning("gateway_kv_events_degraded", engine=topic[:64], error=why[:200])
            self._publish()

    def _publish(self) -> None:
        """``fulcrum_gateway_kv_event_senders`` from the engines heard so far (on a change
        only: the scrape thread reads the gauge, never :attr:`engines`)."""
        degraded = sum(e.degraded for e in self.engines.values())
        pm.KV_EVENT_SENDERS.labels("degraded").set(degraded)
        pm.KV_EVENT_SENDERS.labels("reporting").set(len(self.engines) - degraded)


def _topic(frames: list[bytes]) -> str:
    return frames[0][:64].decode("utf-8", "replace") if frames else ""


async def subscribe(endpoint: str, sink: KvEventSink, bound: asyncio.Future[str]) -> None:
    """Bind a SUB socket at ``endpoint`` (all topics) and feed ``sink`` until cancelled;
    ``bound`` gets the endpoint actually bound (a ``:0`` port resolved)."""
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.SUB)
    try:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.bind(endpoint)
        bound.set_result(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        while True:
            frames: list[Any] = await sock.recv_multipart()
            sink.handle(list(frames))
    except zmq.ZMQError as err:
        if not bound.done():
            bound.set_exception(err)
        log.warning("gateway_kv_events_stopped", endpoint=endpoint, error=str(err))
    finally:
        sock.close(linger=0)
