"""Expert popularity with drift, and the EPLB loop of one EP group.

Popularity: each of ``layers`` representative MoE layers has log-popularity
``theta[l, e]`` following an Ornstein-Uhlenbeck process (stationary std ``skew``, time
constant ``drift_tau_s``); routing probabilities are ``softmax(theta[l])``. A step of
``T`` tokens routes about ``T * top_k`` assignments per layer, drawn as independent
Poisson counts (the multinomial's marginals), so steps with few tokens (decode) have
noisy statistics, as SPEC section 6 notes.

An :class:`EplbGroup` keeps the map in force (a ``fulcrum.core.eplb`` PlacementMap), a
ring of the last ``window`` steps' expert loads and a step counter; every ``period``
steps it asks the configured core policy (``place(layout, loads, previous, params)``)
for a new map. ``moe_lb`` of a step = sum over layers of the most loaded GPU / sum over
layers of the mean GPU load (``fulcrum.core.eplb.metrics`` definition), with each
expert's tokens split evenly over its replicas.

The group starts from a map computed on the expected loads at time 0 (a warm start: a
deployed system has history), unless the policy is ``static`` which keeps the identity
map forever.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Final, NamedTuple

import numpy as np
import numpy.typing as npt

from fulcrum.core.eplb.layout import GroupLayout, PlacementMap, identity_map, make_layout
from fulcrum.core.eplb.params import DEFAULT_PARAMS, RebalanceParams
from fulcrum.sim.cluster import ExpertModel

F64 = npt.NDArray[np.float64]
PlaceFn = Callable[[GroupLayout, F64, PlacementMap | None, RebalanceParams], PlacementMap]

STATIC: Final = "static"
EXACT_ROUTINGS: Final = 512
"""Routings per layer up to which a step's expert loads are drawn exactly."""
GUIDE_CELLS: Final = 8
"""Cells per expert of the guide table that starts each inverse-CDF search."""
POOL_MIN: Final = 2_048
"""Routings per layer of the first block of pre-drawn expert choices after a drift step."""
POOL_MAX: Final = 65_536
"""Routings per layer of the largest block of pre-drawn expert choices."""


def eplb_policy(name: str) -> PlaceFn | None:
    """The core EPLB placement function registered as ``name`` (None for ``static``)."""
    if name == STATIC:
        return None
    from fulcrum.core import eplb as core_eplb

    placer = core_eplb.make_placer(name)

    def place(
        layout: GroupLayout, loads: F64, previous: PlacementMap | None, params: RebalanceParams
    ) -> PlacementMap:
        return placer(layout, loads, previous, params)

    return place


def default_eplb_policy() -> str:
    """The core's default EPLB algorithm."""
    from fulcrum.core import eplb as core_eplb

    return str(core_eplb.DEFAULT_ALGORITHM)


