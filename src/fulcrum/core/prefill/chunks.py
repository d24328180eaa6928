"""Engine-side chunk planner: how many tokens each request computes in each prefill step.

Rule (SPEC section 3, level 4):

* each DP rank has a FIFO queue of prefill tasks (per priority band, higher bands first:
  :mod:`fulcrum.core.prefill.bands`; with one band, plain FIFO);
* every step has one time budget for the whole EP group: the MIN over the ranks'
  budgets (ns) -- the engine all-reduces it, the planner takes the per-rank values and
  applies the MIN, so every rank of the group takes the same time per step;
* a rank's budget (:func:`rank_budget`) is ``compute_quota_limit`` capped by the time of
  the work it holds: ``k`` plus the remaining cost of its queued requests (those of the
  head's priority band), and never below ``floor_ns`` (an empty rank proposes the
  limit: it does not constrain the MIN). So a step lasts until the lightest busy rank
  has done all its work of its head's band (or the limit):
  no rank sits drained for the rest of a step while another fills a full budget, and
  new work reaches a rank that has finished at the next step rather than a full
  budget later. ``floor_ns`` bounds the steps per second (the fixed cost ``k`` is paid
  every step); ``floor_ns = limit`` gives the fixed budget;
* on each rank the planner walks its queue head first and gives each request the
  largest ``q`` (tokens) with ``k + sum of variable costs <= budget`` (closed-form inverse
  of the cost model; the fixed overhead ``k`` is paid once per step), never more than
  ``cap`` (32,768) tokens per rank per step in total;
* a request that does not fit whole is split: it gets what fits now and continues from
  where it stopped in the next step, still at the head; nothing behind it runs in this
  step (FIFO order of progress);
* no starvation: when not even one token of the head request fits an empty step (its
  prefix is so long that ``cost(1, c) > budget``) it is given one token anyway
  (``force_progress``), so every queued request finishes after finitely many steps.

:func:`plan_step` only plans; :func:`commit` returns the queues advanced by a plan.
:class:`ChunkPlanner` wraps both for an engine process.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Final

from fulcrum.core.cost import DEFAULT_COST_MODEL, MAX_CHUNK_TOKENS, CostModel

NAME: Final = "fifo_min_budget"

DEFAULT_FLOOR_FRACTION: Final = 0.1
"""Default lowest rank budget, as a fraction of ``compute_quota_limit`` (our decision:
at most ten steps per limit, so the per-step fixed cost ``k`` stays small)."""


@dataclass(frozen=True, slots=True)
class PrefillTask:
    """A request waiting on one DP rank.

    ``computed``: prefix already computed or cached (tokens, the ``c`` of the next chunk);
    ``total``: total context length (tokens); ``total > computed >= 0``; ``priority``: the
    request's band (higher first on its rank, :mod:`fulcrum.core.prefill.bands`: its
    priority, + 0.5 when taken with fair-share precedence);
    ``overtaken``: tokens of later higher-band work that passed it on its rank.
    """

    request_id: str
    computed: int
    total: int
    priority: float = 0
    overtaken: int = 0

    def __post_init__(self) -> None:
        if self.computed < 0:
            raise ValueError(f"computed: must be >= 0, got {self.computed}")
        if self.total <= self.computed:
            raise ValueError(
                f"total: must be > computed, got total={self.total} computed={self.computed}"
            )

    @property
    def need(self) -> int:
        """Tokens still to compute."""
        return self.total - self.computed


@dataclass(frozen=True, slots=True)
class Chunk:
    """One request's share of one step on one rank.

    ``start`` is the prefix ``c`` (tokens) the chunk builds on, ``tokens`` the ``q``
    computed; ``cost_ns`` its variable cost ``a*q*(c+q/2) + b*q`` (ns, without ``k``);
    ``last`` is True when the request's prefill completes with this chunk.
    """

    request_id: str
    start: int
    tokens: int
    cost_ns: float
    last: bool


@dataclass(frozen=True, slots=True)
class StepPlan:
    """The plan of one prefill step for an engine of R ranks.

    ``budget_ns``: the group budget (MIN over ranks, ns); ``chunks[r]``: rank r's chunks
    in FIFO order; ``cost_ns[r]``: rank r's predicted step time (ns; ``k`` plus its chunks'
    costs, 0 when it has nothing to do); ``tokens[r]``: tokens rank r computes.
    """

    budget_ns: float
    chunks: tuple[tuple[Chunk, ...], ...]
    cost_ns: tuple[float, ...]
    tokens: tuple[int, ...]

    @property
    def step_ns(self) -> float:
        """Predicted time of the step for the group: the slowest rank (ns)."""
        return max(self.cost_ns, default=0.0)


def _plan_rank(
    queue: Sequence[PrefillTask],
    budget_ns: float,
    model: CostModel,
    cap: int,
    force_progress: bool,
) -> tuple[tuple[Chunk, ...], float, int]:
    chunks: list[Chunk] = []
    spent = 0.0  # variable cost of the chunks so far (ns)
    tokens = 0
    fixed = model.k
    for task in queue:
        room = cap - tokens
        if room <= 0:
            break
        c = task.computed
        q = model.max_tokens(c, budget_ns - spent, cap=room, need=task.need)
        if q == 0:
            if chunks or not force_progress:
                break
            q = 1  # starvation guard: the head of an empty step always advances
        cost = model.cost(q, c) - fixed
        chunks.append(Chunk(task.request_id, c, q, cost, q == task.need))
        spent += cost
        tokens += q
        if q < task.need:
            break  # split: the remainder stays at the head for the next step
    step_cost = fixed + spent if chunks else 0.0
    return tuple(chunks), step_cost, tokens


def busy_budget(need: float, limit_ns: float, floor_ns: float) -> float:
    """A busy rank's step budget (ns) for ``need`` ns of work: at least the floor (at
    most the limit), at most the limit. The one clipping rule of :func:`rank_budget`
    and of the prefix affinity's step prediction (:func:`fulcrum.core.prefill.order.step_ns`)."""
    return min(limit_ns, max(min(floor_ns, limit_ns), need))


