"""Cache-aware picks (gateway.cache): through a REAL Envoy with four stand-in upstreams,
and the pieces (prefix index bound, predicted TTFT) on their own."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.core.cost import CostModel
from fulcrum.core.prefix_cost import Coefficients, predicted_ttft_ns, rank
from fulcrum.gateway.prefix_index import PrefixIndex, text_blocks
from tests.gateway.helpers import Candidates, gateway_stack

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
        cache = st_.gateway.picker.cache
        assert cache is not None
        # The pool's endpoints have their index slots before the first pick (made as
        # the adapter learnt their addresses, not on a request's path).
        assert cache.index.slots == len(st_.ups)
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


def _load_only() -> float:
    """``fulcrum_gateway_cache_picks_total{rule="load_only"}`` as the scrape reads it."""
    from fulcrum.metrics import REGISTRY

    got = REGISTRY.get_sample_value("fulcrum_gateway_cache_picks_total", {"rule": "load_only"})
    return got or 0.0


async def test_unparsed_and_empty_prompts_are_picked_by_load_and_counted() -> None:
    async with gateway_stack(gateway=CACHE) as st_:
        before = _load_only()
        r1 = await st_.post("/v1/completions", b"not json at all")
        r2 = await st_.post("/v1/completions", {"model": "m", "prompt": "", "max_tokens": 4})
        assert (r1.status, r2.status) == (200, 200)
        assert _load_only() == before + 2
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


def test_a_prefix_loses_its_tail_first_and_a_long_prompt_keeps_its_head() -> None:
    # As an engine's own cache: vLLM frees a request's blocks last first, so under
    # pressure an older conversation still hits on its head (its system prompt).
    idx = PrefixIndex()
    slot = idx.add(10)
    old, new = [hash(("old", i)) for i in range(6)], [hash(("new", i)) for i in range(6)]
    idx.record(slot, old)
    idx.record(slot, new)  # 2 of old's blocks go: its last two
    assert idx.match(old).tolist() == [4] and idx.match(new).tolist() == [6]
    long = [hash(("long", i)) for i in range(25)]
    idx.record(slot, long)  # longer than the capacity: its first 10 blocks are held
    assert idx.match(long).tolist() == [10] and idx.held(slot) == 10


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 30), st.integers(0, 6), st.booleans()),
                max_size=40))
def test_match_is_each_engines_longest_held_leading_run(
    ops: list[tuple[int, int, int, bool]],
) -> None:
    """Property: the bitset walk equals a per-engine LRU scan (the reference: a request
    touches its blocks last first, so its head is the most recent), also when a request
    repeats a block (its first occurrence counts) or every block is held."""
    idx = PrefixIndex()
    slots = [idx.add(12) for _ in range(4)]
    ref: list[list[int]] = [[] for _ in slots]
    for engine, seed, n, repeat in ops:
        blocks = [hash((seed, j % 2 if repeat else j)) for j in range(n)]
        idx.record(slots[engine], blocks)
        lru = ref[engine]
        for h in reversed(blocks):
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


@pytest.mark.parametrize("engines", [3, 9, 64, 1000])
def test_match_over_many_engines_reads_every_engines_run(engines: int) -> None:
    """Many engines holding the same prefix to different depths (each depth's set is
    past the bit-by-bit walk's size from 9 engines on): every engine gets its own run,
    engines holding nothing get 0, and a removed slot reads 0."""
    idx = PrefixIndex()
    slots = [idx.add(64) for _ in range(engines)]
    prompt = [hash(("system", j)) for j in range(6)]
    for e in slots:
        idx.record(e, prompt[: e % 7])  # depths 0..6
    idx.remove(slots[-1])
    want = [e % 7 for e in slots]
    want[-1] = 0
    assert idx.match(prompt).tolist() == want
    assert idx.match(prompt[:3]).tolist() == [min(w, 3) for w in want]
    assert idx.match([hash("other"), *prompt]).tolist() == [0] * engines


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


def test_behind_queued_work_a_request_shares_the_step_overhead() -> None:
    """shared_steps: an idle engine costs the whole cost(q, c); behind outstanding work the
    request rides a step already paid for and adds cost - k (per-engine k arrays too)."""
    model = CostModel(a=1.0, b=100.0, k=1000.0)
    load, cached = np.array([0.0, 5e5, -3.0]), np.array([0, 900, 0])
    off = predicted_ttft_ns(load, cached, 1000, Coefficients.of(model))
    on = predicted_ttft_ns(load, cached, 1000, Coefficients.of(model), shared_steps=True)
    assert on[0] == off[0] == pytest.approx(model.cost(1000, 0))
    assert on[1] == pytest.approx(5e5 + model.cost(100, 900) - 1000.0)
    assert on[2] == off[2]  # negative load is an idle engine
    per = Coefficients(np.array([1.0, 1.0]), np.array([100.0, 100.0]), np.array([10.0, 20.0]))
    got = predicted_ttft_ns(np.array([7.0, 7.0]), np.array([0, 0]), 10, per, shared_steps=True)
    # cost(10, 0) = 50 + 1000 + k: each engine's own k comes off, so both are 7 + 1050.
    assert got.tolist() == pytest.approx([1057.0, 1057.0])


@pytest.mark.parametrize(("shared", "stays"), [(True, True), (False, False)])
def test_a_conversation_stays_with_its_busy_holder_when_steps_are_shared(
    shared: bool, stays: bool
) -> None:
    """Four conversations' next turns queue on the engine holding them: counted a step
    overhead each, the fourth would leave for the idle engine and lose its prefix; on
    engines that batch, the queue is one step and the turn stays."""
    from fulcrum.config.cache import CacheSettings
    from fulcrum.gateway.body import RequestShape
    from fulcrum.gateway.cache_pick import CachePicker

    fleet = Candidates(2)
    # The step overhead alone (the recompute charge would keep the fourth turn too).
    settings = CacheSettings(enabled=True, shared_steps=shared, recompute_weight=0.0)
    cp = CachePicker(settings, 4.0, fleet)  # type: ignore[arg-type]
    texts = [f"conversation {i} " + "lorem ipsum dolor sit amet " * 60 for i in range(4)]
    for i, t in enumerate(texts):  # each history already on engine 0
        cp._slot(fleet.addrs[i % 2])
        cp.index.record(0, text_blocks(t, cp.block_chars))
    prompt = len(texts[0]) // 4 + 40
    chosen = []
    for i, t in enumerate(texts):  # the next turns arrive together
        shape = RequestShape(prompt, 8, True, text=t + " next question " * 10, stream=True)
        choice = cp.choose(fleet, shape, None, 0)  # type: ignore[arg-type]
        assert choice is not None
        cp.placed(f"r{i}", choice, prompt, 0, stream=True)
        chosen.append(choice.address)
    assert (chosen == [fleet.addrs[0]] * 4) is stays


@pytest.mark.parametrize("bump", [True, False])
def test_a_pick_follows_an_endpoint_to_its_new_decode_slot(bump: bool) -> None:
    """The picker reads index slots from a table by decode slot, kept per generation of
    the adapter's layout: after two endpoints swap decode slots (a new generation), the
    prefix is still found where it was sent. Without the bump the table would be stale:
    the test's control that the table is what is read."""
    from fulcrum.config.cache import CacheSettings
    from fulcrum.gateway.body import RequestShape
    from fulcrum.gateway.cache_pick import CachePicker

    fleet = Candidates(2)
    cp = CachePicker(CacheSettings(enabled=True), 4.0, fleet)  # type: ignore[arg-type]
    text = "lorem ipsum dolor sit amet " * 60
    shape = RequestShape(len(text) // 4, 8, True, text=text)
    first = cp.choose(fleet, shape, None, 0)  # type: ignore[arg-type]
    assert first is not None
    cp.placed("r0", first, shape.prompt_tokens, 0)
    cp.released("r0", "response_end", 1)
    fleet.addrs.reverse()  # the same endpoints, each on the other decode slot
    fleet.generation += bump
    again = cp.choose(fleet, shape, None, 2)  # type: ignore[arg-type]
    assert again is not None
    # Stale, the other endpoint is sent there with the first one's hits.
    assert (again.address == first.address) is bump
    assert again.hit_tokens > 0


def test_only_a_request_alone_on_its_endpoint_is_a_refit_sample() -> None:
    """A request picked behind others' work is marked not alone (its wait is unknown);
    one picked with nothing else in flight there gives its whole observed TTFT."""
    from fulcrum.config.cache import CacheSettings
    from fulcrum.gateway.body import RequestShape
    from fulcrum.gateway.cache_pick import CachePicker

    fleet = Candidates(2)
    cp = CachePicker(CacheSettings(enabled=True), 4.0, fleet)  # type: ignore[arg-type]
    seen: list[tuple[float, bool]] = []
    cp.learner.observe = lambda key, q, c, ttft, alone, now: seen.append((ttft, alone))  # type: ignore[method-assign]
    shape = RequestShape(400, 8, True, text="x " * 800, stream=True)
    for i in range(3):  # the third waits behind the first on engine 0
        choice = cp.choose(fleet, shape, None, 0)  # type: ignore[arg-type]
        assert choice is not None
        cp.placed(f"r{i}", choice, 400, 0, stream=True)
    assert choice.load_ns > 0
    cp.first_token("r2", 10**9)
    cp.first_token("r0", 10**9, ttft_ns=5e8)  # measured elsewhere (the access log)
    assert seen == [(1e9, False), (5e8, True)]


def _holder_and_idle(weight: float, holder_load_ns: float) -> tuple[str, object]:
    """A conversation's history on engine 0 with ``holder_load_ns`` of predicted work
    queued there, engine 1 idle; returns where its next turn goes, and the choice."""
    from fulcrum.config.cache import CacheSettings
    from fulcrum.gateway.body import RequestShape
    from fulcrum.gateway.cache_pick import CachePicker

    fleet = Candidates(2)
    cp = CachePicker(CacheSettings(enabled=True, recompute_weight=weight), 4.0, fleet)  # type: ignore[arg-type]
    text = "system prompt " + "lorem ipsum dolor sit amet " * 70
    for a in fleet.addrs:
        cp._slot(a)
    cp.index.record(0, text_blocks(text, cp.block_chars))
    cp._busy[0] = holder_load_ns
    shape = RequestShape(500, 8, True, text=text + " next question " * 8, stream=True)
    choice = cp.choose(fleet, shape, None, 0)  # type: ignore[arg-type]
    assert choice is not None
    return choice.address, choice


@pytest.mark.parametrize(
    ("weight", "load_ms", "stays"),
    [
        # Measured on two real vLLM engines (emit_scores): the holder predicted 34.0 ms,
        # the idle engine 33.2 ms for a full recompute; least TTFT alone moved the turn.
        (0.0, 30.0, False),
        (1.0, 30.0, True),
        # Far behind, the move pays for its recompute: it still happens.
        (1.0, 120.0, False),
        (0.5, 70.0, False),
    ],
)
def test_a_move_off_the_holder_must_save_more_than_the_recompute_it_adds(
    weight: float, load_ms: float, stays: bool
) -> None:
    where, choice = _holder_and_idle(weight, load_ms * 1e6)
    assert (where == "10.0.0.1:8000") is stays
    # The reported predictions stay the TTFTs, not the charged scores.
    assert choice.chosen_ns == pytest.approx(choice.load_ns + choice.cost_ns)  # type: ignore[attr-defined]


def test_recompute_is_the_work_beyond_the_cheapest_engine() -> None:
    from fulcrum.core.prefix_cost import recompute_ns

    model = CostModel(a=1.0, b=100.0, k=1000.0)
    got = recompute_ns(np.array([0, 900, 500, 900]), 1000, Coefficients.of(model))
    assert got[1] == got[3] == 0.0
    assert got[0] == pytest.approx(model.cost(1000, 0) - model.cost(100, 900))
    assert got[2] == pytest.approx(model.cost(500, 500) - model.cost(100, 900))
    assert recompute_ns(np.array([0, 0]), 1000, Coefficients.of(model)).tolist() == [0.0, 0.0]
    # Per-engine models: each engine's recompute is priced on its own model, against the
    # best holder's hit; a difference between the models alone is no recompute.
    per = Coefficients(np.array([1.0, 1.0]), np.array([100.0, 100.0]), np.array([0.0, 500.0]))
    assert recompute_ns(np.array([0, 0]), 10, per).tolist() == [0.0, 0.0]
    slow = Coefficients(np.array([1.0, 3.0]), np.array([100.0, 300.0]), np.array([0.0, 500.0]))
    got = recompute_ns(np.array([900, 0]), 1000, slow)
    assert got[0] == 0.0
    assert got[1] == pytest.approx(
        CostModel(a=3.0, b=300.0, k=500.0).cost(1000, 0)
        - CostModel(a=3.0, b=300.0, k=500.0).cost(100, 900)
    )


@settings(max_examples=200, deadline=None)
@given(
    hits=st.lists(st.integers(-5, 5000), min_size=1, max_size=8),
    prompt=st.integers(0, 5000),
)
def test_recompute_is_zero_at_the_cheapest_and_never_negative(
    hits: list[int], prompt: int
) -> None:
    from fulcrum.core.prefix_cost import recompute_ns

    got = recompute_ns(np.array(hits), prompt, Coefficients.of(CostModel(a=2.0, b=56e3, k=5e6)))
    assert got.shape == (len(hits),)
    assert float(got.min()) == 0.0 and bool((got >= 0).all())
    # Holding more of the prompt never costs more recompute.
    order = np.argsort(np.clip(hits, 0, max(prompt - 1, 0)), kind="stable")
    assert bool((np.diff(got[order]) <= 1e-6 * max(1.0, float(got.max()))).all())


@settings(max_examples=150, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(-5, 5000), st.floats(0.0, 10.0), st.floats(0.0, 1e5),
                  st.floats(0.0, 1e7)),
        min_size=1, max_size=8,
    ),
    prompt=st.integers(0, 5000),
)
def test_recompute_on_per_engine_models_prices_only_the_missing_prefix(
    rows: list[tuple[int, float, float, float]], prompt: int
) -> None:
    from fulcrum.core.prefix_cost import recompute_ns, request_cost_ns

    hits = np.array([r[0] for r in rows])
    per = Coefficients(*(np.array([r[i] for r in rows]) for i in (1, 2, 3)))
    got = recompute_ns(hits, prompt, per)
    assert got.shape == hits.shape and bool((got >= 0).all())
    # Zero wherever an engine holds as much as the best holder, whatever its model.
    assert bool((got[hits == hits.max()] == 0.0).all())
    # Each engine's own model: its recompute is its cost minus its cost at the best hit.
    for e, (_, a, b, k) in enumerate(rows):
        one = Coefficients.of(CostModel(a=a, b=b, k=k))
        mine = request_cost_ns(hits[e : e + 1], prompt, one)[0]
        best = request_cost_ns(np.array([hits.max()]), prompt, one)[0]
        assert got[e] == pytest.approx(max(mine - best, 0.0), rel=1e-9, abs=1e-6)


