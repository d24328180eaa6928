"""Shape of an expert-parallel (EP) group and the expert-to-GPU placement map.

Rule (SPEC.md section 6): beside its share of the logical (routed) experts, every GPU of an
EP group holds ``redundant_per_gpu`` redundant slots; the total number of physical slots
``n_logical + ep_size * redundant_per_gpu`` is rounded UP to a multiple of ``ep_size`` so
every GPU holds the same number of slots. Role defaults: prefill 4 redundant slots per GPU,
window N = 100 steps, period M = 1,000 steps; decode 1 redundant slot per GPU, N = 1,000,
M = 10,000.

Our reading of the published configurations (documented because they do not all follow
from one default): decode EP64 "384+64" = 384 + 64 x 1 = 448 physical, 7 per GPU (the
default); EP8 "384+32" = 384 + 8 x 4 (the prefill default); prefill EP4 "384+32" is
384 + 4 x 8, i.e. it was deployed with 8 redundant slots per GPU. With the prefill default
of 4 per GPU an EP4 group gets 384 + 16 = 400 physical slots, 100 per GPU; register with
``redundant_per_gpu=8`` to reproduce the published EP4 "384+32" (416, 104 per GPU).

Physical slot ``s`` lives on GPU ``s // slots_per_gpu`` (GPU-major numbering). GPUs are
grouped into nodes of ``gpus_per_node`` (a group smaller than a node is one node).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Literal

import numpy as np
import numpy.typing as npt

__all__ = [
    "ROLE_DEFAULTS",
    "GroupLayout",
    "PlacementMap",
    "Role",
    "RoleDefaults",
    "identity_map",
    "make_layout",
]

Role = Literal["prefill", "decode"]

I64 = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class RoleDefaults:
    """Per-role defaults: redundant slots per GPU, window N (steps), period M (steps)."""

    redundant_per_gpu: int
    window_steps: int
    period_steps: int


ROLE_DEFAULTS: Final = MappingProxyType(
    {
        "prefill": RoleDefaults(redundant_per_gpu=4, window_steps=100, period_steps=1_000),
        "decode": RoleDefaults(redundant_per_gpu=1, window_steps=1_000, period_steps=10_000),
    }
)


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """Shape of one EP group.

    Attributes:
        role: "prefill" or "decode".
        ep_size: GPUs in the group (= DP ranks).
        gpus_per_node: GPUs per server node (NVLink domain).
        n_layers: MoE layers.
        n_logical: routed (logical) experts per layer; the shared expert is not counted.
        n_groups: expert groups for node-limited routing (1 = no grouping).
        redundant_per_gpu: redundant slots per GPU requested (before rounding).
        expert_bytes: bytes of one expert's weights (one layer, one replica).
        window_steps: N, steps of load statistics kept.
        period_steps: M, reported steps between two recomputations.
    """

    role: Role
    ep_size: int
    gpus_per_node: int
    n_layers: int
    n_logical: int
    n_groups: int
    redundant_per_gpu: int
    expert_bytes: int
    window_steps: int
    period_steps: int

    def __post_init__(self) -> None:
        if self.role not in ROLE_DEFAULTS:
            raise ValueError(f"role: must be 'prefill' or 'decode', got {self.role!r}")
        for field, value in (
            ("ep_size", self.ep_size),
            ("gpus_per_node", self.gpus_per_node),
            ("n_layers", self.n_layers),
            ("n_logical", self.n_logical),
            ("n_groups", self.n_groups),
            ("window_steps", self.window_steps),
            ("period_steps", self.period_steps),
        ):
            if value <= 0:
                raise ValueError(f"{field}: must be > 0, got {value}")
        if self.redundant_per_gpu < 0:
            raise ValueError(f"redundant_per_gpu: must be >= 0, got {self.redundant_per_gpu}")
        if self.expert_bytes < 0:
            raise ValueError(f"expert_bytes: must be >= 0, got {self.expert_bytes}")
        if self.ep_size > self.gpus_per_node and self.ep_size % self.gpus_per_node != 0:
            raise ValueError(
                f"ep_size: must be <= gpus_per_node or a multiple of it "
                f"({self.ep_size} vs {self.gpus_per_node})"
            )
        if self.n_logical % self.n_groups != 0:
            raise ValueError(
                f"n_groups: must divide n_logical ({self.n_groups} vs {self.n_logical})"
            )
        if self.n_physical > self.n_logical * self.ep_size:
            raise ValueError(
                f"redundant_per_gpu: {self.n_physical} slots cannot hold {self.n_logical} "
                f"experts on {self.ep_size} GPUs without two replicas of one expert on a GPU"
            )

    @property
    def n_physical(self) -> int:
        """Physical slots per layer: logical + redundant, rounded up to a multiple of ep_size."""
        raw = self.n_logical + self.ep_size * self.redundant_per_gpu
        return -(-raw // self.ep_size) * self.ep_size

    @property
    def n_redundant(self) -> int:
        """Redundant slots per layer after rounding (``n_physical - n_logical``)."""
        return self.n_physical - self.n_logical

    @property
    def slots_per_gpu(self) -> int:
        """Physical slots on each GPU."""
        return self.n_physical // self.ep_size

    @property
    def n_nodes(self) -> int:
        """Nodes spanned by the group (1 when the group fits in one node)."""
        return max(1, self.ep_size // self.gpus_per_node)

    @property
    def hierarchical(self) -> bool:
        """Whether the published hierarchical policy applies (groups divide over nodes)."""
        return (
            self.n_groups % self.n_nodes == 0
            and self.n_logical % self.n_nodes == 0
            and self.n_physical % self.n_nodes == 0
        )

    @property
    def node_limited(self) -> bool:
        """Whether every expert group must keep all its replicas on one node.

        True when the group spans several nodes, the hierarchical policy applies (expert
        groups, experts and slots divide evenly over nodes) and a node's experts can fill
        a GPU without two replicas of one expert (``n_logical / n_nodes >=
        slots_per_gpu``). Node ``k`` then hosts ``n_groups / n_nodes`` whole expert groups
        and only their experts, on its ``n_physical / n_nodes`` slots.
        """
        return (
            self.n_nodes > 1
            and self.hierarchical
            and self.n_logical // self.n_nodes >= self.slots_per_gpu
        )

    @property
    def group_size(self) -> int:
        """Logical experts per expert group (expert ``e`` is in group ``e // group_size``)."""
        return self.n_logical // self.n_groups

    @property
    def map_bytes(self) -> int:
        """Bytes of all expert weights held by the group (every slot of every layer)."""
        return self.n_layers * self.n_physical * self.expert_bytes


def make_layout(
    role: Role,
    ep_size: int,
    n_layers: int,
    n_logical: int,
    *,
    gpus_per_node: int = 8,
    n_groups: int = 1,
    expert_bytes: int = 0,
    redundant_per_gpu: int | None = None,
    window_steps: int | None = None,
    period_steps: int | None = None,
) -> GroupLayout:
    """A layout with the role defaults filled in for every ``None`` argument.

    Raises:
        ValueError: an argument breaks a rule (the message names the field).
    """
    if role not in ROLE_DEFAULTS:
        raise ValueError(f"role: must be 'prefill' or 'decode', got {role!r}")
    d = ROLE_DEFAULTS[role]
    return GroupLayout(
        role=role,
        ep_size=ep_size,
        gpus_per_node=gpus_per_node,
        n_layers=n_layers,
        n_logical=n_logical,
        n_groups=n_groups,
        redundant_per_gpu=d.redundant_per_gpu if redundant_per_gpu is None else redundant_per_gpu,
        expert_bytes=expert_bytes,
        window_steps=d.window_steps if window_steps is None else window_steps,
        period_steps=d.period_steps if period_steps is None else period_steps,
    )


@dataclass(frozen=True, slots=True)
class PlacementMap:
    """Expert-to-GPU map of one EP group, all layers.

    Attributes:
        phy2log: shape (n_layers, n_physical) int64, logical expert held by each physical
            slot; slot ``s`` is on GPU ``s // slots_per_gpu``.
        log2phy: shape (n_layers, n_logical, max_replicas) int64, the slots of each logical
            expert in ascending slot order, padded with -1.
        replica_counts: shape (n_layers, n_logical) int64, slots holding each logical expert.
        ep_size: GPUs in the group.
    """

    phy2log: I64
    log2phy: I64
    replica_counts: I64
    ep_size: int

    @classmethod
    def from_phy2log(cls, phy2log: npt.ArrayLike, ep_size: int, n_logical: int) -> PlacementMap:
        """Build the map (and its inverse views) from ``phy2log`` (n_layers, n_physical).

        Raises:
            ValueError: wrong rank, slots not divisible over GPUs, or expert ids out of range.
        """
        p2l = np.array(phy2log, dtype=np.int64, copy=True)
        if p2l.ndim != 2:
            raise ValueError(f"phy2log: must be 2-D (layers, slots), got shape {p2l.shape}")
        n_layers, n_phys = p2l.shape
        if ep_size <= 0 or n_phys % ep_size != 0:
            raise ValueError(f"phy2log: {n_phys} slots do not divide over {ep_size} GPUs")
        if p2l.size and (p2l.min() < 0 or p2l.max() >= n_logical):
            raise ValueError(f"phy2log: expert ids must lie in [0, {n_logical})")
        keys = (np.arange(n_layers)[:, None] * n_logical + p2l).ravel()
        counts = (
            np.bincount(keys, minlength=n_layers * n_logical)
            .reshape(n_layers, n_logical)
            .astype(np.int64, copy=False)
        )
        width = int(counts.max()) if counts.size else 0
        log2phy = np.full((n_layers, n_logical, max(width, 1)), -1, dtype=np.int64)
        if p2l.size:
            order = np.argsort(p2l, axis=1, kind="stable")  # slots grouped by expert, ascending
            sorted_exp = np.take_along_axis(p2l, order, axis=1)
            starts = np.cumsum(counts, axis=1) - counts  # first position of each expert
            rank = np.arange(n_phys)[None, :] - np.take_along_axis(starts, sorted_exp, axis=1)
            log2phy[np.arange(n_layers)[:, None], sorted_exp, rank] = order
        p2l.setflags(write=False)
        log2phy.setflags(write=False)
        counts.setflags(write=False)
        return cls(phy2log=p2l, log2phy=log2phy, replica_counts=counts, ep_size=ep_size)

    @property
    def n_layers(self) -> int:
        """MoE layers."""
        return int(self.phy2log.shape[0])

    @property
    def n_physical(self) -> int:
        """Physical slots per layer."""
        return int(self.phy2log.shape[1])

    @property
    def n_logical(self) -> int:
        """Logical experts per layer."""
        return int(self.replica_counts.shape[1])

    @property
    def slots_per_gpu(self) -> int:
        """Physical slots per GPU."""
        return self.n_physical // self.ep_size

    @property
    def gpu_slots(self) -> I64:
        """Shape (n_layers, ep_size, slots_per_gpu): logical expert in each slot of each GPU."""
        return self.phy2log.reshape(self.n_layers, self.ep_size, self.slots_per_gpu)

    def same_as(self, other: PlacementMap) -> bool:
        """Whether both maps place the same experts in the same slots."""
        return self.ep_size == other.ep_size and bool(np.array_equal(self.phy2log, other.phy2log))

    def colocated(self) -> int:
        """Number of (layer, GPU, expert) triples holding more than one replica."""
        g = np.sort(self.gpu_slots, axis=-1)
        return int(np.count_nonzero(g[..., 1:] == g[..., :-1]))


def identity_map(layout: GroupLayout) -> PlacementMap:
    """The start-up map before any statistics: slot ``s`` holds expert ``s % n_logical``.

    Redundant slots wrap around to experts 0, 1, ...; two slots of one GPU are at most
    ``slots_per_gpu - 1 < n_logical`` apart, so no GPU holds two replicas of one expert.
    When the layout is ``node_limited`` the same rule applies per node: slot ``j`` of node
    ``k`` (of ``n_physical / n_nodes``) holds expert ``k * m + j % m`` with
    ``m = n_logical / n_nodes``, so node ``k`` hosts expert groups ``k * n_groups / n_nodes``
    onwards, whole.
    """
    if layout.node_limited:
        per_node = layout.n_logical // layout.n_nodes
        slot = np.arange(layout.n_physical, dtype=np.int64)
        node = slot // (layout.n_physical // layout.n_nodes)
        local = slot % (layout.n_physical // layout.n_nodes)
        base = node * per_node + local % per_node
    else:
        base = np.arange(layout.n_physical, dtype=np.int64) % layout.n_logical
    return PlacementMap.from_phy2log(
        np.tile(base, (layout.n_layers, 1)), layout.ep_size, layout.n_logical
    )
