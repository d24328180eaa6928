"""Discrete-event simulator: a virtual clock, a heap of events, the core policies.

Request path (all times ns on the virtual clock):

1. **Arrival.** The prefix cache (:class:`~fulcrum.sim.cache.BlockCache`) gives the cached
   prefix ``c0``; the request's compute quota is the variable part of
   ``cost(input - c0, c0)`` (ns), its tier follows its total input length.
2. **Vision.** Each image is placed on a VE GPU by the VE policy and queued there (FIFO,
   one image at a time, ``v0 + v1 * patches`` each). When the last image is encoded the
   request is ready for prefill.
3. **Prefill.** Fulcrum: the daemon's own balancer object
   (:class:`fulcrum.core.prefill.balancer.PrefillBalancer`) holds the tier queues; when
   work waits it chooses the engine that takes it among the engines with no step
   running (an engine mid-step pulls at its step boundary, as the kit's engine loop
   does), each engine pulls again after each of its steps, and rounds re-split the
   engines across tiers -- the very calls the
   daemon makes. Baselines push each request to one DP rank
   (:class:`fulcrum.sim.baselines.PushRouter`, stale load reports). Every policy runs
   the same engine: it steps while any rank has work; each rank proposes a budget
   (core ``rank_budget``: the time of its work, within the step limit), the core
   ``plan_step`` applies the MIN and plans each rank's chunks; the
   step lasts ``max over ranks of cost`` plus the MoE stretch
   ``moe_fraction * b * mean tokens per rank * (moe_lb - 1)``; the ideal step lasts
   ``mean over ranks of cost``. The first token is produced when the last chunk ends.
4. **Decode.** The decode policy picks a GPU (core FleetView); a request with no room
   waits in FIFO until a GPU frees. An instance steps while it holds requests; GPU ``g``
   needs ``d0 + d1 * conc_g + d2 * kv_g``, the instance moves at its slowest GPU plus
   the MoE stretch ``moe_fraction * d1 * mean conc * (moe_lb - 1)``; ideal: the mean.
   Each step adds one token per request; a request finishes after ``output - 1`` steps.

Cache models (``cluster.cache.mode``): ``global`` looks the prefix up in one pool on
arrival; ``per_engine`` gives each prefill engine its own LRU cache (same total size) and
looks the request up when it reaches the engine that runs it, by the trace's hash ids.
Then Fulcrum's balancer carries the request's blocks and, unless the policy set turns
affinity off, a prefix index (:class:`fulcrum.core.prefill.affinity.Affinity`) that
prices each request per engine; a request's queued cost is the expected one (at the
longest prefix any engine is believed to hold). Push baselines route with the cost of a
fresh prompt, or (prefix-aware ones) with their own prefix index.

The fleet starts cold: the prefill engines join at t = 0 (an even split across tiers
until the first round closes), as a deployment starts.

Events at the same instant run arrivals first, then others in scheduling order; steps
are started by a "kick" event so that simultaneous arrivals share a step. Everything is
deterministic for a given seed: one ``numpy.random.Generator`` per concern, derived
from the seed.
"""

from __future__ import annotations