@settings(max_examples=100, deadline=None)
@given(
    hits=st.lists(st.integers(0, 3000), min_size=1, max_size=6),
    prompt=st.integers(1, 3000),
    weight=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    sharers=st.integers(-2, 50),
)
def test_the_move_charge_is_the_weighted_recompute_shared_among_the_requests_in_flight(
    hits: list[int], prompt: int, weight: float, sharers: int
) -> None:
    from fulcrum.core.prefix_cost import move_charge_ns, recompute_ns

    co = Coefficients.of(CostModel(a=2.0, b=56e3, k=5e6))
    whole = recompute_ns(np.array(hits), prompt, co)
    got = move_charge_ns(np.array(hits), prompt, co, weight, sharers)
    assert got == pytest.approx(whole * weight / (1 + max(sharers, 0)))
    # More requests sharing the prefix never charge a copy more.
    assert bool((move_charge_ns(np.array(hits), prompt, co, weight, max(sharers, 0) + 1)
                 <= got + 1e-9).all())


def test_a_scraped_queue_is_work_ahead_at_the_scrape_and_drains_with_time() -> None:
    """A scrape is a snapshot: its waiting requests are work ahead from the scrape's time
    on, draining as time passes, like the picker's own prediction; a newer scrape
    replaces it."""
    from fulcrum.config.cache import CacheSettings
    from fulcrum.gateway.cache_pick import CachePicker

    fleet = Candidates(2)
    cp = CachePicker(CacheSettings(enabled=True), 4.0, fleet)  # type: ignore[arg-type]
    for a in fleet.addrs:
        cp._slot(a)
    cp._mean[0] = 13e6  # ns per request
    cp.scraped(fleet.addrs[0], 4, 0, 1_000_000_000)
    slots = np.array([0, 1], dtype=np.int64)
    at = [1_000_000_000 + d for d in (0, 26_000_000, 52_000_000, 80_000_000)]
    assert [cp.outstanding_ns(slots, t)[0] for t in at] == [52e6, 26e6, 0.0, 0.0]
    assert cp.outstanding_ns(slots, at[0])[1] == 0.0
    cp.scraped(fleet.addrs[0], 1, 0, at[3])  # the next page: one waiting from then on
    assert cp.outstanding_ns(slots, at[3])[0] == 13e6


