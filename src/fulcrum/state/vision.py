"""The daemon's VE table: machines, per-GPU patches in flight, held placements.

Per-GPU view (patches): ``base + pending``, where ``base`` is the machine's last
heartbeat report (0 before any) and ``pending`` the patches of the placements made since
that report and not yet released. A report replaces ``base`` and folds ``pending`` into
it; releasing an image placed before the latest report lowers ``base`` (never below 0),
one placed after it lowers ``pending``. Without heartbeats in between, release after
place restores the view exactly.

Placements are held per request id in a table bounded by ``vision.max_placements``,
with a lease of ``vision.lease_ms``: unreleased placements expire (counted) at the next
sweep or placement after their deadline. A machine that leaves (deregistered, lapsed,
replaced) leaves placement at once; its held images are dropped and counted as lost.

Machines are kept sorted by id, so that the same registrations and the same seed give
the same decisions whatever the order of registration.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import structlog

from fulcrum.config.vision import VisionSettings
from fulcrum.core.types import Member, MemberLoad, VisionMachineLoad, VisionMachineShape
from fulcrum.core.vision.base import VisionPolicy
from fulcrum.core.vision.fleet import (
    MachineSpec,
    NoEligibleGpuError,
    Placement,
    VisionFleet,
    VisionTopology,
    imbalance,
)
from fulcrum.core.vision.patches import InvalidImageError, checked_patches
from fulcrum.core.vision.registry import make_policy
from fulcrum.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from fulcrum.metrics import vision as metrics

log = structlog.get_logger(__name__)

#: Largest reported patches in flight per GPU (keeps int64 sums exact).
MAX_REPORTED_PATCHES = 1 << 53

#: ``liveness(machine_id, incarnation, now_ns) -> bool``: is the machine still live?
Liveness = Callable[[str, int, int], bool]


class ImageRequest(NamedTuple):
    """One image of a PlaceImages request: sizes in pixels (``patch_size`` 0 = default)."""

    width: int
    height: int
    patch_size: int = 0


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


@dataclass(slots=True)
class _Held:
    images: list[PlacedImage]
    deadline_ns: int


@dataclass(slots=True)
class _Machine:
    member: Member
    gpus: int
    max_patches: int
    start: int = -1  # first global GPU index in the current topology; -1 = not yet in it
    generation: int = 0  # heartbeat reports received
    requests: dict[str, int] = field(default_factory=dict)  # request id -> images here


class VisionState:
    """VE machines, patches in flight and held placements. Not thread-safe; the daemon's
    event loop is the only caller. Implements the fleet's ``FleetListener`` protocol."""

    def __init__(
        self,
        settings: VisionSettings,
        rng: np.random.Generator,
        liveness: Liveness | None = None,
    ) -> None:
        self._rng = rng
        self._liveness = liveness
        self._machines: dict[str, _Machine] = {}
        self._topology = VisionTopology.build([])
        self._by_index: list[_Machine] = []
        self._dirty = False
        self._base: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)
        self._pending: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)
        self._pif: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)
        # The decision's input, built once per membership change (not per placement): the
        # current topology over the very array ``_pif`` (updated in place).
        self._fleet = VisionFleet(self._topology, self._pif)
        self._held: OrderedDict[str, _Held] = OrderedDict()
        self._settings = settings
        self._policy: VisionPolicy = make_policy(settings.policy)
        self._counts = metrics.VisionCounts()
        self._bind_metrics()
        metrics.set_source(self)

    # -- configuration -------------------------------------------------------------------

    def _bind_metrics(self) -> None:
        """Zero the counters of the policy in force (so that they are exported at once)."""
        name = self._policy.name
        c = self._counts
        for outcome in metrics.PLACE_OUTCOMES:
            c.placements.setdefault((name, outcome), 0)
        c.images.setdefault(name, 0)
        c.patches.setdefault(name, 0)
        c.releases.setdefault("released", 0)
        c.releases.setdefault("not_found", 0)
        self._k_placed = (name, "placed")
        self._k_invalid = (name, "invalid_argument")
        self._k_dup = (name, "already_exists")
        self._k_exhausted = (name, "resource_exhausted")

    @property
    def counts(self) -> metrics.VisionCounts:
        """Per-call counters (exported at scrape time)."""
        return self._counts

    @property
    def settings(self) -> VisionSettings:
        return self._settings

    @property
    def policy_name(self) -> str:
        """Registry name of the policy in force."""
        return self._policy.name

    def reconfigure(self, settings: VisionSettings) -> None:
        """Apply new settings (SIGHUP): policy, defaults and bounds apply to new calls;
        placements already held keep their deadline."""
        if settings.policy != self._policy.name:
            self._policy = make_policy(settings.policy)
            self._bind_metrics()
        self._settings = settings
        log.info("vision_reconfigured", policy=settings.policy, lease_ms=settings.lease_ms)

    # -- fleet listener ------------------------------------------------------------------

    def validate_load(self, member: Member, load: MemberLoad) -> None:
        """Refuse a report with an absurd per-GPU figure (changes nothing)."""
        if not isinstance(load, VisionMachineLoad):
            raise InvalidArgument("load", "must be vision_machine for a VE machine")
        for i, value in enumerate(load.patches_in_flight):
            if not 0 <= value <= MAX_REPORTED_PATCHES:
                raise InvalidArgument(
                    f"vision_machine.patches_in_flight[{i}]",
                    f"must be in [0, {MAX_REPORTED_PATCHES}]",
                )

    def on_join(self, member: Member, now_ns: int) -> None:
        shape = member.shape
        assert isinstance(shape, VisionMachineShape)
        self._machines[member.member_id] = _Machine(
            member=member, gpus=shape.gpus, max_patches=shape.max_patches_in_flight
        )
        self._dirty = True
        log.info(
            "vision_machine_joined",
            machine_id=member.member_id,
            incarnation=member.incarnation,
            gpus=shape.gpus,
            max_patches_in_flight=shape.max_patches_in_flight,
        )

    def on_load(self, member: Member, load: MemberLoad, now_ns: int) -> None:
        machine = self._machines.get(member.member_id)
        if machine is None or not isinstance(load, VisionMachineLoad):
            return
        self._sync()
        s, e = machine.start, machine.start + machine.gpus
        machine.generation += 1
        self._base[s:e] = np.asarray(load.patches_in_flight, dtype=np.int64)
        self._pending[s:e] = 0
        self._pif[s:e] = self._base[s:e]

    def on_leave(self, member: Member, reason: str, now_ns: int) -> None:
        machine = self._machines.get(member.member_id)
        if machine is None or machine.member.incarnation != member.incarnation:
            return
        lost = 0
        for request_id in machine.requests:
            held = self._held.get(request_id)
            if held is None:
                continue
            keep = [im for im in held.images if im.machine_id != member.member_id]
            lost += len(held.images) - len(keep)
            if keep:
                held.images = keep
            else:
                del self._held[request_id]
        del self._machines[member.member_id]
        self._dirty = True
        if lost:
            metrics.LOST_IMAGES.labels(reason).inc(lost)
        log.info("vision_machine_left", machine_id=member.member_id, reason=reason, lost=lost)

    def _sync(self) -> None:
        """Rebuild the topology if membership changed since the last call (lazily, so that
        a burst of registrations costs one rebuild)."""
        if self._dirty:
            self._rebuild()

    def _rebuild(self) -> None:
        """New topology after a membership change; carry each machine's GPU figures.

        GPU slices of surviving machines are read at their old ``start``; machines that
        joined since (``start == -1``) begin at zero. O(G + M log M).
        """
        self._dirty = False
        order = sorted(self._machines)
        specs = []
        base_parts: list[npt.NDArray[np.int64]] = []
        pending_parts: list[npt.NDArray[np.int64]] = []
        start = 0
        for machine_id in order:
            machine = self._machines[machine_id]
            specs.append(
                MachineSpec(machine_id, tuple(range(machine.gpus)), max_patches=machine.max_patches)
            )
            old = machine.start
            if old >= 0:
                base_parts.append(self._base[old : old + machine.gpus])
                pending_parts.append(self._pending[old : old + machine.gpus])
            else:
                base_parts.append(np.zeros(machine.gpus, dtype=np.int64))
                pending_parts.append(np.zeros(machine.gpus, dtype=np.int64))
            machine.start = start
            start += machine.gpus
        self._topology = VisionTopology.build(specs)
        self._by_index = [self._machines[m] for m in order]
        empty = np.zeros(0, dtype=np.int64)
        self._base = np.concatenate(base_parts).astype(np.int64) if base_parts else empty
        self._pending = (
            np.concatenate(pending_parts).astype(np.int64) if pending_parts else empty.copy()
        )
        self._pif = self._base + self._pending
        self._fleet = VisionFleet(self._topology, self._pif)

    # -- placement -----------------------------------------------------------------------

    def _patch_counts(self, images: Sequence[ImageRequest]) -> list[int]:
        s = self._settings
        if not images:
            raise InvalidArgument("images", "must not be empty")
        if len(images) > s.max_images_per_request:
            raise InvalidArgument("images", f"must have at most {s.max_images_per_request} entries")
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

    def place(
        self, request_id: str, images: Sequence[ImageRequest], now_ns: int
    ) -> list[PlacedImage]:
        """Place every image of ``request_id`` in order (each sees the ones before it).

        Raises (nothing changes then):
            InvalidArgument: no images, too many, or a size breaks a rule (the field is
                named, e.g. ``images[1].width``).
            AlreadyExists: ``request_id`` already holds a placement.
            ResourceExhausted: the table is full, or no live GPU has room.
        """
        try:
            counts = self._patch_counts(images)
        except InvalidArgument:
            self._counts.placements[self._k_invalid] += 1
            raise
        held_table = self._held
        if held_table and next(iter(held_table.values())).deadline_ns <= now_ns:
            self.expire(now_ns)
        if request_id in held_table:
            self._counts.placements[self._k_dup] += 1
            raise AlreadyExists(f"request_id: {request_id!r} already holds a placement")
        if len(held_table) >= self._settings.max_placements:
            self._counts.placements[self._k_exhausted] += 1
            raise ResourceExhausted(
                f"vision: {self._settings.max_placements} placements held (vision.max_placements)",
                retry_after_ms=100,
            )
        policy, rng = self._policy, self._rng
        while True:
            # The pure fold of core.vision.place_many, done in place on our own array:
            # each image sees the ones before it; undone if any image fails.
            if self._dirty:
                self._rebuild()
            fleet = self._fleet  # VisionFleet(self._topology, self._pif), kept by _rebuild
            topology, pif = fleet.topology, fleet.patches_in_flight
            placed: list[Placement] = []
            try:
                for n in counts:
                    decision = policy.select(fleet, n, rng)
                    g = decision.gpu
                    pif[g] = pif.item(g) + n  # scalar Python arithmetic: no numpy scalars
                    placed.append(decision)
            except NoEligibleGpuError as err:
                for decision in placed:
                    pif[decision.gpu] -= decision.patches
                self._counts.placements[self._k_exhausted] += 1
                raise ResourceExhausted(f"vision: {err.reason}", retry_after_ms=100) from None
            if self._liveness is None or self._all_live(placed, topology, now_ns):
                break
            # A chosen machine had lapsed: the fleet took it out (on_leave rebuilt the
            # arrays); undo on the old array in case it is still ours, and choose again.
            for decision in placed:
                pif[decision.gpu] -= decision.patches
        machines = self._by_index
        pending = self._pending
        out: list[PlacedImage] = []
        for decision in placed:
            machine = machines[decision.machine]
            g = decision.gpu
            pending[g] = pending.item(g) + decision.patches
            member = machine.member
            out.append(
                PlacedImage(
                    member.member_id,
                    decision.gpu - machine.start,
                    decision.patches,
                    member.incarnation,
                    machine.generation,
                )
            )
            requests = machine.requests
            requests[request_id] = requests.get(request_id, 0) + 1
        held_table[request_id] = _Held(out, now_ns + self._settings.lease_ms * 1_000_000)
        c = self._counts
        c.placements[self._k_placed] += 1
        name = self._k_placed[0]
        c.images[name] += len(out)
        c.patches[name] += sum(counts)
        return out

    def _all_live(
        self, placed: Sequence[Placement], topology: VisionTopology, now_ns: int
    ) -> bool:
        assert self._liveness is not None
        if len(placed) == 1:  # the common case: one image, one machine, no set needed
            machine = self._machines.get(topology.machine_ids[placed[0].machine])
            if machine is not None:
                member = machine.member
                if self._liveness(member.member_id, member.incarnation, now_ns):
                    return True
        seen: set[int] = set()
        for p in placed:
            m = p.machine
            if m in seen:
                continue
            seen.add(m)
            machine = self._machines.get(topology.machine_ids[m])
            if machine is None:
                return False
            member = machine.member
            if not self._liveness(member.member_id, member.incarnation, now_ns):
                # The fleet normally reports the lapse through on_leave; make sure the
                # machine is gone so that the next round cannot pick it again.
                current = self._machines.get(member.member_id)
                if current is not None and current.member.incarnation == member.incarnation:
                    self.on_leave(member, "lapsed", now_ns)
                return False
        return True

    def release(self, request_id: str, now_ns: int) -> tuple[int, int]:
        """Free every image of ``request_id``; returns (images, patches) freed.

        Raises:
            NotFound: nothing is held under ``request_id`` (released, expired, lost with
                its machine, or never placed).
        """
        held = self._held.pop(request_id, None)
        if held is None:
            self._counts.releases["not_found"] += 1
            raise NotFound(
                f"request_id: {request_id!r} holds no placement "
                "(released, expired, lost with its machine, or never placed)"
            )
        self._sync()
        patches = self._free(request_id, held)
        self._counts.releases["released"] += 1
        return len(held.images), patches

    def _free(self, request_id: str, held: _Held) -> int:
        total = 0
        for im in held.images:
            machine = self._machines.get(im.machine_id)
            if machine is None or machine.member.incarnation != im.incarnation:
                continue
            g = machine.start + im.gpu_index
            p = im.patches
            if im.generation == machine.generation:
                self._pending[g] -= p
                self._pif[g] -= p
            else:
                dec = min(p, int(self._base[g]))
                self._base[g] -= dec
                self._pif[g] -= dec
            total += p
            left = machine.requests.get(request_id, 0) - 1
            if left > 0:
                machine.requests[request_id] = left
            else:
                machine.requests.pop(request_id, None)
        return total

    def expire(self, now_ns: int) -> int:
        """Free the placements whose lease ran out by ``now_ns``; returns how many.

        Deadlines grow with placement order (one lease for all), so only the oldest
        entries are looked at: O(expired). After a reload that shortens the lease,
        older entries expire at their own (later) deadline.
        """
        held = self._held
        n = images = 0
        if held:
            self._sync()
        while held:
            request_id, entry = next(iter(held.items()))
            if entry.deadline_ns > now_ns:
                break
            del held[request_id]
            self._free(request_id, entry)
            n += 1
            images += len(entry.images)
        if n:
            metrics.EXPIRATIONS.inc(n)
            metrics.EXPIRED_IMAGES.inc(images)
            log.info("vision_placements_expired", requests=n, images=images)
        return n

    # -- views ---------------------------------------------------------------------------

    @property
    def held(self) -> int:
        """Placed requests held."""
        return len(self._held)

    def machine_ids(self) -> list[str]:
        """Machines in placement order (sorted ids)."""
        self._sync()
        return list(self._topology.machine_ids)

    def machine_load(self, machine_id: str) -> tuple[list[int], int, int]:
        """(patches in flight per GPU, per-GPU max patches (0 = unlimited), images held).

        Raises:
            NotFound: ``machine_id`` is not a live VE machine.
        """
        machine = self._machines.get(machine_id)
        if machine is None:
            raise NotFound(f"machine_id: {machine_id!r} is not a registered VE machine")
        self._sync()
        s = machine.start
        images = sum(machine.requests.values())
        return (
            [int(x) for x in self._pif[s : s + machine.gpus]],
            machine.max_patches,
            images,
        )

    def fleet(self) -> VisionFleet:
        """A copy of the current fleet view (for tests and diagnostics)."""
        self._sync()
        return VisionFleet(self._topology, self._pif.copy())

    def gpu_loads(self) -> Iterator[tuple[str, int, int]]:
        """``(machine_id, gpu_index, patches_in_flight)`` of every GPU."""
        self._sync()
        pif = self._pif.tolist()
        for machine_id in self._topology.machine_ids:
            machine = self._machines[machine_id]
            for i in range(machine.gpus):
                yield machine_id, i, pif[machine.start + i]

    def imbalance(self) -> float:
        """Max over mean of patches in flight across GPUs (1.0 = perfect or idle)."""
        self._sync()
        return imbalance(VisionFleet(self._topology, self._pif))
