"""Chaos: prefill engines and the daemon are killed and restarted in a loop while the
entrypoint submits; then every submitted request has ended exactly once and the
accounting is back to zero.

- engines are ``MemberSession`` + a pull loop; a kill cancels both without deregistering
  (a crash: the member lapses), a restart registers the same id with a new incarnation;
- the daemon is drained and stopped (SIGTERM semantics), then a new one starts on the same
  port; engines re-register through their next heartbeat on their own;
- engines acknowledge each batch on their next pull (acknowledged delivery, issue 13); a
  *freeze* stops an engine right after it pulled a batch (it still heartbeats: a
  partition of its pull path): its lease runs out, the batch goes to another engine; it
  then thaws, acknowledges late, is told the requests were reassigned, and is killed;
- invariants: each submit has one final outcome at its caller; no request is run by two
  engines (an engine runs what the daemon accepted its acknowledgement of); every OK
  submit names the engine that actually runs the request, and every request an engine
  runs answered its submitter OK naming it; the daemon records one outcome per request;
  queues, leases, queued quota and fleet end empty.

Bounded: waits are polls on conditions with deadlines; the seed fixes every choice.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from fulcrum.client import FulcrumClient, MemberSession
from fulcrum.config import Settings
from fulcrum.service.server import Daemon, build
from fulcrum.state.prefill import PrefillState
from fulcrum.testing import test_settings as make_settings
from fulcrum.v1 import decode_pb2, fleet_pb2, prefill_pb2

#: Reconnect quickly after a daemon restart (gRPC's default backoff grows to 2 minutes).
FAST_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 500),
]
ENGINES = 3
DECODE_INSTANCES = 2
SUBMITTERS = 6
ROUNDS = 8


async def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Poll ``cond`` until true or fail after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        if loop.time() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@dataclass
class Ledger:
    """What callers and engines saw."""

    outcomes: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    received: dict[str, list[str]] = field(default_factory=dict)  # request -> engines
    reassigned: dict[str, list[str]] = field(default_factory=dict)  # late acks refused
    # request -> engines whose acknowledgement of it was on a call that got no reply (a
    # kill, a stop, a deadline, a restart). A set: after a daemon restart the client's
    # retried submit can be pulled by a second engine while the first still holds it.
    in_doubt: dict[str, set[str]] = field(default_factory=dict)
    server: dict[str, list[str]] = field(default_factory=dict)  # request -> daemon outcomes
    killed: set[str] = field(default_factory=set)
    submitted: int = 0
    decode_codes: dict[str, int] = field(default_factory=dict)
    release_codes: dict[str, int] = field(default_factory=dict)

    @property
    def finished(self) -> int:
        return len(self.outcomes)


class Engine:
    """A fleet member: its registration session, plus a pull loop for a prefill engine
    (a decode instance only heartbeats)."""

    def __init__(self, address: str, member_id: str, ledger: Ledger) -> None:
        self.client = FulcrumClient(address, timeout_s=5.0, options=FAST_RECONNECT)
        self.member_id = member_id
        self.ledger = ledger
        self.decode = member_id.startswith("decode")
        if self.decode:
            register = fleet_pb2.RegisterRequest(
                member_id=member_id,
                decode_instance=fleet_pb2.DecodeInstanceShape(
                    gpus=[fleet_pb2.DecodeGpuCapacity(max_concurrency=64,
                                                      max_kv_tokens=1 << 24)] * 2
                ),
            )
        else:
            register = fleet_pb2.RegisterRequest(
                member_id=member_id, prefill_engine=fleet_pb2.PrefillEngineShape(dp_ranks=2)
            )
        self.session = MemberSession(self.client, register)
        self.task: asyncio.Task[None] | None = None
        self.pending: list[str] = []  # pulled, to acknowledge on the next pull
        self.freeze_next = False
        self.frozen = asyncio.Event()
        self.thaw = asyncio.Event()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10.0
        while True:  # the daemon may be restarting: retry within a bounded time
            try:
                await self.session.start()
                break
            except grpc.aio.AioRpcError:
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(0.05)
        if not self.decode:
            self.task = asyncio.ensure_future(self._pull_loop())

    async def _pull_loop(self) -> None:
        while True:
            acks = list(self.pending)
            try:
                reply = await self.client.prefill.Pull(
                    prefill_pb2.PullRequest(
                        engine_id=self.member_id,
                        incarnation=self.session.incarnation,
                        remaining_quota_ns=10**12,
                        rank_loads_ns=[0, 0],
                        max_wait_ms=200,
                        ack_request_ids=acks,
                    ),
                    timeout=2.0,
                )
            except asyncio.CancelledError:
                for rid in acks:  # killed with its acknowledgement on the wire
                    self.ledger.in_doubt.setdefault(rid, set()).add(self.member_id)
                raise
            except grpc.aio.AioRpcError as err:
                # No reply (a deadline under load, the daemon restarting): the daemon may
                # have applied these acknowledgements before the call failed, as for a
                # call on the wire at a kill. Sent again below; a re-sent one it already
                # has comes back refused, so only this mark records who held it.
                for rid in acks:
                    self.ledger.in_doubt.setdefault(rid, set()).add(self.member_id)
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    self.pending.clear()  # a new incarnation: what it held went elsewhere
                await asyncio.sleep(0.02)  # re-registration is the session's job
                continue
            refused = set(reply.rejected_request_ids)
            for rid in acks:  # the daemon accepted these: this engine runs them
                if rid in refused:
                    self.ledger.reassigned.setdefault(rid, []).append(self.member_id)
                else:
                    self.ledger.received.setdefault(rid, []).append(self.member_id)
            self.pending = [item.request_id for item in reply.requests]
            if self.freeze_next and self.pending:
                self.freeze_next = False
                self.frozen.set()
                await self.thaw.wait()

    async def kill(self) -> None:
        """A crash: stop pulling and heartbeating, without deregistering."""
        self.ledger.killed.add(self.member_id)
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        await self.session.stop(deregister=False)
        await self.client.close()

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        await self.session.stop(deregister=True)
        await self.client.close()


async def submitter(client: FulcrumClient, ids: Any, ledger: Ledger, stop: asyncio.Event
                    ) -> None:
    while not stop.is_set():
        rid = f"req-{next(ids)}"
        ledger.submitted += 1
        try:
            reply = await client.prefill.Submit(
                prefill_pb2.SubmitRequest(
                    request_id=rid, total_tokens=2000, cached_tokens=500, max_wait_ms=1500
                ),
                timeout=5.0,
            )
            outcome = ("OK", reply.engine_id)
        except grpc.aio.AioRpcError as err:
            outcome = (err.code().name, "")
        ledger.outcomes.setdefault(rid, []).append(outcome)


async def decode_worker(client: FulcrumClient, ids: Any, ledger: Ledger, stop: asyncio.Event,
                        held: dict[str, str]) -> None:
    """Place then release decode requests; a refused or lost placement is fine, a held
    one is released (NOT_FOUND when its instance left with it)."""
    while not stop.is_set():
        rid = f"dec-{next(ids)}"
        try:
            reply = await client.decode.PlaceDecode(
                decode_pb2.PlaceDecodeRequest(request_id=rid, kv_tokens=10_000), timeout=5.0
            )
        except grpc.aio.AioRpcError as err:
            ledger.decode_codes[err.code().name] = ledger.decode_codes.get(err.code().name, 0) + 1
            await asyncio.sleep(0.01)
            continue
        held[rid] = reply.instance_id
        await asyncio.sleep(0.005)
        await release(client, rid, held, ledger)


async def release(client: FulcrumClient, rid: str, held: dict[str, str], ledger: Ledger) -> None:
    try:
        await client.decode.ReleaseDecode(decode_pb2.ReleaseDecodeRequest(request_id=rid),
                                          timeout=5.0)
        code = "OK"
    except grpc.aio.AioRpcError as err:
        code = err.code().name
    if code in ("OK", "NOT_FOUND"):
        held.pop(rid, None)
    ledger.release_codes[code] = ledger.release_codes.get(code, 0) + 1


def chaos_settings(port: int) -> Settings:
    return make_settings(
        {
            "server": {"port": port, "grace_period_s": 1.0},
            "metrics": {"enabled": False},
            "fleet": {
                "heartbeat_interval_ms": 50,
                "heartbeat_timeout_ms": 400,
                "sweep_interval_ms": 20,
            },
            "prefill": {"round_period_ms": 100, "submit_wait_ms": 1500, "lease_ms": 300},
        }
    )


async def start_daemon(port: int, ledger: Ledger, started: list[Daemon]) -> Daemon:
    """A daemon on ``port`` (0: any) recording outcomes in ``ledger``, appended to
    ``started`` for the test's final stop."""
    daemon = build(chaos_settings(port))
    await daemon.start()
    started.append(daemon)
    state = daemon.app.components["prefill"]  # a missing balancer or hook list fails
    assert isinstance(state, PrefillState), state

    def record(request_id: str, outcome: str, engine_id: str) -> None:
        ledger.server.setdefault(request_id, []).append(outcome)

    state.outcome_hooks.append(record)
    return daemon


