"""Fleet view of the vision-encoder (VE) machines and their GPUs.

A VE machine runs one vision encoder per GPU. The view has two parts:

* :class:`VisionTopology` (changes rarely: registration, lapse, capacity) holds the
  machines, their GPUs laid out contiguously (CSR offsets), each GPU's capacity in
  patches and a live mask, plus caches that make a decision cheap.
* :class:`VisionFleet` pairs a topology with ``patches_in_flight`` (shape ``(G,)``,
  int64, patches), the only thing that changes per placement.

GPU indices are global positions ``0..G-1`` in the topology; the GPUs of machine ``m``
are ``machine_start[m]:machine_start[m+1]``. Capacity is a per-GPU maximum of patches in
flight, ``0`` meaning unlimited; a GPU is *eligible* for an image of ``p`` patches when
it is live and ``patches_in_flight + p <= capacity`` (or the capacity is unlimited).
Capacity is a filter applied before any policy scores.

Everything here is pure: :func:`commit` and :func:`release` return a new fleet and
never touch their argument. The one exception is :class:`SlotTopology`, the topology the
daemon's table owns and updates in place (O(one machine's GPUs) per join or leave):
machines occupy slot ranges with free slots in between, GPU indices are slot positions.
Policies read any :class:`Topology` (both kinds) and never mutate it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

__all__ = [
    "NO_LIMIT",
    "MachineSpec",
    "NoCapacity",
    "Placement",
    "SlotTopology",
    "Topology",
    "VisionFleet",
    "VisionTopology",
    "commit",
    "imbalance",
    "release",
]

I64 = npt.NDArray[np.int64]
BoolArr = npt.NDArray[np.bool_]

NO_LIMIT = np.int64(1 << 62)
"""Effective limit (patches) of a live GPU with unlimited capacity."""

_DEAD_LIMIT = np.int64(-1)
"""Effective limit of a GPU that is not live: no image (>= 1 patch) ever fits."""


@dataclass(frozen=True, slots=True)
class NoCapacity:
    """No GPU can take the image: no live machine, or no live GPU with room. Returned
    (not raised) by the policies and :func:`~fulcrum.core.vision.base.place_many`, as the
    decode core returns its own ``NoCapacity``; the daemon's placement table turns it
    into RESOURCE_EXHAUSTED.

    Attributes:
        reason: human-readable reason, suitable for a RESOURCE_EXHAUSTED status.
    """

    reason: str


class Topology(Protocol):
    """What a policy reads of a topology (:class:`VisionTopology` or
    :class:`SlotTopology`). Machine ``m``'s GPUs are ``starts[m]:ends[m]``; a GPU index
    outside every live machine has ``limit == -1`` (never eligible)."""

    @property
    def machine_ids(self) -> Sequence[str]: ...
    @property
    def starts(self) -> Sequence[int]: ...
    @property
    def ends(self) -> Sequence[int]: ...
    @property
    def live_machine_list(self) -> Sequence[int]: ...
    @property
    def all_live_list(self) -> Sequence[bool]: ...
    @property
    def live_gpus_list(self) -> Sequence[int]: ...
    @property
    def unlimited(self) -> bool: ...
    @property
    def all_live(self) -> bool: ...
    @property
    def limit(self) -> I64: ...
    @property
    def live(self) -> BoolArr: ...
    @property
    def gpu_machine(self) -> I64: ...
    @property
    def n_machines(self) -> int: ...
    @property
    def n_gpus(self) -> int: ...


@dataclass(frozen=True, slots=True)
class MachineSpec:
    """One VE machine as registered.

    Attributes:
        machine_id: unique, non-empty machine name.
        gpus: GPU ordinals on the machine (unique, >= 0); one encoder per GPU.
        max_patches: per-GPU maximum patches in flight; ``0`` = unlimited.
        live: whether the machine takes placements.
    """

    machine_id: str
    gpus: tuple[int, ...]
    max_patches: int = 0
    live: bool = True


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one image goes.

    Attributes:
        machine: machine index in the topology (``0..M-1``).
        gpu: global GPU index in the topology (``0..G-1``).
        patches: patch count of the image (>= 1).
    """

    machine: int
    gpu: int
    patches: int


