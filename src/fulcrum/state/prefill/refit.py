"""The prefill cost model in force and its periodic refit from engines' step times.

Engines report measured ``(q, c, ns)`` steps (tokens, tokens, ns); a bounded window of
them feeds a refit of :class:`fulcrum.core.cost.CostModel`, adopted only when better than
the model in force by ``refit.adopt_margin``. A reload that changes ``cost_model`` adopts
it at once. Each adoption bumps :attr:`CostRefitter.version`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np
import structlog

from fulcrum.config.prefill import PrefillSettings
from fulcrum.core.cost import CostModel, FitQuality, FitResult, evaluate, fit, should_adopt
from fulcrum.errors import InvalidArgument
from fulcrum.metrics import prefill as m
from fulcrum.state.prefill.export import PrefillMetrics
from fulcrum.units import MAX_U64

log = structlog.get_logger(__name__)


class CostRefitter:
    """See module docstring."""

    def __init__(self, settings: PrefillSettings, metrics: PrefillMetrics) -> None:
        self.settings = settings
        self._metrics = metrics
        cm = settings.cost_model
        self.model = CostModel(a=cm.a, b=cm.b, k=cm.k)
        self.version = 1
        self.samples: deque[tuple[int, int, int]] = deque(
            maxlen=settings.refit.window_samples)
        metrics.gauge_model(self.model)

    def cost_ns(self, q: int, c: int) -> int:
        """The live cost model (ns, with ``k``) of ``q`` tokens after ``c`` cached."""
        return min(MAX_U64, self.model.cost_ns(q, c))

    def apply(self, new: PrefillSettings) -> None:
        """Adopt a reloaded section: the window's size, and a changed ``cost_model``."""
        old = self.settings
        self.settings = new
        if self.samples.maxlen != new.refit.window_samples:
            self.samples = deque(self.samples, maxlen=new.refit.window_samples)
        if new.cost_model != old.cost_model:
            cm = new.cost_model
            self._adopt(CostModel(a=cm.a, b=cm.b, k=cm.k))
            log.info("cost_model_configured", version=self.version, a=cm.a, b=cm.b, k=cm.k)

    def _adopt(self, model: CostModel) -> None:
        self.model = model
        self.version += 1
        self._metrics.gauge_model(model)

    def report(self, samples: Sequence[tuple[int, int, int]]) -> int:
        """Add measured ``(q, c, ns)`` step samples (tokens, tokens, ns) to the fit window;
        INVALID_ARGUMENT naming the first bad one (none is added then)."""
        s = self.settings
        limit = s.refit.max_samples_per_report
        if len(samples) > limit:
            raise InvalidArgument("samples", f"must have at most {limit} entries")
        for i, (q, c, ns) in enumerate(samples):
            if not 1 <= q <= s.max_total_tokens:
                raise InvalidArgument(f"samples[{i}].q", "must be in [1, max_total_tokens]")
            if not 0 <= c <= s.max_total_tokens:
                raise InvalidArgument(f"samples[{i}].c", "must be in [0, max_total_tokens]")
            if ns <= 0:
                raise InvalidArgument(f"samples[{i}].measured_ns", "must be > 0")
        for q, c, ns in samples:
            self.samples.append((q, c, ns))
            predicted = self.model.cost(q, c)
            m.COST_REL_ERROR.observe(abs(predicted - ns) / ns)
        m.COST_SAMPLES.set(len(self.samples))
        return len(samples)

    def refit(self) -> bool:
        """Refit from the window; adopt when better by the margin. True when adopted."""
        rs = self.settings.refit
        if not rs.enabled or len(self.samples) < rs.min_samples:
            m.COST_REFITS.labels("skipped").inc()
            return False
        arr = np.array(self.samples, dtype=np.float64)
        q, c, ns = arr[:, 0], arr[:, 1], arr[:, 2]
        try:
            new = fit(q, c, ns)
            old = evaluate(self.model, q, c, ns)
        except ValueError as err:
            log.warning("cost_model_refit_failed", error=str(err))
            m.COST_REFITS.labels("skipped").inc()
            return False
        m.COST_REL_ERROR_P90.set(old.rel_err_p90)
        if not should_adopt(old, new.quality, rs.adopt_margin):
            m.COST_REFITS.labels("kept").inc()
            return False
        previous = self.model
        self._adopt(new.model)
        m.COST_REFITS.labels("adopted").inc()
        m.COST_REL_ERROR_P90.set(new.quality.rel_err_p90)
        self._log_adopted(previous, old, new)
        return True

    def _log_adopted(self, previous: CostModel, old: FitQuality, new: FitResult) -> None:
        log.info(
            "cost_model_adopted",
            version=self.version,
            a=new.model.a,
            b=new.model.b,
            k=new.model.k,
            old_a=previous.a,
            old_b=previous.b,
            old_k=previous.k,
            old_p90=round(old.rel_err_p90, 4),
            new_p90=round(new.quality.rel_err_p90, 4),
            r2=round(new.quality.r2, 4),
            samples=new.quality.n,
        )
