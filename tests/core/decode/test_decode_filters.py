"""Capacity filter: never eligible past a limit; reasons when nothing fits."""

from __future__ import annotations

import pytest

from fulcrum.core.decode import FleetView, eligible, no_capacity


@pytest.mark.parametrize(
    ("conc", "kv", "live", "kv_tokens", "expect"),
    [
        ([0, 0], [0, 0], [True, True], 100, [True, True]),
        ([4, 0], [0, 0], [True, True], 100, [False, True]),  # concurrency limit
        ([0, 0], [950, 900], [True, True], 100, [False, True]),  # 900+100 == 1000 fits
        ([0, 0], [0, 0], [False, True], 100, [False, True]),  # dead
        ([0, 0], [0, 0], [True, True], 1_001, [False, False]),
        ([5, 0], [1_200, 0], [True, True], 1, [False, True]),  # over capacity already
    ],
)
def test_eligible_table(
    conc: list[int], kv: list[int], live: list[bool], kv_tokens: int, expect: list[bool]
) -> None:
    v = FleetView.build(conc, kv, [4, 4], [1_000, 1_000], live)
    assert eligible(v, kv_tokens).tolist() == expect


@pytest.mark.parametrize(
    ("conc", "kv", "live", "kv_tokens", "needle"),
    [
        ([0, 0], [0, 0], [False, False], 1, "no live decode GPU"),
        ([4, 4], [0, 0], [True, True], 1, "max_concurrency"),
        ([0, 0], [600, 700], [True, True], 500, "largest free: 400"),
        ([4, 0], [0, 700], [True, True], 500, "both a free concurrency slot"),
    ],
)
def test_no_capacity_reasons(
    conc: list[int], kv: list[int], live: list[bool], kv_tokens: int, needle: str
) -> None:
    v = FleetView.build(conc, kv, [4, 4], [1_000, 1_000], live)
    assert not eligible(v, kv_tokens).any()
    nc = no_capacity(v, kv_tokens)
    assert needle in nc.reason
    assert nc.live_gpus == sum(live)
