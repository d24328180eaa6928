"""The daemon's decode table: instances, per-GPU load view, held placements.

Per-GPU view (requests, KV tokens): the instance's last heartbeat report (0 before any)
plus the placements made since it, minus releases. A report replaces the GPU's figures
(the engine's truth, including KV growth from generated tokens); releasing a placement
lowers them again (never below 0). Without a heartbeat in between, release after place
restores the view exactly.

The lease/placement mechanics are those of :mod:`fulcrum.state.placement`, shared with
the vision table: placements are held per request id in a table bounded by
``decode.max_placements`` with a lease of ``decode.lease_ms``; an instance that leaves
drops its placements (counted as lost); before a placement is committed the chosen
instance's liveness is checked with the fleet, so a lapsed instance is never chosen
even between sweeps.

Slots: each instance's GPUs occupy a contiguous range of slots of the view's arrays
(:class:`fulcrum.state.placement.SlotAllocator`); free slots are dead (never eligible).
A join or a leave costs O(the instance's GPUs), a placement or a release O(1) (in-place
writes through :class:`fulcrum.core.decode.GpuWriter`), a heartbeat one vectorised pass
over the instance's GPUs. The layout depends on the order of events, so the same
events in the same order with the same seed give the same decisions. Callers that keep
per-slot tables follow the layout through :meth:`DecodeState.add_slot_listener`
(:class:`SlotListener`: O(the instance's GPUs) per join or leave).

Filter: ``place(..., allowed=...)`` restricts one placement to a subset of the slots
(slot indices or a boolean mask, :func:`fulcrum.core.decode.select_allowed`); the
policy in force chooses among them, with the whole fleet as context. Without it
(``allowed=None``) the decision path is the unfiltered one, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple, Protocol

import numpy as np
import structlog

from fulcrum.config.decode import DecodeSettings
from fulcrum.core.decode import (
    Allowed,
    Decision,
    FleetView,
    NoCapacity,
    branches,
    close_range,
    imbalance,
    make_policy,
    open_range,
    resized,
    select_allowed,
    write_range,
)
from fulcrum.core.decode.keys import MAX_CONCURRENCY_LIMIT, MAX_KV_LIMIT
from fulcrum.core.decode.policy import DecodePolicy
from fulcrum.core.decode.writers import GpuWriter
from fulcrum.core.types import DecodeInstanceLoad, DecodeInstanceShape, Member, MemberLoad
from fulcrum.errors import InvalidArgument, NotFound
from fulcrum.metrics import decode as metrics
from fulcrum.state.placement import (
    DEADLINE_NS,
    RECORD,
    LeaseTable,
    MemberFigureCache,
    PlacementTable,
    Publisher,
    SlotAllocator,
    Slots,
)

log = structlog.get_logger(__name__)

#: ``liveness(instance_id, incarnation, now_ns) -> bool``: is the instance still live?
Liveness = Callable[[str, int, int], bool]


class SlotListener(Protocol):
    """Follows which instance's GPUs occupy which slots of :attr:`DecodeState.view` (for
    callers that keep per-slot tables, e.g. the gateway's slot -> address map). Called on
    the loop, after the change."""

    def slots_opened(self, instance_id: str, start: int, gpus: int) -> None:
        """The instance's GPUs ``0..gpus-1`` now occupy slots ``[start, start + gpus)``."""

    def slots_closed(self, instance_id: str, start: int, gpus: int) -> None:
        """The instance left; slots ``[start, start + gpus)`` are free (dead)."""

    def slots_moved(self) -> None:
        """The view was rebuilt (grown or compacted): every instance may have moved; read
        :meth:`DecodeState.slot_ranges` again."""


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


#: The record held for one placement: ``(instance_id, incarnation, gpu_index,
#: kv_tokens)``, a plain tuple of atomic values (the instance by id, not by reference):
#: the collector untracks it (see :data:`fulcrum.state.placement.Lease`).
_Placed = tuple[str, int, int, int]