async def freeze(eng: Engine, daemon: Daemon, ledger: Ledger) -> None:
    """Freeze ``eng`` right after it pulls a batch; wait until its lease ran out; thaw it
    and wait for its late acknowledgement (refused: the batch went elsewhere)."""
    eng.freeze_next = True
    await wait_for(eng.frozen.is_set, f"{eng.member_id} to pull a batch and freeze")
    held = list(eng.pending)
    state = daemon.app.components["prefill"]
    await wait_for(lambda: not state.leases.held_by(eng.member_id), "lease expiry")
    eng.thaw.set()
    await wait_for(
        lambda: all(eng.member_id in ledger.reassigned.get(r, []) for r in held),
        "the late acknowledgement to be refused",
    )


@contextlib.asynccontextmanager
async def stopping_daemons() -> AsyncIterator[list[Daemon]]:
    """A list for :func:`start_daemon`; on exit every daemon in it is stopped, also when
    a check failed: one left serving is collected after its loop closed, and its gRPC
    shutdown can hang a later test (seen in CI after a failed check here)."""
    started: list[Daemon] = []
    try:
        yield started
    finally:
        for daemon in started:
            await daemon.drain_and_stop()  # idempotent


async def test_engines_and_daemon_restart_under_load() -> None:
    async with stopping_daemons() as started:
        await restart_under_load(started)


