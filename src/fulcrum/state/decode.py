"""The daemon's decode table: instances, per-GPU load view, held placements.

Per-GPU view (requests, KV tokens): the instance's last heartbeat report (0 before any)
plus the placements made since it, minus releases. A report replaces the GPU's figures
(the engine's truth, including KV growth from generated tokens); releasing a placement
lowers them again (never below 0). Without a heartbeat in between, release after place
restores the view exactly.

The table is :class:`fulcrum.state.placement.PlacementTable`, shared with the vision
table (members, slots, leases, reload, release, expiry, metrics); this module keeps the
decode fleet's arrays (:class:`fulcrum.core.decode.FleetView`) and ``place``.
Placements are held per request id in a table bounded by ``decode.max_placements`` with
a lease of ``decode.lease_ms``; an instance that leaves drops its placements (counted
as lost); before a placement is committed the chosen instance's liveness is checked with
the fleet, so a lapsed instance is never chosen even between sweeps.

Slots: each instance's GPUs occupy a contiguous range of slots of the view's arrays
(:class:`fulcrum.state.placement.SlotAllocator`); free slots are dead (never eligible).
A join or a leave costs O(the instance's GPUs), a placement or a release O(1) (in-place
writes through :class:`fulcrum.core.decode.GpuWriter`), a heartbeat one vectorised pass
over the instance's GPUs. The layout depends on the order of events, so the same
events in the same order with the same seed give the same decisions. Callers that keep
per-slot tables follow the layout through :meth:`DecodeState.add_slot_listener`
(:class:`SlotListener`: O(the instance's GPUs) per join or leave).

Filters: ``place(..., allowed=...)`` restricts one placement to a subset of the slots
(slot indices or a boolean mask, :func:`fulcrum.core.decode.select_allowed`), and so
does every step of :attr:`DecodeState.filters`
(:class:`fulcrum.state.placement.SlotFilter`, given a :class:`DecodeRequest`); the
policy in force chooses among what is left, with the whole fleet as context. Without
either (``allowed=None``, no filters) the decision path is the unfiltered one, unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from fulcrum.config.decode import DecodeSettings
from fulcrum.core.decode import (
    Allowed,
    Decision,
    FleetView,
    NoCapacity,
    branches,
    check_allowed,
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
from fulcrum.core.tenant_caps import Fill
from fulcrum.core.tenants import DEFAULT_CLASS, RequestClass
from fulcrum.core.types import DecodeInstanceLoad, DecodeInstanceShape, Member, MemberLoad
from fulcrum.errors import InvalidArgument, NotFound
from fulcrum.metrics import decode as metrics
from fulcrum.state.placement import (
    I64,
    Lease,
    Liveness,
    PlacementTable,
    SlotFilter,
    SlotListener,
    SlotMask,
    Slots,
    TableKind,
)

__all__ = ["DecodeRequest", "DecodeState", "PlaceResult", "ReleaseResult", "SlotListener"]


class DecodeRequest(NamedTuple):
    """One PlaceDecode as the filters see it (:class:`fulcrum.state.placement.SlotFilter`;
    built only when there are filters)."""

    request_id: str
    #: KV length asked for, tokens.
    kv_tokens: int
    #: The request's class (tenant, priority, deadline; issue 23).
    cls: RequestClass = DEFAULT_CLASS


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
    """Read-only views of the decode table (tests, diagnostics, the gateway; on the loop)."""

    _members: dict[str, Slots]
    _view: FleetView

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


_KIND = TableKind(
    what="decode",
    member="instance",
    id_key="instance_id",
    lost_key="lost_placements",
    shape=DecodeInstanceShape,
    load=DecodeInstanceLoad,
    not_held=(
        "request_id: {request_id!r} holds no decode placement "
        "(unknown, already released, expired, or lost with its instance)"
    ),
    make_policy=make_policy,
    metrics=metrics,
    branches=branches,
)


class DecodeState(
    _DecodeViews, PlacementTable[Slots, DecodeSettings, ReleaseResult]
):
    """Decode instances, per-GPU load and held placements: the one placement table
    (:class:`fulcrum.state.placement.PlacementTable`) over the decode fleet's arrays
    (:class:`fulcrum.core.decode.FleetView`). Not thread-safe: the daemon's event loop is
    the only caller (the scrape thread reads :attr:`publisher`'s snapshot). Implements the
    fleet's ``FleetListener`` protocol."""

    KIND = _KIND
    EXPIRE_ON_LOAD = True
    _policy: DecodePolicy

    def __init__(
        self,
        settings: DecodeSettings,
        rng: np.random.Generator,
        liveness: Liveness | None = None,
        debug_log: bool = False,
        filters: Sequence[SlotFilter[DecodeRequest]] = (),
    ) -> None:
        self._debug_log = debug_log  # one debug line per decision (costs ~7 us) only if on
        super().__init__(settings, rng, liveness, filters)

    # -- fleet arrays --------------------------------------------------------------------

    def _init_arrays(self, capacity: int) -> None:
        self._owner: list[Slots | None] = [None] * capacity  # slot -> instance
        self._view = resized(FleetView.build([], [], [], []), capacity)
        self._writer = GpuWriter(self._view)  # O(1) scalar access to the view's arrays
        self._cursor = 0

    def _resize(self, capacity: int, index: np.ndarray | None = None) -> None:
        self._view = resized(self._view, capacity, index)
        self._writer = GpuWriter(self._view)
        if index is None:
            self._owner.extend([None] * (capacity - len(self._owner)))
        else:  # compaction: the instances' :meth:`_move` fill it again
            self._owner = [None] * capacity

    def _open(self, member: Member, start: int, gpus: int) -> Slots:
        shape = member.shape
        assert isinstance(shape, DecodeInstanceShape)
        mc = np.minimum(
            np.asarray(shape.max_concurrency, dtype=np.int64), MAX_CONCURRENCY_LIMIT - 1
        )
        # max_kv_tokens may be up to 2^64-1 (protobuf uint64): clip before converting.
        mk = np.asarray([min(k, MAX_KV_LIMIT - 1) for k in shape.max_kv_tokens], dtype=np.int64)
        open_range(self._view, start, mc, mk)
        slots = Slots(member, start, gpus)
        self._owner[start : start + gpus] = [slots] * gpus
        return slots

    def _close(self, slots: Slots) -> None:
        close_range(self._view, slots.start, slots.gpus)
        self._owner[slots.start : slots.start + slots.gpus] = [None] * slots.gpus

    def _move(self, slots: Slots, start: int) -> None:
        slots.start = start
        self._owner[start : start + slots.gpus] = [slots] * slots.gpus

    def _write_load(self, slots: Slots, load: DecodeInstanceLoad) -> None:
        write_range(
            self._view,
            slots.start,
            np.asarray(load.concurrency, dtype=np.int64),
            np.asarray(load.kv_tokens, dtype=np.int64),
        )

    def _drop(self, slots: Slots) -> int:
        """Every placement held on a leaving instance is lost with it."""
        lost = 0
        for request_id in slots.requests:
            if self._leases.pop(request_id) is not None:
                lost += 1
                self._lose(request_id)
        return lost

    # -- configuration and metrics -------------------------------------------------------

    def _configure(self, settings: DecodeSettings) -> None:
        self._max_request_kv = settings.max_request_kv_tokens

    def _read(self, slots: Slots) -> tuple[I64, I64]:
        e = slots.start + slots.gpus
        view = self._view
        return view.concurrency[slots.start : e].copy(), view.kv_tokens[slots.start : e].copy()

    def _count_expired(self, n: int, units: int) -> None:
        metrics.EXPIRATIONS.inc(n)
        self._log.info("decode_leases_expired", count=n, held=len(self._leases))

    @property
    def view(self) -> FleetView:
        """The current view (owned here: read it, never keep it across calls). Its arrays
        have one slot per GPU of every instance plus free (dead) slots."""
        return self._view

    # -- placement -----------------------------------------------------------------------

    def place(
        self, request_id: str, kv_tokens: int, now_ns: int, allowed: Allowed | None = None,
        cls: RequestClass = DEFAULT_CLASS,
    ) -> PlaceResult:
        """Choose a GPU for ``kv_tokens`` tokens and hold the placement under the lease.

        ``allowed``: when given, the policy chooses among these slots of :attr:`view` only
        (a sorted, duplicate-free int64 array of slot indices, shape ``(k,)``, or a
        boolean mask: see :func:`fulcrum.core.decode.select_allowed`); None (the default)
        with no :attr:`filters` is the unchanged fast path. Slot indices are valid until
        the next change of :attr:`layout_version` (follow it with
        :meth:`add_slot_listener`). ``cls``: the request's class, seen by the filters
        (the tenant step: :mod:`fulcrum.state.tenant_filter`).

        Raises InvalidArgument (kv_tokens, allowed), AlreadyExists (request_id held),
        ResourceExhausted (table full, or no (allowed) GPU fits); a refused call changes
        nothing except expiring due leases and dropping lapsed instances.
        """
        if not 1 <= kv_tokens <= self._max_request_kv:
            self._refuse_kv(kv_tokens)
        self._admit(request_id, now_ns)
        request = None
        if self.filters:
            request = DecodeRequest(request_id, kv_tokens, cls)
            allowed = self._filtered(request, allowed, now_ns)
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
        leases = self._leases
        leases.held[request_id] = (
            (member.member_id, member.incarnation, gpu_index, kv_tokens),
            now_ns,
            now_ns + leases.lease_ns,
        )
        slots.requests[request_id] = 1
        if request is not None:
            self._held_by(request_id, request, ((member.member_id, gpu_index),))
        self._counts.placements[self._k_placed[out.kind]] += 1
        self._figures.mark(slots)
        self.publisher.changed()
        if self._debug_log:
            self._log.debug("decode_placed", request_id=request_id, kv_tokens=kv_tokens,
                            instance_id=member.member_id, gpu=gpu_index, branch=out.kind)
        return PlaceResult(
            member.member_id, member.incarnation, gpu_index, out.kind, conc, kv,
            leases.lease_ms,
        )

    def fill(self) -> Fill:
        """The fleet's load over live GPUs (requests and KV tokens held, with their
        capacities), for the tenant step's band shedding. O(GPUs)."""
        v = self._view
        live = v.live
        return Fill(v.total_concurrency, int(v.max_concurrency[live].sum()),
                    v.total_kv_tokens, int(v.max_kv_tokens[live].sum()))

    def _refuse_kv(self, kv_tokens: int) -> None:
        self.count_refused("invalid_argument")
        raise InvalidArgument(
            "kv_tokens", f"must be in [1, {self._max_request_kv}], got {kv_tokens}"
        )

    def _refuse_allowed(self, err: ValueError) -> InvalidArgument:
        self.count_refused("invalid_argument")
        return InvalidArgument("allowed", str(err).removeprefix("allowed: "))

    def _filtered(
        self, request: DecodeRequest, allowed: Allowed | None, now_ns: int
    ) -> SlotMask | None:
        """The caller's ``allowed`` (checked) and-ed with every filter's mask."""
        view = self._view
        mask: SlotMask | None = None
        if allowed is not None:
            try:
                check_allowed(view, allowed)
            except ValueError as err:
                raise self._refuse_allowed(err) from None
            if allowed.dtype == np.bool_:
                mask = allowed.astype(np.bool_, copy=False)
            else:
                mask = np.zeros(view.n_gpus, dtype=np.bool_)
                mask[allowed] = True
        return self._allowed(request, view.n_gpus, now_ns, mask)

    def _choose(
        self, kv_tokens: int, now_ns: int, allowed: Allowed | None
    ) -> tuple[Decision, Slots]:
        """The policy's decision on a live instance (a lapsed one found is taken out and
        the policy asked again); raises as :meth:`place` does."""
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
                    raise self._refuse_allowed(err) from None
            if isinstance(out, NoCapacity):
                counts = self._counts.placements
                key = (self._policy.name, out.kind, "resource_exhausted")
                counts[key] = counts.get(key, 0) + 1
                self.publisher.changed()
                raise self._leases.refuse_no_capacity(out.reason)
            slots = self._owner[out.gpu]
            assert slots is not None, "a free slot is never eligible"
            # No compaction when lapsed: ``allowed`` (slot indices) must stay valid for
            # the next round; the lapsed slots are simply dead.
            if self._still_live(slots, now_ns, compact=allowed is None):
                return out, slots
            rounds -= 1
            if rounds <= 0:  # pragma: no cover - every round removes one instance
                self.count_refused("resource_exhausted")
                raise self._leases.refuse_no_capacity("no live decode instance")

    # -- release -------------------------------------------------------------------------

    def _released(self, request_id: str, lease: Lease[Any], now_ns: int) -> ReleaseResult:
        placed, placed_ns, _ = lease
        self._unhold(request_id, placed)
        return ReleaseResult(placed[0], placed[2], max(now_ns - placed_ns, 0))

    def _unhold(self, request_id: str, placed: _Placed) -> int:
        """Take a popped placement's share off its GPU (never below 0)."""
        instance_id, incarnation, gpu_index, kv_tokens = placed
        slots = self._members.get(instance_id)
        if slots is None or slots.member.incarnation != incarnation:
            return 1  # its instance left: the share left with it
        slots.requests.pop(request_id, None)
        slot = slots.start + gpu_index
        writer = self._writer
        conc, kv = writer.load(slot)
        writer.write(slot, max(conc - 1, 0), max(kv - kv_tokens, 0), writer.is_live(slot))
        self._figures.mark(slots)
        return 1

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
