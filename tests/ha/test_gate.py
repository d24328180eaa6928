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
