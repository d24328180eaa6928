"""Cache-aware picks for engines that serve prefill and decode (``gateway.cache``).

Per request, among the endpoints the decode policy's filter leaves
(:meth:`fulcrum.gateway.adapter.DecodeAdapter.candidates`: KV room, a free concurrency
slot, the subset hint), the picker takes the one with the least predicted time to first
token (:func:`fulcrum.core.prefix_cost.predicted_ttft_ns`)::

    ttft[e] = outstanding[e] + cost(q = prompt - hit[e], c = hit[e])      [ns]
              - k, when outstanding[e] > 0 (gateway.cache.shared_steps)

* ``hit[e]``: prompt tokens endpoint ``e`` is believed to hold, from the gateway's prefix
  index (:mod:`fulcrum.gateway.prefix_index`) of the prompts it routed there;
* ``outstanding[e]``: prefill work sent to ``e`` and predicted not done yet (ns): each
  pick moves the endpoint's predicted "prefill busy until" to ``max(it, now) + cost``;
  when its last request in flight ends, what is left of it is dropped. The scraped queue
  depth corrects it from below: ``waiting x`` the endpoint's mean predicted cost from the
  scrape's time on, draining as time passes (a scrape is a snapshot of the past).
* ``k``: the cost model's fixed per-step overhead. Engines with continuous batching run
  the prompts waiting together in one step, so a request queued behind outstanding work
  adds ``cost - k`` to it (``gateway.cache.shared_steps``, on by default).
* ``cost``: the configured model (``gateway.cache.cost_model``), refitted online per
  endpoint (or for all) from the TTFT the gateway observes
  (:mod:`fulcrum.gateway.cost_learn`, :meth:`CachePicker.first_token`).

The pick is scored by ``ttft[e] + recompute_weight x recompute[e] / (1 + n)``
(:func:`fulcrum.core.prefix_cost.move_charge_ns`; ``recompute[e]``: the prefill work
``e`` adds for the prefix it lacks and the best holder has, on ``e``'s own model): a
request leaves the
endpoint holding its prefix only when the wait it saves exceeds the work it adds
(``recompute_weight`` 1, the default; 0 = least predicted TTFT alone). ``n``
(``gateway.cache.share_hot_prefixes``, on by default; else 0): the requests in flight
whose prompts contain the prefix the best holder holds (its deepest matched
block). A copy of a prefix that many requests use at once serves the next ones too, so
its one recompute is shared among them; a conversation's own history (nothing else in
flight holds it) pays it whole. With the same setting, a prefix that requests in flight
go on from with other text counts as held by every candidate (:meth:`_spread_hot`)
when its requests in flight, this one too, are more than its holders' share of all the
requests in flight (an engine's share: all of them over the candidates).
The reported TTFTs stay the predictions.
Ties go to fewer requests (the decode view's), then to fewer picks so far. A prompt that
was not parsed or is empty is picked by load alone (no hits), counted as ``load_only``.
Event loop only.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt
import structlog

from fulcrum.config.cache import CacheSettings
from fulcrum.core.cost import CostModel
from fulcrum.core.decode.view import KV_BITS
from fulcrum.core.prefix_cost import (
    Coefficients,
    move_charge_ns,
    predicted_ttft_ns,
    rank,
    request_cost_ns,
)
from fulcrum.gateway import pick_metrics as pm
from fulcrum.gateway.adapter import DecodeAdapter
from fulcrum.gateway.body import RequestShape
from fulcrum.gateway.cost_learn import CostLearner
from fulcrum.gateway.kv_events import KvEventSink
from fulcrum.gateway.prefix_index import PrefixIndex, text_blocks

log = structlog.get_logger(__name__)

#: Weight of a new predicted cost in an endpoint's mean (exponential average).
_MEAN_WEIGHT: Final = 0.1
_GROW: Final = 64
_PICKS_MAX: Final = (1 << KV_BITS) - 1
#: The decode view's ``order_conc`` key without its KV bits (the request count part).
_CONC_MASK: Final = ~_PICKS_MAX


@dataclass(frozen=True, slots=True)
class Choice:
    """A cache-aware decision: decode slot to pin, its address and index slot, the
    request's blocks, its predicted cost there and the load ahead of it (ns) and the
    reported figures."""

    slot: int
    address: str
    index_slot: int
    blocks: list[int]
    cost_ns: float
    load_ns: float
    chosen_ns: float
    other_ns: float
    hit_tokens: int
    rule: str
    #: The pick sends the request where it recomputes a prefix another candidate holds:
    #: "" (it does not), "shared" (its charge was shared by requests in flight) or "full".
    copy: str = ""


def _emit_scores(
    choice: Choice,
    prompt: int,
    addrs: list[str],
    ttft: npt.NDArray[np.float64],
    hits: npt.NDArray[np.int64],
    extra: npt.NDArray[np.float64] | None = None,
    sharers: int = 0,
) -> None:
    """The debug line of one pick (``emit_scores``): every candidate's predicted TTFT
    (ns), hit tokens and the recompute charged on top (ns,
    :func:`~fulcrum.core.prefix_cost.move_charge_ns`), and the requests in flight that
    shared the charge."""
    charged = np.zeros(len(addrs)) if extra is None else extra
    log.info(
        "gateway_endpoint_scores",
        chosen=choice.address,
        rule=choice.rule,
        prompt_tokens=prompt,
        sharers=sharers,
        scores={
            a: [round(float(t)), int(h), round(float(x))]
            for a, t, h, x in zip(addrs, ttft, hits, charged, strict=True)
        },
    )


class CachePicker:
    """See module docstring. ``capacity_blocks(address)`` sizes a new endpoint's index."""

    def __init__(
        self, settings: CacheSettings, chars_per_token: float, adapter: DecodeAdapter,
        default_kv_tokens: int = 0,
    ) -> None:
        self.settings = settings
        self.block_chars = max(1, round(settings.block_tokens * chars_per_token))
        self.index = PrefixIndex()
        self._size_shown = -1  # the index size last set on its gauge
        #: The per-pick figures (the scrape reads them, :mod:`~fulcrum.gateway.pick_metrics`).
        self.counts = pm.CacheCounts()
        pm.CACHE_FIGURES.set_source(self.counts.publisher)
        self._slots: dict[str, int] = {}
        #: decode slot -> index slot (-1: not seen yet), for the adapter's generation.
        self._isl_of = np.zeros(0, dtype=np.int64)
        self._isl_gen = -1
        self._busy = np.zeros(0, dtype=np.float64)  # prefill busy until (ns)
        self._mean = np.zeros(0, dtype=np.float64)  # mean predicted cost (ns)
        #: Scraped work ahead: scrape time + waiting x mean predicted cost (ns).
        self._scraped_until = np.zeros(0, dtype=np.float64)
        self._pending = np.zeros(0, dtype=np.int64)  # requests in flight
        self._picks = np.zeros(0, dtype=np.int64)  # picks so far (tie-break)
        #: request id -> (index slot, predicted cost ns, prompt blocks), until released.
        self._requests: dict[str, tuple[int, float, list[int]]] = {}
        #: block hash -> requests in flight whose prompt contains it (share_hot_prefixes).
        self._inflight: dict[int, int] = {}
        #: block hash -> requests in flight whose prompt's last block it is.
        self._ends: dict[int, int] = {}
        #: Streamed requests waiting for their first token: (slot, q, c, pick ns, alone:
        #: nothing else of ours in flight there and no scraped queue at the pick).
        self._first: dict[str, tuple[int, int, int, int, bool]] = {}
        self._kv_tokens: dict[str, int] = {}  # scraped KV capacity per address (tokens)
        self._started: dict[str, float] = {}  # scraped process start per address (s)
        #: KV cache of an endpoint the scrape has not sized (tokens; 0: unknown).
        self.default_kv_tokens = default_kv_tokens
        #: The KV event receiver, once :meth:`kv_sink` made it (gateway.cache.kv_events).
        self.kv: KvEventSink | None = None
        base = CostModel(settings.cost_model.a, settings.cost_model.b, settings.cost_model.k)
        self._base = base
        self._coef = np.zeros((0, 3), dtype=np.float64)  # (a, b, k) per index slot
        self.learner = CostLearner(settings.refit, base)
        self._addr_of: list[str] = []  # index slot -> address
        #: address -> engine id (the pool entry), for ``learn_per: engine``.
        self.engine_of: dict[str, str] = {}
        self._adapter = adapter
        adapter.scrape_listeners.append(self.scraped)
        adapter.address_listeners.append(self.add_endpoints)
        self.add_endpoints(adapter.addresses())

    # -- endpoints ---------------------------------------------------------------------------

    def _capacity(self, address: str) -> int:
        s = self.settings
        if s.index_blocks is not None:
            return min(s.index_blocks, s.max_index_blocks)
        kv = self._kv_tokens.get(address) or self.default_kv_tokens
        if kv <= 0:
            return s.max_index_blocks
        return min(max(1, kv // s.block_tokens), s.max_index_blocks)

    def _slot(self, address: str) -> int:
        got = self._slots.get(address)
        if got is not None:
            return got
        slot = self.index.add(self._capacity(address))
        self._slots[address] = slot
        if slot >= self._busy.shape[0]:
            grow = max(_GROW, slot + 1 - self._busy.shape[0])
            self._busy = np.concatenate([self._busy, np.zeros(grow)])
            self._mean = np.concatenate([self._mean, np.zeros(grow)])
            self._scraped_until = np.concatenate([self._scraped_until, np.zeros(grow)])
            self._pending = np.concatenate([self._pending, np.zeros(grow, dtype=np.int64)])
            self._picks = np.concatenate([self._picks, np.zeros(grow, dtype=np.int64)])
            b = self._base
            self._coef = np.concatenate([self._coef, np.tile([b.a, b.b, b.k], (grow, 1))])
        while len(self._addr_of) <= slot:
            self._addr_of.append("")
        self._addr_of[slot] = address
        m = self.learner.model(self.learn_key(slot))
        self._coef[slot] = (m.a, m.b, m.k)
        return slot

    def add_endpoints(self, addresses: list[str]) -> None:
        """Give these endpoints their index slots now, as the adapter learns them (its
        ``address_listeners``): a pick that meets new endpoints makes theirs on the
        request's path (40 ms for a pool of 4,096 at its first pick)."""
        for address in addresses:
            self._slot(address)

    def learn_key(self, slot: int) -> str:
        """The online refit's key of an index slot (``gateway.cache.learn_per``)."""
        per = self.settings.learn_per
        if per == "all":
            return ""
        addr = self._addr_of[slot]
        return self.engine_of.get(addr, addr) if per == "engine" else addr

    def scraped(self, address: str, waiting: int, kv_capacity_tokens: int, now_ns: int,
                started_s: float = 0.0) -> None:
        """The scraper's figures of one endpoint, seen at ``now_ns``: requests waiting,
        KV cache (tokens), the engine process's start (s since the epoch; 0: unknown).
        The waiting requests are work ahead *at the scrape*: ``waiting x`` the
        endpoint's mean predicted cost from ``now_ns`` on, which drains as time passes,
        as the picker's own prediction does (the engine works on after the page was
        read; until the next scrape, up to ``scrape.interval_ms`` later). A start that
        differs from the last one seen is a restart: :meth:`restarted`."""
        slot = self._slot(address)
        if started_s > 0:
            before = self._started.get(address)
            self._started[address] = started_s
            if before is not None and before != started_s:
                self.restarted(address)
        self._scraped_until[slot] = float(now_ns) + max(0, waiting) * float(self._mean[slot])
        if kv_capacity_tokens > 0 and self._kv_tokens.get(address) != kv_capacity_tokens:
            self._kv_tokens[address] = kv_capacity_tokens
            self.index.set_capacity(slot, self._capacity(address))

    def restarted(self, address: str) -> None:
        """The engine at ``address`` restarted (its process start changed between two
        scrapes): its prefix cache is empty, so its index is cleared, and the requests
        picked there before are no TTFT samples (they were priced with hits it lost).
        One info line and ``fulcrum_gateway_engine_restarts_total``."""
        slot = self._slot(address)
        dropped = self.index.held(slot)
        self.index.clear(slot)
        for rid in [r for r, f in self._first.items() if f[0] == slot]:
            del self._first[rid]
        pm.ENGINE_RESTARTS.inc()
        self._show_size()
        log.info("gateway_engine_restarted", address=address, index_blocks_dropped=dropped)

    def apply_settings(self, settings: CacheSettings) -> None:
        """Reload: ``emit_scores``, ``refit.*``, ``max_index_blocks`` / ``index_blocks``
        (the index of every known endpoint is resized); the rest is restart-only."""
        self.settings = settings
        self.learner.settings = settings.refit
        for address, slot in self._slots.items():
            self.index.set_capacity(slot, self._capacity(address))

    def kv_sink(self) -> KvEventSink:
        """The receiver of vLLM's KV events for this picker's index."""
        def slot_of(address: str) -> int | None:
            got = self._slots.get(address)
            if got is None and self._adapter.has_address(address):
                got = self._slot(address)  # an endpoint not picked nor scraped yet
            return got

        self.kv = KvEventSink(slot_of, self.index.evict_oldest, self.index.clear)
        return self.kv

    # -- decisions ---------------------------------------------------------------------------

    def outstanding_ns(self, slots: npt.NDArray[np.int64], now_ns: int) -> npt.NDArray[np.float64]:
        """Outstanding prefill work of index slots (ns, shape of ``slots``)."""
        out: npt.NDArray[np.float64] = np.maximum(self._busy[slots], self._scraped_until[slots])
        out -= float(now_ns)
        np.maximum(out, 0.0, out=out)
        return out

    def choose(
        self,
        adapter: DecodeAdapter,
        shape: RequestShape,
        subset: Collection[str] | None,
        now_ns: int,
    ) -> Choice | None:
        """The endpoint with the least predicted TTFT (None: no candidate; the decode
        table's own refusal then applies)."""
        slots, addrs, keys = adapter.candidates(shape.kv_tokens, subset)
        if not addrs:
            return None
        isl = self._index_slots(adapter.generation, slots, addrs)
        text = shape.text
        blocks = text_blocks(text, self.block_chars) if shape.parsed and text else []
        prompt = shape.prompt_tokens
        if blocks:
            per_block = self.block_chars * prompt / max(len(text), 1)  # tokens per block
            # Requests in flight on the candidates: only read when one shares a block.
            in_flight = int(self._pending[isl].sum()) if blocks[0] in self._inflight else 0
            matched = self._spread_hot(blocks, self.index.match(blocks)[isl], in_flight)
            hits = np.floor(matched * per_block).astype(np.int64)
        else:
            matched = hits = np.zeros(len(addrs), dtype=np.int64)
        load = self.outstanding_ns(isl, now_ns)
        co = self._coef[isl]
        coef = Coefficients(co[:, 0], co[:, 1], co[:, 2])
        cost = request_cost_ns(hits, prompt, coef)  # once, for the TTFT and the charge
        ttft = predicted_ttft_ns(
            load, hits, prompt, coef, shared_steps=self.settings.shared_steps, cost_ns=cost
        )
        extra, sharers = self._charge(blocks, matched, hits, prompt, coef, cost)
        # Ties: fewer requests, then fewer picks so far (round robin among equals; the
        # count stays below 2**KV_BITS, :meth:`placed`).
        tie = (keys & _CONC_MASK) | self._picks[isl]
        r = rank(ttft if extra is None else ttft + extra, tie)
        c = r.chosen
        hit = int(min(hits[c], max(prompt - 1, 0)))
        choice = Choice(
            slot=int(slots[c]),
            address=addrs[c],
            index_slot=int(isl[c]),
            blocks=blocks,
            cost_ns=float(ttft[c] - load[c]),
            load_ns=float(load[c]),
            chosen_ns=float(ttft[c]),
            other_ns=float(ttft[r.other]) if r.other >= 0 else math.nan,
            hit_tokens=hit,
            rule="ttft" if blocks or (shape.parsed and prompt > 0) else "load_only",
            copy="" if extra is None or extra[c] <= 0 else ("shared" if sharers else "full"),
        )
        if self.settings.emit_scores:
            _emit_scores(choice, prompt, addrs, ttft, hits, extra, sharers)
        return choice

    def _index_slots(
        self, generation: int, slots: npt.NDArray[np.int64], addrs: list[str]
    ) -> npt.NDArray[np.int64]:
        """The index slots of the candidates (decode ``slots``, ascending, and their
        ``addrs``; shape ``(n,)``), read from a table by decode slot kept for the
        adapter's ``generation``: one numpy call per pick, not a lookup per endpoint
        (1.5 ms at 4,096 endpoints). Unseen endpoints get their index slot here."""
        table = self._isl_of
        if generation != self._isl_gen:
            table = self._isl_of = np.zeros(0, dtype=np.int64)
            self._isl_gen = generation
        n = slots.shape[0]
        if n and int(slots[n - 1]) < table.shape[0]:
            isl: npt.NDArray[np.int64] = table[slots]
            if int(isl.min()) >= 0:
                return isl
        isl = np.array([self._slot(a) for a in addrs], dtype=np.int64)
        top = int(slots[n - 1]) + 1 if n else 0
        if top > table.shape[0]:
            grown = np.full(top, -1, dtype=np.int64)
            grown[: table.shape[0]] = table
            table = self._isl_of = grown
        table[slots] = isl
        return isl

    def _spread_hot(
        self, blocks: list[int], matched: npt.NDArray[np.int64], in_flight: int
    ) -> npt.NDArray[np.int64]:
        """``matched`` (blocks each candidate holds, shape ``(n,)``) with the request's
        leading blocks that other requests in flight share and the rest of its prompt
        does not (a service's system prompt, not a conversation's own history) counted
        as held by every candidate, as far as one of them holds them
        (``share_hot_prefixes``). Copied once to another engine, such a prefix serves
        the requests that share it there too; priced as held by its one holder only,
        every one of them is predicted sooner there, queues there, and the other engines
        never get a copy (BENCHMARKS.md, "Real engines", stop 42: every request of a
        shared system prompt on one of two engines when requests arrive one by one).

        Only a prefix that needs more than its holders is spread: its requests in flight,
        this one too, more than the holders' share of the ``in_flight`` requests on the
        candidates (plus this one; an engine's share is that over the candidates).
        Below it, the requests of other prefixes keep the other engines busy, and a copy
        would take cache room from them (many documents over the fleet's cache: every
        one copied to both engines, "Real engines", stop 45)."""
        if not self.settings.share_hot_prefixes or not len(matched):
            return matched
        inflight, ends = self._inflight, self._ends
        counts = []
        for h in blocks:
            n = inflight.get(h, 0)
            if n <= 0:
                break
            counts.append(n)
        counts.append(0)
        # Shared: the deepest block after which some request in flight goes on with other
        # text (the counts only fall along a prompt: a block's hash chains its prefix).
        # A request in flight whose prompt ends there (this conversation's previous turn,
        # still in flight) shares nothing with others.
        hot = 0
        for j in range(len(counts) - 1, 0, -1):
            if counts[j - 1] - counts[j] - ends.get(blocks[j - 1], 0) > 0:
                hot = j
                break
        held: list[int] = matched.tolist()  # a few endpoints: Python beats numpy here
        reach = min(hot, max(held))
        if reach <= 0:
            return matched
        holders = sum(1 for m in held if m >= reach)
        if (counts[reach - 1] + 1) * len(matched) <= holders * (in_flight + 1):
            return matched
        out: npt.NDArray[np.int64] = np.maximum(matched, reach)
        return out

    def _charge(
        self,
        blocks: list[int],
        matched: npt.NDArray[np.int64],
        hits: npt.NDArray[np.int64],
        prompt: int,
        coef: Coefficients,
        cost: npt.NDArray[np.float64],
    ) -> tuple[npt.NDArray[np.float64] | None, int]:
        """The recompute charged on top of each candidate's TTFT (ns, shape ``(n,)``;
        None without a charge) and ``n``, the requests in flight sharing it (module
        docstring). ``matched``: blocks each candidate holds; ``hits``: the same in
        tokens; ``cost``: :func:`request_cost_ns` of the request there (ns)."""
        w = self.settings.recompute_weight
        held = matched.tolist()  # a few endpoints: Python beats numpy's reductions here
        depth = max(held, default=0)
        if w <= 0 or not blocks or min(held, default=0) == depth:
            return None, 0  # every candidate holds as much: nothing to recompute anywhere
        sharers = 0
        if self.settings.share_hot_prefixes:
            sharers = self._inflight.get(blocks[depth - 1], 0) if depth > 0 else 0
        return move_charge_ns(hits, prompt, coef, w, sharers, cost_ns=cost), sharers

    def placed(
        self,
        request_id: str,
        choice: Choice,
        prompt_tokens: int,
        now_ns: int,
        stream: bool = False,
    ) -> None:
        """The request was placed where :meth:`choose` said: record its blocks and work
        (``stream``: a streamed response, whose first chunk is a TTFT sample)."""
        i = choice.index_slot
        if stream and prompt_tokens > 0:
            c = choice.hit_tokens
            alone = bool(self._pending[i] == 0 and self._scraped_until[i] <= now_ns)
            self._first[request_id] = (i, prompt_tokens - c, c, now_ns, alone)
        if choice.blocks:
            self.index.record(i, choice.blocks)
        self._busy[i] = max(self._busy[i], float(now_ns)) + choice.cost_ns
        m = self._mean[i]
        self._mean[i] = choice.cost_ns if m == 0 else m + _MEAN_WEIGHT * (choice.cost_ns - m)
        self._pending[i] += 1
        self._picks[i] = min(int(self._picks[i]) + 1, _PICKS_MAX)
        old = self._requests.get(request_id)
        if old is not None:  # placed again under the same id: its earlier blocks end
            self._unuse(old[2])
        self._requests[request_id] = (i, choice.cost_ns, choice.blocks)
        self._count(choice.blocks, +1)
        self.counts.picked(choice.rule, choice.copy, choice.hit_tokens, prompt_tokens,
                           choice.chosen_ns / 1e9, choice.other_ns / 1e9)
        self._show_size()

    def _show_size(self) -> None:
        """The index's size on its gauge, set only when it changed (a pick whose blocks
        were all held already leaves it as it was)."""
        size = self.index.size()
        if size != self._size_shown:
            self._size_shown = size
            pm.INDEX_BLOCKS.set(size)

    def released(self, request_id: str, _reason: str, now_ns: int) -> None:
        """A request ended: with none left in flight there, the endpoint's queue is empty."""
        self._first.pop(request_id, None)
        got = self._requests.pop(request_id, None)
        if got is None:
            return
        i = got[0]
        self._unuse(got[2])
        self._pending[i] -= 1
        if self._pending[i] <= 0:
            self._pending[i] = 0
            self._busy[i] = min(self._busy[i], float(now_ns))

    def _unuse(self, blocks: list[int]) -> None:
        """A request holding ``blocks`` is no longer in flight: count it out."""
        self._count(blocks, -1)

    def _count(self, blocks: list[int], delta: int) -> None:
        """A request in flight with ``blocks`` starts (``delta`` +1) or ends (-1): each
        block's count in :attr:`_inflight` and its last block's in :attr:`_ends` move by
        ``delta``; a count that reaches 0 leaves its table (both stay bounded by what is
        in flight)."""
        for table, keys in ((self._inflight, blocks), (self._ends, blocks[-1:])):
            for h in keys:
                n = table.get(h, 0) + delta
                if n > 0:
                    table[h] = n
                else:
                    table.pop(h, None)

    def first_token(self, request_id: str, now_ns: int, ttft_ns: float | None = None) -> None:
        """The first response body chunk of a request passed: one observed TTFT for the
        online refit; an adopted model applies to the next picks. ``ttft_ns``: the time
        to that chunk when it was measured elsewhere (Envoy's access log, ns; None: from
        the pick to ``now_ns``)."""
        got = self._first.pop(request_id, None)
        if got is None:
            return
        i, q, c, t0, alone = got
        key = self.learn_key(i)
        seen = float(now_ns - t0) if ttft_ns is None else ttft_ns
        if self.learner.observe(key, q, c, seen, alone, now_ns) is None:
            return
        for j in range(len(self._addr_of)):  # an own model, or the pool's for several keys
            m = self.learner.model(self.learn_key(j))
            self._coef[j] = (m.a, m.b, m.k)
