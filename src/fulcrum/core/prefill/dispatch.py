"""Who takes a tier's work among the engines waiting to pull: the step both shells share.

The simulator (engines at a step boundary, ``sim/engine.py`` ``_pull``) offers every
waiting engine and needs the one that takes ``tier``'s work now: among the offers whose
source tier (the rule set's source rule) is ``tier``, the balancer's puller choice. The
daemon (waiting long polls, ``state/prefill/dispatcher.py``) makes the same choice over
its parked pulls, kept grouped across dispatches
(:class:`~fulcrum.core.prefill.waiting.Waiting`). Pure.
"""

from __future__ import annotations

from collections.abc import Sequence

from fulcrum.core.prefill.balancer import PrefillBalancer, source_tiers
from fulcrum.core.prefill.items import Offer


def pick_puller(bal: PrefillBalancer, tier: int, offers: Sequence[Offer],
                now_ns: int | None = None) -> int:
    """Index in ``offers`` (every waiting engine, in the shell's deterministic order) of
    the engine that takes ``tier``'s work now; -1 when none does."""
    tiers = source_tiers(bal, offers, now_ns)  # the queue read once for every engine
    able = [i for i, t in enumerate(tiers) if t == tier]
    j = bal.choose_puller(tier, [offers[i] for i in able], now_ns=now_ns)
    return -1 if j < 0 else able[j]