class Popularity:
    """Drifting expert popularity shared by every group of a stage."""

    __slots__ = (
        "_cum",
        "_guide",
        "_pool",
        "_pool_next",
        "_pool_pos",
        "_probs",
        "_t_ns",
        "model",
        "rng",
        "theta",
        "warm_maps",
    )

    def __init__(self, model: ExpertModel, rng: np.random.Generator) -> None:
        self.model = model
        self.rng = rng
        self.theta: F64 = rng.normal(0.0, model.skew, size=(model.layers, model.n_logical))
        self._t_ns = 0
        self._probs: F64 | None = None
        self._cum: F64 | None = None
        self._guide: npt.NDArray[np.intp] | None = None
        # Pre-drawn expert choices for the current probabilities (flat indices
        # layer * n_logical + expert, shape (layers, block)); _pool_pos: next unused column.
        self._pool: npt.NDArray[np.intp] | None = None
        self._pool_pos = 0
        self._pool_next = POOL_MIN
        self.warm_maps: dict[tuple[int, GroupLayout], PlacementMap] = {}

    def probs(self, now_ns: int) -> F64:
        """Routing probabilities at ``now_ns``, shape (layers, n_logical); advances drift."""
        dt = now_ns - self._t_ns
        if dt > 0 and self.model.skew > 0:
            decay = math.exp(-dt / (self.model.drift_tau_s * 1e9))
            noise = self.model.skew * math.sqrt(max(0.0, 1.0 - decay * decay))
            # Coarse drift steps (>= 1 s) keep the cost low; popularity moves on minutes.
            if dt >= 1_000_000_000 or self._probs is None:
                self.theta = self.theta * decay + noise * self.rng.standard_normal(self.theta.shape)
                self._t_ns = now_ns
                self._probs = None
                self._cum = None
                self._guide = None
                self._pool = None
                self._pool_next = POOL_MIN
        if self._probs is None:
            e = np.exp(self.theta - self.theta.max(axis=1, keepdims=True))
            self._probs = e / e.sum(axis=1, keepdims=True)
        return self._probs

    def sample(self, now_ns: int, n: int, rng: np.random.Generator) -> F64:
        """Tokens per expert of ``n`` routings per layer, shape (layers, n_logical).

        Exact up to :data:`EXACT_ROUTINGS` routings per layer: every routing is an
        independent inverse-CDF draw from the current routing probabilities, so the
        counts are a multinomial sample. The draws are made in blocks (:meth:`_refill`)
        and consumed ``n`` per layer at a time: a decode step costs one ``bincount``
        instead of a random draw and a search of its own. A block is dropped unused when
        the probabilities drift; the dropped draws are independent of every draw used, so
        the counts keep their distribution. Above :data:`EXACT_ROUTINGS`, the normal
        approximation of the multinomial, rounded and clipped at 0.
        """
        probs = self.probs(now_ns)
        layers, experts = probs.shape
        if n <= EXACT_ROUTINGS:
            pool, pos = self._pool, self._pool_pos
            if pool is None or pos + n > pool.shape[1]:
                pool, pos = self._refill(probs, max(n, self._pool_next), rng), 0
            self._pool_pos = pos + n
            counts = np.bincount(pool[:, pos : pos + n].ravel(), minlength=layers * experts)
            return counts.reshape(layers, experts).astype(np.float64)
        lam = n * probs
        draws = lam + np.sqrt(lam * (1.0 - probs)) * rng.standard_normal(lam.shape)
        out: F64 = np.maximum(np.rint(draws), 0.0)
        return out

    def _refill(
        self, probs: F64, block: int, rng: np.random.Generator
    ) -> npt.NDArray[np.intp]:
        """A new block of ``block`` expert choices per layer drawn from ``probs`` (flat
        indices, shape (layers, block)). The next block is twice as long, up to
        :data:`POOL_MAX`, so few draws are wasted when the probabilities drift before a
        block is used up."""
        layers, experts = probs.shape
        u = (rng.random((layers, block)) + np.arange(layers)[:, None]).ravel()
        idx = np.minimum(self._lookup(probs, u), layers * experts - 1)
        pool: npt.NDArray[np.intp] = idx.reshape(layers, block)
        self._pool, self._pool_pos = pool, 0
        self._pool_next = min(2 * block, POOL_MAX)
        return pool

    def _lookup(self, probs: F64, u: F64) -> npt.NDArray[np.intp]:
        """``np.searchsorted(cum, u)`` (side left) for the layer-offset cumulative
        probabilities ``cum`` (layer ``l``'s experts cover ``[l, l + 1)``, flat, shape
        (layers * n_logical,)) and uniforms ``u`` offset by their layer, shape (m,).

        Indexed search: the guide table holds, for each of :data:`GUIDE_CELLS` x
        n_logical equal cells per layer, the first index whose cum reaches the cell's
        left edge; a draw starts there and steps right while cum is below it (on
        average a fraction of a step), so the answer equals the binary search's."""
        layers, experts = probs.shape
        if self._cum is None or self._guide is None:
            cum = np.cumsum(probs, axis=1)
            cum /= cum[:, -1:]
            self._cum = (cum + np.arange(layers)[:, None]).ravel()
            cells = GUIDE_CELLS * experts
            edges = np.arange(layers * cells, dtype=np.float64) / cells
            self._guide = np.searchsorted(self._cum, edges)
        cumf, guide = self._cum, self._guide
        last = cumf.size - 1
        cell = np.minimum((u * (GUIDE_CELLS * experts)).astype(np.intp), guide.size - 1)
        idx = guide[cell]
        k = np.flatnonzero(cumf[np.minimum(idx, last)] < u)
        while k.size:
            idx[k] += 1
            k = k[(idx[k] <= last) & (cumf[np.minimum(idx[k], last)] < u[k])]
        out: npt.NDArray[np.intp] = idx
        return out


