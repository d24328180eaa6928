"""Puller rules: among the engines able to take a tier's head, which one does.

* ``most_quota`` (published): the most remaining quota (ties: first offered, i.e. the
  shell's deterministic order).
* ``emptiest_rank`` (default, with late binding): the engine whose least-loaded DP rank
  is emptiest (ties: most remaining quota, then first offered).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fulcrum.core.prefill.items import Offer
from fulcrum.core.prefill.rules.base import RULES, PullerRule
from fulcrum.core.registry import NoParams


@dataclass(frozen=True, slots=True)
class MostQuota(PullerRule):
    """The able engine with the most remaining quota takes the work."""

    name: ClassVar[str] = "most_quota"

    def rank(self, offer: Offer) -> tuple[int, ...]:
        return (-offer.remaining_ns,)


@dataclass(frozen=True, slots=True)
class EmptiestRank(PullerRule):
    """The able engine whose least-loaded rank is emptiest takes the work."""

    name: ClassVar[str] = "emptiest_rank"

    def rank(self, offer: Offer) -> tuple[int, ...]:
        return (min(offer.rank_loads_ns, default=0), -offer.remaining_ns)


RULES.register(MostQuota.name, lambda p: MostQuota(), NoParams, kind=MostQuota.kind)
RULES.register(EmptiestRank.name, lambda p: EmptiestRank(), NoParams, kind=EmptiestRank.kind)
