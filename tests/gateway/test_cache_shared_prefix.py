"""A prefix that requests in flight share counts as held by every candidate
(``CachePicker._spread_hot``, ``gateway.cache.share_hot_prefixes``): users who arrive one
by one under one system prompt are spread by load, not all queued on the prompt's first
holder (seen on two real vLLM engines: 288 / 0, TTFT p50 8-12 ms over round robin's;
BENCHMARKS.md, "Real engines", stop 42), and a conversation keeps its own history's
holder."""

from __future__ import annotations

import heapq

from fulcrum.config.cache import CacheSettings
from fulcrum.core.cost import CostModel
from fulcrum.gateway.body import RequestShape
from fulcrum.gateway.cache_pick import CachePicker
from fulcrum.gateway.prefix_index import text_blocks
from tests.gateway.test_cost_learn import _Candidates

MS = 1_000_000
BASE = CostModel(a=2.0, b=56_000.0, k=5_000_000.0)  # the configured model (the default)
SYSTEM = "You are a helpful assistant. " * 80  # about 580 tokens at 4 characters a token


def _picker(share: bool = True) -> tuple[CachePicker, _Candidates]:
    fake = _Candidates(2)
    s = CacheSettings(enabled=True, share_hot_prefixes=share)
    return CachePicker(s, 4.0, fake), fake  # type: ignore[arg-type]


def _serve(cp: CachePicker, fake: _Candidates, clients: int = 8, n: int = 240) -> list[int]:
    """Requests per endpoint when ``clients`` users, arriving 10 ms apart, each send
    questions one after the other under one system prompt to two FIFO engines that take
    3x the model's cost plus 10 ms a request (what the model leaves out: the running
    requests' decode steps), each answer ending 20 ms after its first token."""
    free = [0.0, 0.0]
    events = [(c * 10.0 * MS, 2, "", c) for c in range(clients)]
    per, sent = [0, 0], 0
    while events:
        t, kind, rid, client = heapq.heappop(events)
        if kind == 0:
            cp.first_token(rid, int(t))
        elif kind == 1:
            cp.released(rid, "response_end", int(t))
            heapq.heappush(events, (t, 2, "", client))
        elif sent < n:
            text = f"{SYSTEM} question {sent}: " + "why " * 40
            shape = RequestShape(len(text) // 4, 8, True, text=text, stream=True)
            choice = cp.choose(fake, shape, None, int(t))  # type: ignore[arg-type]
            assert choice is not None
            rid, e = f"r{sent}", choice.index_slot
            cp.placed(rid, choice, shape.prompt_tokens, int(t), stream=True)
            work = 3 * BASE.cost_ns(shape.prompt_tokens - choice.hit_tokens,
                                    choice.hit_tokens) + 10 * MS
            free[e] = max(free[e], t) + work
            heapq.heappush(events, (free[e], 0, rid, client))
            heapq.heappush(events, (free[e] + 20 * MS, 1, rid, client))
            per[e] += 1
            sent += 1
    return per


def test_users_arriving_one_by_one_under_one_system_prompt_are_spread() -> None:
    cp, fake = _picker()
    per = _serve(cp, fake)
    assert sum(per) == 240 and min(per) >= 0.35 * 240, per
    assert cp._inflight == {} and cp._ends == {}
    # Without the rule the prompt's first holder takes all but the first request or two.
    blind, fake2 = _picker(share=False)
    assert min(_serve(blind, fake2)) <= 2


def test_a_turn_whose_previous_turn_is_still_in_flight_keeps_its_holder() -> None:
    """The access log releases a turn up to 20 ms after its answer ended, so the next turn
    can be picked while the previous one is still in flight. That one ends where the new
    turn's own text starts: it shares the history with no other request, and the history
    stays the holder's alone."""
    cp, fake = _picker()
    history = "a conversation of its own " * 60
    first = RequestShape(len(history) // 4, 8, True, text=history, stream=True)
    choice = cp.choose(fake, first, None, 0)  # type: ignore[arg-type]
    assert choice is not None
    cp.placed("t1", choice, first.prompt_tokens, 0, stream=True)
    holder = choice.index_slot
    nxt = history + "and the next question " * 6
    shape = RequestShape(len(nxt) // 4, 8, True, text=nxt, stream=True)
    again = cp.choose(fake, shape, None, 200 * MS)  # type: ignore[arg-type]
    assert again is not None and again.index_slot == holder
    assert again.hit_tokens >= len(text_blocks(history, cp.block_chars)) * 32 - 32


def test_a_shared_prompt_counts_only_as_far_as_some_candidate_holds_it() -> None:
    """Another request in flight shares the prompt's first blocks with this one; the
    holder holds fewer of them than are shared: the idle engine is credited no more than
    the holder holds."""
    cp, fake = _picker()
    for a in fake.addrs:
        cp._slot(a)
    shared = "common opening text " * 40
    other = RequestShape(len(shared) // 4 + 40, 8, True, text=shared + "elsewhere " * 40)
    choice = cp.choose(fake, other, None, 0)  # type: ignore[arg-type]
    assert choice is not None
    cp.placed("o", choice, other.prompt_tokens, 0)
    blocks = text_blocks(shared, cp.block_chars)
    cp.index.clear(0)
    cp.index.clear(1)
    cp.index.record(0, blocks[:3])  # engine 0 holds three blocks of the shared part
    text = shared + "mine " * 60
    mine = text_blocks(text, cp.block_chars)
    spread = cp._spread_hot(mine, cp.index.match(mine)[[0, 1]])
    assert list(spread) == [3, 3]
