"""Source rules: which tier an engine takes work from.

* ``own_tier`` (published): its own tier, always.
* ``shorter_tiers`` (work conserving): an engine with room whose own tier has nothing
  queued takes from the nearest *shorter* tier with work (short work ends soon, so the
  engine is back for its own tier quickly); never a longer one (without the time there is
  no measure of how long that work waited).
* ``urgency`` (default): given the time, an engine with room takes from the tier whose
  head has waited longest in units of its tier's time scale (its batch cap; ties: its
  own tier, then the shorter tier); a longer tier only when its head costs at most the
  helping bound (``cap // help_divisor`` of the engine's own tier), never a long tier's
  minutes-long prompt. Without the time it is ``shorter_tiers``. On under prefix
  affinity too (issue 21): a held request waits for its holder only while the holder is
  predicted to finish it sooner, so a helper never idles for a busy holder; since
  urgency crosses tiers both ways, every engine with a tier may hold a tier's prefixes,
  and an engine with room goes first to a tier with a request it alone holds best
  (``balancer._held_tier``, for every rule that helps other tiers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from fulcrum.core.prefill.rules.base import RULES, SourceRule, TierView
from fulcrum.core.registry import NoParams

if TYPE_CHECKING:
    from fulcrum.core.prefill.items import Queued


@dataclass(frozen=True, slots=True)
class OwnTier(SourceRule):
    """An engine takes from its own tier only."""

    name: ClassVar[str] = "own_tier"

    def source(self, view: TierView, engine_id: str, own: int, room: bool,
               now_ns: int | None) -> int:
        return own


def _nearest_shorter(view: TierView, own: int) -> int:
    if view.head(own) is not None:
        return own
    for t in range(own - 1, -1, -1):
        if view.head(t) is not None:
            return t
    return own


@dataclass(frozen=True, slots=True)
class ShorterTiers(SourceRule):
    """An engine with room and an empty own tier helps the nearest shorter tier."""

    name: ClassVar[str] = "shorter_tiers"
    helps: ClassVar[bool] = True

    def source(self, view: TierView, engine_id: str, own: int, room: bool,
               now_ns: int | None) -> int:
        return _nearest_shorter(view, own) if room else own


@dataclass(frozen=True, slots=True)
class UrgencyParams:
    """``help_divisor``: a longer tier's request is taken only when it costs at most the
    engine's own tier's batch cap divided by this (>= 1; 4: 2 s under the 8 s cap)."""

    help_divisor: int = 4

    def __post_init__(self) -> None:
        if isinstance(self.help_divisor, bool) or not isinstance(self.help_divisor, int):
            raise ValueError("help_divisor: must be an integer")
        if self.help_divisor < 1:
            raise ValueError("help_divisor: must be >= 1")


@dataclass(frozen=True, slots=True)
class Urgency(SourceRule):
    """An engine with room takes the head that waited longest for its tier's scale."""

    name: ClassVar[str] = "urgency"
    helps: ClassVar[bool] = True
    help_divisor: int = 4

    def serves(self, engine_tier: int, tier: int) -> bool:
        """Any engine with a tier: urgency lets engines take other tiers' work both ways."""
        return engine_tier >= 0

    def helping_bound_ns(self, cap_ns: int) -> int:
        return cap_ns // self.help_divisor

    def source(self, view: TierView, engine_id: str, own: int, room: bool,
               now_ns: int | None) -> int:
        if not room:
            return own
        if now_ns is None:
            return _nearest_shorter(view, own)
        bound = view.helping_bound_ns(own)
        keys = view.once(("urgency", now_ns), lambda: _urgencies(view, now_ns))
        best, most = own, None  # most: (band, -virtual time, wait / scale)
        for t in (own, *range(view.n_tiers)):
            got = keys[t]
            if got is None:
                continue
            head, key = got
            if t > own and view.cost_for(head, engine_id) > bound:
                continue  # a long prompt would hold this engine's rank too long
            if most is None or key > most:
                best, most = t, key
        return best


def _urgencies(view: TierView, now_ns: int
               ) -> list[tuple[Queued, tuple[float, float, float]] | None]:
    """Per tier, its head and urgency key (band, or infinity while a higher band is
    owed; minus the head tenant's virtual time; its wait over the tier's time scale),
    None for an empty tier: the same for every engine, read once per dispatch."""
    out: list[tuple[Queued, tuple[float, float, float]] | None] = []
    for t in range(view.n_tiers):
        head = view.head(t)
        if head is None:
            out.append(None)
            continue
        waited = max(0, now_ns - head.enqueued_ns) / max(1, view.tier_scale_ns(t))
        band = head.cls.priority
        owed = band < max(view.tier_queue(t).bands, default=band)
        out.append((head, (math.inf if owed else band, -view.fair.vt(head.cls.tenant),
                           waited)))
    return out


RULES.register(OwnTier.name, lambda p: OwnTier(), NoParams, kind=OwnTier.kind)
RULES.register(ShorterTiers.name, lambda p: ShorterTiers(), NoParams, kind=ShorterTiers.kind)
RULES.register(Urgency.name, lambda p: Urgency(p.help_divisor), UrgencyParams,
               kind=Urgency.kind)
