"""Online cost learning of the cache-aware picks (gateway.cache.refit): from the TTFT the
gateway observes per request to a per-endpoint model, and the first-token hook through a
REAL Envoy."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from fulcrum.config.cache import CacheSettings
from fulcrum.config.prefill import RefitSettings
from fulcrum.core.cost import CostModel
from fulcrum.gateway import pick_metrics as pm
from fulcrum.gateway.body import RequestShape
from fulcrum.gateway.cache_pick import CachePicker
from tests.gateway.helpers import Candidates, gateway_stack
from tests.polling import until

pytestmark = pytest.mark.timeout(120)

BASE = CostModel(a=2.0, b=56_000.0, k=5_000_000.0)


def _picker(per: str) -> tuple[CachePicker, Candidates]:
    fake = Candidates(2)
    s = CacheSettings(
        enabled=True, learn_per=per,
        refit=RefitSettings(window_samples=64, min_samples=16, period_s=0.001),
    )
    return CachePicker(s, 4.0, fake), fake  # type: ignore[arg-type]


def _serve(cp: CachePicker, fake: Candidates, true: dict[int, CostModel], n: int) -> None:
    """``n`` streamed requests, one at a time, each answered after its true cost."""
    rng = random.Random(7)
    now = 0
    for i in range(n):
        tokens = rng.randrange(100, 3000)
        shape = RequestShape(tokens, 8, True, text=f"{i} " * 40, stream=True)
        choice = cp.choose(fake, shape, None, now)  # type: ignore[arg-type]
        assert choice is not None
        cp.placed(f"r{i}", choice, tokens, now, stream=True)
        q = tokens - choice.hit_tokens
        now += true[choice.index_slot].cost_ns(q, choice.hit_tokens)
        cp.first_token(f"r{i}", now)
        cp.released(f"r{i}", "response_end", now)
        now += 1_000_000


def test_a_slower_endpoint_gets_its_own_model_and_loses_picks() -> None:
    cp, fake = _picker("endpoint")
    slow = CostModel(a=BASE.a * 3, b=BASE.b * 3, k=BASE.k * 3)
    before = pm.COST_REFITS.labels("adopted")._value.get()
    _serve(cp, fake, {0: slow, 1: BASE}, 80)
    assert pm.COST_REFITS.labels("adopted")._value.get() > before
    learnt = cp.learner.model(fake.addrs[0])
    for q in (200, 1000, 2500):
        assert learnt.cost(q, 0) == pytest.approx(slow.cost(q, 0), rel=0.02)
    assert cp.learner.model(fake.addrs[1]) == BASE  # its samples fit the configured model: kept
    # Both idle, no hit anywhere: the fresh prompt now goes to the faster endpoint.
    for i in range(4):
        shape = RequestShape(2000, 8, True, text=f"fresh {i} " * 40)
        choice = cp.choose(fake, shape, None, 10**15)  # type: ignore[arg-type]
        assert choice is not None and choice.index_slot == 1


def test_before_an_endpoint_has_its_own_refit_it_uses_the_pools_model() -> None:
    """Per endpoint, every sample also feeds one pooled window: 16 samples in all (8 on
    each endpoint, below its own min_samples) adopt the pool's model for both at once,
    so neither looks cheaper for not having learnt yet. An endpoint whose own refit kept
    the configured model keeps it, whatever the pool's says."""
    cp, fake = _picker("endpoint")
    slow = CostModel(a=BASE.a * 2, b=BASE.b * 2, k=BASE.k * 2)
    _serve(cp, fake, {0: slow, 1: slow}, 16)
    for i in range(2):
        assert cp.learner.model(fake.addrs[i]).cost(1500, 0) == pytest.approx(
            slow.cost(1500, 0), rel=0.02)
    assert (cp._coef[0] == cp._coef[1]).all()
    assert fake.addrs[0] not in cp.learner.models  # nothing of their own yet: the pool's
    # A learner whose key "b" refitted and kept the configured model: the pool is not its.
    from fulcrum.gateway.cost_learn import CostLearner

    ln = CostLearner(RefitSettings(window_samples=64, min_samples=4, period_s=0.001), BASE)
    rng = random.Random(3)
    for t in range(8):
        q = rng.randrange(100, 3000)
        ln.observe("a", q, 0, slow.cost_ns(q, 0), True, t)
    assert ln.model("b") == ln.model("a") != BASE  # b has no samples: the pool's
    for t in range(8, 16):
        q = rng.randrange(100, 3000)
        ln.observe("b", q, 0, BASE.cost_ns(q, 0), True, t)
    assert ln.model("b") == BASE and ln.model("a") != BASE


