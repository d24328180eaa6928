"""Shared pieces of the VE policies: the policy protocol, eligibility, the pure fold.

A policy is stateless: ``select(fleet, patches, rng)`` returns a :class:`Placement`, or a
:class:`NoCapacity` when no GPU can take the image (returned, not raised: the decode
core's convention too), and never mutates the fleet or anything else but the injected
random generator.
Ties are broken deterministically: the lowest index wins (lowest GPU index inside a
machine, lowest machine index between machines).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import numpy as np
import numpy.typing as npt

from fulcrum.core.vision.fleet import (
    NO_LIMIT,
    NoCapacity,
    Placement,
    VisionFleet,
    commit,
)

__all__ = [
    "Checked",
    "VisionPolicy",
    "best_gpu",
    "check_patches",
    "draw_machine",
    "draw_two_machines",
    "eligible_machines",
    "no_fit_reason",
    "place_many",
]


class VisionPolicy(Protocol):
    """Chooses a VE machine and GPU for one image."""

    @property
    def name(self) -> str:
        """The policy's registry name (also its metric label)."""
        ...

    def select(
        self, fleet: VisionFleet, patches: int, rng: np.random.Generator
    ) -> Placement | NoCapacity:
        """Where an image of ``patches`` patches goes (or why nowhere); pure apart from
        ``rng``.

        Raises:
            ValueError: ``patches`` < 1.
        """
        ...


#: What :meth:`Checked.choose` returns: ``(machine index, global GPU index)``, or why
#: no GPU can take the image.
Chosen = tuple[int, int] | NoCapacity


