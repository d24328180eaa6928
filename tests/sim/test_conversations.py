"""The multi-turn conversation trace generator: prefix structure, determinism, and the
published statistics each preset follows."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fulcrum.sim.conversations import (
    PRESETS,
    SOURCES,
    ConversationSpec,
    LogNormal,
    _turns,
    generate,
    main,
    stats,
)
from fulcrum.sim.traces import read_trace
from fulcrum.sim.workload import BLOCK_TOKENS


def _short(preset: str, seconds: float = 900.0) -> ConversationSpec:
    return replace(PRESETS[preset], duration_s=seconds)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_block_ids_have_prefix_structure(preset: str) -> None:
    reqs = generate(_short(preset), np.random.default_rng(5))
    assert len(reqs) > 100
    assert [r.arrival_ns for r in reqs] == sorted(r.arrival_ns for r in reqs)
    for r in reqs:
        assert len(r.hash_ids) == math.ceil(r.input_tokens / BLOCK_TOKENS)
        assert r.output_tokens >= 1
    # a later turn of a session starts with every full block of the turn before it
    by_first: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for r in reqs:
        by_first.setdefault(r.hash_ids[:1], []).append(r.hash_ids)
    grown = 0
    for r in reqs:
        earlier = [h for h in by_first[r.hash_ids[:1]] if len(h) < len(r.hash_ids)]
        grown += any(r.hash_ids[: len(h) - 1] == h[:-1] for h in earlier if len(h) > 1)
    assert grown > 0


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    spec = _short("wildchat", 300.0)
    a = generate(spec, np.random.default_rng(1))
    b = generate(spec, np.random.default_rng(1))
    c = generate(spec, np.random.default_rng(2))
    assert a == b
    assert a != c


@pytest.mark.parametrize(
    ("preset", "mean_turns", "past_10"),
    [("lmsys", 2.0, None), ("wildchat", 2.54, 0.037)],
)
def test_turns_follow_the_published_figures(
    preset: str, mean_turns: float, past_10: float | None
) -> None:
    rng = np.random.default_rng(11)
    turns = np.array([_turns(PRESETS[preset], rng) for _ in range(100_000)])
    assert turns.min() >= 1
    assert turns.mean() == pytest.approx(mean_turns, rel=0.06)
    if past_10 is not None:
        assert float((turns > 10).mean()) == pytest.approx(past_10, rel=0.15)


def test_kimi_preset_follows_mooncake_conversation_statistics() -> None:
    # published: mean input 12,035 tokens, mean output 343, prefix-cache ratio 40%
    s = stats(generate(_short("kimi", 3600.0), np.random.default_rng(1)))
    assert s.mean_input == pytest.approx(12_035, rel=0.10)
    assert s.mean_output == pytest.approx(343, rel=0.05)
    assert s.cache_ratio == pytest.approx(0.40, abs=0.08)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_cites_its_source(preset: str) -> None:
    assert "http" in SOURCES[preset]


def test_cli_writes_a_trace_the_simulator_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "conv.jsonl"
    assert main(["--preset", "lmsys", "--duration-s", "120", "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    reqs = read_trace(out)
    assert len(reqs) == report["stats"]["requests"] > 0
    assert all(len(r.hash_ids) == math.ceil(r.input_tokens / BLOCK_TOKENS) for r in reqs)


@given(
    rate=st.floats(0.05, 3.0),
    long_share=st.floats(0.0, 1.0),
    doc_prob=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_any_spec_keeps_the_block_invariant(
    rate: float, long_share: float, doc_prob: float, seed: int
) -> None:
    spec = ConversationSpec(duration_s=60.0, session_rate=rate, long_share=long_share,
                            doc_prob=doc_prob, max_context=32_768)
    for r in generate(spec, np.random.default_rng(seed)):
        assert len(r.hash_ids) == math.ceil(r.input_tokens / BLOCK_TOKENS)
        assert r.input_tokens <= spec.max_context
        assert 0 <= r.arrival_ns < 60 * 10**9


@pytest.mark.parametrize(
    ("field", "value"),
    [("session_rate", 0.0), ("system_prompts", 0), ("long_share", 1.5), ("short_turns", 0.5)],
)
def test_bad_spec_names_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        ConversationSpec(**{field: value})


@pytest.mark.parametrize(("median", "sigma", "field"), [
    (100.0, -1.0, "sigma"), (100.0, float("nan"), "sigma"), (100.0, float("inf"), "sigma"),
    (0.0, 1.0, "median"), (float("nan"), 1.0, "median")])
def test_a_bad_length_distribution_names_its_parameter(median: float, sigma: float,
                                                       field: str) -> None:
    # before: a negative sigma passed the spec and failed inside numpy at generate time
    with pytest.raises(ValueError, match=field):
        LogNormal(median, sigma)


def test_a_mean_given_lognormal_has_that_mean() -> None:
    d = LogNormal.of_mean(295.6, 1.0)
    assert d.mean == pytest.approx(295.6)
    rng = np.random.default_rng(3)
    assert float(np.mean([d.draw(rng) for _ in range(40_000)])) == pytest.approx(295.6, rel=0.03)
    with pytest.raises(ValueError, match="mean"):
        LogNormal.of_mean(-1.0, 1.0)
