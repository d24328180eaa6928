"""One "place on GPUs under a lease" table, shared by the decode and the vision balancers.

Both balancers keep fleet members (decode instances, VE machines) whose GPUs occupy slots
of per-GPU arrays, and placements held per request id under a lease. This module owns
everything that is the same for both, in one class, :class:`PlacementTable`; the decode
and the VE tables (:mod:`fulcrum.state.decode`, :mod:`fulcrum.state.vision`) keep only
their per-GPU fleet arrays and their ``place`` (the policy's ``select`` over them):

- **Filters.** One extension point before ``select``: :attr:`PlacementTable.filters`, a
  list of :class:`SlotFilter` s applied in order, each narrowing (a boolean mask over the
  slots) or refusing one request; without filters the decision path is unchanged.

- **Slots.** A member's GPUs occupy a contiguous range of slots ``[start, start + gpus)``
  in the balancer's per-GPU arrays (:class:`SlotAllocator`). A join takes a free range of
  the same size or appends one; a leave frees its range. Both cost O(the member's GPUs):
  the rest of the fleet is never rebuilt. Arrays grow by doubling and are compacted when
  free slots outnumber used ones (amortised O(1) per GPU joining). Free slots are never
  placeable (the balancer marks them dead).
- **Leases.** Placements are held per request id (:class:`LeaseTable`) in a table bounded
  by ``max_placements``, with a lease (ms): unreleased placements expire in placement
  order at the next sweep or placement after their deadline (O(expired)). A member that
  leaves (deregistered, lapsed, replaced) drops its share of the held placements, which
  are counted as lost.
- **Refusals.** One convention: the pure policies of both cores *return* a
  ``NoCapacity`` value (``fulcrum.core.decode.NoCapacity``,
  ``fulcrum.core.vision.NoCapacity``, each with a ``reason``) instead of raising; the
  table raises every refusal as a :mod:`fulcrum.errors` error before anything changes:
  "no capacity" (:meth:`LeaseTable.refuse_no_capacity`) and "table full"
  (:meth:`LeaseTable.refusal`) are ``ResourceExhausted`` with ``retry_after_ms`` = the
  sweep interval (when held placements may next be freed).
- **Reload.** One convention: ``apply_settings(settings)`` on the balancer applies every
  reloadable key (policy, lease, limits, metrics bounds) to the next call; placements
  already held keep their deadline.
- **One owner.** Only the event loop touches the table. The Prometheus scrape thread reads
  an immutable snapshot (:meth:`Publisher.fresh`): changes only mark it stale, and the
  scrape has the loop build a new one (through ``call_soon_threadsafe``), so a table
  under load builds one per scrape. A publication copies the changed members' GPU
  figures only (O(changed GPUs) plus one tuple of the members), never the fleet's arrays.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, Generic, NamedTuple, Protocol, TypeVar

import numpy as np
import numpy.typing as npt
import structlog

from fulcrum.core.types import Member, MemberLoad
from fulcrum.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from fulcrum.units import NS_PER_MS

R = TypeVar("R")
S = TypeVar("S")

I64 = npt.NDArray[np.int64]

#: ``schedule(callback)``: run ``callback`` soon on the event loop, from any thread
#: (``loop.call_soon_threadsafe``).
Schedule = Callable[[Callable[[], None]], Any]


# -- slots ------------------------------------------------------------------------------


class SlotAllocator:
    """Contiguous slot ranges for members in arrays of ``capacity`` slots.

    ``alloc(n)`` reuses a freed range of exactly ``n`` slots (the most recently freed, so
    that the same events give the same layout), else appends at :attr:`end`; it returns
    ``(start, grow_to)`` where ``grow_to`` > 0 asks the caller to grow its arrays to that
    capacity first (doubling). ``free(start, n)`` returns a range. :attr:`wasted` counts
    free slots below :attr:`end`; :meth:`needs_compaction` says when they outnumber the
    used ones (the caller then moves its members with :meth:`compaction`).
    """

    __slots__ = ("_free", "capacity", "end", "min_waste", "used")

    def __init__(self, capacity: int = 64, min_waste: int = 1024) -> None:
        self.capacity = max(capacity, 1)
        #: Free slots below the end worth a compaction at least (tests lower it).
        self.min_waste = min_waste
        self.end = 0
        self.used = 0
        self._free: dict[int, list[int]] = {}

    @property
    def wasted(self) -> int:
        """Free slots below :attr:`end`."""
        return self.end - self.used

    def alloc(self, n: int) -> tuple[int, int]:
        """``(start, grow_to)`` of a new range of ``n`` slots (``grow_to`` 0: no growth)."""
        self.used += n
        starts = self._free.get(n)
        if starts:
            start = starts.pop()
            if not starts:
                del self._free[n]
            return start, 0
        start = self.end
        self.end += n
        grow_to = 0
        if self.end > self.capacity:
            grow_to = self.capacity
            while grow_to < self.end:
                grow_to *= 2
            self.capacity = grow_to
        return start, grow_to

    def free(self, start: int, n: int) -> None:
        """Return the range ``[start, start + n)``."""
        self.used -= n
        if start + n == self.end:
            self.end = start  # the tail shrinks at once
        else:
            self._free.setdefault(n, []).append(start)

    def needs_compaction(self) -> bool:
        """Free slots below the end outnumber the used ones (and are worth moving)."""
        return self.wasted > max(self.used, self.min_waste)

    def compaction(self, ranges: list[tuple[int, int]]) -> tuple[I64, list[int]]:
        """Pack ``ranges`` (``(start, n)`` of every member, in the order to keep) at the
        front: returns the gather index (new slot -> old slot, shape ``(used,)``) and the
        new start of each range. Resets the free lists."""
        parts = [np.arange(s, s + n, dtype=np.int64) for s, n in ranges]
        index = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        starts: list[int] = []
        pos = 0
        for _, n in ranges:
            starts.append(pos)
            pos += n
        self._free.clear()
        self.end = self.used = pos
        return index, starts


# -- members ----------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class Slots:
    """A member's place in the table: its GPUs are slots ``[start, start + gpus)``."""

    member: Member
    start: int
    gpus: int
    #: request id -> placements of that request held on this member.
    requests: dict[str, int] = field(default_factory=dict)

    @property
    def member_id(self) -> str:
        return self.member.member_id

    @property
    def incarnation(self) -> int:
        return self.member.incarnation

    def add_request(self, request_id: str) -> None:
        requests = self.requests
        requests[request_id] = requests.get(request_id, 0) + 1

    def drop_request(self, request_id: str) -> None:
        requests = self.requests
        left = requests.get(request_id, 0) - 1
        if left > 0:
            requests[request_id] = left
        else:
            requests.pop(request_id, None)


