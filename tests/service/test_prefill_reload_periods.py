"""Issue 22 row 11, prefill keys: a reload of ``prefill.round_period_ms`` and of
``prefill.refit.enabled`` / ``period_s`` applies (it was reported applied, not applied),
through a real daemon: the periodic jobs' counters show the new periods."""

from __future__ import annotations

from fulcrum.config import with_overrides
from fulcrum.metrics import REGISTRY
from tests.service.prefill_helpers import prefill_daemon, until


def _count(name: str, **labels: str) -> float:
    v = REGISTRY.get_sample_value(name, labels)
    return 0.0 if v is None else v


def _refits() -> float:
    return sum(_count("fulcrum_prefill_cost_model_refits_total", result=r)
               for r in ("adopted", "kept", "skipped"))


async def test_reloaded_round_period_and_refit_switch_apply_at_once() -> None:
    slow = {"prefill": {"round_period_ms": 600_000,
                        "refit": {"enabled": False, "period_s": 600.0}}}
    async with prefill_daemon(slow) as (d, _c, state):
        rounds0, refits0 = _count("fulcrum_prefill_rounds_total", reason="round"), _refits()
        fast = with_overrides(d.app.settings, {"prefill": {
            "round_period_ms": 20, "refit": {"enabled": True, "period_s": 0.02}}})
        assert d.reload(fast) == "applied"
        assert state.settings.round_period_ms == 20
        # Both jobs were sleeping out a 600 s wait: the reload re-arms them.
        await until(lambda: _count("fulcrum_prefill_rounds_total", reason="round")
                    >= rounds0 + 3, timeout_s=20.0)
        await until(lambda: _refits() >= refits0 + 3, timeout_s=20.0)
        # Switched off again: no further refit runs (checked at each period).
        off = with_overrides(d.app.settings, {"prefill": {"refit": {"enabled": False}}})
        assert d.reload(off) == "applied"
        before = _refits()
        r1 = _count("fulcrum_prefill_rounds_total", reason="round")
        await until(lambda: _count("fulcrum_prefill_rounds_total", reason="round")
                    >= r1 + 3, timeout_s=20.0)  # several refit periods passed
        assert _refits() <= before + 1  # at most one already under way
