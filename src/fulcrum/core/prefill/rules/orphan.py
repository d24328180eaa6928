"""Orphan rules: work for a tier with no engine.

* ``orphan_gate`` (both shipped sets): the orphan redistributes at once only when the
  engines can cover every tier with demand (otherwise the next round decides, which
  avoids moving engines on every submit).
* ``orphan_eager``: the orphan redistributes at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fulcrum.core.prefill.rules.base import RULES, OrphanRule
from fulcrum.core.registry import NoParams


@dataclass(frozen=True, slots=True)
class OrphanGate(OrphanRule):
    """Redistribute for an orphan only when every tier with demand can get an engine."""

    name: ClassVar[str] = "orphan_gate"

    def redistribute(self, can_cover_all: bool) -> bool:
        return can_cover_all


@dataclass(frozen=True, slots=True)
class OrphanEager(OrphanRule):
    """Redistribute for an orphan at once."""

    name: ClassVar[str] = "orphan_eager"

    def redistribute(self, can_cover_all: bool) -> bool:
        return True


RULES.register(OrphanGate.name, lambda p: OrphanGate(), NoParams, kind=OrphanGate.kind)
RULES.register(OrphanEager.name, lambda p: OrphanEager(), NoParams, kind=OrphanEager.kind)