class _DecodeViews:
    """Read-only views of the decode table and its slot layout (tests, diagnostics, the
    gateway; on the loop)."""

    _members: dict[str, Slots]
    _view: FleetView
    _slot_listeners: list[SlotListener]

    # -- slot layout (for callers keeping per-slot tables) --------------------------------

    def add_slot_listener(self, listener: SlotListener) -> None:
        """Tell ``listener`` about every later change of the slot layout (see
        :class:`SlotListener`); read the current one with :meth:`slot_ranges`."""
        self._slot_listeners.append(listener)

    def remove_slot_listener(self, listener: SlotListener) -> None:
        if listener in self._slot_listeners:
            self._slot_listeners.remove(listener)

    def slot_ranges(self) -> Iterator[tuple[str, int, int]]:
        """``(instance_id, start, gpus)`` of every instance: its GPU ``g`` is slot
        ``start + g`` of :attr:`view` (in no particular order)."""
        for member_id, s in self._members.items():
            yield member_id, s.start, s.gpus

    # -- introspection (tests, diagnostics; on the loop) ----------------------------------

    def gpu_loads(self) -> Iterator[tuple[str, int, int, int]]:
        """``(instance_id, gpu_index, concurrency, kv_tokens)`` of every decode GPU, in
        instance id order."""
        view = self._view
        for member_id in sorted(self._members):
            s = self._members[member_id]
            conc = view.concurrency[s.start : s.start + s.gpus].tolist()
            kv = view.kv_tokens[s.start : s.start + s.gpus].tolist()
            for gpu in range(s.gpus):
                yield member_id, gpu, conc[gpu], kv[gpu]

    def instance_load(self, instance_id: str) -> tuple[list[int], list[int]] | None:
        """(requests per GPU, KV tokens per GPU) the balancer sees on one instance, in GPU
        order; None if the instance is not in the table. O(its GPUs)."""
        s = self._members.get(instance_id)
        if s is None:
            return None
        view = self._view
        end = s.start + s.gpus
        return view.concurrency[s.start : end].tolist(), view.kv_tokens[s.start : end].tolist()

    def gpu_load(self, instance_id: str, gpu_index: int) -> tuple[int, int]:
        """(requests, KV tokens) the balancer sees on one GPU; NotFound if unknown."""
        s = self._members.get(instance_id)
        if s is None or not 0 <= gpu_index < s.gpus:
            raise NotFound(f"instance_id: {instance_id!r} gpu {gpu_index} is not known")
        slot = s.start + gpu_index
        return int(self._view.concurrency[slot]), int(self._view.kv_tokens[slot])

    def imbalance(self) -> tuple[float, float]:
        """Max over mean across decode GPUs of (concurrency, total KV); 1.0 = perfect."""
        view = self._view
        return imbalance(view.concurrency, view.live), imbalance(view.kv_tokens, view.live)


