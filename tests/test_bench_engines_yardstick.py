"""The real-engine benchmark's yardsticks (benchmarks/bench_engines.py): the 10% balance
aim of issue 20 and the per-run nonce that opens every text."""

from __future__ import annotations

import pytest

from benchmarks import bench_engines as be


@pytest.mark.parametrize(
    ("per_engine", "within"),
    [
        ([12, 12], True),
        ([13, 11], True),  # 1 off a mean of 12: 8.3%
        ([14, 10], False),  # 16.7%
        ([24, 0], False),  # one engine idle
        ([0, 0, 0], True),  # nothing sent: no engine off the mean
        ([], False),
        ([30, 33, 27], True),  # 10% exactly
        ([30, 34, 26], False),
    ],
)
def test_balanced_is_every_engine_within_ten_percent_of_the_mean(
    per_engine: list[int], within: bool
) -> None:
    assert be.balanced(per_engine) is within


def test_nonce_has_the_same_length_for_every_router_and_is_fresh_per_key() -> None:
    """A router's name must not lengthen the text every request shares (a longer shared
    opening is a cached block more for that router): 16 symbols of a set the model's
    tokenizer holds as single tokens, none in its training words."""
    from tests.engines.tiny_model import WORDS

    names = ["Fulcrum (gateway.cache, unary Envoy mode)", "smg cache_aware", "x"]
    nonces = [be.nonce(f"{n}-multi-turn-1") for n in names]
    assert [len(n) for n in nonces] == [16, 16, 16]
    assert all(ch in be.NONCE_CHARS for n in nonces for ch in n)
    assert not set(be.NONCE_CHARS) & set("".join(WORDS) + "0123456789")
    assert len(set(nonces)) == 3
    assert be.nonce("k") == be.nonce("k")
