"""The simulator's arithmetic on small hand-computed scenarios."""

from __future__ import annotations

import pytest

from fulcrum.sim.cluster import Cluster
from fulcrum.sim.engine import simulate
from fulcrum.sim.policies import get_policy_set
from fulcrum.sim.report import summarize
from fulcrum.sim.workload import Request

MS = 1_000_000


def tiny(**over: dict[str, object]) -> Cluster:
    """1 engine x 2 ranks, 1 decode GPU, 1 VE GPU, no MoE stretch, no cache; a fixed step
    budget (``step_floor_fraction`` = 1: every rank proposes the full limit)."""
    base: dict[str, dict[str, object]] = {
        "prefill": {"engines": 1, "ranks_per_engine": 2, "moe_fraction": 0.0,
                    "step_floor_fraction": 1.0},
        "decode": {"instances": 1, "gpus_per_instance": 1, "moe_fraction": 0.0,
                   "d0_ns": 1_000_000.0, "d1_ns": 10_000.0, "d2_ns": 100.0},
        "vision": {"machines": 1, "gpus_per_machine": 1},
        "cache": {"capacity_blocks": 0},
    }
    for k, v in over.items():
        base[k] = {**base.get(k, {}), **v}
    return Cluster().with_overrides(**base)


def req(rid: int, t: int, inp: int, out: int = 1, images: tuple[int, ...] = ()) -> Request:
    return Request(rid=rid, arrival_ns=t, input_tokens=inp, output_tokens=out,
                   image_patches=images)


def test_two_ranks_three_requests() -> None:
    # Quotas (variable cost, ns): A(1000) = 2*1000*500 + 56e3*1000 = 57e6,
    # B(2000) = 4e6 + 112e6 = 116e6, C(500) = 0.25e6 + 28e6 = 28.25e6.
    # Least-loaded ranks: A -> r0, B -> r1, C -> r0 (57e6 < 116e6).
    # One step: r0 = k + 57e6 + 28.25e6 = 90.25e6, r1 = k + 116e6 = 121e6 -> 121 ms.
    reqs = [req(0, 0, 1000), req(1, 0, 2000), req(2, 0, 500)]
    res = simulate(tiny(), get_policy_set("default"), reqs, seed=0)
    assert res.first_token_ns.tolist() == [121 * MS] * 3
    assert res.finish_ns.tolist() == [121 * MS] * 3
    assert res.prefill.steps == 1
    assert res.prefill.actual_ns == pytest.approx(2 * 121e6)
    assert res.prefill.ideal_ns == pytest.approx(90.25e6 + 121e6)
    assert res.prefill.fraction == pytest.approx(105.625 / 121)
    assert res.prefill_imbalance.value == [pytest.approx(121 / 105.625)]


def test_two_ranks_three_requests_rank_budgets() -> None:
    # Same batch, each rank proposing the time of its work (no floor): r0 = k + 57e6 +
    # 28.25e6 = 90.25e6, r1 = k + 116e6 = 121e6 -> MIN 90.25 ms. Step 1: r0 runs A and C
    # whole; r1 runs the largest q of B with q^2 + 56e3 q <= 85.25e6 -> q = 1,483
    # (85,247,289 ns; 1,484 would cost 85,306,256). Step 2: B's other 517 tokens at
    # c = 1,483: 2*517*(1,483 + 258.5) + 56e3*517 = 30,752,711 ns, + k = 35,752,711.
    reqs = [req(0, 0, 1000), req(1, 0, 2000), req(2, 0, 500)]
    res = simulate(tiny(prefill={"step_floor_fraction": 0.0}), get_policy_set("default"),
                   reqs, seed=0)
    step1 = 90_250_000
    assert res.first_token_ns.tolist() == [step1, step1 + 35_752_711, step1]
    assert res.prefill.steps == 2
    # Step 1 is level (90.25 vs 90.247289 ms); step 2 has r0 idle.
    assert res.prefill.ideal_ns == pytest.approx(90.25e6 + 90_247_289 + 35_752_711)
    assert res.prefill.actual_ns == pytest.approx(2 * 90.25e6 + 2 * 35_752_711)
    assert res.prefill.idle_ns == pytest.approx(35_752_711)
    assert res.prefill.short_ns == pytest.approx(90.25e6 - 90_247_289)


def test_two_ranks_round_robin_baseline() -> None:
    # Round robin: A -> r0, B -> r1, C -> r0; fixed 8,192-token chunks -> same single step.
    reqs = [req(0, 0, 1000), req(1, 0, 2000), req(2, 0, 500)]
    res = simulate(tiny(), get_policy_set("round_robin"), reqs, seed=0)
    assert res.first_token_ns.tolist() == [121 * MS] * 3