@dataclass(frozen=True, slots=True)
class VisionTopology:
    """Machines, GPUs, capacities and liveness. Build it with :meth:`build`.

    Attributes:
        machine_ids: machine names, shape ``(M,)``.
        machine_start: CSR offsets, shape ``(M+1,)``; GPUs of machine ``m`` are
            ``machine_start[m]:machine_start[m+1]``.
        gpu_ordinal: GPU ordinal on its machine, shape ``(G,)``.
        gpu_machine: machine index of every GPU, shape ``(G,)``.
        capacity: per-GPU max patches in flight, ``0`` = unlimited, shape ``(G,)``.
        live: per-GPU live mask, shape ``(G,)``.
        limit: effective limit, patches, shape ``(G,)``: ``capacity`` if limited,
            :data:`NO_LIMIT` if unlimited, ``-1`` if not live.
        live_machines: indices of machines with at least one live GPU, ascending.
        machine_all_live: per machine, all of its GPUs are live, shape ``(M,)``.
        machine_live_gpus: per machine, number of live GPUs, shape ``(M,)``.
        unlimited: no live GPU has a capacity (fast path: only liveness filters).
        all_live: every GPU is live.
        starts, live_machine_list, all_live_list, live_gpus_list: the same figures as
            Python tuples, for O(1) scalar access on the decision path.
    """

    machine_ids: tuple[str, ...]
    machine_start: I64
    gpu_ordinal: I64
    gpu_machine: I64
    capacity: I64
    live: BoolArr
    limit: I64 = field(init=False)
    live_machines: I64 = field(init=False)
    machine_all_live: BoolArr = field(init=False)
    machine_live_gpus: I64 = field(init=False)
    unlimited: bool = field(init=False)
    all_live: bool = field(init=False)
    starts: tuple[int, ...] = field(init=False, repr=False)
    ends: tuple[int, ...] = field(init=False, repr=False)
    live_machine_list: tuple[int, ...] = field(init=False, repr=False)
    all_live_list: tuple[bool, ...] = field(init=False, repr=False)
    live_gpus_list: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name, dtype in (
            ("machine_start", np.int64),
            ("gpu_ordinal", np.int64),
            ("gpu_machine", np.int64),
            ("capacity", np.int64),
            ("live", np.bool_),
        ):
            own = np.array(getattr(self, name), dtype=dtype, copy=True)
            own.flags.writeable = False
            object.__setattr__(self, name, own)
        m = len(self.machine_ids)
        g = int(self.gpu_ordinal.shape[0])
        if self.machine_start.shape != (m + 1,):
            raise ValueError("machine_start: must have shape (M+1,)")
        sizes = np.diff(self.machine_start)
        if int(self.machine_start[0]) != 0 or int(self.machine_start[-1]) != g:
            raise ValueError("machine_start: must run from 0 to G")
        if np.any(sizes < 1):
            raise ValueError("machine_start: every machine needs at least one GPU")
        for name in ("gpu_machine", "capacity", "live"):
            if getattr(self, name).shape != (g,):
                raise ValueError(f"{name}: must have shape (G,) = ({g},)")
        limit = np.where(self.capacity > 0, self.capacity, NO_LIMIT).astype(np.int64)
        limit[~self.live] = _DEAD_LIMIT
        if m > 0:
            live_gpus = np.add.reduceat(self.live.astype(np.int64), self.machine_start[:-1])
        else:
            live_gpus = np.zeros(0, dtype=np.int64)
        live_gpus = live_gpus.astype(np.int64)
        all_live_m = live_gpus == sizes
        live_m = np.flatnonzero(live_gpus > 0).astype(np.int64)
        for arr in (limit, live_gpus, all_live_m, live_m):
            arr.flags.writeable = False
        object.__setattr__(self, "limit", limit)
        object.__setattr__(self, "live_machines", live_m)
        object.__setattr__(self, "machine_all_live", all_live_m)
        object.__setattr__(self, "machine_live_gpus", live_gpus)
        object.__setattr__(self, "unlimited", not bool(np.any(self.capacity[self.live] > 0)))
        object.__setattr__(self, "all_live", bool(np.all(self.live)))
        object.__setattr__(self, "starts", tuple(int(x) for x in self.machine_start))
        object.__setattr__(self, "ends", self.starts[1:])
        object.__setattr__(self, "live_machine_list", tuple(int(x) for x in live_m))
        object.__setattr__(self, "all_live_list", tuple(bool(x) for x in all_live_m))
        object.__setattr__(self, "live_gpus_list", tuple(int(x) for x in live_gpus))

    @staticmethod
    def build(machines: Sequence[MachineSpec]) -> VisionTopology:
        """Topology of ``machines`` in the given order (machine index = position).

        Raises:
            ValueError: an empty or duplicate machine id, a machine without GPUs, a
                negative or duplicate GPU ordinal, a negative ``max_patches``; the
                message names the field (``"machines[2].gpus: must not be empty"``).
        """
        seen: set[str] = set()
        starts = [0]
        ordinals: list[int] = []
        caps: list[int] = []
        lives: list[bool] = []
        for i, spec in enumerate(machines):
            where = f"machines[{i}]"
            if not spec.machine_id:
                raise ValueError(f"{where}.machine_id: must not be empty")
            if spec.machine_id in seen:
                raise ValueError(f"{where}.machine_id: duplicate {spec.machine_id!r}")
            seen.add(spec.machine_id)
            if not spec.gpus:
                raise ValueError(f"{where}.gpus: must not be empty")
            if len(set(spec.gpus)) != len(spec.gpus):
                raise ValueError(f"{where}.gpus: ordinals must be unique")
            if any(o < 0 for o in spec.gpus):
                raise ValueError(f"{where}.gpus: ordinals must be >= 0")
            if spec.max_patches < 0:
                raise ValueError(f"{where}.max_patches: must be >= 0")
            ordinals.extend(spec.gpus)
            caps.extend([spec.max_patches] * len(spec.gpus))
            lives.extend([spec.live] * len(spec.gpus))
            starts.append(len(ordinals))
        machine_start = np.asarray(starts, dtype=np.int64)
        sizes = np.diff(machine_start)
        return VisionTopology(
            machine_ids=tuple(s.machine_id for s in machines),
            machine_start=machine_start,
            gpu_ordinal=np.asarray(ordinals, dtype=np.int64),
            gpu_machine=np.repeat(np.arange(len(machines), dtype=np.int64), sizes),
            capacity=np.asarray(caps, dtype=np.int64),
            live=np.asarray(lives, dtype=np.bool_),
        )

    @property
    def n_machines(self) -> int:
        """Number of machines ``M``."""
        return len(self.machine_ids)

    @property
    def n_gpus(self) -> int:
        """Number of GPUs ``G``."""
        return int(self.gpu_ordinal.shape[0])

    def machine_index(self, machine_id: str) -> int:
        """Index of ``machine_id``; ``KeyError`` if unknown. O(M)."""
        try:
            return self.machine_ids.index(machine_id)
        except ValueError:
            raise KeyError(machine_id) from None

    def gpus_of(self, machine: int) -> range:
        """Global GPU indices of machine index ``machine``."""
        return range(int(self.machine_start[machine]), int(self.machine_start[machine + 1]))

    def with_live(self, machine: int, live: bool) -> VisionTopology:
        """A copy with every GPU of machine index ``machine`` marked live or not."""
        mask = self.live.copy()
        mask[self.machine_start[machine] : self.machine_start[machine + 1]] = live
        return VisionTopology(
            machine_ids=self.machine_ids,
            machine_start=self.machine_start,
            gpu_ordinal=self.gpu_ordinal,
            gpu_machine=self.gpu_machine,
            capacity=self.capacity,
            live=mask,
        )


