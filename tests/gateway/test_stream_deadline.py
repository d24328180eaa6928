"""The body deadline of one ext_proc stream (``gateway.max_body_ms``): one timer per
stream; it cancels a read in progress, refuses the next read when it fired between
reads, and never turns somebody else's cancellation into a refusal."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from fulcrum.config.gateway import GatewaySettings
from fulcrum.gateway.extproc import _Refused, _Stream


def stream(max_body_ms: int) -> _Stream:
    settings = GatewaySettings(max_body_ms=max_body_ms)
    picker: Any = SimpleNamespace(settings=settings, pending_bytes=0)
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
    assert await s.next(aiter(one_message())) == "headers"  # arms the timer
    s._expire()  # the timer fires while the stream is not reading (e.g. writing)
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


async def test_the_timer_ends_with_the_stream() -> None:
    s = stream(60_000)
    await s.next(aiter(one_message()))
    assert s._timer is not None
    s.close()
    assert s._timer is None