def test_per_engine_the_dp_ranks_of_a_pool_entry_share_one_model() -> None:
    cp, fake = _picker("engine")
    cp.engine_of = {fake.addrs[0]: "e0", fake.addrs[1]: "e0"}
    slow = CostModel(a=BASE.a * 2, b=BASE.b * 2, k=BASE.k * 2)
    _serve(cp, fake, {0: slow, 1: slow}, 40)
    assert cp.learn_key(0) == cp.learn_key(1) == "e0"
    assert cp.learner.model("e0").cost(1500, 0) == pytest.approx(slow.cost(1500, 0), rel=0.02)
    assert (cp._coef[0] == cp._coef[1]).all()


def test_one_model_for_all_endpoints_and_bad_samples_are_dropped() -> None:
    cp, fake = _picker("all")
    fast = CostModel(a=1.0, b=20_000.0, k=1_000_000.0)
    _serve(cp, fake, {0: fast, 1: fast}, 40)
    assert cp.learn_key(0) == cp.learn_key(1) == ""
    assert cp.learner.model("") != BASE
    assert cp.learner.model("").cost(1000, 0) == pytest.approx(fast.cost(1000, 0), rel=0.02)
    assert (cp._coef[0] == cp._coef[1]).all()
    dropped = pm.TTFT_SAMPLES.labels("dropped")._value.get()
    queued = pm.TTFT_SAMPLES.labels("queued")._value.get()
    # No computed token, or no time: no sample. Not alone when picked: not learnt from.
    assert cp.learner.observe("", 0, 100, 1_000.0, True, 0) is None
    assert cp.learner.observe("", 100, 0, 0.0, True, 0) is None
    assert pm.TTFT_SAMPLES.labels("dropped")._value.get() == dropped + 2
    assert cp.learner.observe("", 100, 0, 1_000.0, False, 0) is None
    assert pm.TTFT_SAMPLES.labels("queued")._value.get() == queued + 1


def test_a_few_engine_stalls_do_not_keep_the_refit_from_learning() -> None:
    # Requests one at a time (each alone) on an engine of 15 ms + 0.1 ms a token, three
    # of them stalled to 220-310 ms, two among the first eight samples; the configured
    # model is far too fast. The refit fits relative errors, the measure it is judged by,
    # so the stalls do not pull the fit up past the model in force (a real engine's
    # stalls kept every absolute refit in one CI run).
    s = CacheSettings(
        enabled=True, learn_per="all",
        cost_model={"a": 0.0, "b": 1_000.0, "k": 100_000.0},  # type: ignore[arg-type]
        refit=RefitSettings(min_samples=8, period_s=0.001),
    )
    fake = Candidates(2)
    cp = CachePicker(s, 4.0, fake)  # type: ignore[arg-type]
    true = CostModel(a=0.0, b=100_000.0, k=15_000_000.0)
    rng = np.random.default_rng(4)
    now = 0
    for i in range(24):
        tokens = int(rng.integers(130, 650))
        shape = RequestShape(tokens, 8, True, text=f"{i} " * 40, stream=True)
        choice = cp.choose(fake, shape, None, now)  # type: ignore[arg-type]
        assert choice is not None
        cp.placed(f"r{i}", choice, tokens, now, stream=True)
        jitter = rng.uniform(0.8, 1.25)
        took = {2: 265e6, 5: 310e6, 17: 220e6}.get(i, true.cost_ns(tokens, 0) * jitter)
        now += int(took)
        cp.first_token(f"r{i}", now)
        cp.released(f"r{i}", "response_end", now)
        now += 1_000_000
    learnt = cp.learner.model("")
    assert learnt != cp.learner.base
    for q in (150, 400, 650):
        assert learnt.cost(q, 0) == pytest.approx(true.cost(q, 0), rel=0.25)