class Checked:
    """Base of a VE policy: ``select`` checks the patch count (:func:`check_patches`),
    asks :meth:`choose` for ``(machine, gpu)`` and returns the :class:`Placement`.
    A subclass names itself in its bases: ``class RandomMachine(Checked, name=NAME)``."""

    __slots__ = ()
    NAME: ClassVar[str] = ""

    def __init_subclass__(cls, name: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.NAME = name

    @property
    def name(self) -> str:
        return self.NAME

    def choose(self, fleet: VisionFleet, patches: int, rng: np.random.Generator) -> Chosen:
        """``(machine index, global GPU index)`` for an image of ``patches`` (>= 1)
        patches, or why nowhere."""
        raise NotImplementedError

    def select(
        self, fleet: VisionFleet, patches: int, rng: np.random.Generator
    ) -> Placement | NoCapacity:
        if type(patches) is not int or patches < 1:  # the fast path of check_patches
            check_patches(patches)
        chosen = self.choose(fleet, patches, rng)
        if isinstance(chosen, NoCapacity):
            return chosen
        return Placement(machine=chosen[0], gpu=chosen[1], patches=int(patches))


def check_patches(patches: int) -> None:
    """Raise ``ValueError`` unless ``patches`` is an int >= 1."""
    if type(patches) is int and patches >= 1:  # the decision path's case, one check
        return
    if isinstance(patches, bool) or not isinstance(patches, int | np.integer):
        raise ValueError("patches: must be an integer")
    if patches < 1:
        raise ValueError("patches: must be >= 1")


def no_fit_reason(fleet: VisionFleet, patches: int) -> str:
    """Why no GPU can take ``patches`` patches (for RESOURCE_EXHAUSTED)."""
    t = fleet.topology
    if not t.live_machine_list:
        return "no live VE machine"
    free = t.limit[t.live] - fleet.patches_in_flight[t.live]
    return (
        f"no live VE GPU has room for {patches} patches "
        f"(largest free capacity: {int(free.max())} patches)"
    )


def eligible_machines(fleet: VisionFleet, patches: int) -> npt.NDArray[np.int64]:
    """Indices (ascending) of machines with at least one eligible GPU for ``patches``.

    Fast path without capacities: the live machines, O(M). Otherwise one vectorised
    pass over the ``(G,)`` arrays.
    """
    t = fleet.topology
    if t.unlimited or t.n_machines == 0:
        return np.asarray(t.live_machine_list, dtype=np.int64)
    slack = t.limit - fleet.patches_in_flight
    return np.unique(t.gpu_machine[slack >= patches]).astype(np.int64)


def best_gpu(fleet: VisionFleet, machine: int, patches: int) -> int:
    """Global index of machine ``machine``'s eligible GPU with fewest patches in flight.

    Ties go to the lowest GPU index; ``-1`` when the machine has no eligible GPU for
    ``patches``. O(GPUs of the machine).
    """
    t = fleet.topology
    s, e = t.starts[machine], t.ends[machine]
    load = fleet.patches_in_flight[s:e]
    if t.unlimited and t.all_live_list[machine]:
        return s + int(load.argmin())
    fits = load + patches <= t.limit[s:e]
    i = int(np.where(fits, load, NO_LIMIT).argmin())
    return s + i if fits[i] else -1


def draw_machine(
    fleet: VisionFleet, patches: int, rng: np.random.Generator
) -> tuple[int, int] | NoCapacity:
    """A machine drawn uniformly among those with an eligible GPU, and its best GPU.

    Draws: ``rng.integers(L)`` over the ``L`` live machines (ascending index); when that
    machine has no room (only possible with capacities), one more ``rng.integers(E)``
    over the ``E`` eligible machines. The result is exactly uniform over the eligible
    machines (a given eligible machine comes first with probability ``1/L``, or after a
    miss, ``(L-E)/L * 1/E``; the sum is ``1/E``) and costs O(GPUs per machine) unless the
    first machine is full.

    Returns:
        ``(machine, gpu)``: the machine index and the global index of its eligible GPU
        with the fewest patches in flight (:func:`best_gpu`).

    Returns :class:`NoCapacity` when no machine has an eligible GPU.
    """
    live = fleet.topology.live_machine_list
    n = len(live)
    if n == 0:
        return NoCapacity(no_fit_reason(fleet, patches))
    machine = live[int(rng.integers(n))]
    gpu = best_gpu(fleet, machine, patches)
    if gpu >= 0:
        return machine, gpu
    cand = eligible_machines(fleet, patches)
    if cand.shape[0] == 0:
        return NoCapacity(no_fit_reason(fleet, patches))
    machine = int(cand[int(rng.integers(cand.shape[0]))])
    return machine, best_gpu(fleet, machine, patches)


def _pair(n: int, rng: np.random.Generator) -> tuple[int, int]:
    """Uniform ordered pair of distinct positions in ``range(n)``, one draw."""
    k = int(rng.integers(n * (n - 1)))
    i, j = divmod(k, n - 1)
    return i, j + (j >= i)


def draw_two_machines(
    fleet: VisionFleet, patches: int, rng: np.random.Generator
) -> tuple[tuple[int, int], ...] | NoCapacity:
    """Two distinct machines drawn uniformly among the eligible ones (or the only one).

    Draws over a list of ``n`` machines: one ``k = rng.integers(n*(n-1))``, then
    ``i, j = divmod(k, n-1)`` and ``j += j >= i`` (a uniform ordered pair of distinct
    positions). First over the live machines; if either drawn machine has no room (only
    possible with capacities), once more over the eligible machines, so the pair is
    exactly uniform over the eligible pairs (same argument as :func:`draw_machine`).
    A single eligible machine is returned alone without another draw.

    Returns:
        One or two ``(machine, gpu)`` pairs, as :func:`draw_machine`.

    Returns :class:`NoCapacity` when no machine has an eligible GPU.
    """
    live = fleet.topology.live_machine_list
    n = len(live)
    if n >= 2:
        i, j = _pair(n, rng)
        a, b = live[i], live[j]
        ga = best_gpu(fleet, a, patches)
        gb = best_gpu(fleet, b, patches)
        if ga >= 0 and gb >= 0:
            return (a, ga), (b, gb)
    cand = eligible_machines(fleet, patches)
    n = int(cand.shape[0])
    if n == 0:
        return NoCapacity(no_fit_reason(fleet, patches))
    if n == 1:
        a = int(cand[0])
        return ((a, best_gpu(fleet, a, patches)),)
    i, j = _pair(n, rng)
    a, b = int(cand[i]), int(cand[j])
    return (a, best_gpu(fleet, a, patches)), (b, best_gpu(fleet, b, patches))


def place_many(
    policy: VisionPolicy,
    fleet: VisionFleet,
    patch_counts: Sequence[int],
    rng: np.random.Generator,
) -> tuple[tuple[Placement, ...], VisionFleet] | NoCapacity:
    """Place several images in order; each sees the patches of the ones before it.

    A pure fold of ``select`` + :func:`commit`. All or nothing: if any image cannot be
    placed, the first :class:`NoCapacity` is returned (the input is untouched).

    Returns:
        The placements (same order as ``patch_counts``) and the resulting fleet.
    """
    out: list[Placement] = []
    cur = fleet
    for p in patch_counts:
        placement = policy.select(cur, p, rng)
        if isinstance(placement, NoCapacity):
            return placement
        out.append(placement)
        cur = commit(cur, placement)
    return tuple(out), cur