def test_a_restart_clears_only_that_engines_index_and_its_pending_ttft_samples() -> None:
    """A changed process start is a restart: that engine's blocks and the TTFT samples of
    requests picked there (priced with hits it lost) go; the other engine's stay."""
    from fulcrum.config.cache import CacheSettings
    from fulcrum.gateway.body import RequestShape
    from fulcrum.gateway.cache_pick import CachePicker

    fleet = Candidates(2)
    cp = CachePicker(CacheSettings(enabled=True), 4.0, fleet)  # type: ignore[arg-type]
    for a in fleet.addrs:
        cp.scraped(a, 0, 0, 0, 100.0)
    text = "a long shared document " * 40
    for i in range(2):
        shape = RequestShape(len(text) // 4, 8, True, text=text + f" q{i}", stream=True)
        choice = cp.choose(fleet, shape, None, i)  # type: ignore[arg-type]
        assert choice is not None
        cp.placed(f"r{i}", choice, shape.prompt_tokens, i, stream=True)
        cp.index.record(1 - choice.index_slot, choice.blocks)  # both engines hold it
    held = [cp.index.held(0), cp.index.held(1)]
    assert min(held) > 0 and set(cp._first) == {"r0", "r1"}
    first_slot = {r: f[0] for r, f in cp._first.items()}
    assert sorted(first_slot.values()) == [0, 1]  # one picked on each (ties alternate)
    cp.scraped(fleet.addrs[0], 0, 0, 10, 100.0)  # the same process: nothing changes
    assert [cp.index.held(0), cp.index.held(1)] == held
    cp.scraped(fleet.addrs[0], 0, 0, 20, 250.0)
    assert cp.index.held(0) == 0 and cp.index.held(1) == held[1]
    assert set(cp._first) == {r for r, s in first_slot.items() if s == 1}


def test_a_turn_does_not_leave_its_holder_for_a_queue_the_holder_has_since_served() -> None:
    """Caught on two real vLLM engines (unary mode, emit_scores): a scrape saw the holder
    with waiting turns (52 ms predicted ahead there); up to 235 ms later, when the next
    turn of one of those conversations came (so the holder had answered its previous
    turn), the snapshot still counted 52 ms and the turn left with its 409 cached tokens.
    Here the snapshot is long enough that leaving pays at the scrape's instant."""
    from fulcrum.config.cache import CacheSettings
    from fulcrum.gateway.body import RequestShape
    from fulcrum.gateway.cache_pick import CachePicker

    fleet = Candidates(2)
    cp = CachePicker(CacheSettings(enabled=True), 4.0, fleet)  # type: ignore[arg-type]
    text = "system prompt " + "lorem ipsum dolor sit amet " * 70
    for a in fleet.addrs:
        cp._slot(a)
    cp.index.record(0, text_blocks(text, cp.block_chars))
    cp._mean[0] = 26e6
    t_scrape = 10_000_000_000
    cp.scraped(fleet.addrs[0], 3, 0, t_scrape)
    shape = RequestShape(500, 8, True, text=text + " next question " * 8, stream=True)
    at_scrape = cp.choose(fleet, shape, None, t_scrape)  # type: ignore[arg-type]
    later = cp.choose(fleet, shape, None, t_scrape + 235_000_000)  # type: ignore[arg-type]
    assert at_scrape is not None and later is not None
    assert at_scrape.address == fleet.addrs[1]  # 78 ms ahead then: the move pays
    assert later.address == fleet.addrs[0] and later.load_ns == 0.0


# -- hot prefixes: a prefix many requests use at once gets a second copy ---------------------

SYSTEM = "You are a helpful assistant. " * 52  # about 375 tokens at 4 characters a token


def _burst(share: bool, n: int = 12) -> tuple[list[int], list[str], object]:
    """``n`` requests on one system prompt, each with its own question, picked at the same
    instant (none answered yet): the engine each went to, its copy label, and the picker
    (the copy counters read its figures only while it lives: keep it)."""
    from fulcrum.config.cache import CacheSettings
    from fulcrum.gateway.body import RequestShape
    from fulcrum.gateway.cache_pick import CachePicker

    fleet = Candidates(2)
    cp = CachePicker(CacheSettings(enabled=True, share_hot_prefixes=share), 4.0, fleet)  # type: ignore[arg-type]
    where, copies = [], []
    for i in range(n):
        text = SYSTEM + f"question {i} " + "tell me about the weather today " * 7
        shape = RequestShape(len(text) // 4, 8, True, text=text, stream=True)
        choice = cp.choose(fleet, shape, None, 0)  # type: ignore[arg-type]
        assert choice is not None
        cp.placed(f"r{i}", choice, shape.prompt_tokens, 0)
        where.append(fleet.addrs.index(choice.address))
        copies.append(choice.copy)
    return where, copies, cp


def test_a_burst_on_one_system_prompt_gets_a_second_copy_at_once_when_requests_share_it(
) -> None:
    """The first request in flight goes on past the system prompt with its own question:
    the prompt is shared, so it counts as held by both engines, no copy is charged, and
    the second request goes to the idle engine by load."""
    where, copies, picker = _burst(True)
    assert where[:2] == [0, 1]
    assert sorted(set(where)) == [0, 1] and not any(copies)
    assert _copies("shared") + _copies("full") == 0  # the new picker's own figures
    del picker


def test_without_the_rule_a_burst_leaves_the_holder_only_past_the_whole_charge() -> None:
    """The whole charge: the request leaves only once the holder's queue is longer than
    the cold TTFT by the whole recompute (seen on two real vLLM engines: all 72 of a
    run's requests on the holder)."""
    where, copies, picker = _burst(False)
    assert where.index(1) == 5
    assert copies[5] == "full"
    assert [c for c in copies if c] == ["full"]  # one copy: then both engines hold it
    assert _copies("full") == 1  # the new picker's own figures, read while it lives
    del picker


def _copies(charge: str) -> float:
    from fulcrum.metrics import REGISTRY

    got = REGISTRY.get_sample_value("fulcrum_gateway_cache_prefix_copies_total",
                                    {"charge": charge})
    return got or 0.0


@pytest.mark.parametrize("share", [True, False])
def test_a_conversations_own_history_pays_the_whole_charge_while_others_share_its_system_prompt(
    share: bool,
) -> None:
    """Seven other requests in flight contain the same system prompt, none the history:
    the turn's deepest held block is its own, so it stays on its holder. 25 ms are
    queued there (27.5 ms predicted). With the rule, the shared prompt counts as held by
    the idle engine too (18.4 ms predicted there) and the history's recompute (15.9 ms)
    is charged whole: 34.3 ms keeps the turn; a charge shared eight ways (20.4 ms) would
    not. Without it, the idle engine is 38 ms cold + 31 ms charged."""
    from fulcrum.config.cache import CacheSettings
    from fulcrum.gateway.body import RequestShape
    from fulcrum.gateway.cache_pick import CachePicker

    fleet = Candidates(2)
    cp = CachePicker(CacheSettings(enabled=True, share_hot_prefixes=share), 4.0, fleet)  # type: ignore[arg-type]
    for a in fleet.addrs:
        cp._slot(a)
    history = SYSTEM + "my earlier question and your answer " * 20
    cp.index.record(0, text_blocks(history, cp.block_chars))
    for i in range(7):
        other = SYSTEM + f"another user {i} " * 30
        shape = RequestShape(len(other) // 4, 8, True, text=other, stream=True)
        choice = cp.choose(fleet, shape, None, 0)  # type: ignore[arg-type]
        assert choice is not None
        cp.placed(f"o{i}", choice, shape.prompt_tokens, 0)
    cp.index.clear(1)  # what the others left there: engine 1 holds nothing
    cp._busy[:2] = [25e6, 0.0]  # the holder 25 ms behind, the other engine idle
    text = history + " next question " * 8
    shape = RequestShape(len(text) // 4, 8, True, text=text, stream=True)
    choice = cp.choose(fleet, shape, None, 0)  # type: ignore[arg-type]
    assert choice is not None and choice.address == fleet.addrs[0] and choice.copy == ""


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.integers(0, 3)), max_size=40))
def test_in_flight_prefix_counts_follow_placements_and_releases(
    ops: list[tuple[bool, int, int]],
) -> None:
    """Random places (one of six prompts over two system prompts; some under an id in
    flight again) and releases (of any id, known or not, twice or not): the counts (of
    every block, and of each prompt's last block) are those of the requests still in
    flight, and nothing is left once every one is released."""
    from collections import Counter

    from fulcrum.config.cache import CacheSettings
    from fulcrum.gateway.body import RequestShape
    from fulcrum.gateway.cache_pick import CachePicker

    fleet = Candidates(2)
    cp = CachePicker(CacheSettings(enabled=True), 4.0, fleet)  # type: ignore[arg-type]
    live: dict[str, list[int]] = {}
    for n, (place, prompt, rid) in enumerate(ops):
        if place:
            text = ("system one " if prompt % 2 else "system two ") * 40 + f"q{prompt} " * 20
            shape = RequestShape(len(text) // 4, 8, True, text=text)
            choice = cp.choose(fleet, shape, None, n)  # type: ignore[arg-type]
            assert choice is not None
            name = sorted(live)[0] if rid == 3 and live else f"p{n}"  # or an id again
            cp.placed(name, choice, shape.prompt_tokens, n)
            live[name] = choice.blocks
        else:
            victim = sorted(live)[rid % len(live)] if live and rid else f"unknown{rid}"
            cp.released(victim, "done", n)
            live.pop(victim, None)
        want = Counter(h for blocks in live.values() for h in blocks)
        assert cp._inflight == dict(want)
        assert cp._ends == dict(Counter(b[-1] for b in live.values() if b))
    for rid in list(live):
        cp.released(rid, "done", 10**6)
    assert cp._inflight == {} and cp._ends == {}


@pytest.mark.parametrize("http", [False, True], ids=["ext_proc", "http"])
@pytest.mark.parametrize("share", [True, False], ids=["rule_on", "rule_off"])
async def test_a_burst_on_one_system_prompt_through_envoy(http: bool, share: bool) -> None:
    """Six requests on one system prompt, all held open at the stand-in upstreams (in
    flight together), through a real Envoy: with the rule the prompt counts as held by
    every endpoint once a request in flight shares it, and they spread by load; without
    it all six stay on the holder. Costs in seconds (k 1 s, 10 ms a token), so
    that the predicted queue does not drain while the requests pass Envoy."""
    import asyncio

    from tests.polling import until

    cache = {"cache": {"enabled": True, "block_tokens": 8, "share_hot_prefixes": share,
                       "cost_model": {"a": 0.0, "b": 1e7, "k": 1e9}}}
    async with gateway_stack(gateway=cache, http=http) as st_:
        shared0 = _copies("shared")
        sends = []
        for i in range(6):
            body = {"model": "m", "stream": True, "max_tokens": 8, "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"question {i} " + "about the weather " * 8}]}
            sends.append(asyncio.ensure_future(
                st_.post("/v1/chat/completions", body, {"x-test-hold": f"b{i}"})))
            await until(lambda n=f"b{i}": any(n in u.held_now for u in st_.ups), "held")
        homes = [p.address for _, p in st_.picks]
        assert len(homes) == 6
        if share:  # the prompt is shared from the second request on: held everywhere
            assert len(set(homes)) >= 2 and _copies("shared") == shared0
        else:
            assert len(set(homes)) == 1
        for i in range(6):
            for u in st_.ups:
                u.release_hold(f"b{i}")
        assert all(r.status == 200 for r in await asyncio.gather(*sends))
        for rid, _ in st_.picks:
            await st_.wait_released(rid)
        cache_picker = st_.gateway.picker.cache
        assert cache_picker is not None and cache_picker._inflight == {}

