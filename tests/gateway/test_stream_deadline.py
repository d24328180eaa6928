"""The body deadline of one ext_proc stream (``gateway.max_body_ms``): the picker's
:class:`BodyWatch` (one timer for every stream waiting for a message) cancels a read in
progress at the deadline, a read past the deadline refuses at once, and somebody else's
cancellation is never turned into a refusal."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from fulcrum.config.gateway import GatewaySettings
from fulcrum.gateway.extproc import BodyWatch, _Refused, _Stream


def stream(max_body_ms: int, watch: BodyWatch | None = None) -> _Stream:
    settings = GatewaySettings(max_body_ms=max_body_ms)
    picker: Any = SimpleNamespace(settings=settings, pending_bytes=0,
                                  body_watch=watch if watch is not None else BodyWatch())
    return _Stream(picker, asyncio.get_running_loop().time())


async def never() -> AsyncIterator[Any]:
    await asyncio.Event().wait()
    yield None  # pragma: no cover - never reached


async def one_message() -> AsyncIterator[Any]:
    yield "headers"


async def test_a_read_past_the_deadline_is_refused_503() -> None:
    s = stream(20)
    with pytest.raises(_Refused) as err:
        await s.next(aiter(never()))
    assert err.value.refusal.code == 503
    assert err.value.refusal.outcome == "body_timeout"
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_deadline_between_reads_refuses_the_next_read_at_once() -> None:
    s = stream(60_000)
    assert await s.next(aiter(one_message())) == "headers"
    s.deadline = asyncio.get_running_loop().time()  # it passed while the stream wrote
    with pytest.raises(_Refused) as err:
        await s.next(aiter(never()))
    assert err.value.refusal.code == 503


async def test_another_cancellation_stays_a_cancellation() -> None:
    s = stream(60_000)
    reader = asyncio.ensure_future(s.next(aiter(never())))
    await asyncio.sleep(0)  # the read is waiting
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader


async def test_a_stream_is_watched_only_while_its_read_waits() -> None:
    watch = BodyWatch()
    s = stream(60_000, watch)
    await s.next(aiter(one_message()))  # the message was there: watched, then not
    assert len(watch) == 0
    reader = asyncio.ensure_future(s.next(aiter(never())))
    await asyncio.sleep(0)  # the read is waiting
    assert len(watch) == 1
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    assert len(watch) == 0


async def test_one_timer_expires_only_the_streams_past_their_deadline() -> None:
    # Two streams wait; the first one's deadline comes first: it is refused, the other
    # keeps waiting (the watch re-arms for it) until its own deadline refuses it too.
    watch = BodyWatch()
    early, late = stream(20, watch), stream(60, watch)
    first = asyncio.ensure_future(early.next(aiter(never())))
    second = asyncio.ensure_future(late.next(aiter(never())))
    with pytest.raises(_Refused):
        await first
    assert not second.done() and len(watch) == 1
    with pytest.raises(_Refused):
        await second
    assert len(watch) == 0


async def test_a_timer_run_just_before_the_deadline_still_expires_the_stream() -> None:
    # A loop may run a timer up to its clock resolution early: the watch must expire the
    # stream then, not arm itself again for the same instant.
    watch = BodyWatch()
    s = stream(60_000, watch)
    reader = asyncio.ensure_future(s.next(aiter(never())))
    await asyncio.sleep(0)  # the read is waiting
    s.deadline = asyncio.get_running_loop().time() + 0.0005
    watch._fire()  # as the timer would, half a millisecond early
    assert s._expired  # at once, not at a timer armed again
    with pytest.raises(_Refused):
        await reader
    assert len(watch) == 0