class SlotTopology:
    """A topology updated in place by its single owner (the daemon's VE table).

    Machine ``m`` (an index reused after the machine leaves) occupies slots
    ``starts[m]:ends[m]`` of per-GPU arrays of ``n_gpus`` slots (the capacity); free
    slots are not live, have ``limit == -1`` and ``gpu_machine == -1``. The owner lays
    out slots (e.g. with a slot allocator); :meth:`add_machine` and
    :meth:`remove_machine` cost O(the machine's GPUs) plus O(M) list moves of machine
    indices; :meth:`resize` (growth, compaction) O(capacity). Policies must not run while
    the owner updates it.
    """

    __slots__ = (
        "_free_machines",
        "_limited",
        "_live_slots",
        "all_live_list",
        "capacity",
        "ends",
        "gpu_machine",
        "limit",
        "live",
        "live_gpus_list",
        "live_machine_list",
        "machine_ids",
        "starts",
    )

    def __init__(self, capacity: int) -> None:
        self.limit: I64 = np.full(capacity, _DEAD_LIMIT, dtype=np.int64)
        self.live: BoolArr = np.zeros(capacity, dtype=np.bool_)
        self.capacity: I64 = np.zeros(capacity, dtype=np.int64)
        self.gpu_machine: I64 = np.full(capacity, -1, dtype=np.int64)
        self.machine_ids: list[str] = []
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.all_live_list: list[bool] = []
        self.live_gpus_list: list[int] = []
        self.live_machine_list: list[int] = []
        self._free_machines: list[int] = []
        self._limited = 0  # live machines with a per-GPU capacity
        self._live_slots = 0

    @property
    def n_machines(self) -> int:
        """Machine indices in use or free (``machine_ids[m] == ""`` when free)."""
        return len(self.machine_ids)

    @property
    def n_gpus(self) -> int:
        """Slots (GPU indices), live or free."""
        return int(self.limit.shape[0])

    @property
    def unlimited(self) -> bool:
        return self._limited == 0

    @property
    def all_live(self) -> bool:
        return self._live_slots == self.n_gpus

    def add_machine(self, machine_id: str, start: int, gpus: int, max_patches: int) -> int:
        """Put a live machine on the free slots ``start:start+gpus``; returns its index."""
        end = start + gpus
        if not machine_id or gpus < 1 or max_patches < 0 or not 0 <= start <= end <= self.n_gpus:
            raise ValueError(f"machine {machine_id!r}: bad range [{start}, {end}) or capacity")
        if bool(self.live[start:end].any()):
            raise ValueError(f"range [{start}, {end}): holds live GPUs")
        if self._free_machines:
            m = self._free_machines.pop()
            self.machine_ids[m] = machine_id
            self.starts[m], self.ends[m] = start, end
            self.all_live_list[m] = True
            self.live_gpus_list[m] = gpus
        else:
            m = len(self.machine_ids)
            self.machine_ids.append(machine_id)
            self.starts.append(start)
            self.ends.append(end)
            self.all_live_list.append(True)
            self.live_gpus_list.append(gpus)
        bisect.insort(self.live_machine_list, m)
        self.capacity[start:end] = max_patches
        self.limit[start:end] = max_patches if max_patches > 0 else NO_LIMIT
        self.live[start:end] = True
        self.gpu_machine[start:end] = m
        self._live_slots += gpus
        if max_patches > 0:
            self._limited += 1
        return m

    def remove_machine(self, m: int) -> None:
        """Take machine index ``m`` out; its slots become free."""
        start, end = self.starts[m], self.ends[m]
        if bool(self.capacity[start]):
            self._limited -= 1
        self._live_slots -= end - start
        self.capacity[start:end] = 0
        self.limit[start:end] = _DEAD_LIMIT
        self.live[start:end] = False
        self.gpu_machine[start:end] = -1
        i = bisect.bisect_left(self.live_machine_list, m)
        del self.live_machine_list[i]
        self.machine_ids[m] = ""
        self.starts[m] = self.ends[m] = 0
        self.all_live_list[m] = False
        self.live_gpus_list[m] = 0
        self._free_machines.append(m)

    def resize(self, capacity: int, index: I64 | None = None) -> None:
        """New arrays of ``capacity`` slots: slot ``i`` takes old slot ``index[i]`` for
        ``i < len(index)`` (default: identity), the rest free. The owner moves the
        machines' ``starts``/``ends`` itself (:meth:`move_machine`)."""
        if index is None:
            index = np.arange(self.n_gpus, dtype=np.int64)
        n = int(index.shape[0])

        def take(arr: npt.NDArray[np.generic], fill: object) -> npt.NDArray[np.generic]:
            out = np.full(capacity, fill, dtype=arr.dtype)
            out[:n] = arr[index]
            return out

        self.limit = take(self.limit, _DEAD_LIMIT)  # type: ignore[assignment]
        self.live = take(self.live, False)  # type: ignore[assignment]
        self.capacity = take(self.capacity, 0)  # type: ignore[assignment]
        self.gpu_machine = take(self.gpu_machine, -1)  # type: ignore[assignment]

    def move_machine(self, m: int, start: int) -> None:
        """Record that machine ``m`` now starts at slot ``start`` (after :meth:`resize`)."""
        gpus = self.ends[m] - self.starts[m]
        self.starts[m], self.ends[m] = start, start + gpus