def rank_budget(
    queue: Iterable[PrefillTask],
    limit_ns: float,
    model: CostModel = DEFAULT_COST_MODEL,
    *,
    floor_ns: float = 0.0,
) -> float:
    """One rank's budget for the next step (ns), to be all-reduced with MIN.

    ``queue``: the rank's FIFO queue (may be lazy; read until the limit is reached);
    ``limit_ns``: ``compute_quota_limit`` (> 0); ``floor_ns``: lowest budget of a busy
    rank (clipped to ``limit_ns``). Returns ``min(limit, max(floor, k + sum of the queued
    requests' remaining variable costs))``, or ``limit_ns`` for an empty queue. Only the
    head's priority band counts (:mod:`fulcrum.core.prefill.bands`): lower-band work
    queued behind it does not lengthen the step, so a higher-band request ends its step
    when it is done instead of waiting for lower-band chunks on its rank and on the
    sibling ranks (with one band every task counts).
    """
    if limit_ns <= 0:
        raise ValueError(f"limit_ns: must be > 0, got {limit_ns}")
    need = 0.0
    busy = False
    band: float = 0
    for task in queue:
        if not busy:
            busy = True
            need = model.k
            band = task.priority
        elif task.priority < band:
            break
        need += model.cost(task.need, task.computed) - model.k
        if need >= limit_ns:
            return float(limit_ns)
    if not busy:
        return float(limit_ns)
    return float(busy_budget(need, limit_ns, floor_ns))


def rank_budgets(
    queues: Sequence[Iterable[PrefillTask]],
    limit_ns: float,
    model: CostModel = DEFAULT_COST_MODEL,
    *,
    floor_ns: float = 0.0,
) -> list[float]:
    """:func:`rank_budget` of every rank (ns), one per queue; pass them to :func:`plan_step`."""
    return [rank_budget(q, limit_ns, model, floor_ns=floor_ns) for q in queues]


