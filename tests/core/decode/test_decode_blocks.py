"""Block minima (the owner's index over the packed keys) never change a decision.

A view with :class:`BlockMins` (built by ``resized``, kept by ``GpuWriter``,
``write_range``, ``open_range`` and ``close_range``) must give every policy exactly the
decision of the same view without them, after any sequence of in-place writes.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.core.decode import (
    POLICY_NAMES,
    FleetView,
    GpuWriter,
    close_range,
    make_policy,
    open_range,
    resized,
    write_range,
)
from fulcrum.core.decode.view import BLOCK, BlockMins

ops = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.integers(0, 10_000), st.integers(0, 9),
                  st.integers(0, 50_000)),
        st.tuples(st.just("range"), st.integers(0, 10_000), st.integers(0, 9),
                  st.integers(0, 50_000)),
        st.tuples(st.just("close"), st.integers(0, 10_000), st.integers(1, 300), st.just(0)),
        st.tuples(st.just("open"), st.integers(0, 10_000), st.integers(1, 300), st.just(0)),
    ),
    max_size=30,
)


def plain(view: FleetView) -> FleetView:
    """The same view without block minima."""
    return FleetView.build(
        view.concurrency, view.kv_tokens, view.max_concurrency, view.max_kv_tokens, view.live
    )


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3 * BLOCK + 7), ops=ops, kv=st.sampled_from([1, 2_000, 40_000]))
def test_block_minima_give_the_plain_decisions(
    n: int, ops: list[tuple[str, int, int, int]], kv: int
) -> None:
    base = FleetView.build(np.zeros(n), np.zeros(n), np.full(n, 8), np.full(n, 60_000))
    view = resized(base, n)
    fields = {f: getattr(view, f) for f in FleetView.__dataclass_fields__ if f != "blocks"}
    view = FleetView(**fields, blocks=BlockMins.of(view.order_conc, view.order_kv))
    writer = GpuWriter(view)
    for kind, a, b, c in ops:
        g = a % n
        if kind == "write":
            writer.write(g, b, c, writer.is_live(g))
        elif kind == "range":
            k = min(b + 1, n - g)
            write_range(view, g, np.full(k, b, dtype=np.int64), np.full(k, c, dtype=np.int64))
        elif kind == "close":
            k = min(b, n - g)
            close_range(view, g, k)
        else:
            k = min(b, n - g)
            if not view.live[g : g + k].any():
                open_range(view, g, np.full(k, 8, dtype=np.int64), np.full(k, 60_000, np.int64))
        view.check()  # includes the block minima
    reference = plain(view)
    for name in POLICY_NAMES:
        policy = make_policy(name)
        got = policy.select(view, kv, np.random.default_rng(3), 5)
        want = policy.select(reference, kv, np.random.default_rng(3), 5)
        assert got == want, name
