"""The tables' snapshot publisher: built on demand, on the loop, once per read of a stale
snapshot (the scrape thread asks the loop; it never builds one itself)."""

from __future__ import annotations

import asyncio
import threading

from fulcrum.state.placement import Publisher


class Builds:
    """A build function that records the thread of every call."""

    def __init__(self) -> None:
        self.threads: list[int] = []

    def __call__(self) -> int:
        self.threads.append(threading.get_ident())
        return len(self.threads)


def test_without_a_schedule_every_change_builds_at_once() -> None:
    builds = Builds()
    pub = Publisher(builds)
    pub.changed()
    pub.changed()
    assert pub.snapshot == 3
    assert pub.fresh() == 3


async def test_changes_build_nothing_until_read_then_once_on_the_loop() -> None:
    builds = Builds()
    pub = Publisher(builds)
    pub.set_schedule(asyncio.get_running_loop().call_soon_threadsafe)
    for _ in range(100):
        pub.changed()
    assert pub.snapshot == 1  # nothing built yet
    got = await asyncio.to_thread(pub.fresh)  # the scrape thread asks
    assert got == 2
    assert builds.threads[-1] == threading.get_ident()  # built on the loop's thread
    assert await asyncio.to_thread(pub.fresh) == 2  # not stale: no build
    assert len(builds.threads) == 2


async def test_fresh_on_the_loop_thread_builds_directly() -> None:
    builds = Builds()
    pub = Publisher(builds)
    pub.set_schedule(asyncio.get_running_loop().call_soon_threadsafe)
    pub.changed()
    assert pub.fresh() == 2  # would deadlock if it waited for the loop
    assert pub.current() == 2


async def test_a_loop_that_does_not_answer_gives_the_last_snapshot() -> None:
    builds = Builds()
    pub = Publisher(builds)
    pub.set_schedule(lambda callback: None)  # a loop that never runs the callback
    pub.changed()
    got = await asyncio.to_thread(pub.fresh, 0.05)
    assert got == 1
    assert len(builds.threads) == 1


async def test_a_closed_loop_gives_the_last_snapshot() -> None:
    builds = Builds()
    pub = Publisher(builds)
    other = asyncio.new_event_loop()
    other.close()
    pub.set_schedule(other.call_soon_threadsafe)
    pub.changed()
    assert await asyncio.to_thread(pub.fresh) == 1
