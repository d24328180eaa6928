"""The etcd election backend, over etcd's v3 gRPC API (the protos and stubs ``aetcd``
ships, on our own grpc.aio channel: TLS and several endpoints, which aetcd's own client
does not offer).

Election: the daemon keeps one lease of ``ha.lease_ttl_s`` (renewed every third of it) and
campaigns with one transaction, "if the key does not exist (create revision 0) put my
address under my lease, else read it". The winner is the leader until its lease expires
or it resigns (the lease is revoked: the key goes at once). Every write the leader makes
for the pool (:meth:`EtcdElector.guarded`) is a transaction that compares the key's
create revision with the one the leader created: a deposed leader's write fails.

Fencing: after each renewal *sent* at ``t`` that etcd confirms, the gate may serve until
``t + renew_deadline_s``; etcd cannot expire the lease before ``t + lease_ttl_s``, which is
later, so the old leader has stopped before anyone else can win the key.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aetcd.rpc as rpc
import grpc
import structlog

from fulcrum.config.ha import HaSettings
from fulcrum.errors import Unavailable
from fulcrum.ha.elector import LeaseLost
from fulcrum.ha.gate import Gate
from fulcrum.metrics import ha as m

log = structlog.get_logger(__name__)


def prefix_end(prefix: bytes) -> bytes:
    """etcd's range end of every key starting with ``prefix``."""
    b = bytearray(prefix)
    while b and b[-1] == 0xFF:
        b.pop()
    if not b:
        return b"\x00"
    b[-1] += 1
    return bytes(b)


class _Conn:
    """A channel to one endpoint and its stubs; rotates to the next endpoint on failure."""

    def __init__(self, endpoints: list[str], creds: grpc.ChannelCredentials | None,
                 server_name: str | None) -> None:
        self._endpoints = endpoints
        self._creds = creds
        self._server_name = server_name
        self._index = 0
        self.channel: grpc.aio.Channel | None = None
        self.kv: Any = None
        self.lease: Any = None

    @property
    def endpoint(self) -> str:
        return self._endpoints[self._index]

    def open(self) -> None:
        if self.channel is not None:
            return
        target = self.endpoint
        if self._creds is None:
            self.channel = grpc.aio.insecure_channel(target)
        else:
            opts = ([("grpc.ssl_target_name_override", self._server_name)]
                    if self._server_name else [])
            self.channel = grpc.aio.secure_channel(target, self._creds, options=opts)
        self.kv = rpc.KVStub(self.channel)
        self.lease = rpc.LeaseStub(self.channel)

    async def rotate(self) -> None:
        """Drop the channel; the next :meth:`open` uses the next endpoint."""
        channel, self.channel = self.channel, None
        self._index = (self._index + 1) % len(self._endpoints)
        if channel is not None:
            await channel.close(grace=None)