# -- leases -----------------------------------------------------------------------------


#: A held placement: ``(record, placed_ns, deadline_ns)``, a plain tuple. With a record of
#: atomic values only (strings, ints, plain tuples of them), CPython's collector untracks
#: both (it untracks exact tuples only, not NamedTuples), so that a table of a million
#: held placements adds nothing to a collection's pause on the loop. Replace an entry
#: to change it (``held[id] = (new, placed, deadline)``: its expiry order is kept).
Lease = tuple[R, int, int]
#: Positions in a :data:`Lease`.
RECORD: Final = 0
PLACED_NS: Final = 1
DEADLINE_NS: Final = 2


class LeaseTable(Generic[R]):
    """Placements held per request id, bounded, expiring in placement order.

    ``what`` names the table in messages ("decode", "vision"). Deadlines grow with
    placement order for a given lease; after a reload that shortens the lease, older
    entries expire at their own (later) deadline, as documented.
    """

    __slots__ = ("held", "lease_ns", "max_held", "retry_after_ms", "setting", "what")

    def __init__(
        self, what: str, setting: str, lease_ms: int, max_held: int, retry_after_ms: int
    ) -> None:
        self.what = what
        self.setting = setting
        #: request id -> lease, in placement order. The decision paths read and write it
        #: inline (hot path); everything else goes through the methods.
        self.held: OrderedDict[str, Lease[R]] = OrderedDict()
        self.lease_ns = lease_ms * NS_PER_MS
        self.max_held = max_held
        self.retry_after_ms = retry_after_ms

    def configure(self, lease_ms: int, max_held: int, retry_after_ms: int) -> None:
        """New lease (for new placements), bound and retry hint."""
        self.lease_ns = lease_ms * NS_PER_MS
        self.max_held = max_held
        self.retry_after_ms = retry_after_ms

    @property
    def lease_ms(self) -> int:
        return self.lease_ns // NS_PER_MS

    def __len__(self) -> int:
        return len(self.held)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.held

    def get(self, request_id: str) -> Lease[R] | None:
        return self.held.get(request_id)

    def due(self, now_ns: int) -> bool:
        """Whether the oldest placement's lease has run out."""
        held = self.held
        return bool(held) and next(iter(held.values()))[DEADLINE_NS] <= now_ns

    def room_for(self, request_id: str) -> bool:
        """Whether ``request_id`` may be placed now (not held, table not full)."""
        return request_id not in self.held and len(self.held) < self.max_held

    def refusal(self, request_id: str) -> tuple[str, AlreadyExists | ResourceExhausted]:
        """Why ``request_id`` may not be placed now (when :meth:`room_for` is false): the
        outcome label and the error to raise."""
        if request_id in self.held:
            return "already_exists", AlreadyExists(
                f"request_id: {request_id!r} already holds a placement ({self.what})"
            )
        return "resource_exhausted", ResourceExhausted(
            f"{self.what} placements: table full ({self.max_held} held, "
            f"{self.setting}); release finished requests",
            self.retry_after_ms,
        )

    def hold(self, request_id: str, record: R, now_ns: int) -> None:
        self.held[request_id] = (record, now_ns, now_ns + self.lease_ns)

    def pop(self, request_id: str) -> Lease[R] | None:
        return self.held.pop(request_id, None)

    def expired(self, now_ns: int) -> Iterator[tuple[str, Lease[R]]]:
        """Pop and yield the placements whose lease ran out by ``now_ns`` (oldest first)."""
        held = self.held
        while held:
            request_id, first = next(iter(held.items()))
            if first[DEADLINE_NS] > now_ns:
                return
            held.popitem(last=False)
            yield request_id, first

    def refuse_no_capacity(self, reason: str) -> ResourceExhausted:
        """The one "no capacity" refusal (to raise): RESOURCE_EXHAUSTED with the reason and
        a retry hint of one sweep (when held placements may next be freed)."""
        return ResourceExhausted(f"{self.what}: {reason}", self.retry_after_ms)


