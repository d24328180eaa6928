"""Issue 22 row 10 / issue 21: a tenant that salts its block hashes cannot be steered by
another client sending the tenant's unsalted (or guessed) hashes, through the daemon."""

from __future__ import annotations

import asyncio

from fulcrum.client.prefix import block_hashes
from fulcrum.v1 import prefill_pb2
from tests.service.prefill_helpers import prefill_daemon, pull_request, register, until

S = 1_000_000_000
CONFIG = {"prefill": {"cache_model": "per_engine", "affinity_max_wait_ms": 60_000,
                      "engine_cache_blocks": 1_000, "pull_wait_ms": 0}}
PROMPT = list(range(4_096))  # 8 full blocks


def test_salted_chains_never_share_a_hash() -> None:
    plain = block_hashes(PROMPT)
    a = block_hashes(PROMPT, salt=b"tenant-a")
    b = block_hashes(PROMPT, salt=b"tenant-b")
    assert len(plain) == len(a) == len(b) == 8
    assert not set(plain) & set(a) and not set(a) & set(b) and not set(plain) & set(b)
    assert block_hashes(PROMPT, salt=b"tenant-a") == a  # stable for the tenant
    assert block_hashes(PROMPT[:2_048], salt=b"tenant-a") == a[:4]  # prefixes still shared


async def _submit(c, state, rid: str, hashes: list[int]):  # type: ignore[no-untyped-def]
    call = asyncio.ensure_future(c.prefill.Submit(prefill_pb2.SubmitRequest(
        request_id=rid, total_tokens=len(PROMPT) + 100, max_wait_ms=20_000,
        block_hashes=hashes)))
    await until(lambda: state.is_queued(rid))
    return call


async def test_unsalted_flood_steers_only_the_flooder_not_a_salted_tenant() -> None:
    async with prefill_daemon(CONFIG) as (d, c, state):
        now = [d.app.clock()]
        state._clock = lambda: now[0]  # the test drives the daemon's clock
        inc = {e: await register(c, e, dp_ranks=1) for e in ("x", "y")}
        state.rebalance(now[0])
        # An attacker sends the victim's prompt unsalted, and engine x takes it: x holds it.
        call = await _submit(c, state, "attacker-0", block_hashes(PROMPT))
        got = await c.prefill.Pull(pull_request("x", inc["x"], 100 * S, [0], wait_ms=0))
        assert [r.request_id for r in got.requests] == ["attacker-0"]
        await call
        now[0] += state.model_cost_ns(len(PROMPT) + 100, 0)  # x has finished it
        # The attacker's next copy is steered to x: y (idle) is predicted slower.
        call = await _submit(c, state, "attacker-1", block_hashes(PROMPT))
        got = await c.prefill.Pull(pull_request("y", inc["y"], 100 * S, [0], wait_ms=0))
        assert not got.requests
        got = await c.prefill.Pull(pull_request("x", inc["x"], 100 * S, [0], wait_ms=0))
        assert [r.request_id for r in got.requests] == ["attacker-1"]
        await call
        # The salted victim's request matches nothing x holds: the first puller takes it.
        call = await _submit(c, state, "victim", block_hashes(PROMPT, salt=b"victim"))
        got = await c.prefill.Pull(pull_request("y", inc["y"], 100 * S, [0], wait_ms=0))
        assert [r.request_id for r in got.requests] == ["victim"]
        assert (await call).engine_id == "y"