@dataclass(frozen=True, slots=True)
class VisionFleet:
    """A topology plus the patches in flight on each GPU.

    Attributes:
        topology: the machines and GPUs.
        patches_in_flight: patches placed and not yet released, per GPU, shape ``(G,)``,
            int64, >= 0. Treated as read-only by the core.
    """

    topology: Topology
    patches_in_flight: I64

    @staticmethod
    def empty(topology: Topology) -> VisionFleet:
        """The fleet with nothing in flight."""
        return VisionFleet(topology, np.zeros(topology.n_gpus, dtype=np.int64))

    def machine_load(self, machine: int) -> int:
        """Patches in flight over the live GPUs of machine index ``machine``."""
        t = self.topology
        s, e = t.starts[machine], t.ends[machine]
        load = self.patches_in_flight[s:e]
        if t.all_live_list[machine]:
            total: int = sum(load.tolist())  # faster than ndarray.sum for a few GPUs
            return total
        return int(load[t.live[s:e]].sum())


def commit(fleet: VisionFleet, placement: Placement) -> VisionFleet:
    """The fleet after ``placement``: its GPU carries ``placement.patches`` more.

    Raises:
        ValueError: the GPU index is out of range or the patch count is < 1.
    """
    if not 0 <= placement.gpu < fleet.topology.n_gpus:
        raise ValueError(f"gpu: index {placement.gpu} out of range")
    if placement.patches < 1:
        raise ValueError("patches: must be >= 1")
    pif = fleet.patches_in_flight.copy()
    pif[placement.gpu] += placement.patches
    return VisionFleet(fleet.topology, pif)