def test_chunked_over_two_steps() -> None:
    # Budget 100 ms: one 2,000-token request on one rank. Step 1 takes the largest q with
    # 5e6 + q^2 + 56e3 q <= 1e8 -> q = 1,647 (99,944,609 ns; 1,648 would cost
    # 100,003,904); step 2 computes the other 353 tokens at c = 1,647:
    # 5e6 + 2*353*(1647 + 176.5) + 56e3*353 = 26,055,391 ns.
    c = tiny(prefill={"ranks_per_engine": 1, "step_budget_ns": 100_000_000.0})
    res = simulate(c, get_policy_set("default"), [req(0, 0, 2000)], seed=0)
    assert res.prefill.steps == 2
    assert res.first_token_ns.tolist() == [99_944_609 + 26_055_391]


def test_one_decode_gpu() -> None:
    # Prefill of 100 tokens on one rank: 5e6 + 2*100*50 + 56e3*100 = 10,610,000 ns.
    # Decode, 2 steps: 1e6 + 1e4 + 100*100 = 1,020,000; then KV 101 -> 1,020,100.
    c = tiny(prefill={"ranks_per_engine": 1})
    res = simulate(c, get_policy_set("default"), [req(0, 0, 100, out=3)], seed=0)
    assert res.first_token_ns.tolist() == [10_610_000]
    assert res.finish_ns.tolist() == [10_610_000 + 1_020_000 + 1_020_100]
    assert res.decode.steps == 2
    assert res.decode.fraction == pytest.approx(1.0)


def test_one_decode_gpu_two_requests_share_steps() -> None:
    # Both prefill in one step on the one rank: each 100-token request costs
    # 2*100*50 + 56e3*100 = 5,610,000 ns -> step 5e6 + 2 * 5,610,000 = 16,220,000 ns.
    # Decode: step 1 holds both (KV 200): 1e6 + 2*1e4 + 100*200 = 1,040,000 and A (2 output
    # tokens, 1 decode step) finishes; step 2 holds B alone (KV 101): 1,020,100.
    c = tiny(prefill={"ranks_per_engine": 1})
    reqs = [req(0, 0, 100, out=2), req(1, 0, 100, out=3)]
    res = simulate(c, get_policy_set("default"), reqs, seed=0)
    t0 = 16_220_000
    assert res.first_token_ns.tolist() == [t0, t0]
    assert res.finish_ns.tolist() == [t0 + 1_040_000, t0 + 1_040_000 + 1_020_100]


def test_one_ve_gpu() -> None:
    # VE: 2 ms + 5 us/patch, FIFO on the only GPU: 4,000 patches -> 22 ms, then
    # 1,000 patches -> 7 ms more (29 ms). A starts a prefill step at 22 ms; B, ready at
    # 29 ms, waits for that step to end (the group steps together).
    reqs = [req(0, 0, 1000, images=(4000,)), req(1, 0, 500, images=(1000,))]
    res = simulate(tiny(), get_policy_set("default"), reqs, seed=0)
    assert res.ve_done_ns.tolist() == [22 * MS, 29 * MS]
    # A: step from 22 ms lasting 5e6 + 57e6 = 62 ms -> 84 ms; B then runs alone:
    # 5e6 + 28.25e6 = 33.25 ms -> 117.25 ms.
    assert res.first_token_ns.tolist() == [84 * MS, 84 * MS + 33_250_000]
    assert res.ve_imbalance.value == [1.0, 1.0]


def test_ideal_runs_at_mean_step_time() -> None:
    reqs = [req(0, 0, 1000), req(1, 0, 2000), req(2, 0, 500)]
    res = simulate(tiny(), get_policy_set("ideal"), reqs, seed=0)
    # One step of (90.25e6 + 121e6) / 2 = 105.625 ms.
    assert res.first_token_ns.tolist() == [105_625_000] * 3
    assert res.prefill.fraction == pytest.approx(1.0)


def test_request_too_long_for_any_decode_gpu_is_counted() -> None:
    c = tiny(prefill={"ranks_per_engine": 1}, decode={"max_kv_tokens": 150})
    res = simulate(c, get_policy_set("default"), [req(0, 0, 100, out=60)], seed=0)
    assert res.decode_rejected == 1
    assert res.finish_ns.tolist() == res.first_token_ns.tolist()


# -- yardsticks on hand-made policies -------------------------------------------------------


def test_utilisation_counts_idle_engines() -> None:
    # Two engines of one rank, two 1,000-token requests at t=0 (57e6 ns variable each).
    # Round robin: one per engine, one step each of k + 57e6 = 62 ms -> useful 114e6 over
    # 2 GPUs x 62 ms. The hand-made bad policy "one_engine" runs both on engine 0 in one
    # step of k + 114e6 = 119 ms while engine 1 idles: 114e6 / (2 x 119e6).
    c = tiny(prefill={"engines": 2, "ranks_per_engine": 1})
    reqs = [req(0, 0, 1000), req(1, 0, 1000)]
    rr = summarize(simulate(c, get_policy_set("round_robin"), reqs, seed=0))
    one = summarize(simulate(c, get_policy_set("one_engine"), reqs, seed=0))
    assert rr["prefill_utilisation"] == pytest.approx(114e6 / (2 * 62e6))
    assert one["prefill_utilisation"] == pytest.approx(114e6 / (2 * 119e6))
    # The old per-step balance ratio does not see the idle engine at all.
    assert one["balance_ratio"] == pytest.approx(1.0)
    assert one["prefill_utilisation"] < 0.5


