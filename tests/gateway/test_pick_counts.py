"""The picker's per-request counts reach the scrape unchanged in name, labels and
buckets (``gateway.metrics.PickCounts``: plain counts on the loop, a published
snapshot for the scrape thread)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fulcrum.gateway import metrics as gm


def samples(counts: gm.PickCounts) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    reg = CollectorRegistry()
    collector = gm._PickCollector()
    collector.set_source(counts)
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