def test_requests_that_queued_behind_others_do_not_teach_the_model_their_wait() -> None:
    # A FIFO engine 3x slower than the configured model serves bursts of four requests;
    # one request alone follows each burst. The picker's predicted queue comes from the
    # configured model, so a burst's TTFT minus that prediction is mostly the wait it
    # under-predicted: learning from it inflated the model (stop 41: a fixed cost of
    # 30-130 ms per step learnt on engines whose own is 15 ms). Only the lone requests
    # teach it, and it learns the engine's true cost.
    cp, fake = _picker("all")
    true = CostModel(a=BASE.a * 3, b=BASE.b * 3, k=BASE.k * 3)
    queued0 = pm.TTFT_SAMPLES.labels("queued")._value.get()
    rng = random.Random(11)
    now, n = 0, 0
    for _ in range(24):
        done: list[tuple[int, str]] = []
        free = {0: now, 1: now}  # each endpoint's FIFO: when it is free again (ns)
        for j in range(5):  # four at once, then one alone after they are all done
            if j == 4:
                for at, rid in sorted(done):
                    cp.first_token(rid, at)
                    cp.released(rid, "response_end", at)
                now = max(free.values()) + 1_000_000
                free = {0: now, 1: now}
                done = []
            tokens = rng.randrange(100, 3000)
            shape = RequestShape(tokens, 8, True, text=f"{n} " * 40, stream=True)
            choice = cp.choose(fake, shape, None, now)  # type: ignore[arg-type]
            assert choice is not None
            cp.placed(f"r{n}", choice, tokens, now, stream=True)
            e = choice.index_slot
            hit = choice.hit_tokens
            free[e] = max(free[e], now) + true.cost_ns(tokens - hit, hit)
            done.append((free[e], f"r{n}"))
            n += 1
        for at, rid in done:
            cp.first_token(rid, at)
            cp.released(rid, "response_end", at)
        now = max(free.values()) + 1_000_000
    learnt = cp.learner.model("")
    assert learnt != BASE
    for q in (200, 1000, 2500):
        assert learnt.cost(q, 0) == pytest.approx(true.cost(q, 0), rel=0.02)
    assert pm.TTFT_SAMPLES.labels("queued")._value.get() - queued0 >= 24 * 2


async def test_first_streamed_chunk_through_envoy_is_one_ttft_sample() -> None:
    cache = {"cache": {"enabled": True, "block_tokens": 8}}
    async with gateway_stack(gateway=cache) as st_:
        picker = st_.gateway.picker
        assert picker.cache is not None
        cache_picker = picker.cache
        kept0 = pm.TTFT_SAMPLES.labels("kept")._value.get()
        drop0 = pm.TTFT_SAMPLES.labels("dropped")._value.get()
        seen0 = pm.OBSERVED_TTFT._sum.get(), sum(b.get() for b in pm.OBSERVED_TTFT._buckets)
        body = {"model": "m", "stream": True, "max_tokens": 8,
                "messages": [{"role": "user", "content": "hello there " * 30}]}
        for i in range(3):
            name = f"ttft-{i}"
            task = st_.post("/v1/chat/completions", body, {"x-test-hold": name})
            fut = asyncio.ensure_future(task)
            await until(lambda n=name: any(n in u.held_now for u in st_.ups), "held")
            rid = st_.picks[-1][0]
            # The first chunk passed the ext_proc stream while the response is still open.
            await until(lambda r=rid: r not in cache_picker._first, "first chunk")
            for u in st_.ups:
                u.release_hold(name)
            r = await fut
            assert r.status == 200
            await st_.wait_released(rid)
        kept = pm.TTFT_SAMPLES.labels("kept")._value.get() - kept0
        dropped = pm.TTFT_SAMPLES.labels("dropped")._value.get() - drop0
        assert kept + dropped == 3
        assert sum(b.get() for b in pm.OBSERVED_TTFT._buckets) - seen0[1] == 3
        # A non-streamed request gives no sample.
        r = await st_.post("/v1/chat/completions", {**body, "stream": False})
        assert r.status == 200
        assert pm.TTFT_SAMPLES.labels("kept")._value.get() - kept0 == kept
        assert not cache_picker._first


