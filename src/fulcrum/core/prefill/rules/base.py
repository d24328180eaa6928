"""The prefill rule interfaces and their registry.

A prefill rule set (:class:`fulcrum.core.prefill.rules.Rules`) is a list of rules, at
most one of each *kind* (the extension points of a pull, like a scheduler profile's
filters, scorers and picker):

* ``source`` (:class:`SourceRule`): which tier an engine takes work from now;
* ``binding`` (:class:`BindingRule`): when an engine has room, and how far a pull may
  load its DP ranks (early binding: an idle engine takes a batch; late binding: a rank
  takes work only while below a horizon);
* ``puller`` (:class:`PullerRule`): among the engines able to take a tier's head, which
  one does;
* ``orphan`` (:class:`OrphanRule`): whether work for a tier with no engine redistributes
  at once;
* ``order`` (:class:`OrderRule`): the take order inside a tier queue (priority bands,
  tenants' fair shares; issue 23).

A kind left out of a list takes its published rule (:data:`KIND_DEFAULTS`). Each rule
module owns its parameter dataclass (frozen, validated in ``__post_init__``) and
registers itself in :data:`RULES`. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeVar

from fulcrum.core.registry import Registry

if TYPE_CHECKING:
    from fulcrum.core.prefill.affinity import Affinity
    from fulcrum.core.prefill.fair import FairLedger, TierQueue
    from fulcrum.core.prefill.items import Offer, Queued

T = TypeVar("T")


class TierView(Protocol):
    """What a source rule reads of the balancer: the balancer as one dispatch reads it
    (:class:`fulcrum.core.prefill.source_view.SourceView` satisfies it)."""

    n_tiers: int
    affinity: Affinity | None
    fair: FairLedger

    def head(self, tier: int) -> Queued | None: ...

    def tier_queue(self, tier: int) -> TierQueue: ...

    def cost_for(self, item: Queued, engine_id: str) -> int: ...

    def helping_bound_ns(self, tier: int) -> int: ...

    def tier_scale_ns(self, tier: int) -> int: ...

    def once(self, key: Hashable, compute: Callable[[], T]) -> T:
        """``compute()`` once per dispatch under ``key``: what a rule reads of the queue
        the same way for every engine (``key`` names the rule and what it reads)."""
        ...


class Rule:
    """Base of every prefill rule: ``kind`` names its extension point, ``name`` its
    registry name (set by the concrete class)."""

    kind: ClassVar[str] = ""
    name: ClassVar[str] = ""


class SourceRule(Rule):
    """Which tier an engine takes work from (``source``)."""

    kind: ClassVar[str] = "source"
    #: True when engines help shorter tiers (then they also count as serving them).
    helps: ClassVar[bool] = False

    def source(self, view: TierView, engine_id: str, own: int, room: bool,
               now_ns: int | None) -> int:
        """The tier ``engine_id`` (on tier ``own``; ``room``: it may take more work now)
        takes from; ``now_ns`` is the time when the shell gives it. It reads the engine
        only through ``view.cost_for`` of tier heads: engines pricing every head alike
        (holding none of them) on the same tier with the same room get the same answer,
        which a dispatch computes once (:meth:`SourceView.plain`)."""
        raise NotImplementedError

    def serves(self, engine_tier: int, tier: int) -> bool:
        """True when an engine on ``engine_tier`` may take ``tier``'s work."""
        return engine_tier == tier or (self.helps and engine_tier > tier)

    def helping_bound_ns(self, cap_ns: int) -> int:
        """Longest cost (ns) of a longer tier's request an engine of a tier with batch cap
        ``cap_ns`` may take (only rules that take from longer tiers use it)."""
        return cap_ns // 4


class RankFill(Protocol):
    """Per-pull state of a binding rule over the engine's DP rank loads (ns)."""

    def full(self) -> bool:
        """True when the next request would land on a rank at or above the horizon."""
        ...

    def place(self, cost_ns: int) -> None:
        """Account a request of ``cost_ns`` on the least-loaded rank."""
        ...


class BindingRule(Rule):
    """When an engine has room and how far a pull may load its ranks (``binding``)."""

    kind: ClassVar[str] = "binding"

    def horizon_ns(self, step_quota_ns: int) -> int | None:
        """A rank's late-binding horizon (ns), None when binding is early."""
        raise NotImplementedError

    def has_room(self, loads_ns: Sequence[int], step_quota_ns: int) -> bool:
        """True when an engine with these rank loads (ns) may take more work now."""
        raise NotImplementedError

    def fill(self, loads_ns: Sequence[int], step_quota_ns: int) -> RankFill:
        """The per-pull rank state (see :class:`RankFill`)."""
        raise NotImplementedError

    def full(self, loads_ns: Sequence[int], step_quota_ns: int) -> bool:
        """True when the least-loaded rank is at or above the horizon (the next request
        would wait); ``fill(...).full()`` without building the pull state."""
        raise NotImplementedError


class PullerRule(Rule):
    """Who takes a tier's work among the engines able to (``puller``)."""

    kind: ClassVar[str] = "puller"

    def rank(self, offer: Offer) -> tuple[int, ...]:
        """The rule's preference for ``offer``, smallest first; it may read the offer
        alone (a waiting engine's rank is kept while it waits,
        :class:`~fulcrum.core.prefill.waiting.Waiting`)."""
        raise NotImplementedError

    def key(self, offer: Offer, i: int) -> tuple[int, ...]:
        """:meth:`rank`, then ``i`` (the offer's index in the shell's deterministic order:
        ties go to the first): the puller is the able engine with the smallest key, so
        engines are asked in this order until one is able
        (:meth:`PrefillBalancer.choose_puller`)."""
        return (*self.rank(offer), i)


class OrphanRule(Rule):
    """Whether a tier with work and no engine gets one at once (``orphan``)."""

    kind: ClassVar[str] = "orphan"

    def redistribute(self, can_cover_all: bool) -> bool:
        """True when the orphan redistributes now (``can_cover_all``: the engines can
        cover every tier with demand)."""
        raise NotImplementedError


class OrderRule(Rule):
    """The take order inside a tier queue (``order``)."""

    kind: ClassVar[str] = "order"
    #: The rule gives fair-share precedence on the ranks (:meth:`TierQueue.leads`): a
    #: request taken while its tenant leads a band shared with another tenant runs
    #: ahead of that band's other work on its rank (half a band up).
    precedence: ClassVar[bool] = False

    def order(self, queue: TierQueue, now_ns: int) -> Iterator[Queued]:
        """``queue``'s requests in take order at ``now_ns`` (a tenant at its compute cap
        is skipped)."""
        raise NotImplementedError

    def units(self, item: Queued, cost_ns: int) -> float:
        """What serving ``item`` at ``cost_ns`` (ns) charges its tenant's virtual time
        (before the weight): ns by default."""
        return float(cost_ns)


#: Every prefill rule, by name (the YAML names of ``prefill.rules`` list entries).
RULES: Registry[Rule] = Registry("prefill.rules")

KINDS: tuple[str, ...] = ("source", "binding", "puller", "orphan")
#: Every kind a rule list may name: :data:`KINDS` and the queue ``order`` (issue 23),
#: which the shipped sets leave to its default (``wfq_ns``: FIFO for one tenant).
ALL_KINDS: tuple[str, ...] = (*KINDS, "order")