# -- publication for the scrape thread --------------------------------------------------


#: How long a scrape waits for the loop to build a stale snapshot, s.
FRESH_TIMEOUT_S: Final = 0.5


class Publisher(Generic[S]):
    """Holds the latest immutable snapshot of a table for other threads.

    ``build()`` makes a snapshot on the loop. Without a scheduler (tests of the table
    alone) :meth:`changed` builds one at once. With one (:meth:`set_schedule`, the loop's
    ``call_soon_threadsafe``), :meth:`changed` only marks the snapshot stale, and nothing
    is built until somebody reads: :meth:`fresh` (the scrape thread) has the loop build
    it, :meth:`current` (on the loop) builds it. A busy table so builds one snapshot per
    scrape, not one per loop iteration, and a scrape always sees the table as it is.
    Other threads never touch the table: they read :attr:`snapshot` (one reference).
    """

    __slots__ = ("__weakref__", "_build", "_schedule", "_stale", "_thread", "snapshot")

    def __init__(self, build: Callable[[], S]) -> None:
        self._build = build
        self._schedule: Schedule | None = None
        self._thread = 0  # the loop's thread (threading.get_ident) once scheduled
        self._stale = False
        self.snapshot: S = build()

    def set_schedule(self, schedule: Schedule | None) -> None:
        """Build snapshots on demand through ``schedule`` (the loop's
        ``call_soon_threadsafe``; call this on the loop's thread) from now on."""
        self._schedule = schedule
        self._thread = threading.get_ident()

    def changed(self) -> None:
        if self._schedule is None:
            self.snapshot = self._build()
            return
        self._stale = True

    def publish(self) -> None:
        """Publish now (on the loop)."""
        self._stale = False
        self.snapshot = self._build()

    def current(self) -> S:
        """The snapshot of the table as it is (on the loop: built if stale)."""
        if self._stale:
            self.publish()
        return self.snapshot

    def fresh(self, timeout_s: float = FRESH_TIMEOUT_S) -> S:
        """The snapshot of the table as it is, from any thread: the loop builds it when
        stale. When the loop does not answer within ``timeout_s`` (busy, stopping), the
        last published one."""
        if not self._stale or self._schedule is None:
            return self.snapshot
        if threading.get_ident() == self._thread:
            return self.current()
        done = threading.Event()

        def build() -> None:
            try:
                self.current()
            finally:
                done.set()

        try:
            self._schedule(build)
        except RuntimeError:  # the loop is closed
            return self.snapshot
        done.wait(timeout_s)
        return self.snapshot


class MemberFigures(NamedTuple):
    """One member's per-GPU figures at publication (arrays copied, never written).

    (NamedTuples here and in the snapshots: one is built per publication, and a tuple is
    several times cheaper to construct than a frozen dataclass.)"""

    member_id: str
    #: One array per figure, each of shape ``(gpus,)``, int64.
    values: tuple[I64, ...]


class MemberTable:
    """Every member's :class:`MemberFigures` at a publication, in chunks (iterate it).
    Never changed after construction."""

    __slots__ = ("chunks",)

    def __init__(self, chunks: tuple[tuple[MemberFigures | None, ...], ...] = ()) -> None:
        self.chunks = chunks

    def __iter__(self) -> Iterator[MemberFigures]:
        for chunk in self.chunks:
            for figures in chunk:
                if figures is not None:
                    yield figures


#: Members per chunk of a :class:`MemberTable`.
CHUNK = 64


