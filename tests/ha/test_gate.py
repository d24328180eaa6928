"""The serving gate on its own (no etcd): it closes by itself when its deadline passes,
cancels the calls in flight, reports each transition once, and a late renewal does not
reopen it."""

from __future__ import annotations

import asyncio
import time

from fulcrum.ha.gate import Gate
from tests.polling import until


async def test_gate_closes_at_its_deadline_and_cancels_calls() -> None:
    changes: list[tuple[bool, str]] = []
    gate = Gate(lambda serving, reason: changes.append((serving, reason)))
    assert not gate.ok() and not gate.serving
    gate.extend(time.monotonic() + 0.2)
    gate.extend(time.monotonic() + 0.3, "lease renewed")  # still open: no new line
    assert gate.ok() and gate.serving
    call = asyncio.ensure_future(asyncio.Event().wait())
    gate.calls.add(call)
    await until(lambda: not gate.serving, "the gate closes by itself", 10)
    assert not gate.ok()
    await until(call.cancelled, "the call in flight is cancelled", 10)
    assert [s for s, _ in changes] == [True, False]
    assert changes[1][1].endswith("(fenced)")


async def test_late_renewal_keeps_the_gate_closed() -> None:
    changes: list[bool] = []
    gate = Gate(lambda serving, reason: changes.append(serving))
    gate.extend(time.monotonic() - 0.001)  # a renewal confirmed after its deadline
    assert not gate.ok() and not gate.serving
    assert changes == []  # was never open: nothing to report
    gate.extend(time.monotonic() + 60)
    gate.close("resigned")
    assert not gate.ok()
    assert changes == [True, False]


async def test_a_timer_firing_just_before_the_deadline_still_fences() -> None:
    """A loop timer may fire a little early; if the deadline passes while the gate looks
    at the clock, the gate closes as fenced (counted as such), not as a late renewal.
    Seen in a full test run: the fencing test read 'renewal came too late'."""
    reads: list[float] = []
    changes: list[tuple[bool, str]] = []
    gate = Gate(lambda serving, reason: changes.append((serving, reason)),
                lambda: reads.pop(0) if reads else 200.0)
    reads[:] = [100.0, 100.0]
    gate.extend(160.0)
    assert gate.serving
    # The timer fires 1 us early, and the deadline passes between two reads of the clock.
    reads[:] = [160.0 - 1e-6, 160.0 + 1e-6, 160.0 + 2e-6]
    gate._expire()
    if gate.serving:  # it waited for the rest: the next firing, past the deadline
        gate._expire()
    assert not gate.serving and not gate.ok()
    assert [s for s, _ in changes] == [True, False]
    assert changes[1][1].endswith("(fenced)")
