"""Policy sets compared by the simulator, and thin adapters onto the core policies.

A :class:`PolicySet` names one choice per balancer. ``default`` is Fulcrum with the
prefill balancer's ``default`` rules (:mod:`fulcrum.core.prefill.balancer`);
``published`` the same with the ``published`` rules (the letter of the design):

* prefill -- tiers re-split by quota demand every round (``core.prefill.tiers``), engines
  pull FIFO batches within their remaining quota (``core.prefill.batch``), least-loaded
  DP rank (``core.prefill.ranks``), time-budget chunks with the MIN budget
  (``core.prefill.chunks``);
* decode -- ``dual`` (``core.decode``); VE -- ``random_machine`` (``core.vision``);
  EPLB -- ``stable`` when the core has it, else ``reference`` (``core.eplb``).

Each baseline replaces every routing decision with one rule: prefill as a conventional
push router (no tiers, no pull: each request goes on arrival to a DP rank of any engine
chosen by the rule over the router's view of the ranks -- its own sends plus engine load
reports ``report_staleness_s`` old, :class:`fulcrum.sim.baselines.PushRouter`); decode
and VE by the core policy of that name when the core registers one, else by
:mod:`fulcrum.sim.baselines`. Every policy, baselines included, runs the same
engine-side chunk planner (time budget with the MIN of the ranks' budgets, chunk cap)
and the same cost model: only the routing differs. EPLB stays the default policy in
every set, so the columns differ only by routing (EPLB alone is compared by ``eplb`` sets).

``ideal`` runs the default decisions but every step lasts its perfectly balanced time
(total work / ranks, moe_lb = 1): the denominator of "fraction of ideal".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from fulcrum.core import decode as core_decode
from fulcrum.core import vision as core_vision
from fulcrum.core.prefill.balancer import DEFAULT as DEFAULT_RULES
from fulcrum.core.prefill.balancer import PUBLISHED
from fulcrum.sim import baselines
from fulcrum.sim.experts import STATIC, default_eplb_policy

FULCRUM: Final = "fulcrum"
#: Baseline queue orders (issue 23), each a policy set of that name: Fulcrum's default
#: with the tier queues in FIFO, strict bands + round robin (llm-d), or token VTC (AIBrix).
ORDER_BASELINES: Final = ("fifo", "strict_rr", "vtc_tokens")


@dataclass(frozen=True, slots=True)
class PolicySet:
    """One policy per balancer; ``ideal`` stretches no step beyond its balanced time."""

    name: str
    prefill: str
    decode: str
    vision: str
    eplb: str
    ideal: bool = False
    rules: str = DEFAULT_RULES
    affinity: bool = True
    #: Queue order rule replacing the rule set's (issue 23; "": the set's own).
    order: str = ""


def policy_sets() -> dict[str, PolicySet]:
    """Every named set: ``default``, ``published``, the baselines, ``ideal``, EPLB variants."""
    eplb = default_eplb_policy()
    out = {
        "default": PolicySet("default", FULCRUM, core_decode.DEFAULT_POLICY,
                             core_vision.DEFAULT_POLICY, eplb),
        PUBLISHED: PolicySet(PUBLISHED, FULCRUM, core_decode.DEFAULT_POLICY,
                             core_vision.DEFAULT_POLICY, eplb, rules=PUBLISHED),
        "ideal": PolicySet("ideal", FULCRUM, core_decode.DEFAULT_POLICY,
                           core_vision.DEFAULT_POLICY, eplb, ideal=True),
    }
    for b in baselines.BASELINES.names():
        out[b] = PolicySet(b, b, b, b, eplb)
    # Per-engine caches: Fulcrum without prefix affinity (the comparison for the fairness
    # bound); prefix-aware baselines place decode and VE by least requests.
    out["default_noaffinity"] = PolicySet("default_noaffinity", FULCRUM,
                                          core_decode.DEFAULT_POLICY,
                                          core_vision.DEFAULT_POLICY, eplb, affinity=False)
    for b in baselines.PREFIX_NAMES:
        out[b] = PolicySet(b, b, baselines.LEAST_REQUESTS, baselines.LEAST_REQUESTS, eplb)
    # Queue orders inside the tier queues (issue 23): the default is wfq_ns.
    for order in ORDER_BASELINES:
        out[order] = PolicySet(order, FULCRUM, core_decode.DEFAULT_POLICY,
                               core_vision.DEFAULT_POLICY, eplb, order=order)
    out["eplb_static"] = PolicySet("eplb_static", FULCRUM, core_decode.DEFAULT_POLICY,
                                   core_vision.DEFAULT_POLICY, STATIC)
    if eplb != "reference":
        out["eplb_reference"] = PolicySet("eplb_reference", FULCRUM, core_decode.DEFAULT_POLICY,
                                          core_vision.DEFAULT_POLICY, "reference")
    return out


def get_policy_set(name: str) -> PolicySet:
    """The set called ``name``; ValueError listing the known ones otherwise."""
    sets = policy_sets()
    if name not in sets:
        raise ValueError(f"policy set: unknown {name!r} (known: {', '.join(sets)})")
    return sets[name]


class DecodeChooser:
    """Decode placement through the core policy of that name (or a sim baseline)."""

    __slots__ = ("_core", "_cursor", "name")

    def __init__(self, name: str, params: Mapping[str, float]) -> None:
        """``params``: parameter values by key; the policy takes the ones it declares."""
        self.name = name
        self._cursor = 0
        self._core = (
            core_decode.make_policy(name, core_decode.params_for(name, params))
            if name in core_decode.REGISTRY
            else None
        )
        if self._core is None and name not in baselines.BASELINES:
            raise ValueError(f"decode: unknown policy {name!r}")

    def choose(
        self,
        conc: npt.NDArray[np.int64],
        kv: npt.NDArray[np.int64],
        max_conc: npt.NDArray[np.int64],
        max_kv: npt.NDArray[np.int64],
        kv_tokens: int,
        rng: np.random.Generator,
    ) -> int:
        """GPU index for a request of ``kv_tokens`` tokens, or -1 when none has room."""
        view = core_decode.FleetView.build(conc, kv, max_conc, max_kv)
        if self._core is not None:
            d = self._core.select(view, kv_tokens, rng, self._cursor)
            if isinstance(d, core_decode.NoCapacity):
                return -1
            self._cursor = d.cursor
            return d.gpu
        ok = core_decode.eligible(view, kv_tokens)
        idx = np.flatnonzero(ok)
        if idx.size == 0:
            return -1
        i, self._cursor = baselines.choose(self.name, conc[idx], rng, self._cursor)
        return int(idx[i])


class VisionChooser:
    """VE placement through the core policy of that name (or a sim baseline)."""

    __slots__ = ("_core", "_cursor", "name", "topology")

    def __init__(self, name: str, machines: int, gpus_per_machine: int) -> None:
        self.name = name
        self._cursor = 0
        self.topology = core_vision.VisionTopology.build(
            [
                core_vision.MachineSpec(f"ve-{m}", tuple(range(gpus_per_machine)))
                for m in range(machines)
            ]
        )
        self._core = (
            core_vision.make_policy(name) if name in core_vision.REGISTRY else None
        )
        if self._core is None and name not in baselines.BASELINES:
            raise ValueError(f"vision: unknown policy {name!r}")

    def choose(
        self,
        patches_in_flight: npt.NDArray[np.int64],
        images_in_flight: npt.NDArray[np.int64],
        patches: int,
        rng: np.random.Generator,
    ) -> int:
        """Global VE GPU index for an image of ``patches`` patches."""
        if self._core is not None:
            fleet = core_vision.VisionFleet(self.topology, patches_in_flight)
            out = self._core.select(fleet, patches, rng)
            if isinstance(out, core_vision.NoCapacity):  # the core returns refusals
                raise RuntimeError(f"vision: {out.reason}")
            return out.gpu
        i, self._cursor = baselines.choose(self.name, images_in_flight, rng, self._cursor)
        return i