class EtcdElector:
    """:class:`fulcrum.ha.elector.Elector` on etcd (see the module docstring)."""

    def __init__(self, settings: HaSettings, advertise: str, gate: Gate,
                 creds: grpc.ChannelCredentials | None) -> None:
        self._s = settings
        self._key = settings.election_key.encode()
        self._me = advertise.encode()
        self._gate = gate
        self._conn = _Conn(settings.etcd.endpoints, creds, settings.etcd.tls.server_name)
        self._timeout = settings.etcd.dial_timeout_s
        self._lease = 0
        self._renewed = 0.0  # monotonic s when the last confirmed renewal was sent
        self._next_renew = 0.0
        self._create_rev = 0  # the key's create revision while this daemon leads
        self._leading = False
        self._served = False
        self._fault = ""  # the etcd fault last logged ("" = reachable)
        self.on_elected: Callable[[], Awaitable[None]] | None = None
        self.on_lost: Callable[[str], None] | None = None

    @property
    def leading(self) -> bool:
        return self._leading

    def set_advertise(self, address: str) -> None:
        """The address written in the election key (known once the port is bound)."""
        self._me = address.encode()

    def fence_deadline(self) -> float:
        return self._gate.until

    # -- the loop ------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            delay = self._s.retry_period_s
            try:
                delay = await self._step()
                self._reachable()
            except LeaseLost as err:
                self._lease_lost(str(err))
            except (grpc.aio.AioRpcError, TimeoutError, OSError) as err:
                await self._unreachable(err)
            except Exception:  # e.g. an on_elected hook: never stop campaigning
                log.exception("ha_elector_step_failed", leading=self._leading)
                self._gate.close("election step failed")
            await asyncio.sleep(max(0.0, delay))

    async def _step(self) -> float:
        """One round: a lease, its renewal when due, a campaign (standby) or a check that
        the key is still ours (leader). Returns the wait before the next round, s."""
        self._conn.open()
        if self._lease == 0:
            await self._grant()
        if time.monotonic() >= self._next_renew:
            await self._renew()
        if self._leading:
            await self._verify()
            return self._next_renew - time.monotonic()
        await self._campaign()
        if self._leading:
            return self._next_renew - time.monotonic()
        return min(self._s.retry_period_s, self._next_renew - time.monotonic())

    async def _grant(self) -> None:
        sent = time.monotonic()
        reply = await self._conn.lease.LeaseGrant(
            rpc.LeaseGrantRequest(TTL=self._s.lease_ttl_s), timeout=self._timeout)
        if reply.error:
            raise LeaseLost(f"etcd refused a lease: {reply.error}")
        self._lease = int(reply.ID)
        self._renewed = sent
        self._next_renew = sent + self._s.lease_ttl_s / 3

    async def _renew(self) -> None:
        sent = time.monotonic()
        call = self._conn.lease.LeaseKeepAlive(
            iter([rpc.LeaseKeepAliveRequest(ID=self._lease)]), timeout=self._timeout)
        try:
            reply = await anext(aiter(call), None)
        finally:
            call.cancel()
        if reply is None or reply.TTL <= 0:
            raise LeaseLost("the lease expired (not renewed in time)")
        self._renewed = sent
        self._next_renew = sent + self._s.lease_ttl_s / 3
        if self._leading:
            self._gate.extend(sent + self._s.renew_deadline_s, "lease renewed")

    async def _campaign(self) -> None:
        put = rpc.RequestOp(request_put=rpc.PutRequest(
            key=self._key, value=self._me, lease=self._lease))
        get = rpc.RequestOp(request_range=rpc.RangeRequest(key=self._key))
        cmp = rpc.Compare(key=self._key, target=rpc.Compare.CREATE,
                          result=rpc.Compare.EQUAL, create_revision=0)
        reply = await self._conn.kv.Txn(
            rpc.TxnRequest(compare=[cmp], success=[put], failure=[get]), timeout=self._timeout)
        if reply.succeeded:
            await self._won(int(reply.header.revision))
            return
        kvs = reply.responses[0].response_range.kvs
        if not kvs:
            return  # gone meanwhile: the next round campaigns again
        kv = kvs[0]
        if int(kv.lease) == self._lease:  # ours (a round that failed after winning)
            await self._won(int(kv.create_revision))
            return
        self._gate.leader = kv.value.decode(errors="replace")

    async def _won(self, create_rev: int) -> None:
        self._create_rev = create_rev
        if self.on_elected is not None:
            await self.on_elected()  # before serving: durable state first
        self._leading = True
        self._served = True
        self._gate.leader = self._me.decode()
        self._gate.extend(self._renewed + self._s.renew_deadline_s, "elected")

    async def _verify(self) -> None:
        reply = await self._conn.kv.Range(rpc.RangeRequest(key=self._key),
                                          timeout=self._timeout)
        if not reply.kvs or int(reply.kvs[0].create_revision) != self._create_rev:
            raise LeaseLost("the election key was deleted or taken")

    # -- faults --------------------------------------------------------------------------

    def _lease_lost(self, reason: str) -> None:
        was_leader = self._served
        self._leading = False
        self._lease = 0
        self._next_renew = 0.0
        self._gate.close(reason)
        m.ETCD_ERRORS.labels("lease").inc()
        if was_leader and self.on_lost is not None:
            self.on_lost(reason)
        else:
            log.info("ha_lease_lost", reason=reason, leader_before=False)

    async def _unreachable(self, err: BaseException) -> None:
        m.ETCD_ERRORS.labels("request").inc()
        what = (f"{err.code().name}: {err.details()}" if isinstance(err, grpc.aio.AioRpcError)
                else f"{type(err).__name__}: {err}")
        if not self._fault:  # one line until etcd answers again, however many retries
            self._fault = what.split(":")[0]
            log.warning("ha_etcd_unreachable", endpoint=self._conn.endpoint, error=what,
                        leading=self._leading,
                        effect="serving until the renew deadline, then fenced"
                        if self._leading else "standby; retrying every ha.retry_period_s")
        await self._conn.rotate()

    def _reachable(self) -> None:
        if self._fault:
            log.info("ha_etcd_reachable", endpoint=self._conn.endpoint, was=self._fault)
            self._fault = ""

    # -- pool writes, guarded by the leadership -----------------------------------------

    async def guarded(self, ops: list[Any]) -> None:
        """Apply etcd request ops (``rpc.RequestOp``) only while this daemon holds the key
        with the create revision it won; Unavailable when it does not (nothing written)."""
        if not self._leading or not self._gate.ok():
            m.DURABLE_WRITES.labels("deposed").inc()
            raise Unavailable("ha: this daemon is not the leader; nothing was written")
        cmp = rpc.Compare(key=self._key, target=rpc.Compare.CREATE,
                          result=rpc.Compare.EQUAL, create_revision=self._create_rev)
        try:
            reply = await self._conn.kv.Txn(rpc.TxnRequest(compare=[cmp], success=ops),
                                            timeout=self._timeout)
        except (grpc.aio.AioRpcError, TimeoutError) as err:
            m.DURABLE_WRITES.labels("failed").inc()
            raise Unavailable(f"ha: etcd write failed ({err}); nothing changed",
                              retry_after_ms=int(self._s.retry_period_s * 1000)) from None
        if not reply.succeeded:
            m.DURABLE_WRITES.labels("deposed").inc()
            self._gate.close("a guarded write found another leader")
            raise Unavailable("ha: deposed (the election key changed); nothing was written")
        m.DURABLE_WRITES.labels("ok").inc()

    async def get_prefix(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """Every (key, value) under ``prefix``, in key order."""
        reply = await self._conn.kv.Range(
            rpc.RangeRequest(key=prefix, range_end=prefix_end(prefix)), timeout=self._timeout)
        return [(bytes(kv.key), bytes(kv.value)) for kv in reply.kvs]

    async def resign(self) -> None:
        """Revoke the lease (the key goes with it) after closing the gate."""
        self._gate.close("resigned (shutting down)")
        self._leading = False
        if self._lease and self._conn.channel is not None:
            try:
                await self._conn.lease.LeaseRevoke(rpc.LeaseRevokeRequest(ID=self._lease),
                                                   timeout=self._timeout)
                log.info("ha_resigned", key=self._s.election_key)
            except (grpc.aio.AioRpcError, TimeoutError) as err:
                log.warning("ha_resign_failed", error=str(err),
                            effect="a standby takes over when the lease expires")
        self._lease = 0
        await self._conn.rotate()