def test_more_steps_do_not_raise_utilisation() -> None:
    # One 2,000-token request on one rank (useful work 4e6 + 112e6 = 116e6 ns): a 1 s
    # budget takes one step of 121 ms; a 100 ms budget two steps (126 ms in all, see
    # test_chunked_over_two_steps): the fixed cost k of the second step is not useful.
    one = tiny(prefill={"ranks_per_engine": 1})
    small = tiny(prefill={"ranks_per_engine": 1, "step_budget_ns": 100_000_000.0})
    a = summarize(simulate(one, get_policy_set("default"), [req(0, 0, 2000)], seed=0))
    b = summarize(simulate(small, get_policy_set("default"), [req(0, 0, 2000)], seed=0))
    assert a["prefill_utilisation"] == pytest.approx(116e6 / 121e6)
    assert b["prefill_utilisation"] == pytest.approx(116e6 / 126e6)
    assert b["prefill_utilisation"] < a["prefill_utilisation"]


def test_starved_requests_count_in_ttft_p99() -> None:
    # The run ends (drain horizon) before the third request's prefill ends: its TTFT
    # counts as the time until the run ended, so the tier's p99 shows the starvation
    # instead of ignoring the request.
    c = tiny(prefill={"ranks_per_engine": 1, "step_budget_ns": 100_000_000.0})
    reqs = [req(0, 0, 100), req(1, 0, 100), req(2, 0, 60_000)]
    res = simulate(c, get_policy_set("round_robin"), reqs, seed=0, drain_s=1.0)
    s = summarize(res)
    assert s["unfinished"] == 1 and s["finished"] == 2
    tier = s["ttft_by_tier"]["16K-64K"]
    assert tier["count"] == 1 and tier["finished"] == 0
    assert tier["p99_s"] == pytest.approx(res.end_ns / 1e9)
    assert s["ttft_by_tier"]["<16K"]["p99_s"] <= 0.1 + 1e-9


def test_goodput_of_a_policy_that_starves_a_tier_is_zero() -> None:
    """A 300K-token prompt ahead of short ones on one FIFO rank starves the short tier
    for minutes at any arrival rate: the short tier's TTFT p99 never meets its SLO, so
    the goodput search finds no rate; the tiered default, which gives the short tier
    its own engine, has a positive goodput on the same requests."""
    from benchmarks.bench_sim import SLO_TTFT_P99_S, goodput, meets_slo

    c = tiny(prefill={"engines": 2, "ranks_per_engine": 1, "step_floor_fraction": 0.1})
    reqs = [req(0, 0, 300_000)] + [req(i, i * 200 * MS, 2_000) for i in range(1, 40)]
    one = summarize(simulate(c, get_policy_set("one_engine"), reqs, seed=0))
    assert one["ttft_by_tier"]["<16K"]["p99_s"] > SLO_TTFT_P99_S["<16K"]
    assert not meets_slo(one)
    assert goodput(reqs, c, "one_engine", steps=2) == (0.0, 0.0)
    rho, rps = goodput(reqs, c, "default", steps=2)
    assert rho > 0 and rps > 0


def test_work_arriving_mid_step_goes_to_the_first_engine_at_a_step_boundary() -> None:
    # 2 engines x 2 ranks, each rank proposing the time of its work. At t = 0 a
    # 13,000-token prompt (897 ms of compute) and two 3,300-token prompts (196 ms each)
    # keep both engines stepping; one engine has an empty rank. At 50 ms a fourth prompt
    # arrives while both engines are mid-step. Engines pull between steps (the kit's
    # loop), so it waits in the tier queue -- it is not bound to the empty rank of an
    # engine in the middle of a step -- and the first engine to reach a step boundary
    # takes it there.
    reqs = [req(0, 0, 13_000), req(1, 0, 3_300), req(2, 0, 3_300), req(3, 50 * MS, 3_300)]
    events: list[tuple[object, ...]] = []
    res = simulate(tiny(prefill={"engines": 2, "step_floor_fraction": 0.0}),
                   get_policy_set("default"), reqs, seed=0, trace=events.append)
    pulls = [ev for ev in events if ev[0] == "pull"]
    taken_at = {rid: int(ev[1]) for ev in pulls for rid in ev[5]}  # type: ignore[attr-defined, call-overload]
    assert taken_at["0"] == taken_at["1"] == taken_at["2"] == 0
    # Step ends: every later pull is an engine at a boundary; the first one after 50 ms
    # took request 3.
    boundary = min(int(ev[1]) for ev in pulls if int(ev[1]) > 50 * MS)  # type: ignore[call-overload]
    assert taken_at["3"] == boundary
    # e001's first step ends when its lighter rank's 3,300 tokens are done (MIN budget):
    # k + 3,300^2 + 56e3 * 3,300 = 200.69 ms; request 3 then runs alone on a rank.
    assert boundary == 200_690_000
    assert res.first_token_ns[3] == 2 * 200_690_000
