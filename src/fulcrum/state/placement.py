"""One "place on GPUs under a lease" table, shared by the decode and the vision balancers.

Both balancers keep fleet members (decode instances, VE machines) whose GPUs occupy slots
of per-GPU arrays, and placements held per request id under a lease. This module owns
everything that is the same for both:

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
  :attr:`Publisher.snapshot`, an immutable object swapped in by reference after changes
  (at most once per loop iteration: :meth:`Publisher.changed` schedules the publication
  with the loop's ``call_soon``). A publication copies the changed members' GPU figures
  only (O(changed GPUs) plus one tuple of the members), never the fleet's arrays.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final, Generic, NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

from fulcrum.core.types import Member
from fulcrum.errors import AlreadyExists, ResourceExhausted
from fulcrum.units import NS_PER_MS

R = TypeVar("R")
S = TypeVar("S")

I64 = npt.NDArray[np.int64]

#: ``schedule(callback)``: run ``callback`` soon on the event loop (``loop.call_soon``).
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


class Publisher(Generic[S]):
    """Holds the latest immutable snapshot of a table for other threads.

    ``build()`` makes a snapshot on the loop; :meth:`changed` asks for a new one: at once
    without a scheduler (tests of the table alone), else once per loop iteration however
    many changes it saw. Other threads only read :attr:`snapshot` (one reference read).
    """

    __slots__ = ("__weakref__", "_build", "_pending", "_schedule", "snapshot")

    def __init__(self, build: Callable[[], S]) -> None:
        self._build = build
        self._schedule: Schedule | None = None
        self._pending = False
        self.snapshot: S = build()

    def set_schedule(self, schedule: Schedule | None) -> None:
        """Publish through ``schedule`` (the loop's ``call_soon``) from now on."""
        self._schedule = schedule

    def changed(self) -> None:
        if self._pending:
            return
        if self._schedule is None:
            self.snapshot = self._build()
            return
        self._pending = True
        self._schedule(self._publish)

    def publish(self) -> None:
        """Publish now (on the loop)."""
        self._pending = False
        self.snapshot = self._build()

    _publish = publish


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

    def refresh(self, read: Callable[[Slots], tuple[I64, ...]]) -> MemberTable:
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


# -- the table skeleton -----------------------------------------------------------------


M = TypeVar("M", bound=Slots)
SettingsT = TypeVar("SettingsT")
CountsT = TypeVar("CountsT")


class PlacementTable(Generic[M, SettingsT, CountsT]):
    """What the decode and the vision tables share: members by id (``M``, a
    :class:`Slots`), the :class:`LeaseTable`, the settings section in force, the
    per-call counters and the :class:`Publisher`. Subclasses keep their fleet arrays, their
    ``place``/``release`` and :meth:`_remove`."""

    _members: dict[str, M]
    _leases: LeaseTable[Any]
    _settings: SettingsT
    _counts: CountsT
    _policy: Any  # has ``name``
    publisher: Publisher[Any]

    def set_schedule(self, schedule: Schedule | None) -> None:
        """Publish metrics snapshots through the event loop's ``call_soon``."""
        self.publisher.set_schedule(schedule)

    @property
    def counts(self) -> CountsT:
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

    def count_release_refused(self, outcome: str) -> None:
        """Count a release refused before it reached the table (e.g. a bad id)."""
        releases: dict[str, int] = getattr(self._counts, "releases")  # noqa: B009
        releases[outcome] += 1
        self.publisher.changed()

    def on_leave(self, member: Member, reason: str, now_ns: int) -> None:
        """The fleet dropped ``member``: take it out (if it is the incarnation we hold)."""
        slots = self._members.get(member.member_id)
        if slots is None or slots.member.incarnation != member.incarnation:
            return
        self._remove(slots, reason)

    def _remove(self, slots: M, reason: str) -> None:
        raise NotImplementedError
