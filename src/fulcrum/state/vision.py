"""The daemon's VE table: machines, per-GPU patches in flight, held placements.

Per-GPU view (patches): ``base + pending``, where ``base`` is the machine's last
heartbeat report (0 before any) and ``pending`` the patches of the placements made since
that report and not yet released. A report replaces ``base`` and folds ``pending`` into
it; releasing an image placed before the latest report lowers ``base`` (never below 0),
one placed after it lowers ``pending``. Without heartbeats in between, release after
place restores the view exactly.

The table is :class:`fulcrum.state.placement.PlacementTable`, shared with the decode
table (members, slots, leases, reload, release, expiry, metrics); this module keeps the
VE fleet's arrays (base, pending and in-flight patches over a ``SlotTopology``) and
``place``. Placed requests are held per request id in a table bounded by
``vision.max_placements`` with a lease of ``vision.lease_ms``; a machine that leaves
drops its images (counted as lost; a request keeps its images on other machines).

Slots: each machine's GPUs occupy a contiguous range of slots
(:class:`fulcrum.state.placement.SlotAllocator`) of a
:class:`fulcrum.core.vision.fleet.SlotTopology` updated in place, so that a join, a
leave or a heartbeat costs O(the machine's GPUs), never a rebuild of the fleet. The
layout depends on the order of events: the same events in the same order with the same
seed give the same decisions.

Filters: every step of :attr:`VisionState.filters`
(:class:`fulcrum.state.placement.SlotFilter`, given a :class:`VisionRequest`) narrows
the GPUs a request's images may take (:func:`fulcrum.core.vision.filters.restrict`);
without filters the decision path is the unfiltered one, unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from fulcrum.config.vision import VisionSettings
from fulcrum.core.tenant_caps import Fill
from fulcrum.core.tenants import DEFAULT_CLASS, RequestClass
from fulcrum.core.types import Member, MemberLoad, VisionMachineLoad, VisionMachineShape
from fulcrum.core.vision.base import VisionPolicy
from fulcrum.core.vision.filters import restrict
from fulcrum.core.vision.fleet import (
    NoCapacity,
    Placement,
    SlotTopology,
    VisionFleet,
    imbalance,
)
from fulcrum.core.vision.patches import InvalidImageError, checked_patches
from fulcrum.core.vision.registry import make_policy
from fulcrum.errors import InvalidArgument, NotFound
from fulcrum.metrics import vision as metrics
from fulcrum.state.placement import (
    RECORD,
    Lease,
    Liveness,
    PlacementTable,
    SlotFilter,
    SlotMask,
    Slots,
    TableKind,
)
from fulcrum.units import MAX_EXACT_FLOAT

#: Largest reported patches in flight per GPU (keeps int64 sums exact).
MAX_REPORTED_PATCHES = MAX_EXACT_FLOAT


class ImageRequest(NamedTuple):
    """One image of a PlaceImages request: sizes in pixels (``patch_size`` 0 = default)."""

    width: int
    height: int
    patch_size: int = 0


class VisionRequest(NamedTuple):
    """One PlaceImages as the filters see it (:class:`fulcrum.state.placement.SlotFilter`;
    built only when there are filters)."""

    request_id: str
    #: Patch count of each image, in order.
    patches: tuple[int, ...]
    #: The request's class (tenant, priority, deadline; issue 23).
    cls: RequestClass = DEFAULT_CLASS


class PlacedImage(NamedTuple):
    """Where an image went (also the record held until release)."""

    #: VE machine (fleet member id).
    machine_id: str
    #: GPU index on that machine.
    gpu_index: int
    #: Patch count of the image.
    patches: int
    #: Incarnation of the machine when placed.
    incarnation: int
    #: The machine's heartbeat-report generation when placed.
    generation: int


@dataclass(slots=True, eq=False)
class _Machine(Slots):
    index: int = -1  # machine index in the topology
    max_patches: int = 0
    generation: int = 0  # heartbeat reports received


def _patch_counts(s: VisionSettings, images: Sequence[ImageRequest]) -> list[int]:
    """Patch count of each image (InvalidArgument naming the image and the rule)."""
    if not images:
        raise InvalidArgument("images", "must not be empty")
    if len(images) > s.max_images_per_request:
        raise InvalidArgument(
            "images",
            f"must have at most {s.max_images_per_request} entries "
            "(vision.max_images_per_request)",
        )
    counts = []
    default, max_side = s.patch_size, s.max_side
    for i, (width, height, patch_size) in enumerate(images):
        p = patch_size or default
        if (
            type(width) is int
            and type(height) is int
            and type(p) is int
            and 0 < width <= max_side
            and 0 < height <= max_side
            and 0 < p <= max_side
        ):  # fast path of checked_patches (same rule)
            counts.append(-(-width // p) * -(-height // p))
            continue
        try:
            counts.append(checked_patches(width, height, p, max_side=max_side))
        except InvalidImageError as err:
            raise InvalidArgument(f"images[{i}].{err.field}", err.rule) from None
    return counts


class _VisionViews:
    """Read-only views of the VE table (tests, diagnostics, GetMachineLoad; on the loop)."""

    _members: dict[str, _Machine]
    _pif: npt.NDArray[np.int64]
    _topology: SlotTopology
    _fleet: VisionFleet

    def machine_ids(self) -> list[str]:
        """Machines, sorted by id."""
        return sorted(self._members)

    def machine_load(self, machine_id: str) -> tuple[list[int], int, int]:
        """(patches in flight per GPU, per-GPU max patches (0 = unlimited), images held).

        Raises:
            NotFound: ``machine_id`` is not a live VE machine.
        """
        machine = self._members.get(machine_id)
        if machine is None:
            raise NotFound(f"machine_id: {machine_id!r} is not a registered VE machine")
        s = machine.start
        images = sum(machine.requests.values())
        return self._pif[s : s + machine.gpus].tolist(), machine.max_patches, images

    def fleet(self) -> VisionFleet:
        """A copy of the current fleet view (for tests and diagnostics): GPU indices are
        slots, free slots are not live."""
        return VisionFleet(self._topology, self._pif.copy())

    def gpu_loads(self) -> Iterator[tuple[str, int, int]]:
        """``(machine_id, gpu_index, patches_in_flight)`` of every GPU, machines by id."""
        for machine_id in sorted(self._members):
            machine = self._members[machine_id]
            pif = self._pif[machine.start : machine.start + machine.gpus].tolist()
            for i, value in enumerate(pif):
                yield machine_id, i, value

    def imbalance(self) -> float:
        """Max over mean of patches in flight across GPUs (1.0 = perfect or idle)."""
        return imbalance(self._fleet)


#: The record held for one request: its images as plain tuples of PlacedImage's fields
#: (atomic values only, so the collector untracks them: see placement.Lease).
_Images = tuple[tuple[str, int, int, int, int], ...]

_KIND = TableKind(
    what="vision",
    member="machine",
    id_key="machine_id",
    lost_key="lost",
    shape=VisionMachineShape,
    load=VisionMachineLoad,
    not_held=(
        "request_id: {request_id!r} holds no placement "
        "(released, expired, lost with its machine, or never placed)"
    ),
    make_policy=make_policy,
    metrics=metrics,
    units=("images", "patches"),
)


class VisionState(
    _VisionViews, PlacementTable[_Machine, VisionSettings, tuple[int, int]]
):
    """VE machines, patches in flight and held placements: the one placement table
    (:class:`fulcrum.state.placement.PlacementTable`) over the VE fleet's arrays. Not
    thread-safe; the daemon's event loop is the only caller (the scrape thread reads
    :attr:`publisher`'s snapshot). Implements the fleet's ``FleetListener`` protocol."""

    KIND = _KIND
    _policy: VisionPolicy

    def __init__(
        self,
        settings: VisionSettings,
        rng: np.random.Generator,
        liveness: Liveness | None = None,
        filters: Sequence[SlotFilter[VisionRequest]] = (),
    ) -> None:
        super().__init__(settings, rng, liveness, filters)

    # -- fleet arrays --------------------------------------------------------------------

    def _init_arrays(self, capacity: int) -> None:
        self._topology = SlotTopology(capacity)
        self._by_index: list[_Machine | None] = []  # machine index -> machine
        self._base: npt.NDArray[np.int64] = np.zeros(capacity, dtype=np.int64)
        self._pending: npt.NDArray[np.int64] = np.zeros(capacity, dtype=np.int64)
        self._pif: npt.NDArray[np.int64] = np.zeros(capacity, dtype=np.int64)
        # The decision's input: the topology over the very array ``_pif`` (in place).
        self._fleet = VisionFleet(self._topology, self._pif)

    def _resize(self, capacity: int, index: npt.NDArray[np.int64] | None = None) -> None:
        """New per-slot arrays of ``capacity`` slots (growth, or compaction by ``index``)."""
        self._topology.resize(capacity, index)
        if index is None:
            index = np.arange(self._pif.shape[0], dtype=np.int64)
        n = int(index.shape[0])
        arrays = []
        for arr in (self._base, self._pending, self._pif):
            out = np.zeros(capacity, dtype=np.int64)
            out[:n] = arr[index]
            arrays.append(out)
        self._base, self._pending, self._pif = arrays
        self._fleet = VisionFleet(self._topology, self._pif)

    def _open(self, member: Member, start: int, gpus: int) -> _Machine:
        shape = member.shape
        assert isinstance(shape, VisionMachineShape)
        max_patches = min(shape.max_patches_in_flight, MAX_REPORTED_PATCHES)
        index = self._topology.add_machine(member.member_id, start, gpus, max_patches)
        machine = _Machine(member, start, gpus, index=index, max_patches=max_patches)
        if index == len(self._by_index):
            self._by_index.append(machine)
        else:
            self._by_index[index] = machine
        return machine

    def _joined_fields(self, member: Member) -> dict[str, Any]:
        shape = member.shape
        assert isinstance(shape, VisionMachineShape)
        return {"max_patches_in_flight": shape.max_patches_in_flight}

    def _close(self, machine: _Machine) -> None:
        s, e = machine.start, machine.start + machine.gpus
        self._topology.remove_machine(machine.index)
        self._by_index[machine.index] = None
        self._base[s:e] = 0
        self._pending[s:e] = 0
        self._pif[s:e] = 0

    def _move(self, machine: _Machine, start: int) -> None:
        machine.start = start
        self._topology.move_machine(machine.index, start)

    def _write_load(self, machine: _Machine, load: VisionMachineLoad) -> None:
        s, e = machine.start, machine.start + machine.gpus
        machine.generation += 1
        self._base[s:e] = np.asarray(load.patches_in_flight, dtype=np.int64)
        self._pending[s:e] = 0
        self._pif[s:e] = self._base[s:e]

    def _drop(self, machine: _Machine) -> int:
        """The images held on a leaving machine are lost; a request keeps the others."""
        member_id = machine.member_id
        leases = self._leases
        lost = 0
        for request_id in machine.requests:
            lease = leases.get(request_id)
            if lease is None:
                continue
            images, placed_ns, deadline_ns = lease
            keep = tuple(im for im in images if im[0] != member_id)
            lost += len(images) - len(keep)
            if keep:
                leases.held[request_id] = (keep, placed_ns, deadline_ns)
            else:
                leases.pop(request_id)
                self._lose(request_id)
        return lost

    # -- configuration and metrics -------------------------------------------------------

    def _read(self, slots: _Machine) -> tuple[npt.NDArray[np.int64]]:
        return (self._pif[slots.start : slots.start + slots.gpus].copy(),)

    def _count_expired(self, n: int, units: int) -> None:
        metrics.EXPIRATIONS.inc(n)
        metrics.EXPIRED_IMAGES.inc(units)
        self._log.info("vision_placements_expired", requests=n, images=units)

    # -- fleet listener ------------------------------------------------------------------

    def validate_load(self, member: Member, load: MemberLoad) -> None:
        """Refuse a report with an absurd per-GPU figure (changes nothing)."""
        if not isinstance(load, VisionMachineLoad):
            raise InvalidArgument("load", "must be vision_machine for a VE machine")
        for i, value in enumerate(load.patches_in_flight):
            if not 0 <= value <= MAX_REPORTED_PATCHES:
                raise InvalidArgument(
                    f"vision_machine.patches_in_flight[{i}]",
                    f"must be in [0, 2^53 = {MAX_REPORTED_PATCHES}]",
                )

    # -- placement -----------------------------------------------------------------------

    def check_image_count(self, n: int) -> None:
        """Refuse (and count) a request of ``n`` images beyond the bound, before anything
        is converted: the service calls it on the repeated field's length."""
        if n > self._settings.max_images_per_request:
            self.count_refused("invalid_argument")
            raise InvalidArgument(
                "images",
                f"must have at most {self._settings.max_images_per_request} entries "
                f"(vision.max_images_per_request), got {n}",
            )

    def place(
        self, request_id: str, images: Sequence[ImageRequest], now_ns: int,
        cls: RequestClass = DEFAULT_CLASS,
    ) -> list[PlacedImage]:
        """Place every image of ``request_id`` in order (each sees the ones before it).
        ``cls``: the request's class, seen by the filters (the tenant step).

        Raises (nothing changes then):
            InvalidArgument: no images, too many, or a size breaks a rule (the field is
                named, e.g. ``images[1].width``).
            AlreadyExists: ``request_id`` already holds a placement.
            ResourceExhausted: the table is full, or no live (allowed) GPU has room.
        """
        try:
            counts = _patch_counts(self._settings, images)
        except InvalidArgument:
            self.count_refused("invalid_argument")
            raise
        self._admit(request_id, now_ns)
        request = mask = None
        if self.filters:
            request = VisionRequest(request_id, tuple(counts), cls)
            mask = self._allowed(request, self._topology.n_gpus, now_ns)
        placed = self._fold(counts, now_ns, mask)
        out = self._commit(request_id, placed)
        self._leases.hold(
            request_id,
            tuple((m, g, p, i, gen) for m, g, p, i, gen in out),  # plain tuples: untracked
            now_ns,
        )
        if request is not None:
            self._held_by(request_id, request, [(im[0], im[1]) for im in out])
        self._counts.placements[self._k_placed[""]] += 1
        name = self._policy.name
        images_placed, patches_placed = self._units
        images_placed[name] += len(out)
        patches_placed[name] += sum(counts)
        self.publisher.changed()
        return out

    def fill(self) -> Fill:
        """Patches in flight on live GPUs with a capacity, and those capacities (GPUs
        without one are not counted), for the tenant step's band shedding. O(GPUs)."""
        t = self._topology
        limited = t.live & (t.capacity > 0)
        return Fill(0, 0, int(self._pif[limited].sum()), int(t.capacity[limited].sum()))

    def _commit(self, request_id: str, placed: list[Placement]) -> list[PlacedImage]:
        """Add the chosen images to their GPUs' pending patches (in place)."""
        pif = self._fleet.patches_in_flight
        machines = self._by_index
        pending = self._pending
        out: list[PlacedImage] = []
        for decision in placed:
            machine = machines[decision.machine]
            assert machine is not None
            g = decision.gpu
            p = decision.patches
            pending[g] = pending.item(g) + p
            pif[g] = pif.item(g) + p
            member = machine.member
            out.append(
                PlacedImage(
                    member.member_id, g - machine.start, p, member.incarnation,
                    machine.generation,
                )
            )
            machine.add_request(request_id)
            self._figures.mark(machine)
        return out

    def _fold(self, counts: list[int], now_ns: int, mask: SlotMask | None) -> list[Placement]:
        """Choose a GPU for each image in order (each sees the ones before it) on live
        (and ``mask``-allowed) machines only; the view is left unchanged. Raises
        ResourceExhausted (counted)."""
        policy, rng = self._policy, self._rng
        while True:
            # The pure fold of core.vision.place_many, done in place on our own array:
            # each image sees the ones before it; undone if any image fails.
            fleet = self._fleet if mask is None else restrict(self._fleet, mask)
            pif = fleet.patches_in_flight
            placed: list[Placement] = []
            for n in counts:
                decision = policy.select(fleet, n, rng)
                if isinstance(decision, NoCapacity):
                    for done in placed:
                        pif[done.gpu] -= done.patches
                    self.count_refused("resource_exhausted")
                    raise self._leases.refuse_no_capacity(decision.reason)
                g = decision.gpu
                pif[g] = pif.item(g) + n  # scalar Python arithmetic: no numpy scalars
                placed.append(decision)
            for decision in placed:  # undone here; committed below once all are live
                pif[decision.gpu] -= decision.patches
            if self._liveness is None or self._all_live(placed, now_ns, mask is None):
                return placed

    def _all_live(self, placed: Sequence[Placement], now_ns: int, compact: bool) -> bool:
        """Whether every machine chosen is still live; a lapsed one is taken out."""
        seen: set[int] = set()
        for p in placed:
            m = p.machine
            if m in seen:
                continue
            seen.add(m)
            machine = self._by_index[m]
            if machine is None or not self._still_live(machine, now_ns, compact):
                return False
        return True

    # -- release -------------------------------------------------------------------------

    def _released(self, request_id: str, lease: Lease[Any], now_ns: int) -> tuple[int, int]:
        """(images, patches) freed."""
        images = lease[RECORD]
        return len(images), self._free(request_id, images)

    def _unhold(self, request_id: str, images: _Images) -> int:
        self._free(request_id, images)
        return len(images)

    def _free(self, request_id: str, images: _Images) -> int:
        """Take held images off their GPUs; returns their patches."""
        total = 0
        for machine_id, gpu_index, p, incarnation, generation in images:
            machine = self._members.get(machine_id)
            total += p
            if machine is None or machine.member.incarnation != incarnation:
                continue
            g = machine.start + gpu_index
            if generation == machine.generation:
                self._pending[g] -= p
                self._pif[g] -= p
            else:
                dec = min(p, int(self._base[g]))
                self._base[g] -= dec
                self._pif[g] -= dec
            machine.drop_request(request_id)
            self._figures.mark(machine)
        return total