async def restart_under_load(started: list[Daemon]) -> None:
    rng = random.Random(7)
    ledger = Ledger()
    daemon = await start_daemon(0, ledger, started)
    port = daemon.port
    address = daemon.address
    names = [f"engine-{i}" for i in range(ENGINES)]
    names += [f"decode-{i}" for i in range(DECODE_INSTANCES)]
    engines = {n: Engine(address, n, ledger) for n in names}
    for e in engines.values():
        await e.start()
    down: list[str] = []
    entry = FulcrumClient(address, timeout_s=5.0, options=FAST_RECONNECT)
    stop = asyncio.Event()
    ids = itertools.count()
    held: dict[str, str] = {}
    workers = [asyncio.ensure_future(submitter(entry, ids, ledger, stop))
               for _ in range(SUBMITTERS)]
    workers += [asyncio.ensure_future(decode_worker(entry, ids, ledger, stop, held))
                for _ in range(2)]
    restarts = 0
    freezes = 0
    try:
        for _ in range(ROUNDS):
            target = ledger.finished + 20
            await wait_for(lambda t=target: ledger.finished >= t, "submits to progress")
            action = rng.choice(["kill", "freeze", "restart_engine", "restart_daemon"])
            alive = sorted(set(engines) - set(down))
            prefill_alive = [n for n in alive if not engines[n].decode]
            if action == "freeze" and len(prefill_alive) >= 2:
                # Frozen right after a pull: its lease runs out and the batch goes to
                # another engine; thawed, it acknowledges late and is refused; killed.
                name = rng.choice(prefill_alive)
                await freeze(engines[name], daemon, ledger)
                await engines[name].kill()
                down.append(name)
                freezes += 1
            elif action in ("kill", "freeze") and len(down) < len(engines) - 2:
                name = rng.choice(alive)
                await engines[name].kill()
                down.append(name)
            elif action == "restart_engine" and down:
                name = down.pop(0)
                engines[name] = Engine(address, name, ledger)
                await engines[name].start()
            else:
                await daemon.drain_and_stop()
                daemon = await start_daemon(port, ledger, started)
                restarts += 1
        # bring every engine back so that what is queued gets pulled
        for name in down:
            engines[name] = Engine(address, name, ledger)
            await engines[name].start()
        down.clear()
        if freezes == 0:  # the seed did not pick it: freeze one engine anyway
            name = next(n for n in engines if not engines[n].decode)
            await freeze(engines[name], daemon, ledger)
            await engines[name].kill()
            engines[name] = Engine(address, name, ledger)
            await engines[name].start()
            freezes += 1
        if restarts == 0:  # the seed did not pick it: restart the daemon once anyway
            await daemon.drain_and_stop()
            daemon = await start_daemon(port, ledger, started)
            restarts += 1
        # engines re-register with the new daemon on their own
        await wait_for(lambda: daemon.app.fleet.count() == len(engines), "members re-registered")
        target = ledger.finished + 20
        await wait_for(lambda: ledger.finished >= target, "submits after the restarts")
        stop.set()
        await asyncio.wait_for(asyncio.gather(*workers), timeout=15)
        for rid in list(held):  # what the workers still held when told to stop
            await release(entry, rid, held, ledger)
        decode = daemon.app.components["decode"]
        await wait_for(lambda: decode.held == 0, "decode placements released")
        loads = list(decode.gpu_loads())
        assert len(loads) == 2 * DECODE_INSTANCES
        assert all(c == 0 and k == 0 for _, _, c, k in loads), loads
    finally:
        stop.set()
        for w in workers:
            w.cancel()
        for e in engines.values():
            if e.member_id not in down:
                await e.stop()
        await entry.close()

    # -- invariants ---------------------------------------------------------------------
    assert restarts >= 1 and freezes >= 1 and ledger.killed
    assert not held
    bad = {"INTERNAL", "UNKNOWN"}
    assert not bad & (set(_codes(ledger)) | set(ledger.decode_codes) | set(ledger.release_codes))
    assert ledger.release_codes.get("OK", 0) > 0
    assert ledger.finished == ledger.submitted, "a submit ended without an outcome"
    assert all(len(o) == 1 for o in ledger.outcomes.values())
    doubles = {r: e for r, e in ledger.received.items() if len(e) > 1}
    assert not doubles, f"requests run by two engines: {doubles}"
    for rid, (engine,) in ledger.received.items():
        code, named = ledger.outcomes[rid][0]
        assert (code, named) == ("OK", engine), (rid, engine, ledger.outcomes[rid])
    # Every OK names the engine that actually runs the request: none was lost on an
    # engine that was frozen or killed after its pull. The only OKs no engine recorded
    # are acknowledgements the daemon accepted from an engine killed (or stopped) while
    # that call was on the wire, or on a call that got no reply: the engine had accepted
    # the request, and it was the engine named. (Another engine may hold the same id in
    # doubt: the client retried the submit on the restarted daemon, which handed it out
    # again.)
    unseen = [
        (rid, o[0][1]) for rid, o in ledger.outcomes.items()
        if o[0][0] == "OK" and rid not in ledger.received
    ]
    assert all(engine in ledger.in_doubt.get(rid, ()) for rid, engine in unseen), unseen
    assert ledger.reassigned, "no late acknowledgement was refused"
    ok = sum(1 for o in ledger.outcomes.values() if o[0][0] == "OK")
    assert ok > ledger.finished // 2, {c: n for c, n in _codes(ledger).items()}
    # the daemon recorded one outcome per request (per daemon life: a request refused
    # UNAVAILABLE by a draining daemon may be retried by the client on the next one)
    for rid, outs in ledger.server.items():
        assert outs.count("delivered") <= 1, (rid, outs)
    # accounting back to zero on the last daemon
    state = daemon.app.components["prefill"]
    try:
        await wait_for(lambda: sum(state.queue_depths()) == 0, "queues empty")
        assert sum(state.queued_ns()) == 0
        await wait_for(lambda: len(state.leases) == 0, "leases ended")
        assert state.leases.leased_ns == [0] * state.n_tiers
        await wait_for(lambda: daemon.app.fleet.count() == 0, "fleet empty")
        assert all(n == 0 for n in state.engines_per_tier())
    finally:
        await daemon.drain_and_stop()


