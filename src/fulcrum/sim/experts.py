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
from typing import Final

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

    __slots__ = ("_cum", "_probs", "_t_ns", "model", "rng", "theta", "warm_maps")

    def __init__(self, model: ExpertModel, rng: np.random.Generator) -> None:
        self.model = model
        self.rng = rng
        self.theta: F64 = rng.normal(0.0, model.skew, size=(model.layers, model.n_logical))
        self._t_ns = 0
        self._probs: F64 | None = None
        self._cum: F64 | None = None
        self.warm_maps: dict[tuple[int, GroupLayout], PlacementMap] = {}

    def probs(self, now_ns: int) -> F64:
        """Routing probabilities at ``now_ns``, shape (layers, n_logical); advances drift."""
        dt = now_ns - self._t_ns
        if dt > 0 and self.model.skew > 0:
            decay = math.exp(-dt / (self.model.drift_tau_s * 1e9))
            noise = self.model.skew * math.sqrt(max(0.0, 1.0 - decay * decay))
            # Coarse drift steps (>= 1 s) keep the cost low; popularity moves on minutes.
            if dt >= 1_000_000_000 or self._probs is None:
                self.theta = self.theta * decay + noise * self.rng.standard_normal(
                    self.theta.shape
                )
                self._t_ns = now_ns
                self._probs = None
                self._cum = None
        if self._probs is None:
            e = np.exp(self.theta - self.theta.max(axis=1, keepdims=True))
            self._probs = e / e.sum(axis=1, keepdims=True)
        return self._probs


    def sample(self, now_ns: int, n: int, rng: np.random.Generator) -> F64:
        """Tokens per expert of ``n`` routings per layer, shape (layers, n_logical).

        Exact (inverse-CDF draws) up to :data:`EXACT_ROUTINGS` routings per layer; above,
        the normal approximation of the multinomial, rounded and clipped at 0.
        """
        probs = self.probs(now_ns)
        layers, experts = probs.shape
        if n <= EXACT_ROUTINGS:
            if self._cum is None:
                cum = np.cumsum(probs, axis=1)
                cum /= cum[:, -1:]
                self._cum = (cum + np.arange(layers)[:, None]).ravel()
            u = rng.random((layers, n)) + np.arange(layers)[:, None]
            idx = np.minimum(np.searchsorted(self._cum, u.ravel()), layers * experts - 1)
            counts = np.bincount(idx, minlength=layers * experts)
            return counts.reshape(layers, experts).astype(np.float64)
        lam = n * probs
        draws = lam + np.sqrt(lam * (1.0 - probs)) * rng.standard_normal(lam.shape)
        out: F64 = np.maximum(np.rint(draws), 0.0)
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
        self._slot_div = pmap.replica_counts[rows, pmap.phy2log].astype(np.float64)
        self._counts = rows

    def step(self, now_ns: int, tokens: int) -> float:
        """Route one step of ``tokens`` tokens; record its loads; rebalance on period.

        Returns the step's moe_lb (>= 1.0; 1.0 for an empty step).
        """
        if tokens <= 0:
            return 1.0
        m = self.pop.model
        loads = self.pop.sample(now_ns, tokens * m.top_k, self.rng)
        self.ring[self.ring_pos] = loads
        self.ring_pos = (self.ring_pos + 1) % self.ring.shape[0]
        self.steps += 1
        pmap = self.map
        per_slot = loads[self._counts, pmap.phy2log] / self._slot_div
        gl = per_slot.reshape(pmap.n_layers, pmap.ep_size, -1).sum(axis=-1)
        mean = float(gl.mean(axis=1).sum())
        lb = float(gl.max(axis=1).sum()) / mean if mean > 0 else 1.0
        if self.place_fn is not None and self.steps % self.layout.period_steps == 0:
            window = self.ring.sum(axis=0)
            self._set_map(self.place_fn(self.layout, window, self.map, self.params))
            self.rebalances += 1
        return lb