def release(fleet: VisionFleet, gpu: int, patches: int) -> VisionFleet:
    """The fleet after ``patches`` finish on global GPU index ``gpu``.

    Raises:
        ValueError: the GPU index is out of range, ``patches`` < 1, or more patches would
            be released than are in flight there.
    """
    if not 0 <= gpu < fleet.topology.n_gpus:
        raise ValueError(f"gpu: index {gpu} out of range")
    if patches < 1:
        raise ValueError("patches: must be >= 1")
    if int(fleet.patches_in_flight[gpu]) < patches:
        raise ValueError(
            f"patches: releasing {patches} but only {int(fleet.patches_in_flight[gpu])} "
            "in flight on that gpu"
        )
    pif = fleet.patches_in_flight.copy()
    pif[gpu] -= patches
    return VisionFleet(fleet.topology, pif)


def imbalance(fleet: VisionFleet) -> float:
    """Max over mean of patches in flight across live GPUs (1.0 = perfect).

    Returns 1.0 when no GPU is live or nothing is in flight.
    """
    t = fleet.topology
    load = fleet.patches_in_flight if t.all_live else fleet.patches_in_flight[t.live]
    if load.size == 0:
        return 1.0
    total = int(load.sum())
    if total == 0:
        return 1.0
    return float(int(load.max()) * load.size / total)
