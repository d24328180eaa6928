"""Cache-aware picks (gateway.cache): through a REAL Envoy with four stand-in upstreams,
and the pieces (prefix index bound, predicted TTFT) on their own."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.core.cost import CostModel
from fulcrum.core.prefix_cost import Coefficients, predicted_ttft_ns, rank
from fulcrum.gateway import pick_metrics as pm
from fulcrum.gateway.prefix_index import PrefixIndex, text_blocks
from tests.gateway.helpers import gateway_stack

pytestmark = pytest.mark.timeout(120)

CACHE = {"cache": {"enabled": True, "block_tokens": 8}}


def chat(system: str, turns: list[str]) -> dict[str, object]:
    msgs = [{"role": "system", "content": system}]
    for i, t in enumerate(turns):
        msgs.append({"role": "user", "content": t})
        if i < len(turns) - 1:
            msgs.append({"role": "assistant", "content": "ok " + t[:20]})
    return {"model": "m", "messages": msgs, "max_tokens": 8}


async def test_each_turn_of_a_chat_goes_where_its_prefix_is() -> None:
    async with gateway_stack(gateway=CACHE) as st_:
        homes: dict[int, str] = {}
        for turn in range(3):
            for conv in range(4):
                system = f"conversation {conv} " + "lorem ipsum dolor sit amet " * 40
                turns = [f"question {conv}-{t} " * 10 for t in range(turn + 1)]
                r = await st_.post("/v1/chat/completions", chat(system, turns))
                assert r.status == 200
                rid, placement = st_.picks[-1]
                await st_.wait_released(rid)
                if turn == 0:
                    homes[conv] = placement.address
                else:
                    assert placement.address == homes[conv]
        # The four conversations spread over the four endpoints (no hit: least load).
        assert len(set(homes.values())) == 4
        assert st_.decode.held == 0
        assert st_.gateway.picker.in_flight == 0


async def test_unparsed_and_empty_prompts_are_picked_by_load_and_counted() -> None:
    async with gateway_stack(gateway=CACHE) as st_:
        before = pm.CACHE_PICKS.labels("load_only")._value.get()
        r1 = await st_.post("/v1/completions", b"not json at all")
        r2 = await st_.post("/v1/completions", {"model": "m", "prompt": "", "max_tokens": 4})
        assert (r1.status, r2.status) == (200, 200)
        assert pm.CACHE_PICKS.labels("load_only")._value.get() == before + 2
        for rid, _ in st_.picks:
            await st_.wait_released(rid)


def test_index_at_its_bound_evicts_and_never_grows() -> None:
    idx = PrefixIndex()
    slot = idx.add(50)
    for i in range(20):
        idx.record(slot, text_blocks(f"text {i} " * 100, 16))
        assert idx.held(slot) <= 50
    assert idx.held(slot) == 50
    last = text_blocks("text 19 " * 100, 16)
    assert idx.match(last)[slot] == len(last)  # the most recent survive
    idx.set_capacity(slot, 5)
    assert idx.size() == 5
    idx.remove(slot)
    assert idx.size() == 0 and idx.match(last).tolist() == [0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 30), st.integers(0, 6)), max_size=40))
def test_match_is_each_engines_longest_held_leading_run(ops: list[tuple[int, int, int]]) -> None:
    """Property: the bitset walk equals a per-engine LRU scan (the reference)."""
    idx = PrefixIndex()
    slots = [idx.add(12) for _ in range(4)]
    ref: list[list[int]] = [[] for _ in slots]
    for engine, seed, n in ops:
        blocks = [hash((seed, j)) for j in range(n)]
        idx.record(slots[engine], blocks)
        lru = ref[engine]
        for h in blocks:
            if h in lru:
                lru.remove(h)
            lru.append(h)
        del lru[:-12]
        probe = [hash((seed, j)) for j in range(8)]
        want = []
        for held in ref:
            k = 0
            while k < len(probe) and probe[k] in held:
                k += 1
            want.append(k)
        assert idx.match(probe).tolist() == want


def test_predicted_ttft_prices_misses_and_adds_the_queue() -> None:
    model = CostModel(a=1.0, b=100.0, k=1000.0)
    ttft = predicted_ttft_ns(
        np.array([0.0, 5e5, -3.0]), np.array([0, 900, 5000]), 1000, Coefficients.of(model)
    )
    assert ttft[0] == pytest.approx(model.cost(1000, 0))
    assert ttft[1] == pytest.approx(5e5 + model.cost(100, 900))
    assert ttft[2] == pytest.approx(model.cost(1, 999))  # cached clipped to prompt - 1
    r = rank(ttft, np.array([3, 2, 1], dtype=np.int64))
    assert r.chosen == 2 and r.other == 0


def test_index_is_invisible_to_the_cycle_collector() -> None:
    """A full collection does not walk the index's entries: after one, its maps are
    untracked (plain dicts of ints), the rest numpy arrays."""
    import gc

    idx = PrefixIndex()
    slots = [idx.add(1000) for _ in range(3)]
    for s in slots:
        for j in range(30):
            idx.record(s, [hash((s, j, k)) for k in range(50)])
    gc.collect()
    assert not gc.is_tracked(idx._where)
    for s in slots:
        lru = idx._lru[s]
        assert lru is not None and not gc.is_tracked(lru.pos)
        assert 1000 - 1000 // 64 <= idx.held(s) <= 1000  # at its bound, with the margin
    newest = [hash((slots[0], 29, k)) for k in range(50)]
    assert idx.match(newest).tolist() == [50, 0, 0]
