"""Online learning of the cache picker's cost model from the time to first token the
gateway observes (``gateway.cache.refit``, ``gateway.cache.learn_per``).

Each streamed request picked by :class:`fulcrum.gateway.cache_pick.CachePicker` gives one
sample when its first response body chunk passes the ext_proc stream::

    (q, c, ns) = (prompt - hit tokens, hit tokens, observed TTFT)

``observed TTFT`` is the time from the pick to the first response body chunk (ns; in the
unary and HTTP modes, Envoy's time from the request sent upstream to that chunk, from its
access log: :data:`fulcrum.gateway.authz.TTFT_TAG`). Only a request picked while it was
**alone** on its endpoint (no other request of ours in flight there, no queue in the
last scrape) gives a sample; the others are counted ``queued``. Their wait behind the
other requests is not known, and subtracting the picker's predicted queue fed the
model's own error back into it: on two real vLLM engines the refit then learnt a fixed
cost of 32-131 ms per step against the engines' 15 ms, and the picks that used it sent
up to 88% of a workload's requests to one engine (BENCHMARKS.md, "Real engines", stop 41).
A sample of zero or no computed tokens is dropped. Non-streamed responses give no
sample: their first body chunk is the whole answer. The lean Envoy mode sends no
response message and no access log, so it learns nothing.

Samples go to one window per key: the endpoint's address (``learn_per: endpoint``), its
engine (``engine``: a pool entry's id, its DP ranks' ports together: one engine class) or
one for all (``all``); ``refit.window_samples`` newest kept, in numpy rings (no per-sample Python
object). At most every ``refit.period_s`` per window, with ``refit.min_samples`` at least,
the window is refitted with the daemon's one fitter (:func:`fulcrum.core.cost.fit`, the
same as the prefill refit and ``fulcrum fit-cost``), here in relative errors
(``relative=True``: an engine's stall, a sample many times its cost, would pull an
absolute fit up past the model in force; in one CI run on real engines it kept every
refit), and the new model is adopted when its
p90 relative error on the window beats the model in force by ``refit.adopt_margin``
(:func:`fulcrum.core.cost.should_adopt`). Every endpoint starts from the configured model
(``gateway.cache.cost_model``). With ``learn_per`` ``endpoint`` or ``engine``, every sample
also goes to one pooled window, refitted the same way: a key whose own window has not had
a refit yet (fewer than ``refit.min_samples`` of its own) uses the pool's model once one
was adopted; its own first refit is judged against the configured model, so from then on
it runs on a model its own samples chose (its fit, or the configured one kept). So a
fleet of N endpoints leaves the configured model after about
``min_samples`` requests picked alone in all, not ``min_samples`` on each, and all its
endpoints leave it together: before, the endpoint that adopted first looked costlier
than the others until they adopted too (BENCHMARKS.md, "Real engines", stop 43). Event
loop only.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import structlog

from fulcrum.config.prefill import RefitSettings
from fulcrum.core.cost import CostModel, evaluate, fit, should_adopt
from fulcrum.gateway import pick_metrics as pm

log = structlog.get_logger(__name__)

_NS: Final = 1_000_000_000
#: The pool's key: every key's samples, one model for a key with no refit of its own yet.
POOL: Final = ""


class _Window:
    """The newest ``size`` samples (q, c, ns) of one key, a ring of shape ``(size, 3)``."""

    __slots__ = ("data", "n", "next", "refit_ns")

    def __init__(self, size: int) -> None:
        self.data = np.zeros((size, 3), dtype=np.float64)
        self.n = 0
        self.next = 0
        self.refit_ns: int | None = None  # last refit attempt (ns)

    def add(self, q: float, c: float, ns: float) -> None:
        self.data[self.next] = (q, c, ns)
        self.next = (self.next + 1) % self.data.shape[0]
        self.n = min(self.n + 1, self.data.shape[0])


class CostLearner:
    """Per-key windows and models; :meth:`observe` returns a new model to adopt, or None.
    Keys (strings: an address, an engine id, or "" for all) are the caller's; at most
    ``MAX_KEYS`` windows of ``window_samples`` x 24 bytes each (later keys keep the
    configured model, unlearnt)."""

    MAX_KEYS = 1024

    def __init__(self, settings: RefitSettings, base: CostModel) -> None:
        self.settings = settings
        self.base = base
        self._windows: dict[str, _Window] = {}
        self.models: dict[str, CostModel] = {}

    def model(self, key: str) -> CostModel:
        """The model in force for a key: its own once its window has had a refit (adopted,
        or the configured one kept); before that the pool's (key ``""``, every key's
        samples) when one was adopted, else the configured one."""
        own = self.models.get(key)
        if own is not None:
            return own
        win = self._windows.get(key)
        if win is not None and win.refit_ns is not None:
            return self.base  # its own samples kept the configured model
        return self.models.get(POOL, self.base)

    def observe(
        self, key: str, q: int, c: int, ttft_ns: float, alone: bool, now_ns: int
    ) -> CostModel | None:
        """One observed first token: ``q`` tokens computed after ``c`` cached (tokens),
        ``ttft_ns`` from pick to first chunk (ns); ``alone``: the request was the only one
        of ours in flight on its endpoint, with no scraped queue, when picked (else its
        wait behind the others is unknown: counted ``queued``, not learnt from).
        Returns a model adopted by this sample's refit (the key's own, else the pool's),
        or None: after one, every key's :meth:`model` may have changed."""
        pm.OBSERVED_TTFT.observe(max(ttft_ns, 0.0) / _NS)
        if not alone:
            pm.SAMPLES_BY_RESULT["queued"].inc()
            return None
        if q <= 0 or ttft_ns <= 0:
            pm.SAMPLES_BY_RESULT["dropped"].inc()
            return None
        pm.SAMPLES_BY_RESULT["kept"].inc()
        own = self._learn(key, q, c, ttft_ns, now_ns)
        pool = None if key == POOL else self._learn(POOL, q, c, ttft_ns, now_ns)
        return own or pool

    def _learn(self, key: str, q: int, c: int, ttft_ns: float, now_ns: int) -> CostModel | None:
        s = self.settings
        win = self._windows.get(key)
        if win is None:
            if len(self._windows) >= self.MAX_KEYS:
                return None
            win = self._windows[key] = _Window(s.window_samples)
        win.add(float(q), float(c), float(ttft_ns))
        if not s.enabled or win.n < s.min_samples:
            return None
        if win.refit_ns is not None and now_ns - win.refit_ns < s.period_s * _NS:
            return None
        win.refit_ns = now_ns
        return self._refit(key, win)

    def _refit(self, key: str, win: _Window) -> CostModel | None:
        d = win.data[: win.n]
        q, c, ns = d[:, 0], d[:, 1], d[:, 2]
        old_model = self.models.get(key, self.base)
        try:
            new = fit(q, c, ns, relative=True)
            old = evaluate(old_model, q, c, ns)
        except ValueError as err:
            log.warning("gateway_cost_refit_failed", error=str(err))
            pm.COST_REFITS.labels("skipped").inc()
            return None
        if not should_adopt(old, new.quality, self.settings.adopt_margin):
            pm.COST_REFITS.labels("kept").inc()
            return None
        self.models[key] = new.model
        pm.COST_REFITS.labels("adopted").inc()
        log.info(
            "gateway_cost_model_adopted",
            key=key or "all",
            a=new.model.a, b=new.model.b, k=new.model.k,
            old_p90=round(old.rel_err_p90, 4), new_p90=round(new.quality.rel_err_p90, 4),
            samples=new.quality.n,
        )
        return new.model