def plan_step(
    queues: Sequence[Sequence[PrefillTask]],
    budgets_ns: Sequence[float],
    model: CostModel = DEFAULT_COST_MODEL,
    *,
    cap: int = MAX_CHUNK_TOKENS,
    force_progress: bool = True,
) -> StepPlan:
    """Plan one step. ``queues[r]`` is rank r's FIFO queue (head first), ``budgets_ns[r]``
    rank r's step budget (ns); ``len(queues) == len(budgets_ns) >= 1``."""
    if len(queues) != len(budgets_ns) or not queues:
        raise ValueError("budgets_ns: need one budget per rank queue (>= 1 rank)")
    if cap < 1:
        raise ValueError(f"cap: must be >= 1, got {cap}")
    budget = float(min(budgets_ns))
    per_rank = [_plan_rank(q, budget, model, cap, force_progress) for q in queues]
    return StepPlan(
        budget_ns=budget,
        chunks=tuple(p[0] for p in per_rank),
        cost_ns=tuple(p[1] for p in per_rank),
        tokens=tuple(p[2] for p in per_rank),
    )


def commit(
    queues: Sequence[Sequence[PrefillTask]], plan: StepPlan
) -> tuple[tuple[PrefillTask, ...], ...]:
    """The queues after ``plan`` ran: finished requests leave, a split one advances."""
    if len(queues) != len(plan.chunks):
        raise ValueError("plan: rank count does not match the queues")
    out: list[tuple[PrefillTask, ...]] = []
    for queue, chunks in zip(queues, plan.chunks, strict=True):
        rest = list(queue)
        for i, chunk in enumerate(chunks):
            task = rest[i]
            if task.request_id != chunk.request_id or task.computed != chunk.start:
                raise ValueError(f"plan: stale for request {chunk.request_id!r}")
        tail = rest[len(chunks) :]
        if chunks and not chunks[-1].last:
            ch = chunks[-1]
            total = rest[len(chunks) - 1].total
            tail.insert(0, PrefillTask(ch.request_id, ch.start + ch.tokens, total))
        out.append(tuple(tail))
    return tuple(out)


# -- priority bands on a rank (fulcrum.core.prefill.bands has the rule) --------------

DEFAULT_MAX_OVERTAKEN_TOKENS: Final = 65_536
"""Most tokens of later, higher-band work that may pass a task on its rank (our
decision: two of the largest chunks, about 4 s of compute at the default cost model)."""


def enqueue_task(queue: deque[PrefillTask], task: PrefillTask,
                 max_overtaken_tokens: int = DEFAULT_MAX_OVERTAKEN_TOKENS) -> int:
    """Put ``task`` on a rank's queue (head first): behind every task of its band or a
    higher one, ahead of the lower-band tasks at the tail that may still be passed (each
    passed task's ``overtaken`` grows by ``task.need`` tokens and may not pass
    ``max_overtaken_tokens``). Returns how many tasks it passed. O(tasks passed)."""
    if not queue or queue[-1].priority >= task.priority:
        queue.append(task)
        return 0
    passed = 0
    n = len(queue)
    while passed < n:
        prev = queue[n - 1 - passed]
        if prev.priority >= task.priority or prev.overtaken + task.need > max_overtaken_tokens:
            break
        passed += 1
    if passed == 0:
        queue.append(task)
        return 0
    tail = [queue.pop() for _ in range(passed)]
    queue.append(task)
    for t in reversed(tail):
        queue.append(replace(t, overtaken=t.overtaken + task.need))
    return passed


def band_loads(queues: Sequence[Iterable[PrefillTask]], model: CostModel,
               max_overtaken_tokens: int = DEFAULT_MAX_OVERTAKEN_TOKENS) -> dict[float, list[int]]:
    """Per band ``p`` present on the engine, per rank: the predicted cost (ns) of what runs
    before a new request of band ``p`` there -- its tasks of priority ``p`` or higher, and
    every task up to the last lower-band one that may no longer be passed (``overtaken``
    at ``max_overtaken_tokens``). ``queues[r]``: rank r's queue, head first; the lowest
    band's loads are the whole loads. Empty when the engine holds nothing. O(tasks x
    bands)."""
    ranks = [[(t.priority, t.overtaken >= max_overtaken_tokens,
               int(model.cost_ns(t.need, t.computed))) for t in q] for q in queues]
    bands = sorted({prio for rank in ranks for prio, _, _ in rank})
    out: dict[float, list[int]] = {}
    for p in bands:
        row = []
        for rank in ranks:
            stuck = max((i for i, (prio, full, _) in enumerate(rank) if prio < p and full),
                        default=-1)
            row.append(sum(ns for i, (prio, _, ns) in enumerate(rank)
                           if i <= stuck or prio >= p))
        out[p] = row
    return out


