"""The picker's per-request counts reach the scrape unchanged in name, labels and
buckets (``gateway.metrics.PickCounts`` and the cache-aware picks'
``gateway.pick_metrics.CacheCounts``: plain counts on the loop, a published snapshot for
the scrape thread)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fulcrum.gateway import metrics as gm
from fulcrum.gateway import pick_metrics as pm

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(counts: gm.PickCounts | pm.CacheCounts) -> Samples:
    """The text exposition of ``counts``' families, parsed back (a scrape)."""
    reg = CollectorRegistry()
    families = gm.PICK_FIGURES if isinstance(counts, gm.PickCounts) else pm.CACHE_FIGURES
    collector = gm.FiguresCollector(families.families)
    collector.set_source(counts.publisher)
    reg.register(collector)
    text = generate_latest(reg).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_counts_picks_releases_and_the_pick_time_histogram() -> None:
    c = gm.PickCounts()  # no schedule: every change publishes at once
    c.pick("dual", "picked")
    c.pick("dual", "picked")
    c.pick("dual", "shed")
    c.released("response_end")
    for seconds in (1e-5, 3e-4, 0.2):  # a bound itself, a middle bucket, above the last
        c.timed(seconds)
    m = samples(c)
    assert m[("fulcrum_gateway_picks_total", (("outcome", "picked"), ("policy", "dual")))] == 2
    assert m[("fulcrum_gateway_picks_total", (("outcome", "shed"), ("policy", "dual")))] == 1
    assert m[("fulcrum_gateway_releases_total", (("reason", "response_end"),))] == 1
    assert m[("fulcrum_gateway_releases_total", (("reason", "not_held"),))] == 0
    bucket = "fulcrum_gateway_pick_seconds_bucket"
    assert m[(bucket, (("le", "1e-05"),))] == 1  # le is inclusive
    assert m[(bucket, (("le", "0.00025"),))] == 1
    assert m[(bucket, (("le", "0.0005"),))] == 2
    assert m[(bucket, (("le", "0.1"),))] == 2
    assert m[(bucket, (("le", "+Inf"),))] == 3
    assert m[("fulcrum_gateway_pick_seconds_count", ())] == 3
    assert abs(m[("fulcrum_gateway_pick_seconds_sum", ())] - (1e-5 + 3e-4 + 0.2)) < 1e-12


def test_before_any_pick_the_families_are_present_and_empty() -> None:
    m = samples(gm.PickCounts())
    assert m[("fulcrum_gateway_pick_seconds_count", ())] == 0
    assert m[("fulcrum_gateway_releases_total", (("reason", "stream_closed"),))] == 0
    assert not [k for k in m if k[0] == "fulcrum_gateway_picks_total"]


def test_the_cache_picks_figures_reach_the_scrape() -> None:
    """Per pick a few writes; the scrape carries them (rules, copies, tokens and both
    predicted-TTFT histograms; no best other without a second candidate)."""
    counts = pm.CacheCounts()  # no schedule: every change publishes at once
    counts.picked("ttft", "shared", 100, 300, 0.02, 0.04)
    counts.picked("load_only", "", 0, -1, 40.0, float("nan"))
    m = samples(counts)
    assert m[("fulcrum_gateway_cache_picks_total", (("rule", "ttft"),))] == 1
    assert m[("fulcrum_gateway_cache_picks_total", (("rule", "load_only"),))] == 1
    assert m[("fulcrum_gateway_cache_prefix_copies_total", (("charge", "shared"),))] == 1
    assert m[("fulcrum_gateway_cache_prefix_copies_total", (("charge", "full"),))] == 0
    assert m[("fulcrum_gateway_cache_hit_tokens_total", ())] == 100
    assert m[("fulcrum_gateway_cache_prompt_tokens_total", ())] == 300  # -1: none
    chosen = "fulcrum_gateway_cache_predicted_ttft_seconds"
    assert m[(f"{chosen}_bucket", (("le", "0.025"),))] == 1
    assert m[(f"{chosen}_bucket", (("le", "+Inf"),))] == 2
    assert abs(m[(f"{chosen}_sum", ())] - 40.02) < 1e-9
    other = "fulcrum_gateway_cache_best_other_ttft_seconds"
    assert m[(f"{other}_count", ())] == 1
    assert abs(m[(f"{other}_sum", ())] - 0.04) < 1e-12


def test_before_any_cache_pick_its_families_are_present_and_zero() -> None:
    m = samples(pm.CacheCounts())
    assert m[("fulcrum_gateway_cache_picks_total", (("rule", "ttft"),))] == 0
    assert m[("fulcrum_gateway_cache_predicted_ttft_seconds_count", ())] == 0