def _codes(ledger: Ledger) -> dict[str, int]:
    out: dict[str, int] = {}
    for o in ledger.outcomes.values():
        out[o[0][0]] = out.get(o[0][0], 0) + 1
    return out


# -- reloads during load ------------------------------------------------------------------

#: What the reloader cycles through (nested overrides of the chaos settings). Each changes
#: reloadable keys of several sections; the seed change is restart-only.
RELOADS: list[dict[str, Any]] = [
    {"prefill": {"submit_wait_ms": 800}, "fleet": {"heartbeat_timeout_ms": 600}},
    {"decode": {"policy": "least_kv"}, "server": {"admission": {"max_placement": 64}}},
    {"server": {"seed": 99, "max_call_s": 30.0}},
    {"decode": {"policy": "dual"}, "fleet": {"heartbeat_timeout_ms": 500}},
    {"logging": {"level": "error"}, "server": {"admission": {"shed_wait_ms": 1000.0}}},
    {"prefill": {"submit_wait_ms": 1500}, "fleet": {"sweep_interval_ms": 30}},
]


async def test_reloads_during_load() -> None:
    """Reloads of many keys while engines pull, the entrypoint submits and places, and
    members heartbeat: every reload ends applied or restart_required (never failed), each
    reloadable key is in effect afterwards and restart-only ones are not, no call ends
    INTERNAL/UNKNOWN, every submit ends exactly once, and the accounting returns to zero."""
    async with stopping_daemons() as started:
        await reloads_during_load(started)