import heapq
import math
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from fulcrum.core.cost import CostModel
from fulcrum.core.prefill import chunks as core_chunks
from fulcrum.core.prefill import tiers as core_tiers
from fulcrum.core.prefill.affinity import Affinity, PrefixIndex
from fulcrum.core.prefill.balancer import (
    BalancerConfig,
    Offer,
    PrefillBalancer,
    Queued,
    rules_by_name,
)
from fulcrum.core.prefill.batch import quota_ns
from fulcrum.core.prefill.chunks import enqueue_task
from fulcrum.core.prefill.dispatch import pick_puller
from fulcrum.core.prefill.rules import DEFAULT as DEFAULT_RULES
from fulcrum.core.tenants import RequestClass
from fulcrum.sim import baselines
from fulcrum.sim.cache import PER_ENGINE, BlockCache, block_hit_ratio, engine_caches
from fulcrum.sim.cluster import Cluster
from fulcrum.sim.decode_stage import DecodeStage
from fulcrum.sim.events import DECODE_DONE as _DECODE_DONE
from fulcrum.sim.events import DECODE_KICK as _DECODE_KICK
from fulcrum.sim.events import PREFILL_DONE as _PREFILL_DONE
from fulcrum.sim.events import PREFILL_KICK as _PREFILL_KICK
from fulcrum.sim.events import ROUND as _ROUND
from fulcrum.sim.events import VE_DONE as _VE_DONE
from fulcrum.sim.experts import EplbGroup, Popularity, eplb_policy
from fulcrum.sim.policies import FULCRUM, PolicySet
from fulcrum.sim.stats import Series as Series
from fulcrum.sim.stats import StageTotals as StageTotals
from fulcrum.sim.tenant_stage import TenantStage
from fulcrum.sim.vision_stage import VisionStage
from fulcrum.sim.workload import BLOCK_TOKENS, Request

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


@dataclass(slots=True)
class SimResult:
    """Raw output of one run; :mod:`fulcrum.sim.report` summarises it.

    Per-request arrays have shape (n_requests,); times in ns, -1 when the event did not
    happen before the run ended.
    """

    policy: str
    seed: int
    tier_bounds: tuple[int, ...]
    arrival_ns: I64
    input_tokens: I64
    output_tokens: I64
    cached_tokens: I64
    ve_done_ns: I64
    first_token_ns: I64
    finish_ns: I64
    prefill: StageTotals
    decode: StageTotals
    prefill_imbalance: Series
    decode_imbalance: Series
    ve_imbalance: Series
    prefill_moe_lb: Series
    decode_moe_lb: Series
    prefill_gpus: int
    decode_gpus: int
    cache_hit_ratio: float
    end_ns: int
    eplb_rebalances: int
    window_ns: tuple[int, int] = (0, 0)
    decode_rejected: int = 0
    start_ns: int = 0
    block_hit_ratio: float = 0.0
    #: Per request (issue 23): its class, shed or not, when handed to an engine (ns,
    #: -1: never), useful prefill compute (ns). None on results built by hand.
    classes: tuple[RequestClass, ...] = ()
    shed: npt.NDArray[np.bool_] | None = None
    taken_ns: I64 | None = None
    useful_ns: F64 | None = None

    @property
    def span_ns(self) -> int:
        """Length of the run (ns): first arrival to the last event (or the drain horizon)."""
        return max(0, self.end_ns - self.start_ns)

    @property
    def prefill_utilisation(self) -> float:
        """Useful prefill compute / (prefill GPUs x run span): idle engines count."""
        span = self.span_ns * self.prefill_gpus
        return self.prefill.useful_ns / span if span > 0 else 0.0

    @property
    def decode_utilisation(self) -> float:
        """Useful decode compute / (decode GPUs x run span): idle instances count."""
        span = self.span_ns * self.decode_gpus
        return self.decode.useful_ns / span if span > 0 else 0.0

    @property
    def prefill_capacity_fraction(self) -> float:
        """Balanced prefill work done in the measurement window / (prefill GPUs x window).

        The window runs from 10% into the arrival span to the last arrival. When the
        offered load exceeds capacity (work always waits), this is throughput as a fraction
        of the ideal fleet, counting idle engines as lost; under light load it is the
        utilisation.
        """
        span = self.window_ns[1] - self.window_ns[0]
        if span <= 0:
            return 1.0
        return self.prefill.window_ideal_ns / (span * self.prefill_gpus)