class MemberFigureCache:
    """Per-member copies of GPU figures, refreshed only for members marked dirty.

    Members hold fixed positions in chunks of :data:`CHUNK`; a refresh copies the dirty
    members' figures and rebuilds only their chunks and the tuple of chunks, so that a
    publication costs O(changed GPUs + CHUNK + members / CHUNK), not O(members).
    """

    __slots__ = ("_chunks", "_dirty", "_dirty_chunks", "_free", "_frozen", "_pos", "_table")

    def __init__(self) -> None:
        self._pos: dict[str, int] = {}
        self._free: list[int] = []
        self._chunks: list[list[MemberFigures | None]] = []
        self._frozen: list[tuple[MemberFigures | None, ...]] = []
        self._dirty: dict[str, Slots] = {}
        self._dirty_chunks: set[int] = set()
        self._table = MemberTable()

    def mark(self, slots: Slots) -> None:
        self._dirty[slots.member_id] = slots

    def forget(self, member_id: str) -> None:
        self._dirty.pop(member_id, None)
        pos = self._pos.pop(member_id, None)
        if pos is not None:
            c, i = divmod(pos, CHUNK)
            self._chunks[c][i] = None
            self._dirty_chunks.add(c)
            self._free.append(pos)

    def _position(self, member_id: str) -> int:
        pos = self._pos.get(member_id)
        if pos is None:
            if self._free:
                pos = self._free.pop()
            else:
                pos = len(self._pos)
                if pos // CHUNK == len(self._chunks):
                    self._chunks.append([None] * CHUNK)
                    self._frozen.append(())
            self._pos[member_id] = pos
        return pos

    def refresh(self, read: Callable[[Any], tuple[I64, ...]]) -> MemberTable:
        """Copy the dirty members' figures (``read(slots)`` returns fresh arrays) and
        return the table of every member's."""
        if self._dirty:
            for member_id, slots in self._dirty.items():
                c, i = divmod(self._position(member_id), CHUNK)
                self._chunks[c][i] = MemberFigures(member_id, read(slots))
                self._dirty_chunks.add(c)
            self._dirty.clear()
        if self._dirty_chunks:
            for c in self._dirty_chunks:
                self._frozen[c] = tuple(self._chunks[c])
            self._dirty_chunks.clear()
            self._table = MemberTable(tuple(self._frozen))
        return self._table


# -- counters and the published snapshot -----------------------------------------------


#: Outcomes of a placement call (unary or streamed); the first is the success.
PLACE_OUTCOMES: Final = ("placed", "invalid_argument", "already_exists", "resource_exhausted")
#: Outcomes of a release call.
RELEASE_OUTCOMES: Final = ("released", "invalid_argument", "not_found")


@dataclass(slots=True)
class Counts:
    """Per-call counters kept as plain ints by a table (on the loop); the published
    snapshot carries a copy."""

    #: ``(policy, [branch,] outcome)`` -> placement calls; outcome in
    #: :data:`PLACE_OUTCOMES` (decode keys carry the policy's branch label).
    placements: dict[tuple[str, ...], int] = field(default_factory=dict)
    #: outcome -> release calls; outcome in :data:`RELEASE_OUTCOMES`.
    releases: dict[str, int] = field(default_factory=dict)
    #: unit ("images", "patches") -> policy -> units placed (:attr:`TableKind.units`).
    units: dict[str, dict[str, int]] = field(default_factory=dict)


class TableSnapshot(NamedTuple):
    """What the scrape thread reads of a table: published by the loop, never written after."""

    policy: str = ""
    held: int = 0
    #: Per-GPU series bound (``<table>.metrics_gpu_series``).
    gpu_series: int = 0
    #: Per member: its figures per GPU (decode: ``(concurrency, kv_tokens)``; vision:
    #: ``(patches_in_flight,)``), each of shape ``(gpus,)``.
    members: MemberTable = MemberTable()
    placements: tuple[tuple[tuple[str, ...], int], ...] = ()
    releases: tuple[tuple[str, int], ...] = ()
    #: ``(unit, ((policy, units placed), ...))`` of every unit the table counts.
    units: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = ()


# -- filters: the extension point before the policy's select ----------------------------


#: A boolean mask over a table's slots, shape ``(slots,)``: True where a GPU may be chosen.
SlotMask = npt.NDArray[np.bool_]
Q = TypeVar("Q", contravariant=True)


class SlotFilter(Protocol[Q]):
    """One step of a table's filter list (:attr:`PlacementTable.filters`), applied in
    order before the policy's ``select``: each narrows the GPUs one request may take.

    ``allowed(request, slots, now_ns)`` returns a mask of shape ``(slots,)`` (True: may be
    chosen) or None (no restriction, the fast path); the masks of all filters (and the
    caller's own restriction, e.g. the gateway's ``allowed``) are and-ed, and the policy
    chooses among what is left (none left: RESOURCE_EXHAUSTED, as any "no capacity").
    ``request`` is the table's request tuple (:class:`fulcrum.state.decode.DecodeRequest`,
    :class:`fulcrum.state.vision.VisionRequest`); the mask applies to the whole request
    (every image of a VE request, chosen in one fold, may take any allowed GPU). A filter
    may also refuse the request outright by raising a :mod:`fulcrum.errors` error (before
    anything changes).

    ``held(request_id, request, gpus)`` and ``freed(request_id)`` tell a filter that keeps
    counts (a per-tenant cap) that a request now holds placements on ``gpus`` (``(member_id,
    gpu_index)`` pairs, one per placement: stable while slots move), and that it no longer
    holds any (released, expired or lost with its member; a VE request that loses some of
    its images with a machine but keeps others is still held). A filter maps members to slots
    with :meth:`PlacementTable.slot_ranges` and follows the layout with
    :meth:`PlacementTable.add_slot_listener`. A filter that also has
    ``apply_settings(section)`` gets the table's new settings section on reload.
    """

    def allowed(self, request: Q, slots: int, now_ns: int) -> SlotMask | None: ...

    def held(self, request_id: str, request: Q, gpus: Sequence[tuple[str, int]]) -> None: ...

    def freed(self, request_id: str) -> None: ...


