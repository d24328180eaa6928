"""Synthetic workload for what no public trace holds.

Three independent streams, merged by arrival time (all lengths in tokens, times in s):

* **Agent sessions** -- multi-turn coding agents. A session starts with a context of
  ``agent_start_tokens`` (uniform range), and each turn appends the previous answer plus
  a tool result (log-normal, mean ``agent_growth_mean``); with probability
  ``screenshot_prob`` a turn also carries one screenshot of ``screenshot_w x
  screenshot_h`` pixels cut in ``patch_size`` patches (SPEC section 5; image tokens =
  patches / 4). The session ends once its context passes ``agent_max_tokens`` (default
  300K: past the 256K tier bound). Each turn's ``hash_ids`` is the prefix of the
  session's block list, so everything but the new tail is a prefix-cache hit. Turns
  are ``agent_gap_s`` apart on average (open loop: the gap covers the agent's tool
  execution and the previous answer).
* **Chat background** -- Poisson arrivals at ``chat_rate`` req/s, log-normal input
  (median ``chat_input_median``) and output (median ``chat_output_median``), no images.
* **Tier surge** -- between ``surge_start_s`` and ``surge_start_s + surge_duration_s``,
  fresh requests at ``surge_rate`` req/s with inputs uniform in
  ``[surge_min_tokens, surge_max_tokens)`` (default: the >= 256K tier).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fulcrum.sim.workload import BLOCK_TOKENS, NS_PER_S, Request, merge


@dataclass(frozen=True, slots=True)
class SyntheticSpec:
    """Parameters of :func:`generate` (see the module docstring for their meaning)."""

    duration_s: float = 600.0
    agent_sessions: int = 24
    agent_start_tokens: tuple[int, int] = (8_000, 40_000)
    agent_growth_mean: float = 9_000.0
    agent_growth_sigma: float = 0.8
    agent_max_tokens: int = 300_000
    agent_output_median: float = 250.0
    agent_gap_s: float = 8.0
    screenshot_prob: float = 0.3
    screenshot_w: int = 1280
    screenshot_h: int = 800
    patch_size: int = 16
    chat_rate: float = 2.0
    chat_input_median: float = 1_500.0
    chat_output_median: float = 200.0
    surge_start_s: float = 200.0
    surge_duration_s: float = 60.0
    surge_rate: float = 0.25
    surge_min_tokens: int = 256 * 1024
    surge_max_tokens: int = 400 * 1024


def screenshot_patches(w: int, h: int, patch_size: int) -> int:
    """Patches of a ``w x h`` image (SPEC section 5; sides rounded up)."""
    return math.ceil(w / patch_size) * math.ceil(h / patch_size)


def _lognormal(rng: np.random.Generator, mean: float, sigma: float) -> float:
    mu = math.log(mean) - sigma * sigma / 2.0
    return float(rng.lognormal(mu, sigma))


def agent_sessions(spec: SyntheticSpec, rng: np.random.Generator) -> list[Request]:
    """The agent-session stream."""
    out: list[Request] = []
    shot = screenshot_patches(spec.screenshot_w, spec.screenshot_h, spec.patch_size)
    shot_tokens = max(1, shot // 4)
    for s in range(spec.agent_sessions):
        base = (s + 1) << 32
        t = float(rng.uniform(0.0, spec.duration_s * 0.5))
        ctx = int(rng.integers(spec.agent_start_tokens[0], spec.agent_start_tokens[1]))
        while t < spec.duration_s:
            images: tuple[int, ...] = ()
            if rng.random() < spec.screenshot_prob:
                images = (shot,)
                ctx += shot_tokens
            n_blocks = math.ceil(ctx / BLOCK_TOKENS)
            out_tokens = max(1, round(_lognormal(rng, spec.agent_output_median, 0.6)))
            out.append(
                Request(
                    rid=0,
                    arrival_ns=int(t * NS_PER_S),
                    input_tokens=ctx,
                    output_tokens=out_tokens,
                    hash_ids=tuple(range(base, base + n_blocks)),
                    image_patches=images,
                    source="agent",
                )
            )
            if ctx >= spec.agent_max_tokens:
                break
            ctx += out_tokens + round(
                _lognormal(rng, spec.agent_growth_mean, spec.agent_growth_sigma)
            )
            t += float(rng.exponential(spec.agent_gap_s))
    return out


def chat_stream(spec: SyntheticSpec, rng: np.random.Generator) -> list[Request]:
    """The Poisson chat background."""
    if spec.chat_rate <= 0:
        return []
    n = int(rng.poisson(spec.chat_rate * spec.duration_s))
    times = np.sort(rng.uniform(0.0, spec.duration_s, size=n))
    inp = rng.lognormal(math.log(spec.chat_input_median), 1.0, size=n)
    outp = rng.lognormal(math.log(spec.chat_output_median), 0.8, size=n)
    return [
        Request(
            rid=0,
            arrival_ns=int(times[i] * NS_PER_S),
            input_tokens=max(1, min(int(inp[i]), 15_000)),
            output_tokens=max(1, min(int(outp[i]), 4_000)),
            source="chat",
        )
        for i in range(n)
    ]


def surge_stream(spec: SyntheticSpec, rng: np.random.Generator) -> list[Request]:
    """The tier surge: fresh long requests in a short window."""
    if spec.surge_rate <= 0 or spec.surge_duration_s <= 0:
        return []
    n = int(rng.poisson(spec.surge_rate * spec.surge_duration_s))
    times = spec.surge_start_s + np.sort(rng.uniform(0.0, spec.surge_duration_s, size=n))
    lens = rng.integers(spec.surge_min_tokens, spec.surge_max_tokens, size=n)
    return [
        Request(
            rid=0,
            arrival_ns=int(times[i] * NS_PER_S),
            input_tokens=int(lens[i]),
            output_tokens=max(1, round(_lognormal(rng, 400.0, 0.6))),
            source="surge",
        )
        for i in range(n)
        if times[i] < spec.duration_s
    ]


def generate(spec: SyntheticSpec, rng: np.random.Generator) -> list[Request]:
    """All three streams merged (deterministic for a given ``rng`` state)."""
    return merge(agent_sessions(spec, rng), chat_stream(spec, rng), surge_stream(spec, rng))