def _step_heads(queues: Sequence[deque[core_chunks.PrefillTask]],
                cap: int) -> list[list[core_chunks.PrefillTask]]:
    """Each rank's queue head up to ``cap`` tokens of need (what one step may plan)."""
    heads: list[list[core_chunks.PrefillTask]] = []
    for q in queues:
        head: list[core_chunks.PrefillTask] = []
        need = 0
        for task in q:
            head.append(task)
            need += task.need
            if need >= cap:
                break
        heads.append(head)
    return heads


def _count_prefill_step(tot: StageTotals, plan: core_chunks.StepPlan,
                        queues: Sequence[deque[core_chunks.PrefillTask]], dur: float, *,
                        ideal: bool) -> None:
    """Add one prefill step of ``dur`` ns (its ranks' ``plan`` over ``queues``) to
    ``tot``: actual and ideal GPU time, where the difference went, tokens, useful work."""
    costs = plan.cost_ns
    r = len(costs)
    mean = sum(costs) / r
    mx = max(costs)
    tot.steps += 1
    tot.actual_ns += dur * r
    tot.ideal_ns += mean * r
    if not ideal:
        tot.moe_ns += (dur - mx) * r
        for cost, chunks, q in zip(costs, plan.chunks, queues, strict=True):
            if cost >= mx:
                continue
            if not chunks:
                tot.idle_ns += mx - cost
            elif len(chunks) == len(q) and chunks[-1].last:
                tot.drained_ns += mx - cost
            else:
                tot.short_ns += mx - cost
    tot.tokens += sum(plan.tokens)
    tot.useful_ns += sum(ch.cost_ns for chs in plan.chunks for ch in chs)


def _eplb_groups(
    cluster: Cluster, eplb: str, rngs: tuple[np.random.Generator, ...],
) -> tuple[list[EplbGroup], list[EplbGroup]]:
    """Expert popularity and one EPLB group per prefill engine and per decode instance
    (``rngs``: popularity prefill, popularity decode, MoE prefill, MoE decode)."""
    r_pop_p, r_pop_d, r_moe_p, r_moe_d = rngs
    x, p, d = cluster.experts, cluster.prefill, cluster.decode
    place = eplb_policy(eplb)
    pop_p = Popularity(x, r_pop_p)
    pop_d = Popularity(x, r_pop_d)
    prefill = [EplbGroup("prefill", p.ranks_per_engine, pop_p, place, r_moe_p)
               for _ in range(p.engines)]
    decode = [EplbGroup("decode", d.gpus_per_instance, pop_d, place, r_moe_d)
              for _ in range(d.instances)]
    return prefill, decode