class DecodeState(_DecodeViews, PlacementTable[Slots, DecodeSettings, metrics.DecodeCounts]):
    """Decode instances, per-GPU load and held placements. Not thread-safe: the daemon's
    event loop is the only caller (the scrape thread reads :attr:`publisher`'s snapshot).
    Implements the fleet's ``FleetListener`` protocol."""

    def __init__(
        self,
        settings: DecodeSettings,
        rng: np.random.Generator,
        liveness: Liveness | None = None,
        debug_log: bool = False,
    ) -> None:
        self._debug_log = debug_log  # one debug line per decision (costs ~7 us) only if on
        self._rng = rng
        self._liveness = liveness
        self._members: dict[str, Slots] = {}
        self._alloc = SlotAllocator(64)
        self._owner: list[Slots | None] = [None] * self._alloc.capacity  # slot -> instance
        self._view = resized(FleetView.build([], [], [], []), self._alloc.capacity)
        self._writer = GpuWriter(self._view)  # O(1) scalar access to the view's arrays
        self._leases: LeaseTable[_Placed] = LeaseTable(
            "decode", "decode.max_placements", settings.lease_ms, settings.max_placements,
            settings.sweep_interval_ms,
        )
        self._cursor = 0
        self.expired_total = 0
        self.lost_total = 0
        self._counts = metrics.DecodeCounts()
        self._figures = MemberFigureCache()
        self._settings = settings
        self._policy: DecodePolicy = make_policy(settings.policy, settings.params())
        self._max_request_kv = settings.max_request_kv_tokens
        self._bind_metrics()
        self.publisher: Publisher[metrics.DecodeSnapshot] = Publisher(self._snapshot)
        metrics.set_source(self.publisher)
        self._slot_listeners: list[SlotListener] = []
        #: Grows on every change of the slot layout (join, leave, growth, compaction).
        self.layout_version = 0

    # -- configuration -------------------------------------------------------------------

    def _bind_metrics(self) -> None:
        """Zero the counters of the policy in force (exported at once) and precompute the
        keys the decision path increments (plain ints: no lock, no label lookup)."""
        name = self._policy.name
        c = self._counts
        # "" and the branch labels the policy declares (dual: short, long).
        labels = dict.fromkeys(("", *branches(name)))
        self._k_placed = {b: (name, b, "placed") for b in labels}
        self._k_refused = {o: (name, "", o) for o in metrics.PLACE_OUTCOMES[1:]}
        for key in (*self._k_placed.values(), *self._k_refused.values()):
            c.placements.setdefault(key, 0)
        for outcome in metrics.RELEASE_OUTCOMES:
            c.releases.setdefault(outcome, 0)

    def _snapshot(self) -> metrics.DecodeSnapshot:
        """The immutable snapshot for the scrape thread (built on the loop)."""
        conc, kv = self._view.concurrency, self._view.kv_tokens

        def read(s: Slots) -> tuple[np.ndarray, np.ndarray]:
            e = s.start + s.gpus
            return conc[s.start : e].copy(), kv[s.start : e].copy()

        c = self._counts
        return metrics.DecodeSnapshot(
            policy=self._policy.name,
            held=len(self._leases),
            gpu_series=self._settings.metrics_gpu_series,
            members=self._figures.refresh(read),
            placements=tuple(c.placements.items()),
            releases=tuple(c.releases.items()),
        )

    @property
    def view(self) -> FleetView:
        """The current view (owned here: read it, never keep it across calls). Its arrays
        have one slot per GPU of every instance plus free (dead) slots."""
        return self._view

    def apply_settings(self, settings: DecodeSettings) -> None:
        """Apply every key of new settings (SIGHUP): policy and parameters apply to the
        next decision; lease, table bound, largest request, sweep period and metrics bound
        to the next call. Held placements keep their deadline (expiry runs in placement
        order, so a shortened lease takes effect once older placements are gone)."""
        self._policy = make_policy(settings.policy, settings.params())
        self._settings = settings
        self._leases.configure(
            settings.lease_ms, settings.max_placements, settings.sweep_interval_ms
        )
        self._max_request_kv = settings.max_request_kv_tokens
        self._bind_metrics()
        self.publisher.changed()
        log.info("decode_settings_applied", policy=settings.policy, lease_ms=settings.lease_ms)

    # -- placement ----------------------------------------------------------------------

    def count_refused(self, outcome: str) -> None:
        """Count a PlaceDecode refused before it reached the table (e.g. a bad id)."""
        self._counts.placements[self._k_refused[outcome]] += 1
        self.publisher.changed()

    def place(
        self, request_id: str, kv_tokens: int, now_ns: int, allowed: Allowed | None = None
    ) -> PlaceResult:
        """Choose a GPU for ``kv_tokens`` tokens and hold the placement under the lease.

        ``allowed``: when given, the policy chooses among these slots of :attr:`view` only
        (a sorted, duplicate-free int64 array of slot indices, shape ``(k,)``: see
        :func:`fulcrum.core.decode.select_allowed`); None (the default) is the unchanged
        fast path. Slot indices are valid until the next change of
        :attr:`layout_version` (follow it with :meth:`add_slot_listener`).

        Raises InvalidArgument (kv_tokens, allowed), AlreadyExists (request_id held),
        ResourceExhausted (table full, or no (allowed) GPU fits); a refused call changes
        nothing except expiring due leases and dropping lapsed instances.
        """
        if not 1 <= kv_tokens <= self._max_request_kv:
            self._refuse_kv(kv_tokens)
        counts = self._counts.placements
        leases = self._leases
        held = leases.held
        if held and next(iter(held.values()))[DEADLINE_NS] <= now_ns:
            self.expire(now_ns)
        if request_id in held or len(held) >= leases.max_held:
            outcome, error = leases.refusal(request_id)
            self.count_refused(outcome)
            raise error
        out, slots = self._choose(kv_tokens, now_ns, allowed)
        slot = out.gpu
        member = slots.member
        # The chosen GPU is live, has a free slot and room (the selection's filter), so
        # the new load is in range: the O(1) in-place write of the core.
        writer = self._writer
        conc, kv = writer.load(slot)
        conc += 1
        kv += kv_tokens
        writer.write(slot, conc, kv, True)
        self._cursor = out.cursor
        gpu_index = slot - slots.start
        held[request_id] = (
            (member.member_id, member.incarnation, gpu_index, kv_tokens),
            now_ns,
            now_ns + leases.lease_ns,
        )
        slots.requests[request_id] = 1
        counts[self._k_placed[out.kind]] += 1
        self._figures.mark(slots)
        self.publisher.changed()
        if self._debug_log:
            log.debug("decode_placed", request_id=request_id, kv_tokens=kv_tokens,
                      instance_id=member.member_id, gpu=gpu_index, branch=out.kind)
        return PlaceResult(
            member.member_id,
            member.incarnation,
            gpu_index,
            out.kind,
            conc,
            kv,
            leases.lease_ms,
        )

    def _refuse_kv(self, kv_tokens: int) -> None:
        self.count_refused("invalid_argument")
        raise InvalidArgument(
            "kv_tokens", f"must be in [1, {self._max_request_kv}], got {kv_tokens}"
        )

    def _choose(
        self, kv_tokens: int, now_ns: int, allowed: Allowed | None
    ) -> tuple[Decision, Slots]:
        """The policy's decision on a live instance (a lapsed one found is taken out and
        the policy asked again); raises as :meth:`place` does."""
        counts = self._counts.placements
        leases = self._leases
        liveness = self._liveness
        rounds = len(self._members) + 1
        while True:
            if allowed is None:
                out = self._policy.select(self._view, kv_tokens, self._rng, self._cursor)
            else:
                try:
                    out = select_allowed(
                        self._policy, self._view, kv_tokens, self._rng, self._cursor, allowed
                    )
                except ValueError as err:
                    self.count_refused("invalid_argument")
                    raise InvalidArgument("allowed", str(err).removeprefix("allowed: ")) from None
            if isinstance(out, NoCapacity):
                key = (self._policy.name, out.kind, "resource_exhausted")
                counts[key] = counts.get(key, 0) + 1
                self.publisher.changed()
                raise leases.refuse_no_capacity(out.reason)
            slot = out.gpu
            slots = self._owner[slot]
            assert slots is not None, "a free slot is never eligible"
            member = slots.member
            if liveness is None or liveness(member.member_id, member.incarnation, now_ns):
                return out, slots
            # The fleet found it lapsed (and normally told us through on_leave already).
            if self._members.get(member.member_id) is slots:
                # No compaction now: ``allowed`` (slot indices) must stay valid for the
                # next round; the lapsed slots are simply dead.
                self._remove(slots, "lapsed", compact=allowed is None)
            rounds -= 1
            if rounds <= 0:  # pragma: no cover - every round removes one instance
                self.count_refused("resource_exhausted")
                raise leases.refuse_no_capacity("no live decode instance")

    def release(self, request_id: str, now_ns: int) -> ReleaseResult:
        """Free a held placement; NotFound when unknown, released, expired or lost."""
        lease = self._leases.pop(request_id)
        if lease is None:
            self._counts.releases["not_found"] += 1
            self.publisher.changed()
            raise NotFound(
                f"request_id: {request_id!r} holds no decode placement "
                "(unknown, already released, expired, or lost with its instance)"
            )
        placed, placed_ns, _ = lease
        self._unhold(request_id, placed)
        self._counts.releases["released"] += 1
        self.publisher.changed()
        return ReleaseResult(
            placed[0], placed[2], max(now_ns - placed_ns, 0)
        )

    def _unhold(self, request_id: str, placed: _Placed) -> None:
        """Take a popped placement's share off its GPU (never below 0)."""
        instance_id, incarnation, gpu_index, kv_tokens = placed
        slots = self._members.get(instance_id)
        if slots is None or slots.member.incarnation != incarnation:
            return  # its instance left: the share left with it
        slots.requests.pop(request_id, None)
        slot = slots.start + gpu_index
        writer = self._writer
        conc, kv = writer.load(slot)
        writer.write(slot, max(conc - 1, 0), max(kv - kv_tokens, 0), writer.is_live(slot))
        self._figures.mark(slots)

    def expire(self, now_ns: int) -> int:
        """Expire placements whose lease ran out (in placement order); returns how many."""
        n = 0
        for request_id, lease in self._leases.expired(now_ns):
            self._unhold(request_id, lease[RECORD])
            n += 1
        if n:
            self.expired_total += n
            metrics.EXPIRATIONS.inc(n)
            self.publisher.changed()
            log.info("decode_leases_expired", count=n, held=len(self._leases))
        return n

    # -- fleet listener ------------------------------------------------------------------

    def validate_load(self, member: Member, load: MemberLoad) -> None:
        """Refuse a report with an absurd per-GPU figure (changes nothing)."""
        if not isinstance(load, DecodeInstanceLoad):
            raise InvalidArgument("load", "must be decode_instance for a decode instance")
        conc = np.asarray(load.concurrency, dtype=np.int64)
        kv = np.asarray(load.kv_tokens, dtype=np.int64)
        bad_c = np.flatnonzero((conc < 0) | (conc >= MAX_CONCURRENCY_LIMIT))
        if bad_c.size:
            raise InvalidArgument(
                f"decode_instance.gpus[{int(bad_c[0])}].concurrency",
                f"must be in [0, {MAX_CONCURRENCY_LIMIT - 1}]",
            )
        bad_k = np.flatnonzero((kv < 0) | (kv >= MAX_KV_LIMIT))
        if bad_k.size:
            raise InvalidArgument(
                f"decode_instance.gpus[{int(bad_k[0])}].kv_tokens",
                f"must be in [0, {MAX_KV_LIMIT - 1}]",
            )

    def on_join(self, member: Member, now_ns: int) -> None:
        """Give the instance slots (O(its GPUs); amortised O(1) per GPU when the arrays
        grow)."""
        shape = member.shape
        if not isinstance(shape, DecodeInstanceShape):
            return
        old = self._members.get(member.member_id)
        if old is not None:  # the fleet calls on_leave first; be safe anyway
            self._remove(old, "replaced")
        gpus = shape.gpus
        start, grow_to = self._alloc.alloc(gpus)
        if grow_to:
            self._resize(grow_to)
        mc = np.minimum(
            np.asarray(shape.max_concurrency, dtype=np.int64), MAX_CONCURRENCY_LIMIT - 1
        )
        # max_kv_tokens may be up to 2^64-1 (protobuf uint64): clip before converting.
        mk = np.asarray([min(k, MAX_KV_LIMIT - 1) for k in shape.max_kv_tokens], dtype=np.int64)
        open_range(self._view, start, mc, mk)
        slots = Slots(member, start, gpus)
        self._owner[start : start + gpus] = [slots] * gpus
        self._members[member.member_id] = slots
        self._figures.mark(slots)
        self.publisher.changed()
        self.layout_version += 1
        for listener in self._slot_listeners:
            listener.slots_opened(member.member_id, start, gpus)
        log.info(
            "decode_instance_joined",
            instance_id=member.member_id,
            incarnation=member.incarnation,
            gpus=gpus,
        )

    def on_load(self, member: Member, load: MemberLoad, now_ns: int) -> None:
        slots = self._members.get(member.member_id)
        if (
            slots is None
            or slots.member.incarnation != member.incarnation
            or not isinstance(load, DecodeInstanceLoad)
        ):
            return
        write_range(
            self._view,
            slots.start,
            np.asarray(load.concurrency, dtype=np.int64),
            np.asarray(load.kv_tokens, dtype=np.int64),
        )
        self._figures.mark(slots)
        self.publisher.changed()
        self.expire(now_ns)

    def _remove(self, slots: Slots, reason: str, compact: bool = True) -> None:
        """Take an instance out: its slots are freed, its placements lost. O(its GPUs +
        its placements); amortised O(1) per GPU when the arrays are compacted (not with
        ``compact=False``: then at a later leave)."""
        member_id = slots.member_id
        del self._members[member_id]
        lost = 0
        for request_id in slots.requests:
            if self._leases.pop(request_id) is not None:
                lost += 1
        slots.requests.clear()
        close_range(self._view, slots.start, slots.gpus)
        self._owner[slots.start : slots.start + slots.gpus] = [None] * slots.gpus
        self._alloc.free(slots.start, slots.gpus)
        self._figures.forget(member_id)
        self.layout_version += 1
        for listener in self._slot_listeners:
            listener.slots_closed(member_id, slots.start, slots.gpus)
        if compact and self._alloc.needs_compaction():
            self._compact()
        if lost:
            self.lost_total += lost
            metrics.LOST.labels(reason).inc(lost)
        self.publisher.changed()
        log.info(
            "decode_instance_left",
            instance_id=member_id,
            incarnation=slots.member.incarnation,
            reason=reason,
            lost_placements=lost,
        )

    def _resize(self, capacity: int, index: np.ndarray | None = None) -> None:
        self._view = resized(self._view, capacity, index)
        self._writer = GpuWriter(self._view)
        if index is None:
            self._owner.extend([None] * (capacity - len(self._owner)))
            self._moved()

    def _moved(self) -> None:
        self.layout_version += 1
        for listener in self._slot_listeners:
            listener.slots_moved()

    def _compact(self) -> None:
        """Pack the instances' slots at the front (O(GPUs), amortised over the leaves
        that freed as many slots as are used)."""
        order = list(self._members.values())
        index, starts = self._alloc.compaction([(s.start, s.gpus) for s in order])
        self._resize(self._alloc.capacity, index)
        owner: list[Slots | None] = [None] * self._alloc.capacity
        for s, start in zip(order, starts, strict=True):
            s.start = start
            owner[start : start + s.gpus] = [s] * s.gpus
        self._owner = owner
        self._moved()
