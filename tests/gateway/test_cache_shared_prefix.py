"""A prefix that requests in flight share counts as held by every candidate
(``CachePicker._spread_hot``, ``gateway.cache.share_hot_prefixes``): users who arrive one
by one under one system prompt are spread by load, not all queued on the prompt's first
holder (seen on two real vLLM engines: 288 / 0, TTFT p50 8-12 ms over round robin's;
BENCHMARKS.md, "Real engines", stop 42), and a conversation keeps its own history's
holder."""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable

import pytest

from fulcrum.config.cache import CacheSettings
from fulcrum.core.cost import CostModel
from fulcrum.gateway.body import RequestShape
from fulcrum.gateway.cache_pick import CachePicker
from fulcrum.gateway.prefix_index import text_blocks
from tests.gateway.helpers import Candidates

MS = 1_000_000
BASE = CostModel(a=2.0, b=56_000.0, k=5_000_000.0)  # the configured model (the default)
SYSTEM = "You are a helpful assistant. " * 80  # about 580 tokens at 4 characters a token


def _picker(share: bool = True, blocks: int | None = None) -> tuple[CachePicker, Candidates]:
    fake = Candidates(2)
    s = CacheSettings(enabled=True, share_hot_prefixes=share, index_blocks=blocks)
    return CachePicker(s, 4.0, fake), fake  # type: ignore[arg-type]


def _question(i: int) -> str:
    return f"{SYSTEM} question {i}: " + "why " * 40


def _serve(cp: CachePicker, fake: Candidates, clients: int = 8, n: int = 240,
           prompt: Callable[[int], str] = _question, hits: list[int] | None = None) -> list[int]:
    """Requests per endpoint when ``clients`` users, arriving 10 ms apart, each send
    questions one after the other (``prompt(i)``: the i-th request's text; by default
    under one system prompt) to two FIFO engines that take 3x the model's cost plus
    10 ms a request (what the model leaves out: the running requests' decode steps),
    each answer ending 20 ms after its first token. ``hits``: appended [hit tokens,
    prompt tokens] of every pick, as the picker's index saw them."""
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
            text = prompt(sent)
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
            if hits is not None:
                hits[0] += choice.hit_tokens
                hits[1] += shape.prompt_tokens
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
    spread = cp._spread_hot(mine, cp.index.match(mine)[[0, 1]], 1)
    assert list(spread) == [3, 3]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_many_documents_over_the_cache_stay_each_on_one_engine(seed: int) -> None:
    """Questions about 20 documents (about 17 index blocks each), drawn uniformly, 8
    users at a time, each engine's index bounded at 220 blocks: two engines hold them
    all only if each document lives on one. A document with another request in flight
    is not spread: its requests are fewer than its holder's share of all in flight, so
    the other documents keep the other engine busy. Spreading every such document
    copied each to both engines, and both caches churned (real vLLM engines: hit ratio
    0.41-0.49, now 0.66-0.71; BENCHMARKS.md, "Real engines", stop 45). Here: 0.73-0.77
    of the prompt tokens were hits then, 0.85-0.86 now."""
    rng = random.Random(seed)
    docs = [f"document {d}: " + " ".join(f"w{rng.randrange(5000)}" for _ in range(400))
            for d in range(20)]
    cp, fake = _picker(blocks=220)
    seen = [0, 0]
    per = _serve(cp, fake, n=400, hits=seen,
                 prompt=lambda i: f"{rng.choice(docs)} question {i}: " + "why " * 40)
    assert sum(per) == 400 and min(per) >= 0.4 * 400, per
    assert seen[0] >= 0.82 * seen[1], seen


@pytest.mark.parametrize(
    ("sharing", "in_flight", "holders", "spread"),
    [
        (1, 7, 1, False),  # one other request of 8 in flight: the holder's share is 4
        (3, 7, 1, False),  # 4 of 8 (this one too): exactly its holder's share
        (4, 7, 1, True),  # 5 of 8: more than one engine's share
        (1, 1, 1, True),  # users one by one under one prompt: all in flight share it
        (7, 7, 2, False),  # both engines hold it already: nothing to spread
    ],
)
def test_a_prefix_is_spread_only_when_its_requests_exceed_its_holders_share(
    sharing: int, in_flight: int, holders: int, spread: bool
) -> None:
    """The rule of :meth:`CachePicker._spread_hot`, two candidates: ``sharing`` requests
    in flight go on from the prefix with other text, of ``in_flight`` on the candidates;
    ``holders`` candidates hold it."""
    cp, fake = _picker()
    for a in fake.addrs:
        cp._slot(a)
    prefix = "a document many questions are about " * 20
    pb = text_blocks(prefix, cp.block_chars)
    for j in range(sharing):
        other = text_blocks(prefix + f"other question {j} " * 30, cp.block_chars)
        cp._count(other, +1)
    for e in range(holders):
        cp.index.record(e, pb)
    mine = text_blocks(prefix + "my own question " * 30, cp.block_chars)
    matched = cp.index.match(mine)[[0, 1]]
    got = cp._spread_hot(mine, matched, in_flight)
    assert list(got) == ([len(pb)] * 2 if spread or holders == 2 else list(matched))