class Simulator:
    """One run of a workload through a cluster under a policy set (see module docstring)."""

    def __init__(
        self,
        cluster: Cluster,
        policy: PolicySet,
        requests: Sequence[Request],
        *,
        seed: int = 0,
        drain_s: float = 1_800.0,
        progress: Callable[[float], None] | None = None,
        trace: Callable[[tuple[object, ...]], None] | None = None,
    ) -> None:
        self.cluster = cluster
        self.policy = policy
        self.reqs = sorted(requests, key=lambda r: (r.arrival_ns, r.rid))
        self.seed = seed
        self.progress = progress
        ss = np.random.SeedSequence(seed)
        (r_route, r_pop_p, r_pop_d, r_moe_p, r_moe_d, r_ve) = (
            np.random.default_rng(s) for s in ss.spawn(6)
        )
        self.rng_route = r_route
        self.rng_ve = r_ve
        p = cluster.prefill
        self.model = CostModel(a=p.cost_model.a, b=p.cost_model.b, k=p.cost_model.k)
        self.n = len(self.reqs)
        first = self.reqs[0].arrival_ns if self.reqs else 0
        last = self.reqs[-1].arrival_ns if self.reqs else 0
        self.horizon_ns = last + int(drain_s * 1e9)
        self.window = (first + (last - first) // 10, last)

        self._init_requests()
        self.tenants = TenantStage(cluster.tenants.to_policy(), self.reqs)
        self._init_prefill(r_route, trace)
        self._init_affinity()
        self._init_decode()
        self._init_vision()
        self.eplb_prefill, self.decode.eplb = _eplb_groups(
            cluster, policy.eplb, (r_pop_p, r_pop_d, r_moe_p, r_moe_d))
        self._init_bookkeeping()

    def _init_requests(self) -> None:
        """Per-request arrays (index: request id after sorting by arrival)."""
        p, cluster, n = self.cluster.prefill, self.cluster, self.n
        self.arrival = np.array([r.arrival_ns for r in self.reqs], dtype=np.int64)
        self.inp = np.array([r.input_tokens for r in self.reqs], dtype=np.int64)
        self.outp = np.array([r.output_tokens for r in self.reqs], dtype=np.int64)
        self.cached = np.zeros(n, dtype=np.int64)
        self.ve_done = np.full(n, -1, dtype=np.int64)
        self.first_tok = np.full(n, -1, dtype=np.int64)
        self.finish = np.full(n, -1, dtype=np.int64)
        self.quota: list[int] = [0] * n
        self.images_left: list[int] = [0] * n
        self.cache = BlockCache(cluster.cache.capacity_blocks)
        self.per_engine = p.cache_model == PER_ENGINE
        self.engine_caches = (
            engine_caches(cluster.cache.capacity_blocks, p.engines) if self.per_engine else []
        )

    def _init_prefill(self, r_route: np.random.Generator,
                      trace: Callable[[tuple[object, ...]], None] | None) -> None:
        """Prefill engines, ranks and the daemon's balancer (or a push router)."""
        policy = self.policy
        p = self.cluster.prefill
        self.n_engines = p.engines
        self.n_ranks = p.ranks_per_engine
        self.bounds = core_tiers.validate_bounds(p.tier_bounds)
        self.n_tiers = len(self.bounds) + 1
        self.queues: list[list[deque[core_chunks.PrefillTask]]] = [
            [deque() for _ in range(p.ranks_per_engine)] for _ in range(p.engines)
        ]
        self.rank_load: list[list[float]] = [
            [0.0] * p.ranks_per_engine for _ in range(p.engines)
        ]
        self.rank_reqs = np.zeros(p.engines * p.ranks_per_engine, dtype=np.int64)
        self.engine_busy = [False] * p.engines
        self.engine_kicked = [False] * p.engines
        self.engine_plan: list[core_chunks.StepPlan | None] = [None] * p.engines
        self.horizon = p.horizons_ns()
        self.fulcrum_prefill = policy.prefill == FULCRUM
        self.router = None if self.fulcrum_prefill else baselines.PushRouter(
            policy.prefill, p.engines, p.ranks_per_engine, r_route,
            staleness_ns=int(p.report_staleness_s * 1e9),
        )
        # The daemon's balancer object itself, driven on the virtual clock. Cold start,
        # as a deployment starts: the engines join one by one at t = 0 (an even split
        # until the first round closes).
        self.engine_ids = [f"e{i:03d}" for i in range(p.engines)]
        rules = rules_by_name(policy.rules if policy.rules != DEFAULT_RULES else p.rules)
        self.balancer = PrefillBalancer(BalancerConfig(
            bounds=self.bounds,
            batch_cap_ns=tuple(p.tier_batch_cap_ns),
            backlog_rounds=p.backlog_rounds, hysteresis=p.hysteresis,
            max_batch_requests=p.max_batch_requests,
            rules=rules.with_order(policy.order) if policy.order else rules,
            step_quota_ns=p.step_quota_ns,
            step_floor_ns=int(p.step_quota_ns * p.step_floor_fraction),
            min_dwell_ns=p.min_tier_dwell_ms * 1_000_000,
            tenants=self.tenants.table.policy,
        ))
        #: Optional observer of the balancer calls (tests replay them through the daemon).
        self.trace: Callable[[tuple[object, ...]], None] | None = trace

    def _init_affinity(self) -> None:
        """Per-engine caches: Fulcrum's prefix index, a prefix-aware router's own index;
        the engines join; the chunk planner's budget."""
        policy = self.policy
        p = self.cluster.prefill
        # a prefix-aware push router's own index.
        self.affinity: Affinity | None = None
        self.router_index: PrefixIndex | None = None
        per_cap = (self.engine_caches[0].capacity_blocks if self.engine_caches else None)
        index_cap = min(per_cap if per_cap is not None else 1 << 24, 1 << 24)
        if self.per_engine and self.fulcrum_prefill and policy.affinity:
            self.affinity = Affinity(
                PrefixIndex(BLOCK_TOKENS), self._cost,
                max_wait_ns=p.affinity_max_wait_ms * 1_000_000,
            )
            self.balancer.affinity = self.affinity
            for eid in self.engine_ids:
                self.affinity.index.add_engine(eid, index_cap)
        if self.per_engine and policy.prefill in baselines.PREFIX_NAMES:
            self.router_index = PrefixIndex(BLOCK_TOKENS)
            for e in range(p.engines):
                self.router_index.add_engine(str(e), index_cap)
        for eid in self.engine_ids if self.fulcrum_prefill else ():
            self.balancer.add_engine(eid, p.ranks_per_engine)
            self._trace(("join", 0, eid, p.ranks_per_engine))
        # Every policy runs the same engine-side chunk planner (time budget, chunk cap).
        self.step_limit = float(p.step_quota_ns)
        self.step_floor = p.step_quota_ns * p.step_floor_fraction
        self.chunk_cap = p.max_chunk_tokens

    def _init_decode(self) -> None:
        """Decode GPUs, instances and the decode policy (:class:`DecodeStage`)."""
        self.decode = DecodeStage(self, self.cluster.decode, self.policy, self.n,
                                  self.rng_route)

    def _init_vision(self) -> None:
        """Vision-encoder GPUs and the VE policy (:class:`VisionStage`)."""
        self.vision = VisionStage(self, self.cluster.vision, self.policy.vision, self.rng_ve)

    def _init_bookkeeping(self) -> None:
        """Clock, event heap and the running totals."""
        n = self.n
        self.now = 0
        self.heap: list[tuple[int, int, int, int]] = []
        self.seq = 0
        self.pending = n
        self.prefill_tot = StageTotals()
        self.s_pimb = Series()
        self.s_plb = Series()

    # -- event plumbing ---------------------------------------------------------------------
    def _push(self, t: int, kind: int, arg: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, arg))

    def run(self) -> SimResult:
        """Run to completion (or the drain horizon) and return the raw result."""
        reqs = self.reqs
        i = 0
        n = self.n
        if self.fulcrum_prefill and n:
            self._push(self.cluster.prefill.round_period_ms * 1_000_000, _ROUND, 0)
        next_report = 0.0
        while True:
            t_heap = self.heap[0][0] if self.heap else None
            if i < n and (t_heap is None or reqs[i].arrival_ns <= t_heap):
                self.now = reqs[i].arrival_ns
                self._arrive(i)
                i += 1
                if self.progress is not None and i / n >= next_report:
                    self.progress(i / n)
                    next_report += 0.05
                continue
            if t_heap is None or (self.pending == 0 and i >= n):
                break
            t, _, kind, arg = heapq.heappop(self.heap)
            if t > self.horizon_ns:
                self.now = self.horizon_ns
                break
            self.now = t
            if kind == _PREFILL_DONE:
                self._prefill_done(arg)
            elif kind == _DECODE_DONE:
                self.decode.done(arg)
            elif kind == _VE_DONE:
                self.vision.done(arg)
            elif kind == _ROUND:
                self._round()
            elif kind == _PREFILL_KICK:
                self.engine_kicked[arg] = False
                if not self.engine_busy[arg]:
                    self._start_prefill_step(arg)
            elif kind == _DECODE_KICK:
                self.decode.kick(arg)
        return _result_of(self)

    # -- arrival -----------------------------------------------------------------------
    def _cost(self, q: int, c: int) -> int:
        return self.model.cost_ns(q, c)

    def _arrive(self, rid: int) -> None:
        r = self.reqs[rid]
        # Per-engine caches: looked up when the request reaches its engine (_enqueue);
        # until then it is priced as a fresh prompt (or by the balancer's affinity).
        c0 = 0 if self.per_engine else self.cache.lookup_and_insert(r.hash_ids, r.input_tokens)
        self.cached[rid] = c0
        q = r.input_tokens - c0
        self.quota[rid] = self.model.cost_ns(q, c0)
        if r.image_patches:
            self.images_left[rid] = len(r.image_patches)
            for patches in r.image_patches:
                self.vision.place(rid, patches)
        else:
            self._prefill_ready(rid)

    # -- prefill ----------------------------------------------------------------------------
    def _trace(self, event: tuple[object, ...]) -> None:
        if self.trace is not None:
            self.trace(event)

    def _prefill_ready(self, rid: int) -> None:
        if self.fulcrum_prefill:
            bal = self.balancer
            blocks = tuple(self.reqs[rid].hash_ids) if self.per_engine else ()
            cost = self.quota[rid]
            if self.affinity is not None and blocks:
                cost = self.affinity.expected_cost(int(self.inp[rid]), blocks)
            item = Queued(str(rid), int(self.inp[rid]), int(self.cached[rid]),
                          bal.tier_for(int(self.inp[rid]), blocks), cost, self.now, blocks,
                          cls=self.tenants.classes[rid])
            if self.tenants.refuse(bal, item, self.now - int(self.arrival[rid])):
                self.pending -= 1  # shed: refused at once, never queued
                return
            red = bal.enqueue(item)
            self._trace(("submit", self.now, item.request_id, item.total, item.cached,
                         tuple(bal.engines_per_tier())))
            if red is not None:
                self._pull_all()
            else:
                self._pull(item.tier)
        else:
            assert self.router is not None
            if self.router_index is not None:
                rank, _ = self.router.route_prefix(
                    self.now, self.router_index, int(self.inp[rid]),
                    self.reqs[rid].hash_ids, self._cost, float(self.step_limit))
            else:
                rank = self.router.route(self.now, self.quota[rid])
            e, r = divmod(rank, self.n_ranks)
            self._enqueue(e, r, rid, self.tenants.classes[rid].priority)
            self._kick_engine(e)

    def _enqueue(self, e: int, r: int, rid: int, band: float) -> None:
        total = int(self.inp[rid])
        if self.per_engine:
            # The engine's own cache: what it really holds decides the cost.
            c0 = self.engine_caches[e].lookup_and_insert(self.reqs[rid].hash_ids, total)
            self.cached[rid] = c0
            self.quota[rid] = self.model.cost_ns(total - c0, c0)
        enqueue_task(self.queues[e][r], core_chunks.PrefillTask(
            str(rid), int(self.cached[rid]), total, band))
        self.rank_load[e][r] += self.quota[rid]
        self.rank_reqs[e * self.n_ranks + r] += 1

    def _remaining(self, e: int) -> int:
        """Engine ``e``'s remaining quota (ns): over its ranks, ``max(0, horizon - load)``
        with the horizon of its tier."""
        tier = self.balancer.engine_tier(self.engine_ids[e])
        return quota_ns(self.horizon[max(0, tier)], self._loads(e))

    def _loads(self, e: int) -> list[int]:
        kit = self.tenants.whole_loads(self.queues[e], self.model)  # as the kit reports
        return kit if kit is not None else [max(0, int(x)) for x in self.rank_load[e]]

    def _take(self, e: int) -> bool:
        """Engine ``e`` pulls (as a real engine does between steps): True when it got work."""
        eid = self.engine_ids[e]
        remaining = self._remaining(e)
        loads = self._loads(e)
        bands = self.tenants.band_loads(self.queues[e], self.model)
        taken = self.balancer.take(eid, remaining, loads, now_ns=self.now, band_loads=bands)
        ids = tuple(it.request_id for it in taken.items)
        self._trace(("pull", self.now, eid, remaining, tuple(loads), ids, taken.ranks, bands,
                     taken.bands))
        self.tenants.taken(taken.items, self.now)
        for it, r, band in zip(taken.items, taken.ranks, taken.bands, strict=True):
            self._enqueue(e, r, int(it.request_id), band)
        if taken.items:
            self._kick_engine(e)
        return bool(taken.items)

    def _pull(self, tier: int) -> None:
        """Work waits in ``tier``: the balancer chooses which engine takes it, until no
        engine can (each engine offers its remaining quota and rank loads). Only engines
        with no step running offer, as engines running the kit's loop
        (:class:`fulcrum.client.prefill.PrefillEngineLoop`) do: an engine pulls once
        between its steps (without waiting) and parks a long poll only when it has
        nothing to step, so work that arrives while every engine is mid-step waits in the
        tier queue for the first engine to reach a step boundary."""
        bal = self.balancer
        while bal.head(tier) is not None:
            # mid-step engines do not offer: they pull at their step boundary
            waiting = [e for e in range(self.n_engines) if not self.engine_busy[e]]
            offers = [Offer(self.engine_ids[e], self._remaining(e), self._loads(e),
                            self.tenants.band_loads(self.queues[e], self.model)) for e in waiting]
            i = pick_puller(bal, tier, offers, self.now)
            if i < 0 or not self._take(waiting[i]):
                return

    def _pull_all(self) -> None:
        for t in range(self.n_tiers):
            self._pull(t)

    def _kick_engine(self, e: int) -> None:
        if not self.engine_busy[e] and not self.engine_kicked[e]:
            self.engine_kicked[e] = True
            self._push(self.now, _PREFILL_KICK, e)

    def _start_prefill_step(self, e: int) -> None:
        queues = self.queues[e]
        if not any(queues):
            self.engine_busy[e] = False
            return
        cap = self.chunk_cap
        heads = _step_heads(queues, cap)
        budgets = core_chunks.rank_budgets(queues, self.step_limit, self.model,
                                           floor_ns=self.step_floor)
        plan = core_chunks.plan_step(heads, budgets, self.model, cap=cap)
        costs = plan.cost_ns
        tokens = sum(plan.tokens)
        r = len(costs)
        mean = sum(costs) / r
        mx = max(costs)
        if self.policy.ideal:
            lb = 1.0
            dur = mean
        else:
            lb = self.eplb_prefill[e].step(self.now, tokens)
            extra = self.cluster.prefill.moe_fraction * self.model.b * tokens / r * (lb - 1.0)
            dur = mx + extra
        _count_prefill_step(self.prefill_tot, plan, queues, dur, ideal=self.policy.ideal)
        self.tenants.step(plan)
        if self.window[0] <= self.now < self.window[1]:
            self.prefill_tot.window_ideal_ns += mean * r
        if mean > 0:
            self.s_pimb.add(self.now, mx / mean)
        self.s_plb.add(self.now, lb, float(tokens))
        self.engine_busy[e] = True
        self.engine_plan[e] = plan
        self._push(self.now + max(1, math.ceil(dur)), _PREFILL_DONE, e)

    def _prefill_done(self, e: int) -> None:
        plan = self.engine_plan[e]
        assert plan is not None
        self.engine_plan[e] = None
        finished: list[int] = []
        for r, chunks in enumerate(plan.chunks):
            q = self.queues[e][r]
            for ch in chunks:
                task = q.popleft()
                self.rank_load[e][r] -= ch.cost_ns
                if ch.last:
                    self.rank_load[e][r] -= self.model.k  # a request's quota holds one k
                    finished.append(int(task.request_id))
                    self.rank_reqs[e * self.n_ranks + r] -= 1
                else:
                    q.appendleft(
                        replace(task, computed=ch.start + ch.tokens)
                    )
            if not q:
                self.rank_load[e][r] = 0.0  # clear float drift
        self.engine_busy[e] = False
        if self.router is not None:
            r0 = e * self.n_ranks
            self.router.report(self.now, e, self.rank_reqs[r0:r0 + self.n_ranks],
                               self.rank_load[e])
        for rid in finished:
            self.first_tok[rid] = self.now
            self.decode.admit(rid)
        if self.fulcrum_prefill:
            self._take(e)
            self._pull_all()
        self._start_prefill_step(e)

    def _round(self) -> None:
        """Close a round: the balancer re-splits the engines across tiers."""
        red = self.balancer.redistribute("round", self.now)
        self._trace(("round", self.now, red.counts))
        self._pull_all()
        if self.pending > 0:
            self._push(self.now + self.cluster.prefill.round_period_ms * 1_000_000, _ROUND, 0)

    def _finish(self, rid: int) -> None:
        self.finish[rid] = self.now
        self.pending -= 1