def and_masks(masks: Iterator[SlotMask | None], slots: int) -> SlotMask | None:
    """The conjunction of ``masks`` (None: no restriction); None when all are None."""
    out: SlotMask | None = None
    for mask in masks:
        if mask is None:
            continue
        if mask.shape != (slots,):
            raise ValueError(f"a filter's mask must have shape ({slots},)")
        out = mask.copy() if out is None else np.logical_and(out, mask, out=out)
    return out


class SlotListener(Protocol):
    """Follows which member's GPUs occupy which slots of a table's per-GPU arrays (for
    callers that keep per-slot tables, e.g. the gateway's slot -> address map, or a filter's
    per-slot counts). Called on the loop, after the change."""

    def slots_opened(self, member_id: str, start: int, gpus: int) -> None:
        """The member's GPUs ``0..gpus-1`` now occupy slots ``[start, start + gpus)``."""

    def slots_closed(self, member_id: str, start: int, gpus: int) -> None:
        """The member left; slots ``[start, start + gpus)`` are free (dead)."""

    def slots_moved(self) -> None:
        """The arrays were rebuilt (grown or compacted): every member may have moved; read
        :meth:`PlacementTable.slot_ranges` again."""


# -- the one placement table ------------------------------------------------------------


M = TypeVar("M", bound=Slots)
SettingsT = TypeVar("SettingsT", bound="TableSettings")
ReleasedT = TypeVar("ReleasedT")

#: ``liveness(member_id, incarnation, now_ns) -> bool``: is the member still live?
Liveness = Callable[[str, int, int], bool]


class TableSettings(Protocol):
    """The keys of a settings section the table reads itself (``decode.*``, ``vision.*``)."""

    @property
    def policy(self) -> str: ...
    @property
    def lease_ms(self) -> int: ...
    @property
    def max_placements(self) -> int: ...
    @property
    def sweep_interval_ms(self) -> int: ...
    @property
    def metrics_gpu_series(self) -> int: ...
    def params(self) -> Any: ...


@dataclass(frozen=True, slots=True)
class TableKind:
    """What names a table: in messages, settings, log events and metrics."""

    #: Table name ("decode", "vision"): messages, settings section, log event prefix.
    what: str
    #: Member noun in log events ("instance", "machine") and its id key ("instance_id").
    member: str
    id_key: str
    #: Log key of the placements lost with a member that left.
    lost_key: str
    #: The ``MemberShape`` and ``MemberLoad`` types of this table's members.
    shape: type
    load: type
    #: NotFound message of a release of nothing held (``{request_id!r}`` is filled in).
    not_held: str
    #: ``make_policy(name, params)`` of the balancer's registry.
    make_policy: Callable[[str, Any], Any]
    #: The balancer's metrics module (counters ``EXPIRATIONS``, ``LOST``; ``set_source``).
    metrics: Any
    #: ``branches(policy)``: the branch labels the policy declares (its registry entry);
    #: None: the table's counter keys carry no branch.
    branches: Callable[[str], tuple[str, ...]] | None = None
    #: Units counted per policy besides calls ("images", "patches").
    units: tuple[str, ...] = ()


