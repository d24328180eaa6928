"""The allowed-slots filter in front of every decode policy (``select_allowed``).

- a pick is always an allowed, live GPU with a free slot and KV room;
- NoCapacity exactly when no allowed GPU fits; the view is never changed;
- deterministic policies pick what their rule picks among the allowed GPUs (reference);
- every slot allowed gives the very decision (and cursor) of the unfiltered policy;
- allowed=None is the policy's own select;
- both forms (slot indices, boolean mask) decide alike;
- a malformed ``allowed`` is a ValueError.
"""

from __future__ import annotations

import numpy as np
import pytest
from decode_reference import eligible_list, expected
from decode_strategies import fleet_views
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.core.decode import (
    POLICY_NAMES,
    Decision,
    FleetView,
    NoCapacity,
    make_policy,
    params_for,
    select_allowed,
)
from fulcrum.core.decode.copies import copy_view

DETERMINISTIC = [n for n in POLICY_NAMES if n != "power_of_two"]
PARAMS = {"long_factor": 1.5, "long_tokens": 800, "short_slack": 1, "d1_ns": 3.0, "d2_ns": 0.25}


def allowed_of(view: FleetView, bits: list[bool], as_mask: bool = False) -> np.ndarray:
    """Slot indices (or the same set as a boolean mask) from a bit pattern."""
    if as_mask:
        return np.array([bits[g % len(bits)] for g in range(view.n_gpus)], dtype=np.bool_)
    return np.array([g for g in range(view.n_gpus) if bits[g % len(bits)]], dtype=np.int64)


def as_list(view: FleetView, allowed: np.ndarray) -> list[int]:
    return np.flatnonzero(allowed).tolist() if allowed.dtype == np.bool_ else allowed.tolist()


@settings(max_examples=200, deadline=None)
@given(
    view=fleet_views(),
    kv_tokens=st.integers(1, 2_500),
    name=st.sampled_from(POLICY_NAMES),
    bits=st.lists(st.booleans(), min_size=1, max_size=12),
    cursor=st.integers(0, 30),
    seed=st.integers(0, 2**32 - 1),
    as_mask=st.booleans(),
)
def test_pick_is_allowed_live_with_room(
    view: FleetView,
    kv_tokens: int,
    name: str,
    bits: list[bool],
    cursor: int,
    seed: int,
    as_mask: bool,
) -> None:
    allowed = allowed_of(view, bits, as_mask)
    before = copy_view(view)
    out = select_allowed(
        make_policy(name, params_for(name, PARAMS)),
        view,
        kv_tokens,
        np.random.default_rng(seed),
        cursor,
        allowed,
    )
    fits = [g for g in eligible_list(view, kv_tokens) if g in set(as_list(view, allowed))]
    if isinstance(out, NoCapacity):
        assert fits == []
    else:
        assert out.gpu in fits  # allowed, live, a free slot, room
    assert view.same_as(before)  # pure


@settings(max_examples=200, deadline=None)
@given(
    view=fleet_views(),
    kv_tokens=st.integers(1, 2_500),
    name=st.sampled_from(DETERMINISTIC),
    bits=st.lists(st.booleans(), min_size=1, max_size=12),
    cursor=st.integers(0, 30),
    as_mask=st.booleans(),
)
def test_matches_reference_among_allowed(
    view: FleetView, kv_tokens: int, name: str, bits: list[bool], cursor: int, as_mask: bool
) -> None:
    allowed = allowed_of(view, bits, as_mask)
    out = select_allowed(
        make_policy(name, params_for(name, PARAMS)),
        view,
        kv_tokens,
        np.random.default_rng(0),
        cursor,
        allowed,
    )
    want = expected(
        name,
        view,
        kv_tokens,
        long_factor=PARAMS["long_factor"],
        long_tokens=int(PARAMS["long_tokens"]),
        short_slack=int(PARAMS["short_slack"]),
        d1=PARAMS["d1_ns"],
        d2=PARAMS["d2_ns"],
        cursor=cursor % view.n_gpus,
        allowed=as_list(view, allowed),
    )
    if want is None:
        assert isinstance(out, NoCapacity)
    else:
        assert isinstance(out, Decision) and out.gpu == want
        if name == "round_robin":
            assert out.cursor == (want + 1) % view.n_gpus
        else:
            assert out.cursor == cursor


@settings(max_examples=150, deadline=None)
@given(
    view=fleet_views(),
    kv_tokens=st.integers(1, 2_500),
    name=st.sampled_from(POLICY_NAMES),
    cursor=st.integers(0, 30),
    seed=st.integers(0, 2**32 - 1),
)
def test_everything_allowed_is_the_plain_policy(
    view: FleetView, kv_tokens: int, name: str, cursor: int, seed: int
) -> None:
    policy = make_policy(name, params_for(name, PARAMS))
    c = cursor % view.n_gpus
    plain = policy.select(view, kv_tokens, np.random.default_rng(seed), c)
    none = select_allowed(policy, view, kv_tokens, np.random.default_rng(seed), c, None)
    assert none == plain
    for every in (
        np.arange(view.n_gpus, dtype=np.int64),
        np.ones(view.n_gpus, dtype=np.bool_),
    ):
        rng = np.random.default_rng(seed)
        filtered = select_allowed(policy, view, kv_tokens, rng, c, every)
        if isinstance(plain, NoCapacity):
            assert isinstance(filtered, NoCapacity)
        else:
            assert isinstance(filtered, Decision)
            assert (filtered.gpu, filtered.kind) == (plain.gpu, plain.kind)
            assert filtered.cursor == plain.cursor


def test_nothing_allowed_is_no_capacity() -> None:
    view = FleetView.empty_like([4, 4], [100, 100])
    for name in POLICY_NAMES:
        out = select_allowed(
            make_policy(name), view, 10, np.random.default_rng(0), 0, np.zeros(0, np.int64)
        )
        assert isinstance(out, NoCapacity) and "allowed" in out.reason


@pytest.mark.parametrize(
    "allowed",
    [
        np.array([2], dtype=np.int64),
        np.array([-1], dtype=np.int64),
        np.array([1, 0], dtype=np.int64),
        np.array([1, 1], dtype=np.int64),
        np.array([0.0]),
        np.array([[0]], dtype=np.int64),
        np.array([True, False, True]),
    ],
)
def test_malformed_allowed_is_refused(allowed: np.ndarray) -> None:
    view = FleetView.empty_like([4, 4], [100, 100])
    with pytest.raises(ValueError, match="allowed"):
        select_allowed(make_policy("dual"), view, 10, np.random.default_rng(0), 0, allowed)