def _observed() -> tuple[float, float]:
    """The observed-TTFT histogram: samples in all, and samples at or under 0.1 s."""
    buckets = pm.OBSERVED_TTFT._buckets
    upto = pm.OBSERVED_TTFT._upper_bounds.index(0.1)
    return sum(b.get() for b in buckets), sum(b.get() for b in buckets[: upto + 1])


@pytest.mark.parametrize("mode", ["http", "unary"])
async def test_envoys_access_log_carries_each_streamed_first_token_to_the_learner(
    mode: str,
) -> None:
    # No response message reaches the picker in these modes: the sample is Envoy's own
    # time from the request sent upstream to the first body byte, from its access log.
    # The upstream sends its headers at once and its first chunk 120 ms later, as an
    # engine does (headers, then the prefill): a header time would be under 0.1 s.
    cache = {"cache": {"enabled": True, "block_tokens": 8}}
    async with gateway_stack(gateway=cache, http=mode == "http", unary=mode == "unary") as st_:
        cache_picker = st_.gateway.picker.cache
        assert cache_picker is not None
        kept0 = pm.TTFT_SAMPLES.labels("kept")._value.get()
        drop0 = pm.TTFT_SAMPLES.labels("dropped")._value.get()
        seen0, fast0 = _observed()
        body = {"model": "m", "stream": True, "max_tokens": 8,
                "messages": [{"role": "user", "content": "hello there " * 30}]}
        for i in range(3):
            name = f"{mode}-ttft-{i}"
            headers = {"x-test-hold": name, "x-test-first-ms": "120"}
            fut = asyncio.ensure_future(st_.post("/v1/chat/completions", body, headers))
            await until(lambda n=name: any(n in u.held_now for u in st_.ups), "held")
            rid = st_.picks[-1][0]
            for u in st_.ups:
                u.release_hold(name)
            assert (await fut).status == 200
            assert await st_.wait_released(rid) == "access_log"
        kept = pm.TTFT_SAMPLES.labels("kept")._value.get() - kept0
        dropped = pm.TTFT_SAMPLES.labels("dropped")._value.get() - drop0
        assert kept + dropped == 3
        seen, fast = _observed()
        assert (seen - seen0, fast - fast0) == (3, 0)
        assert not cache_picker._first


class _Log:
    def __init__(self) -> None:
        self.lines: list[dict[str, object]] = []

    def info(self, event: str, **kw: object) -> None:
        self.lines.append({"event": event, **kw})


def _other_sum() -> float:
    """The sum of ``fulcrum_gateway_cache_best_other_ttft_seconds`` as the scrape reads it."""
    from fulcrum.metrics import REGISTRY

    return REGISTRY.get_sample_value("fulcrum_gateway_cache_best_other_ttft_seconds_sum") or 0.0


def test_the_decision_is_exposed_and_its_log_line_switches_on_by_reload(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Per pick: chosen and best-other predicted TTFT and hit tokens in metrics; the score
    line (every candidate's [predicted TTFT ns, hit tokens]) only once emit_scores is on."""
    import fulcrum.gateway.cache_pick as cache_pick

    rec = _Log()
    monkeypatch.setattr(cache_pick, "log", rec)
    cp, fake = _picker("endpoint")
    shape = RequestShape(1000, 8, True, text="exposed " * 100)
    other0 = _other_sum()
    choice = cp.choose(fake, shape, None, 0)  # type: ignore[arg-type]
    assert choice is not None and not rec.lines
    cp.placed("x0", choice, 1000, 0)
    assert _other_sum() > other0 and choice.other_ns >= choice.chosen_ns
    cp.released("x0", "response_end", 0)
    cp.apply_settings(cp.settings.model_copy(update={"emit_scores": True}))
    choice = cp.choose(fake, shape, None, 1)  # type: ignore[arg-type]
    assert choice is not None
    (line,) = rec.lines
    assert line["event"] == "gateway_endpoint_scores" and line["chosen"] == choice.address
    assert line["sharers"] == 0  # x0 was released: nothing in flight uses the prefix
    scores = line["scores"]
    assert isinstance(scores, dict) and set(scores) == set(fake.addrs)
    assert scores[choice.address][1] == choice.hit_tokens > 0  # its blocks held