class PlacementTable(Generic[M, SettingsT, ReleasedT]):
    """The one "place on GPUs under a lease" table of the decode and the vision balancers.

    It owns members by id (``M``, a :class:`Slots`), their slot ranges
    (:class:`SlotAllocator`, growth and compaction, :class:`SlotListener` s), the
    :class:`LeaseTable`, the settings section and policy in force (reload), the per-call
    counters, the :class:`Publisher`, the fleet-listener protocol (join, load, leave,
    lapse), release, expiry and the filter list (:attr:`filters`). A balancer (subclass)
    keeps only its per-GPU fleet arrays and its ``place`` (the policy's ``select`` over
    those arrays, after :meth:`_admit` and :meth:`_allowed`), through the hooks below:
    the per-GPU arrays (``_init_arrays``, ``_resize``), one member's slots (``_open``,
    ``_close``, ``_move``, ``_write_load``, ``_read``), held placements on a member that
    leaves (``_drop``), what a held record frees (``_unhold``, ``_released``) and the
    expiry metrics and log line (``_count_expired``).
    """

    KIND: ClassVar[TableKind]
    #: Whether a load report also expires due leases (decode: reports come often).
    EXPIRE_ON_LOAD: ClassVar[bool] = False

    def __init__(
        self,
        settings: SettingsT,
        rng: np.random.Generator,
        liveness: Liveness | None,
        filters: Sequence[SlotFilter[Any]] = (),
    ) -> None:
        kind = self.KIND
        self._log = structlog.get_logger(f"fulcrum.state.{kind.what}")
        self._rng = rng
        self._liveness = liveness
        self._members: dict[str, M] = {}
        self._alloc = SlotAllocator(64)
        self._leases: LeaseTable[Any] = LeaseTable(
            kind.what, f"{kind.what}.max_placements", settings.lease_ms,
            settings.max_placements, settings.sweep_interval_ms,
        )
        self._settings = settings
        self._policy: Any = kind.make_policy(settings.policy, settings.params())
        self._counts = Counts()
        self._figures = MemberFigureCache()
        #: The filter steps applied, in order, before the policy's select (see
        #: :class:`SlotFilter`); empty: the unfiltered decision path, unchanged.
        self.filters: list[SlotFilter[Any]] = list(filters)
        self._slot_listeners: list[SlotListener] = []
        #: Grows on every change of the slot layout (join, leave, growth, compaction).
        self.layout_version = 0
        self.expired_total = 0
        self.lost_total = 0
        self._init_arrays(self._alloc.capacity)
        self._configure(settings)
        self._bind_metrics()
        self.publisher: Publisher[Any] = Publisher(self._snapshot)
        kind.metrics.set_source(self.publisher)

    # -- hooks of a balancer -------------------------------------------------------------

    def _init_arrays(self, capacity: int) -> None:
        raise NotImplementedError

    def _resize(self, capacity: int, index: I64 | None = None) -> None:
        raise NotImplementedError

    def _open(self, member: Member, start: int, gpus: int) -> M:
        raise NotImplementedError

    def _close(self, slots: M) -> None:
        raise NotImplementedError

    def _move(self, slots: M, start: int) -> None:
        slots.start = start

    def _write_load(self, slots: M, load: Any) -> None:
        raise NotImplementedError

    def _drop(self, slots: M) -> int:
        raise NotImplementedError

    def _unhold(self, request_id: str, record: Any) -> int:
        raise NotImplementedError

    def _released(self, request_id: str, lease: Lease[Any], now_ns: int) -> ReleasedT:
        raise NotImplementedError

    def _read(self, slots: M) -> tuple[I64, ...]:
        """Copies of one member's per-GPU figures (for the snapshot)."""
        raise NotImplementedError

    def _count_expired(self, n: int, units: int) -> None:
        raise NotImplementedError

    def _configure(self, settings: SettingsT) -> None:
        """Per-balancer keys of a new settings section (after the table's own)."""

    def _joined_fields(self, member: Member) -> dict[str, Any]:
        """Extra fields of the "joined" log line."""
        return {}

    # -- read-only views -----------------------------------------------------------------

    def set_schedule(self, schedule: Schedule | None) -> None:
        """Build metrics snapshots on demand through the event loop's
        ``call_soon_threadsafe`` (call on the loop's thread)."""
        self.publisher.set_schedule(schedule)

    @property
    def counts(self) -> Counts:
        """Placement and release counters (live: the loop's own; see :attr:`publisher`)."""
        return self._counts

    @property
    def settings(self) -> SettingsT:
        return self._settings

    @property
    def policy_name(self) -> str:
        """Registry name of the policy in force."""
        name: str = self._policy.name
        return name

    @property
    def lease_ms(self) -> int:
        """Lease given to new placements, ms."""
        return self._leases.lease_ms

    @property
    def held(self) -> int:
        """Placements held (not yet released, expired or lost)."""
        return len(self._leases)

    def add_slot_listener(self, listener: SlotListener) -> None:
        """Tell ``listener`` about every later change of the slot layout (see
        :class:`SlotListener`); read the current one with :meth:`slot_ranges`."""
        self._slot_listeners.append(listener)

    def remove_slot_listener(self, listener: SlotListener) -> None:
        if listener in self._slot_listeners:
            self._slot_listeners.remove(listener)

    def slot_ranges(self) -> Iterator[tuple[str, int, int]]:
        """``(member_id, start, gpus)`` of every member: its GPU ``g`` is slot
        ``start + g`` of the per-GPU arrays (in no particular order)."""
        for member_id, s in self._members.items():
            yield member_id, s.start, s.gpus

    # -- configuration and counting ------------------------------------------------------

    def apply_settings(self, settings: SettingsT) -> None:
        """Apply every key of new settings (SIGHUP): policy and its parameters, lease,
        table bound, sweep period, metrics bound and the balancer's own keys apply to the
        next call. Held placements keep their deadline (expiry runs in placement order, so
        a shortened lease takes effect once older placements are gone)."""
        self._policy = self.KIND.make_policy(settings.policy, settings.params())
        self._settings = settings
        self._leases.configure(
            settings.lease_ms, settings.max_placements, settings.sweep_interval_ms
        )
        self._configure(settings)
        for f in self.filters:  # a filter with settings of its own follows the reload
            apply = getattr(f, "apply_settings", None)
            if apply is not None:
                apply(settings)
        self._bind_metrics()
        self.publisher.changed()
        self._log.info(
            f"{self.KIND.what}_settings_applied", policy=settings.policy,
            lease_ms=settings.lease_ms,
        )

    def _bind_metrics(self) -> None:
        """Zero the counters of the policy in force (exported at once) and precompute the
        keys the decision path increments (plain ints: no lock, no label lookup)."""
        kind = self.KIND
        name: str = self._policy.name
        c = self._counts
        self._k_placed: dict[str, tuple[str, ...]]
        self._k_refused: dict[str, tuple[str, ...]]
        if kind.branches is None:
            self._k_placed = {"": (name, "placed")}
            self._k_refused = {o: (name, o) for o in PLACE_OUTCOMES[1:]}
        else:
            labels = dict.fromkeys(("", *kind.branches(name)))  # "" and the policy's own
            self._k_placed = {b: (name, b, "placed") for b in labels}
            self._k_refused = {o: (name, "", o) for o in PLACE_OUTCOMES[1:]}
        for key in (*self._k_placed.values(), *self._k_refused.values()):
            c.placements.setdefault(key, 0)
        for outcome in RELEASE_OUTCOMES:
            c.releases.setdefault(outcome, 0)
        self._units = [c.units.setdefault(unit, {}) for unit in kind.units]
        for per_policy in self._units:
            per_policy.setdefault(name, 0)

    def _snapshot(self) -> TableSnapshot:
        """The immutable snapshot for the scrape thread (built on the loop)."""
        c = self._counts
        units = self.KIND.units
        return TableSnapshot(
            self._policy.name,
            len(self._leases),
            self._settings.metrics_gpu_series,
            self._figures.refresh(self._read),
            tuple(c.placements.items()),
            tuple(c.releases.items()),
            tuple([(u, tuple(c.units[u].items())) for u in units]) if units else (),
        )

    def count_refused(self, outcome: str) -> None:
        """Count a placement refused with ``outcome`` (one of the metrics module's
        ``PLACE_OUTCOMES`` but "placed"), e.g. before it reached the table (a bad id)."""
        self._counts.placements[self._k_refused[outcome]] += 1
        self.publisher.changed()

    def count_release_refused(self, outcome: str) -> None:
        """Count a release refused before it reached the table (e.g. a bad id)."""
        self._counts.releases[outcome] += 1
        self.publisher.changed()

    # -- the steps of a placement --------------------------------------------------------

    def _admit(self, request_id: str, now_ns: int) -> None:
        """Expire due leases, then refuse (counted) a request id already held or a full
        table: the first step of every ``place``."""
        leases = self._leases
        held = leases.held
        if held and next(iter(held.values()))[DEADLINE_NS] <= now_ns:
            self.expire(now_ns)
        if request_id in held or len(held) >= leases.max_held:
            outcome, error = leases.refusal(request_id)
            self.count_refused(outcome)
            raise error

    def _allowed(
        self, request: Any, slots: int, now_ns: int, mask: SlotMask | None = None
    ) -> SlotMask | None:
        """The filter step: ``mask`` (the caller's own restriction, or None) and-ed with
        every filter's (None: no restriction at all). Counts a refusal by a filter."""
        masks = (f.allowed(request, slots, now_ns) for f in self.filters)
        try:
            return and_masks(itertools.chain((mask,), masks), slots)
        except ResourceExhausted:
            self.count_refused("resource_exhausted")
            raise
        except InvalidArgument:
            self.count_refused("invalid_argument")
            raise

    def _held_by(self, request_id: str, request: Any, gpus: Sequence[tuple[str, int]]) -> None:
        """Tell the filters that ``request_id`` now holds placements on ``gpus``
        (``(member_id, gpu_index)`` pairs)."""
        for f in self.filters:
            f.held(request_id, request, gpus)

    def _freed(self, request_id: str) -> None:
        """Tell the filters that ``request_id`` holds nothing any more."""
        for f in self.filters:
            f.freed(request_id)

    def _still_live(self, slots: M, now_ns: int, compact: bool = True) -> bool:
        """Whether the fleet still has ``slots``' member live; a lapsed one is taken out
        (the fleet normally reports the lapse through :meth:`on_leave` already)."""
        liveness = self._liveness
        member = slots.member
        if liveness is None or liveness(member.member_id, member.incarnation, now_ns):
            return True
        if self._members.get(member.member_id) is slots:
            self._remove(slots, "lapsed", compact=compact)
        return False

    # -- release and expiry --------------------------------------------------------------

    def release(self, request_id: str, now_ns: int) -> ReleasedT:
        """Free a held placement; NotFound when unknown, released, expired or lost."""
        lease = self._leases.pop(request_id)
        if lease is None:
            self._counts.releases["not_found"] += 1
            self.publisher.changed()
            raise NotFound(self.KIND.not_held.format(request_id=request_id))
        out = self._released(request_id, lease, now_ns)
        if self.filters:
            self._freed(request_id)
        self._counts.releases["released"] += 1
        self.publisher.changed()
        return out

    def expire(self, now_ns: int) -> int:
        """Free the placements whose lease ran out by ``now_ns`` (in placement order: O(
        expired)); returns how many."""
        n = units = 0
        for request_id, lease in self._leases.expired(now_ns):
            units += self._unhold(request_id, lease[RECORD])
            if self.filters:
                self._freed(request_id)
            n += 1
        if n:
            self.expired_total += n
            self._count_expired(n, units)
            self.publisher.changed()
        return n

    # -- fleet listener ------------------------------------------------------------------

    def on_join(self, member: Member, now_ns: int) -> None:
        """Give the member slots: O(its GPUs) (amortised, when the arrays grow)."""
        shape = member.shape
        if not isinstance(shape, self.KIND.shape):
            return
        old = self._members.get(member.member_id)
        if old is not None:  # the fleet calls on_leave first; be safe anyway
            self._remove(old, "replaced")
        gpus: int = shape.gpus
        start, grow_to = self._alloc.alloc(gpus)
        if grow_to:
            self._resize(grow_to)
            self._moved()
        slots = self._open(member, start, gpus)
        self._members[member.member_id] = slots
        self._figures.mark(slots)
        self.publisher.changed()
        self.layout_version += 1
        for listener in self._slot_listeners:
            listener.slots_opened(member.member_id, start, gpus)
        kind = self.KIND
        self._log.info(
            f"{kind.what}_{kind.member}_joined",
            **{kind.id_key: member.member_id},
            incarnation=member.incarnation,
            gpus=gpus,
            **self._joined_fields(member),
        )

    def on_load(self, member: Member, load: MemberLoad, now_ns: int) -> None:
        """A heartbeat's report replaces the member's figures (O(its GPUs))."""
        slots = self._members.get(member.member_id)
        if (
            slots is None
            or slots.member.incarnation != member.incarnation
            or not isinstance(load, self.KIND.load)
        ):
            return
        self._write_load(slots, load)
        self._figures.mark(slots)
        self.publisher.changed()
        if self.EXPIRE_ON_LOAD:
            self.expire(now_ns)

    def on_leave(self, member: Member, reason: str, now_ns: int) -> None:
        """The fleet dropped ``member``: take it out (if it is the incarnation we hold)."""
        slots = self._members.get(member.member_id)
        if slots is None or slots.member.incarnation != member.incarnation:
            return
        self._remove(slots, reason)

    def _remove(self, slots: M, reason: str, compact: bool = True) -> None:
        """Take a member out: its slots are freed, its placements lost. O(its GPUs + its
        placements); amortised O(1) per GPU when the arrays are compacted (not with
        ``compact=False``, which keeps slot indices valid: then at a later leave)."""
        member_id = slots.member_id
        del self._members[member_id]
        lost = self._drop(slots)
        slots.requests.clear()
        self._close(slots)
        self._alloc.free(slots.start, slots.gpus)
        self._figures.forget(member_id)
        self.layout_version += 1
        for listener in self._slot_listeners:
            listener.slots_closed(member_id, slots.start, slots.gpus)
        if compact and self._alloc.needs_compaction():
            self._compact()
        if lost:
            self.lost_total += lost
            self.KIND.metrics.LOST.labels(reason).inc(lost)
        self.publisher.changed()
        kind = self.KIND
        self._log.info(
            f"{kind.what}_{kind.member}_left",
            **{kind.id_key: member_id},
            incarnation=slots.member.incarnation,
            reason=reason,
            **{kind.lost_key: lost},
        )

    def _lose(self, request_id: str) -> None:
        """A request lost its last placement with a member that left."""
        if self.filters:
            self._freed(request_id)

    def _moved(self) -> None:
        self.layout_version += 1
        for listener in self._slot_listeners:
            listener.slots_moved()

    def _compact(self) -> None:
        """Pack the members' slots at the front (O(GPUs), amortised over the leaves that
        freed as many slots as are used)."""
        order = list(self._members.values())
        index, starts = self._alloc.compaction([(s.start, s.gpus) for s in order])
        self._resize(self._alloc.capacity, index)
        for s, start in zip(order, starts, strict=True):
            self._move(s, start)
        self._moved()