async def reloads_during_load(started: list[Daemon]) -> None:
    from fulcrum.config import with_overrides

    ledger = Ledger()
    daemon = await start_daemon(0, ledger, started)
    base = daemon.app.settings
    address = daemon.address
    names = [f"engine-{i}" for i in range(ENGINES)] + ["decode-0", "decode-1"]
    engines = {n: Engine(address, n, ledger) for n in names}
    for e in engines.values():
        await e.start()
    entry = FulcrumClient(address, timeout_s=5.0, options=FAST_RECONNECT)
    stop = asyncio.Event()
    ids = itertools.count()
    held: dict[str, str] = {}
    workers = [asyncio.ensure_future(submitter(entry, ids, ledger, stop)) for _ in range(4)]
    workers += [asyncio.ensure_future(decode_worker(entry, ids, ledger, stop, held))
                for _ in range(2)]
    outcomes: list[str] = []
    settings = base
    try:
        for i in range(2 * len(RELOADS)):
            target = ledger.finished + 10
            await wait_for(lambda t=target: ledger.finished >= t, "submits to progress")
            settings = with_overrides(settings, RELOADS[i % len(RELOADS)])
            outcomes.append(daemon.reload(settings))
        target = ledger.finished + 10
        await wait_for(lambda: ledger.finished >= target, "submits after the reloads")
        stop.set()
        await asyncio.wait_for(asyncio.gather(*workers), timeout=15)
        for rid in list(held):
            await release(entry, rid, held, ledger)
        decode = daemon.app.components["decode"]
        await wait_for(lambda: decode.held == 0, "decode placements released")
        assert all(c == 0 and k == 0 for _, _, c, k in decode.gpu_loads())
    finally:
        stop.set()
        for w in workers:
            w.cancel()
        for e in engines.values():
            await e.stop()
        await entry.close()
    try:
        assert set(outcomes) <= {"applied", "restart_required"}, outcomes
        assert "restart_required" in outcomes and "applied" in outcomes
        s = daemon.app.settings
        assert s.server.seed == base.server.seed  # restart-only: kept
        assert s.prefill.submit_wait_ms == settings.prefill.submit_wait_ms
        assert daemon.app.fleet.settings == settings.fleet
        assert daemon.app.components["admission"].settings == settings.server.admission
        bad = {"INTERNAL", "UNKNOWN"}
        codes = set(_codes(ledger)) | set(ledger.decode_codes) | set(ledger.release_codes)
        assert not bad & codes, codes
        assert ledger.finished == ledger.submitted
        assert all(len(o) == 1 for o in ledger.outcomes.values())
        doubles = {r: e for r, e in ledger.received.items() if len(e) > 1}
        assert not doubles
        state = daemon.app.components["prefill"]
        await wait_for(lambda: sum(state.queue_depths()) == 0, "queues empty")
        assert sum(state.queued_ns()) == 0
        await wait_for(lambda: daemon.app.fleet.count() == 0, "fleet empty")
    finally:
        await daemon.drain_and_stop()