def _result_of(sim: Simulator) -> SimResult:
    """The raw result of a finished simulation."""
    return SimResult(
        policy=sim.policy.name,
        seed=sim.seed,
        tier_bounds=sim.bounds,
        arrival_ns=sim.arrival,
        input_tokens=sim.inp,
        output_tokens=sim.outp,
        cached_tokens=sim.cached,
        ve_done_ns=sim.ve_done,
        first_token_ns=sim.first_tok,
        finish_ns=sim.finish,
        prefill=sim.prefill_tot,
        decode=sim.decode.tot,
        prefill_imbalance=sim.s_pimb,
        decode_imbalance=sim.decode.imbalance,
        ve_imbalance=sim.vision.imbalance,
        prefill_moe_lb=sim.s_plb,
        decode_moe_lb=sim.decode.moe_lb,
        prefill_gpus=sim.n_engines * sim.n_ranks,
        decode_gpus=sim.cluster.decode.n_gpus,
        cache_hit_ratio=(
            sum(c.hit_tokens for c in sim.engine_caches)
            / max(1, sum(c.lookup_tokens for c in sim.engine_caches))
            if sim.per_engine else sim.cache.hit_ratio
        ),
        block_hit_ratio=block_hit_ratio(sim.engine_caches if sim.per_engine
                                        else [sim.cache]),
        end_ns=sim.now,
        eplb_rebalances=sum(g.rebalances for g in sim.eplb_prefill + sim.decode.eplb),
        window_ns=sim.window,
        decode_rejected=sim.decode.rejected,
        start_ns=int(sim.arrival[0]) if sim.n else 0,
        classes=tuple(sim.tenants.classes),
        shed=sim.tenants.shed,
        taken_ns=sim.tenants.taken_ns,
        useful_ns=sim.tenants.useful_ns,
    )



def simulate(
    cluster: Cluster,
    policy: PolicySet,
    requests: Sequence[Request],
    *,
    seed: int = 0,
    drain_s: float = 1_800.0,
    progress: bool = False,
    trace: Callable[[tuple[object, ...]], None] | None = None,
) -> SimResult:
    """Convenience wrapper: build a :class:`Simulator`, run it, return the result."""

    def report(frac: float) -> None:
        sys.stderr.write(f"\r  {policy.name}: {frac * 100:5.1f}% of arrivals")
        if frac >= 1.0:
            sys.stderr.write("\n")
        sys.stderr.flush()

    show = progress and sys.stderr.isatty()
    sim = Simulator(
        cluster, policy, requests, seed=seed, drain_s=drain_s,
        progress=report if show else None, trace=trace,
    )
    return sim.run()
