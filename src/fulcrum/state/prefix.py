"""Prefix affinity in the daemon: the prefill shell's wiring of
:class:`fulcrum.core.prefill.affinity.Affinity` (issue 15).

:class:`PrefixWiring` is owned by :class:`fulcrum.state.prefill.PrefillState` and touched
only on the event loop: it installs (``prefill.cache_model: per_engine``) or removes
(``global``) the balancer's affinity, prices a submit at its expected cost, keeps the
index's engines in step with the fleet (an engine that re-registers starts with an empty
believed cache), and turns the core's counters into metrics after each pull.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fulcrum.config.prefill import PrefillSettings
from fulcrum.core.prefill.affinity import Affinity, PrefixIndex
from fulcrum.core.prefill.balancer import PrefillBalancer
from fulcrum.errors import InvalidArgument
from fulcrum.metrics import prefix as pm
from fulcrum.units import NS_PER_S

PER_ENGINE = "per_engine"


class PrefixWiring:
    """See module docstring. ``cost_ns(q, c)``: the daemon's live cost model (ns)."""

    def __init__(self, balancer: PrefillBalancer, settings: PrefillSettings,
                 cost_ns: Callable[[int, int], int], labels: Sequence[str]) -> None:
        self._bal = balancer
        self._cost = cost_ns
        self._labels = tuple(labels)
        self._seen_engine: dict[str, tuple[int, int]] = {}
        self._seen_tier: dict[int, tuple[int, int]] = {}
        #: Decision label -> the affinity's count already fed to the metric.
        self._seen_decisions: dict[str, int] = {}
        #: Prefix-cache capacity each engine registered (blocks; absent: the default).
        self._registered: dict[str, int] = {}
        self.settings = settings
        self.apply(settings)

    @property
    def affinity(self) -> Affinity | None:
        """The balancer's affinity (None under the global cache model)."""
        return self._bal.affinity

    def apply(self, s: PrefillSettings) -> None:
        """Adopt (re)loaded settings: cache model, engine capacity, fairness bound."""
        self.settings = s
        if s.cache_model != PER_ENGINE:
            self._bal.affinity = None
            pm.INDEX_BLOCKS.set(0)
            return
        aff = self._bal.affinity
        if aff is None:
            aff = Affinity(PrefixIndex(s.block_tokens), lambda q, c: self._cost(q, c))
            self._bal.affinity = aff
            # a new affinity counts from zero: so do the deltas the metrics are fed
            self._seen_decisions.clear()
            self._seen_engine.clear()
            self._seen_tier.clear()
        aff.max_wait_ns = s.affinity_max_wait_ms * (NS_PER_S // 1000)
        for eid in self._bal.engine_ids():
            aff.index.add_engine(eid, self._capacity(eid), keep=True)
        pm.INDEX_BLOCKS.set(aff.index.size())

    def validate(self, blocks: Sequence[int], total_tokens: int) -> None:
        """INVALID_ARGUMENT when a submit carries more block hashes than its prompt has
        blocks (``ceil(total_tokens / block_tokens)``) or than ``max_block_hashes`` (call
        with the raw repeated field, before converting it)."""
        bound = self.settings.max_block_hashes
        if len(blocks) > bound:
            raise InvalidArgument(
                "block_hashes", f"must have at most {bound} entries (prefill.max_block_hashes)")
        per_prompt = -(-max(0, total_tokens) // self.settings.block_tokens)
        if len(blocks) > per_prompt:
            raise InvalidArgument(
                "block_hashes",
                f"must have at most ceil(total_tokens / {self.settings.block_tokens}) = "
                f"{per_prompt} entries (one per block of the prompt)")

    def blocks(self, raw: Sequence[int]) -> tuple[int, ...]:
        """The blocks a queued request carries (none under the global cache model)."""
        return tuple(int(h) for h in raw) if self._bal.affinity is not None else ()

    def tier(self, total: int, blocks: Sequence[int], tier: int) -> int:
        """The tier to queue in: the holder's shorter tier when the balancer says so
        (:meth:`PrefillBalancer.tier_for`) and that tier's queue is below its bound, else
        ``tier`` (by length; its bound was checked at validation)."""
        if not blocks:
            return tier
        t = self._bal.tier_for(total, blocks)
        if t != tier and self._bal.queue_depth(t) >= self.settings.max_queued_per_tier:
            return tier
        return t

    def cost(self, total: int, cached: int, blocks: Sequence[int], plain_ns: int) -> int:
        """Queued cost (ns): the expected per-engine cost under affinity, else ``plain_ns``."""
        aff = self._bal.affinity
        if aff is None or not blocks:
            return plain_ns
        return min(plain_ns, aff.expected_cost(total, blocks, cached))

    def join(self, engine_id: str, capacity_blocks: int = 0, *,
             cache_survived: bool = False) -> None:
        """An engine (re-)registered with a prefix cache of ``capacity_blocks`` blocks (0:
        ``engine_cache_blocks``): empty believed cache unless it says it survived."""
        if capacity_blocks > 0:
            self._registered[engine_id] = capacity_blocks
        else:
            self._registered.pop(engine_id, None)
        aff = self._bal.affinity
        if aff is not None:
            aff.index.add_engine(engine_id, self._capacity(engine_id), keep=cache_survived)

    def _capacity(self, engine_id: str) -> int:
        return self._registered.get(engine_id, self.settings.engine_cache_blocks)

    def leave(self, engine_id: str, *, replaced: bool = False) -> None:
        """An engine left: forget its cache and its metric series. ``replaced``: a new
        incarnation registers at once, and its :meth:`join` decides (kept only when it
        says its cache survived)."""
        if replaced:
            return
        self._registered.pop(engine_id, None)
        aff = self._bal.affinity
        if aff is not None:
            aff.index.remove_engine(engine_id)
            pm.INDEX_BLOCKS.set(aff.index.size())
        if self._seen_engine.pop(engine_id, None) is not None:
            for c in (pm.ENGINE_HIT_BLOCKS, pm.ENGINE_LOOKUP_BLOCKS):
                c.remove(engine_id)

    def after_take(self, engine_id: str) -> None:
        """Metrics after a pull by ``engine_id`` (deltas of the core's counters)."""
        aff = self._bal.affinity
        if aff is None:
            return
        c = aff.index.cache(engine_id)
        if c is not None:
            h0, l0 = self._seen_engine.get(engine_id, (0, 0))
            if c.hit_blocks >= h0 and c.lookup_blocks >= l0:
                pm.ENGINE_HIT_BLOCKS.labels(engine_id).inc(c.hit_blocks - h0)
                pm.ENGINE_LOOKUP_BLOCKS.labels(engine_id).inc(c.lookup_blocks - l0)
            self._seen_engine[engine_id] = (c.hit_blocks, c.lookup_blocks)
        for t, (hit, look) in aff.tier_blocks.items():
            h0, l0 = self._seen_tier.get(t, (0, 0))
            if hit >= h0 and look >= l0 and (hit, look) != (h0, l0):
                pm.TIER_HIT_BLOCKS.labels(self._labels[t]).inc(hit - h0)
                pm.TIER_LOOKUP_BLOCKS.labels(self._labels[t]).inc(look - l0)
                self._seen_tier[t] = (hit, look)
        for label, n in (("affinity_hit", aff.hits), ("fairness_override", aff.overrides),
                         ("holder_tier", aff.holder_tiers)):
            seen = self._seen_decisions.get(label, 0)
            if n > seen:
                pm.DECISIONS.labels(label).inc(n - seen)
            self._seen_decisions[label] = n
        pm.INDEX_BLOCKS.set(aff.index.size())