class EplbGroup:
    """EPLB state of one EP group (see module docstring)."""

    __slots__ = (
        "_counts",
        "_slot_div",
        "layout",
        "map",
        "params",
        "place_fn",
        "pop",
        "rebalances",
        "ring",
        "ring_pos",
        "rng",
        "steps",
    )

    def __init__(
        self,
        role: str,
        ep_size: int,
        pop: Popularity,
        place_fn: PlaceFn | None,
        rng: np.random.Generator,
        params: RebalanceParams = DEFAULT_PARAMS,
    ) -> None:
        m = pop.model
        red = m.prefill_redundant_per_gpu if role == "prefill" else m.decode_redundant_per_gpu
        win = m.prefill_window_steps if role == "prefill" else m.decode_window_steps
        per = m.prefill_period_steps if role == "prefill" else m.decode_period_steps
        red = min(red, max(0, (m.n_logical * ep_size - m.n_logical) // ep_size))
        self.layout = make_layout(
            "prefill" if role == "prefill" else "decode",
            ep_size,
            m.layers,
            m.n_logical,
            gpus_per_node=8 if ep_size % 8 == 0 else ep_size,
            redundant_per_gpu=red,
            window_steps=win,
            period_steps=per,
        )
        self.pop = pop
        self.place_fn = place_fn
        self.rng = rng
        self.params = params
        self.ring: F64 = np.zeros((win, m.layers, m.n_logical))
        self.ring_pos = 0
        self.steps = 0
        self.rebalances = 0
        start = identity_map(self.layout)
        if place_fn is not None:
            # Groups of one stage share the popularity, so their warm-start maps are equal:
            # compute it once per (stage, layout, policy).
            key = (id(place_fn), self.layout)
            cached = pop.warm_maps.get(key)
            if cached is None:
                cached = place_fn(self.layout, pop.probs(0) * 1e6, start, params)
                pop.warm_maps[key] = cached
            start = cached
        self.map = start
        self._set_map(start)

    def _set_map(self, pmap: PlacementMap) -> None:
        self.map = pmap
        rows = np.arange(pmap.n_layers)[:, None]
        # Flat expert index of every physical slot, shape (layers * slots,), and the
        # share of that expert's tokens the slot gets (1 / replicas).
        self._counts = (rows * self.pop.model.n_logical + pmap.phy2log).ravel()
        self._slot_div = 1.0 / pmap.replica_counts[rows, pmap.phy2log].astype(np.float64).ravel()

    def step(self, now_ns: int, tokens: int) -> float:
        """Route one step of ``tokens`` tokens; record its loads; rebalance on period.

        Returns the step's moe_lb (>= 1.0; 1.0 for an empty step). Only the steps of the
        window before a rebalance are recorded (the ring is read only there).
        """
        if tokens <= 0:
            return 1.0
        m = self.pop.model
        loads = self.pop.sample(now_ns, tokens * m.top_k, self.rng)
        self.steps += 1
        period = self.layout.period_steps
        win = self.ring.shape[0]
        if self.place_fn is not None and (win >= period or -self.steps % period < win):
            self.ring[self.ring_pos] = loads
            self.ring_pos = (self.ring_pos + 1) % win
        pmap = self.map
        per_slot = loads.ravel()[self._counts] * self._slot_div
        gl = per_slot.reshape(pmap.n_layers, pmap.ep_size, -1).sum(axis=-1)
        total = float(gl.sum())
        lb = float(gl.max(axis=1).sum()) * pmap.ep_size / total if total > 0 else 1.0
        if self.place_fn is not None and self.steps % period == 0:
            window = self.ring.sum(axis=0)
            self._set_map(self.place_fn(self.layout, window, self.map, self.params))
            self.rebalances += 1
        return lb


# -- EPLB scenario suite (issue 10) ----------------------------------------------------------
#
# Every scenario starts where a deployment starts: a freshly registered group whose map in
# force is the identity map (``RegisterGroup`` without an initial map). A window is drawn
# as ``buckets`` multinomial samples (the window's buckets, as the daemon keeps them), so
# the noise estimate of ``core.eplb.window`` sees what the daemon sees. Each map computed
# on window t is scored on window t + 1; both algorithms get the same layout (slot budget).


class Window(NamedTuple):
    """One statistics window: ``loads`` (L, E) tokens = sum of ``buckets`` (B, L, E)."""

    loads: F64
    buckets: F64
    steps: npt.NDArray[np.int64]


def skew_scales(z: F64, target: F64) -> F64:
    """Per-layer sigma so that max / mean of ``exp(sigma * z[l])`` equals ``target[l]``."""
    lo = np.zeros(z.shape[0])
    hi = np.full(z.shape[0], 6.0)
    for _ in range(60):
        mid = (lo + hi) / 2
        p = np.exp(mid[:, None] * z)
        peak = p.max(axis=1) / p.mean(axis=1)
        lo = np.where(peak < target, mid, lo)
        hi = np.where(peak < target, hi, mid)
    out: F64 = (lo + hi) / 2
    return out


def popularity(z: F64, sigma: F64) -> F64:
    """Routing probabilities (L, E) of log-popularity ``sigma[l] * z[l]``."""
    p = np.exp(sigma[:, None] * z - (sigma[:, None] * z).max(axis=1, keepdims=True))
    out: F64 = p / p.sum(axis=1, keepdims=True)
    return out


def draw_window(
    probs: F64, routings: int, buckets: int, steps: int, rng: np.random.Generator
) -> Window:
    """A window of ``routings`` token-expert assignments per layer, as ``buckets``
    multinomial samples of equal size."""
    per = max(1, routings // buckets)
    parts = np.stack([rng.multinomial(per, probs).astype(np.float64) for _ in range(buckets)])
    n = np.full(buckets, max(1, steps // buckets), dtype=np.int64)
    return Window(parts.sum(axis=0), parts, n)


class Rebalanced(NamedTuple):
    """One rebalance of a scenario: the map's next-window moe_lb, the stale map's, what
    moved and what it cost."""

    lb_mean: float  # next-window moe_lb, mean over layers
    lb_p99: float  # next-window moe_lb, p99 over layers
    lb_overall: float  # next-window moe_lb, overall (slowest GPU summed over layers)
    stale_overall: float  # next window, map in force before the rebalance
    slots_changed: int
    slots_total: int
    bytes_moved: int
    applied: bool
    predicted_gain: float  # overall moe_lb, on the window the map was computed on
    noise_threshold: float
    cpu_s: float


def run_scenario(
    layout: GroupLayout,
    algorithm: str,
    windows: list[Window],
    params: RebalanceParams = DEFAULT_PARAMS,
    start: PlacementMap | None = None,
) -> list[Rebalanced]:
    """Rebalance on every window but the last, from the identity map (or ``start``),
    scoring each map on the following window."""
    import time

    from fulcrum.core import eplb as core_eplb
    from fulcrum.core.eplb.window import window_variance

    current = identity_map(layout) if start is None else start
    out: list[Rebalanced] = []
    for t in range(len(windows) - 1):
        w = windows[t]
        var = window_variance(w.buckets, w.steps)
        c0 = time.process_time()
        res = core_eplb.rebalance(algorithm, layout, w.loads, current, params, load_var=var)
        cpu = time.process_time() - c0
        nxt = core_eplb.balance(windows[t + 1].loads, res.placement)
        stale = core_eplb.balance(windows[t + 1].loads, current)
        before = res.before.overall if res.before is not None else res.after.overall
        out.append(
            Rebalanced(
                lb_mean=float(nxt.per_layer.mean()),
                lb_p99=float(np.percentile(nxt.per_layer, 99)),
                lb_overall=nxt.overall,
                stale_overall=stale.overall,
                slots_changed=res.migration.slots_changed,
                slots_total=res.migration.slots_total,
                bytes_moved=res.migration.bytes_moved,
                applied=res.migration.slots_changed > 0,
                predicted_gain=before - res.after.overall,
                noise_threshold=res.noise_threshold,
                cpu_s=cpu,
            )
        )
        current = res.placement
    return out


def scenario_windows(
    kind: str,
    layers: int,
    experts: int,
    role: str,
    n_windows: int,
    seed: int,
    *,
    skew: tuple[float, float] = (2.5, 14.0),
    buckets: int = 16,
    change_at: int = 2,
    rho: float = 0.98,
) -> list[Window]:
    """Windows of one scenario.

    Kinds: ``stationary`` (fixed popularity, multinomial noise; first placement and the
    noise scenario), ``shift`` (the hot experts are permuted at window ``change_at``),
    ``drift`` (Ornstein-Uhlenbeck step of the log-popularity between windows, correlation
    ``rho``). Per-layer max / mean popularity is drawn uniformly in ``skew``. Window
    sizes are the role's: prefill 100 steps x 8,192 tokens x top-8, decode 1,000 steps x
    2,048 tokens (64 ranks x 32 sequences) x top-8.
    """
    rng = np.random.default_rng(seed)
    steps, routings = (100, 100 * 8192 * 8) if role == "prefill" else (1000, 1000 * 2048 * 8)
    z = rng.standard_normal((layers, experts))
    z = (z - z.mean(axis=1, keepdims=True)) / z.std(axis=1, keepdims=True)
    sigma = skew_scales(z, rng.uniform(skew[0], skew[1], size=layers))
    out: list[Window] = []
    for t in range(n_windows):
        if kind == "shift" and t == change_at:
            for layer in range(layers):  # the hottest quarter trades places with the rest
                order = np.argsort(-z[layer])
                hot = order[: experts // 4]
                cold = rng.permutation(order[experts // 4 :])[: hot.size]
                z[layer, hot], z[layer, cold] = z[layer, cold].copy(), z[layer, hot].copy()
        if kind == "drift" and t > 0:
            z = rho * z + math.sqrt(1 - rho * rho) * rng.standard_normal(z.shape)
        out.append(draw_window(popularity(z, sigma), routings, buckets, steps, rng))
    return out