class ChunkPlanner:
    """Stateful wrapper for an engine: ``add`` tasks per rank, then ``step`` each prefill step.

    ``plan`` never mutates; ``commit`` (or ``step`` = plan + commit) advances the queues.
    """

    def __init__(
        self,
        n_ranks: int,
        model: CostModel = DEFAULT_COST_MODEL,
        *,
        cap: int = MAX_CHUNK_TOKENS,
        force_progress: bool = True,
        max_overtaken_tokens: int | None = None,
    ) -> None:
        if n_ranks < 1:
            raise ValueError(f"n_ranks: must be >= 1, got {n_ranks}")
        self.model = model
        self.cap = cap
        self.force_progress = force_progress
        self.max_overtaken_tokens = (DEFAULT_MAX_OVERTAKEN_TOKENS
                                     if max_overtaken_tokens is None else max_overtaken_tokens)
        self._queues: list[deque[PrefillTask]] = [deque() for _ in range(n_ranks)]

    @property
    def n_ranks(self) -> int:
        """Number of DP ranks."""
        return len(self._queues)

    def add(self, rank: int, task: PrefillTask) -> None:
        """Queue ``task`` on rank ``rank``: FIFO within its band, ahead of lower bands
        (:func:`enqueue_task`)."""
        if not 0 <= rank < len(self._queues):
            raise ValueError(f"rank: must be in [0, {len(self._queues)}), got {rank}")
        enqueue_task(self._queues[rank], task, self.max_overtaken_tokens)

    def band_loads(self) -> dict[float, list[int]]:
        """Per band held, per rank: the predicted cost (ns) of its tasks of that band or
        higher (:func:`band_loads`; the pull's
        ``band_rank_loads``)."""
        return band_loads(self._queues, self.model, self.max_overtaken_tokens)

    def queue(self, rank: int) -> tuple[PrefillTask, ...]:
        """Snapshot of rank ``rank``'s queue, head first."""
        return tuple(self._queues[rank])

    def pending_tokens(self) -> tuple[int, ...]:
        """Tokens still to compute per rank."""
        return tuple(sum(t.need for t in q) for q in self._queues)

    def budgets(self, limit_ns: float, *, floor_ns: float = 0.0) -> list[float]:
        """Each rank's budget for the next step (ns; :func:`rank_budget`): all-reduce
        them with MIN across the group (or pass them to :meth:`plan`, which applies it)."""
        return rank_budgets(self._queues, limit_ns, self.model, floor_ns=floor_ns)

    def plan(self, budgets_ns: Sequence[float]) -> StepPlan:
        """Plan the next step with per-rank budgets (ns); the MIN applies."""
        # Only the heads can be touched in one step; pass bounded prefixes.
        heads = [list(_head(q, self.cap)) for q in self._queues]
        return plan_step(
            heads, budgets_ns, self.model, cap=self.cap, force_progress=self.force_progress
        )

    def commit(self, plan: StepPlan) -> None:
        """Advance the queues by a plan made from their current state."""
        for r, chunks in enumerate(plan.chunks):
            q = self._queues[r]
            for i, chunk in enumerate(chunks):
                if i >= len(q) or q[i].request_id != chunk.request_id or (
                    q[i].computed != chunk.start
                ):
                    raise ValueError(f"plan: stale for request {chunk.request_id!r}")
            for chunk in chunks:
                task = q.popleft()
                if not chunk.last:
                    q.appendleft(replace(task, computed=chunk.start + chunk.tokens))

    def step(self, budgets_ns: Sequence[float]) -> StepPlan:
        """Plan and commit one step."""
        plan = self.plan(budgets_ns)
        self.commit(plan)
        return plan


def _head(queue: deque[PrefillTask], cap: int) -> list[PrefillTask]:
    # A step holds at most `cap` chunks of >= 1 token each.
    out: list[PrefillTask] = []
    for task in queue:
        if len(out) >= cap:
            break
        out.append(task)
    return out
