"""The daemon's decode table: instances, per-GPU load view, held placements.

Per-GPU view (requests, KV tokens): the instance's last heartbeat report (0 before any)
plus the placements made since it, minus releases. A report replaces the GPU's figures
(the engine's truth, including KV growth from generated tokens); releasing a placement
lowers them again (never below 0). Without a heartbeat in between, release after place
restores the view exactly.

Placements are held per request id in a table bounded by ``decode.max_placements``, with
a lease of ``decode.lease_ms``: unreleased placements expire (counted, and their share
freed) at the next sweep or placement after their deadline. An instance that leaves
(deregistered, lapsed, replaced) leaves placement at once; its held placements are
dropped and counted as lost. Before a placement is committed, the chosen instance's
liveness is checked with the fleet, so a lapsed instance is never chosen even between
sweeps.

Instances are kept sorted by id (GPU slots in that order), so that the same
registrations and the same seed give the same decisions whatever the order of
registration. The view's arrays are owned here and updated in place (O(1) per placement,
one vectorised pass per heartbeat); a join or a leave rebuilds them (O(GPUs)).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import structlog

from fulcrum.config.decode import DecodeSettings
from fulcrum.core.decode import (
    FleetView,
    NoCapacity,
    imbalance,
    make_policy,
    write_range,
)
from fulcrum.core.decode.policy import DecodePolicy
from fulcrum.core.decode.view import MAX_CONCURRENCY_LIMIT, MAX_KV_LIMIT, GpuWriter
from fulcrum.core.types import DecodeInstanceLoad, DecodeInstanceShape, Member, MemberLoad
from fulcrum.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from fulcrum.metrics import decode as metrics

log = structlog.get_logger(__name__)

#: ``liveness(instance_id, incarnation, now_ns) -> bool``: is the instance still live?
Liveness = Callable[[str, int, int], bool]


class PlaceResult(NamedTuple):
    """Where a request went. Loads are the chosen GPU's after the placement.

    (A NamedTuple rather than a frozen dataclass: it is built once per placement and a
    tuple is several times cheaper to construct.)
    """

    instance_id: str
    incarnation: int
    gpu_index: int
    branch: str
    gpu_concurrency: int
    gpu_kv_tokens: int
    lease_ms: int


class ReleaseResult(NamedTuple):
    """Which GPU a released placement held, and for how long (ns)."""

    instance_id: str
    gpu_index: int
    held_ns: int


@dataclass(slots=True)
class _Held:
    instance: _Instance
    gpu_index: int
    kv_tokens: int
    placed_ns: int
    deadline_ns: int


@dataclass(slots=True, eq=False)
class _Instance:
    member: Member
    max_concurrency: tuple[int, ...]
    max_kv_tokens: tuple[int, ...]
    start: int = -1  # first slot in the view; -1 = not in it
    requests: set[str] = field(default_factory=set)

    @property
    def gpus(self) -> int:
        return len(self.max_concurrency)


class DecodeState:
    """Decode instances, per-GPU load and held placements. Not thread-safe: the daemon's
    event loop is the only caller. Implements the fleet's ``FleetListener`` protocol."""

    def __init__(
        self,
        settings: DecodeSettings,
        rng: np.random.Generator,
        liveness: Liveness | None = None,
        debug_log: bool = False,
    ) -> None:
        self._settings = settings
        self._debug_log = debug_log  # one debug line per decision (costs ~7 us) only if on
        self._rng = rng
        self._liveness = liveness
        self._instances: dict[str, _Instance] = {}
        self._order: list[str] = []  # instance ids, sorted
        self._slots: list[tuple[_Instance, int]] = []  # slot -> (instance, gpu index)
        self._view = FleetView.build([], [], [], [])
        self._writer = GpuWriter(self._view)  # O(1) scalar access to the view's arrays
        self._held: OrderedDict[str, _Held] = OrderedDict()
        self._cursor = 0
        self._policy: DecodePolicy = make_policy(settings.policy, settings.params())
        self._lease_ns = settings.lease_ms * 1_000_000
        self.expired_total = 0
        self.lost_total = 0
        self._max_request_kv = settings.max_request_kv_tokens
        self._max_placements = settings.max_placements
        self._counts = metrics.DecodeCounts()
        self._bind_metrics()
        metrics.set_source(self)

    # -- configuration -------------------------------------------------------------------

    def _bind_metrics(self) -> None:
        """Zero the counters of the policy in force (exported at once) and precompute the
        keys the decision path increments (plain ints: no lock, no label lookup)."""
        name = self._policy.name
        c = self._counts
        self._k_placed = {b: (name, b, "placed") for b in ("", "short", "long")}
        self._k_refused = {o: (name, "", o) for o in metrics.PLACE_OUTCOMES[1:]}
        for key in (*self._k_placed.values(), *self._k_refused.values()):
            c.placements.setdefault(key, 0)
        for outcome in metrics.RELEASE_OUTCOMES:
            c.releases.setdefault(outcome, 0)

    @property
    def counts(self) -> metrics.DecodeCounts:
        """Placement and release counters (exported at scrape time)."""
        return self._counts

    @property
    def settings(self) -> DecodeSettings:
        return self._settings

    @property
    def policy_name(self) -> str:
        """Registry name of the policy in force."""
        return self._policy.name

    @property
    def view(self) -> FleetView:
        """The current view (owned here: read it, never keep it across calls)."""
        return self._view

    @property
    def held(self) -> int:
        """Placements held (not yet released, expired or lost)."""
        return len(self._held)

    def reconfigure(self, settings: DecodeSettings) -> None:
        """Apply new settings (SIGHUP): policy and parameters apply to the next decision, the
        lease to new placements (expiry runs in placement order, so a shortened lease
        takes effect once older placements are gone); held placements keep their deadline."""
        self._policy = make_policy(settings.policy, settings.params())
        self._settings = settings
        self._lease_ns = settings.lease_ms * 1_000_000
        self._max_request_kv = settings.max_request_kv_tokens
        self._max_placements = settings.max_placements
        self._bind_metrics()
        log.info("decode_reconfigured", policy=settings.policy, lease_ms=settings.lease_ms)

    # -- placement ----------------------------------------------------------------------

    def count_refused(self, outcome: str) -> None:
        """Count a PlaceDecode refused before it reached the table (e.g. a bad id)."""
        self._counts.placements[self._k_refused[outcome]] += 1

    def place(self, request_id: str, kv_tokens: int, now_ns: int) -> PlaceResult:
        """Choose a GPU for ``kv_tokens`` tokens and hold the placement under the lease.

        Raises InvalidArgument (kv_tokens), AlreadyExists (request_id held),
        ResourceExhausted (table full, or no GPU fits); a refused call changes nothing
        except expiring due leases.
        """
        counts = self._counts.placements
        if not 1 <= kv_tokens <= self._max_request_kv:
            counts[self._k_refused["invalid_argument"]] += 1
            raise InvalidArgument(
                "kv_tokens", f"must be in [1, {self._max_request_kv}], got {kv_tokens}"
            )
        held = self._held
        if held and next(iter(held.values())).deadline_ns <= now_ns:
            self.expire(now_ns)
        if request_id in held:
            counts[self._k_refused["already_exists"]] += 1
            raise AlreadyExists(f"request_id: {request_id!r} already holds a decode placement")
        if len(held) >= self._max_placements:
            counts[self._k_refused["resource_exhausted"]] += 1
            raise ResourceExhausted(
                f"decode placements: table full ({self._max_placements} held); "
                "release finished requests",
                self._settings.sweep_interval_ms,
            )
        liveness = self._liveness
        rounds = len(self._instances) + 1
        while True:
            view = self._view
            out = self._policy.select(view, kv_tokens, self._rng, self._cursor)
            if isinstance(out, NoCapacity):
                key = (self._policy.name, out.kind, "resource_exhausted")
                counts[key] = counts.get(key, 0) + 1
                raise ResourceExhausted(f"decode: {out.reason}", self._settings.sweep_interval_ms)
            slot = out.gpu
            instance, gpu_index = self._slots[slot]
            member = instance.member
            if liveness is None or liveness(member.member_id, member.incarnation, now_ns):
                break
            # The fleet found it lapsed (and normally told us through on_leave already).
            if self._instances.get(member.member_id) is instance:
                self._remove(instance, "lapsed")
            rounds -= 1
            if rounds <= 0:  # pragma: no cover - every round removes one instance
                counts[self._k_refused["resource_exhausted"]] += 1
                raise ResourceExhausted("decode: no live decode instance", 1000)
        # The chosen GPU is live, has a free slot and room (the selection's filter), so
        # the new load is in range: the O(1) in-place write of the core.
        writer = self._writer
        conc, kv = writer.load(slot)
        conc += 1
        kv += kv_tokens
        writer.write(slot, conc, kv, True)
        self._cursor = out.cursor
        held[request_id] = _Held(instance, gpu_index, kv_tokens, now_ns, now_ns + self._lease_ns)
        instance.requests.add(request_id)
        counts[self._k_placed[out.kind]] += 1
        if self._debug_log:
            log.debug(
                "decode_placed",
                request_id=request_id,
                kv_tokens=kv_tokens,
                instance_id=member.member_id,
                gpu=gpu_index,
                branch=out.kind,
            )
        return PlaceResult(
            member.member_id,
            member.incarnation,
            gpu_index,
            out.kind,
            conc,
            kv,
            self._lease_ns // 1_000_000,
        )

    def release(self, request_id: str, now_ns: int) -> ReleaseResult:
        """Free a held placement; NotFound when unknown, released, expired or lost."""
        held = self._held.pop(request_id, None)
        if held is None:
            self._counts.releases["not_found"] += 1
            raise NotFound(
                f"request_id: {request_id!r} holds no decode placement "
                "(unknown, already released, expired, or lost with its instance)"
            )
        self._unhold(request_id, held)
        self._counts.releases["released"] += 1
        return ReleaseResult(
            held.instance.member.member_id, held.gpu_index, max(now_ns - held.placed_ns, 0)
        )

    def count_release_refused(self, outcome: str) -> None:
        """Count a ReleaseDecode refused before it reached the table (e.g. a bad id)."""
        self._counts.releases[outcome] += 1

    def _unhold(self, request_id: str, held: _Held) -> None:
        """Take a popped placement's share off its GPU (never below 0)."""
        instance = held.instance
        instance.requests.discard(request_id)
        if instance.start < 0:
            return
        slot = instance.start + held.gpu_index
        writer = self._writer
        conc, kv = writer.load(slot)
        writer.write(slot, max(conc - 1, 0), max(kv - held.kv_tokens, 0), writer.is_live(slot))

    def expire(self, now_ns: int) -> int:
        """Expire placements whose lease ran out (in placement order); returns how many."""
        n = 0
        held = self._held
        while held:
            request_id, first = next(iter(held.items()))
            if first.deadline_ns > now_ns:
                break
            held.popitem(last=False)
            self._unhold(request_id, first)
            n += 1
        if n:
            self.expired_total += n
            metrics.EXPIRATIONS.inc(n)
            log.info("decode_leases_expired", count=n, held=len(held))
        return n

    # -- fleet listener ------------------------------------------------------------------

    def validate_load(self, member: Member, load: MemberLoad) -> None:
        """Refuse a report with an absurd per-GPU figure (changes nothing)."""
        if not isinstance(load, DecodeInstanceLoad):
            raise InvalidArgument("load", "must be decode_instance for a decode instance")
        for i, (c, k) in enumerate(zip(load.concurrency, load.kv_tokens, strict=True)):
            if not 0 <= c < MAX_CONCURRENCY_LIMIT:
                raise InvalidArgument(
                    f"decode_instance.gpus[{i}].concurrency",
                    f"must be in [0, {MAX_CONCURRENCY_LIMIT - 1}]",
                )
            if not 0 <= k < MAX_KV_LIMIT:
                raise InvalidArgument(
                    f"decode_instance.gpus[{i}].kv_tokens", f"must be in [0, {MAX_KV_LIMIT - 1}]"
                )

    def on_join(self, member: Member, now_ns: int) -> None:
        shape = member.shape
        if not isinstance(shape, DecodeInstanceShape):
            return
        old = self._instances.get(member.member_id)
        if old is not None:  # the fleet calls on_leave first; be safe anyway
            self._remove(old, "replaced", rebuild=False)
        self._instances[member.member_id] = _Instance(
            member=member,
            max_concurrency=tuple(min(c, MAX_CONCURRENCY_LIMIT - 1) for c in shape.max_concurrency),
            max_kv_tokens=tuple(min(k, MAX_KV_LIMIT - 1) for k in shape.max_kv_tokens),
        )
        bisect.insort(self._order, member.member_id)
        self._rebuild()
        log.info(
            "decode_instance_joined",
            instance_id=member.member_id,
            incarnation=member.incarnation,
            gpus=shape.gpus,
        )

    def on_load(self, member: Member, load: MemberLoad, now_ns: int) -> None:
        instance = self._instances.get(member.member_id)
        if (
            instance is None
            or instance.member.incarnation != member.incarnation
            or not isinstance(load, DecodeInstanceLoad)
            or instance.start < 0
        ):
            return
        write_range(
            self._view,
            instance.start,
            np.asarray(load.concurrency, dtype=np.int64),
            np.asarray(load.kv_tokens, dtype=np.int64),
        )
        self.expire(now_ns)

    def on_leave(self, member: Member, reason: str, now_ns: int) -> None:
        instance = self._instances.get(member.member_id)
        if instance is None or instance.member.incarnation != member.incarnation:
            return
        self._remove(instance, reason)

    def _remove(self, instance: _Instance, reason: str, rebuild: bool = True) -> None:
        member_id = instance.member.member_id
        del self._instances[member_id]
        i = bisect.bisect_left(self._order, member_id)
        if i < len(self._order) and self._order[i] == member_id:
            del self._order[i]
        lost = 0
        for request_id in instance.requests:
            if self._held.pop(request_id, None) is not None:
                lost += 1
        instance.requests.clear()
        instance.start = -1
        if lost:
            self.lost_total += lost
            metrics.LOST.labels(reason).inc(lost)
        if rebuild:
            self._rebuild()
        log.info(
            "decode_instance_left",
            instance_id=member_id,
            incarnation=instance.member.incarnation,
            reason=reason,
            lost_placements=lost,
        )

    def _rebuild(self) -> None:
        """Lay the instances' GPUs out in id order, keeping current loads (O(GPUs))."""
        old = self._view
        conc: list[np.ndarray[tuple[int], np.dtype[np.int64]]] = []
        kv: list[np.ndarray[tuple[int], np.dtype[np.int64]]] = []
        slots: list[tuple[_Instance, int]] = []
        mc: list[int] = []
        mk: list[int] = []
        start = 0
        for member_id in self._order:
            inst = self._instances[member_id]
            if inst.start >= 0:
                conc.append(old.concurrency[inst.start : inst.start + inst.gpus])
                kv.append(old.kv_tokens[inst.start : inst.start + inst.gpus])
            else:
                conc.append(np.zeros(inst.gpus, dtype=np.int64))
                kv.append(np.zeros(inst.gpus, dtype=np.int64))
            mc.extend(inst.max_concurrency)
            mk.extend(inst.max_kv_tokens)
            slots.extend((inst, g) for g in range(inst.gpus))
            inst.start = start
            start += inst.gpus
        empty = np.zeros(0, dtype=np.int64)
        self._view = FleetView.build(
            np.concatenate(conc) if conc else empty,
            np.concatenate(kv) if kv else empty,
            mc,
            mk,
        )
        self._writer = GpuWriter(self._view)
        self._slots = slots

    # -- introspection (metrics, tests) --------------------------------------------------

    def gpu_loads(self) -> Iterator[tuple[str, int, int, int]]:
        """``(instance_id, gpu_index, concurrency, kv_tokens)`` of every decode GPU."""
        view = self._view
        conc = view.concurrency.tolist()
        kv = view.kv_tokens.tolist()
        for slot, (inst, gpu) in enumerate(self._slots):
            yield inst.member.member_id, gpu, conc[slot], kv[slot]

    def gpu_load(self, instance_id: str, gpu_index: int) -> tuple[int, int]:
        """(requests, KV tokens) the balancer sees on one GPU; NotFound if unknown."""
        inst = self._instances.get(instance_id)
        if inst is None or not 0 <= gpu_index < inst.gpus or inst.start < 0:
            raise NotFound(f"instance_id: {instance_id!r} gpu {gpu_index} is not known")
        slot = inst.start + gpu_index
        return int(self._view.concurrency[slot]), int(self._view.kv_tokens[slot])

    def imbalance(self) -> tuple[float, float]:
        """Max over mean across decode GPUs of (concurrency, total KV); 1.0 = perfect."""
        view = self._view
        return imbalance(view.concurrency, view.live), imbalance(view.kv_tokens, view.live)
