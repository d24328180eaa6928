"""Multi-turn conversation traces with real prefix structure (sessions, think times,
growing contexts, shared system prompts), following published statistics.

Why: the only public trace with block ids (Mooncake's) is one workload; a prefix-aware
policy must also hold on conversation shapes it was not tuned on. Each preset below
matches figures published for a public conversation data set (sources cited per
preset); what no source publishes is marked *our assumption*.

The model (lengths in tokens, times in s):

* **Sessions** arrive as a Poisson process at ``session_rate``. Each picks one of
  ``system_prompts`` shared system prompts by Zipf popularity (exponent ``zipf_s``); a
  system prompt's length is log-normal (``system``, by its median).
* **Turns per session** follow a two-component geometric mixture: with probability
  ``long_share`` a session is "long" (mean ``long_turns``), else "short" (mean
  ``short_turns``). One geometric cannot give both a published mean and a published
  tail share (e.g. WildChat: 2.54 turns on average and 3.7% of conversations past 10
  turns); the mixture matches both.
* **Turn k** sends the whole context so far: the system prompt, every earlier user
  message and answer, and the new user message (log-normal ``user``, by its mean). With
  probability ``doc_prob`` the first user message also carries a document (log-normal,
  ``doc``): long-context chat, as in Kimi's traffic behind Mooncake.
* **Answers** are log-normal (``output``, by its mean). The next turn arrives after the
  answer is read and a reply typed: ``think`` (log-normal by its median, *our assumption*: no
  data set we found publishes inter-turn gaps) plus ``output_tokens * decode_s_per_token``.
* **Block ids** (Mooncake ``hash_ids``, one per 512-token block): a full block keeps its
  id for the rest of the session (the system prompt's full blocks are shared by every
  session using it); the partial last block gets a fresh id each turn, since an engine
  caches full blocks only. So ``len(hash_ids) == ceil(input_tokens / 512)`` and a turn's
  ids start with every full block of the previous turn.

Pure and deterministic: the only randomness is the ``numpy.random.Generator`` passed in.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Final

import numpy as np

from fulcrum.sim.workload import BLOCK_TOKENS, NS_PER_S, Request, renumber


@dataclass(frozen=True, slots=True)
class LogNormal:
    """A log-normal length (tokens) or time (s): its ``median`` (> 0) and shape ``sigma``
    (>= 0). :meth:`of_mean` builds one from a published mean."""

    median: float
    sigma: float

    def __post_init__(self) -> None:
        if not (self.median > 0 and math.isfinite(self.median)):
            raise ValueError(f"median: must be finite and > 0, got {self.median}")
        if not (self.sigma >= 0 and math.isfinite(self.sigma)):
            raise ValueError(f"sigma: must be finite and >= 0, got {self.sigma}")

    @classmethod
    def of_mean(cls, mean: float, sigma: float) -> LogNormal:
        """The log-normal of shape ``sigma`` whose mean (not median) is ``mean``."""
        if not mean > 0:
            raise ValueError(f"mean: must be > 0, got {mean}")
        return cls(mean * math.exp(-sigma * sigma / 2.0), sigma)

    @property
    def mean(self) -> float:
        """The distribution's mean."""
        return self.median * math.exp(self.sigma * self.sigma / 2.0)

    def draw(self, rng: np.random.Generator) -> float:
        """One draw."""
        return float(rng.lognormal(math.log(self.median), self.sigma))


#: Shapes of the user-message and answer lengths (*our assumption*: the sources publish
#: means only), shared by every preset.
USER_SIGMA: Final = 1.0
OUTPUT_SIGMA: Final = 0.7
#: The defaults (the ``wildchat`` preset's lengths; a document's length is ours).
_USER: Final = LogNormal.of_mean(295.6, USER_SIGMA)
_OUTPUT: Final = LogNormal.of_mean(441.3, OUTPUT_SIGMA)
_DOC: Final = LogNormal.of_mean(10_000.0, 0.8)


@dataclass(frozen=True, slots=True)
class ConversationSpec:
    """Parameters of :func:`generate` (meanings in the module docstring; tokens, s)."""

    duration_s: float = 600.0
    session_rate: float = 1.0
    system_prompts: int = 8
    zipf_s: float = 1.0
    system: LogNormal = LogNormal(1_200.0, 0.6)
    short_turns: float = 1.6
    long_turns: float = 6.3
    long_share: float = 0.2
    user: LogNormal = _USER
    output: LogNormal = _OUTPUT
    doc_prob: float = 0.0
    doc: LogNormal = _DOC
    think: LogNormal = LogNormal(20.0, 1.0)
    decode_s_per_token: float = 0.02
    max_context: int = 131_072

    def __post_init__(self) -> None:
        for name in ("duration_s", "session_rate"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0")
        for name in ("system", "user", "output", "doc", "think"):
            if not isinstance(getattr(self, name), LogNormal):
                raise ValueError(f"{name}: must be a LogNormal")
        if self.system_prompts < 1:
            raise ValueError("system_prompts: must be >= 1")
        if not (self.short_turns >= 1.0 and self.long_turns >= 1.0):
            raise ValueError("short_turns, long_turns: must be >= 1")
        for name in ("long_share", "doc_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}: must be in [0, 1]")
        if self.max_context < BLOCK_TOKENS:
            raise ValueError(f"max_context: must be >= {BLOCK_TOKENS}")


#: Presets, each matching one published source (see :data:`SOURCES`).
PRESETS: Final[dict[str, ConversationSpec]] = {
    # LMSYS-Chat-1M: 2.0 turns per conversation, 69.5 tokens per prompt, 214.5 per answer.
    "lmsys": ConversationSpec(short_turns=1.45, long_turns=4.6, long_share=0.2,
                              user=LogNormal.of_mean(69.5, USER_SIGMA),
                              output=LogNormal.of_mean(214.5, OUTPUT_SIGMA)),
    # WildChat-1M: 2.54 turns per conversation (3.7% past 10 turns), 295.6 tokens per
    # user turn, 441.3 per answer.
    "wildchat": ConversationSpec(),
    # Mooncake (Kimi) conversation trace: mean input 12,035 tokens, mean output 343, a
    # 40% prefix-cache ratio; long documents in the first turn, few turns.
    "kimi": ConversationSpec(short_turns=1.15, long_turns=3.0, long_share=0.15,
                             user=LogNormal.of_mean(300.0, USER_SIGMA),
                             output=LogNormal.of_mean(343.0, OUTPUT_SIGMA), doc_prob=0.85,
                             doc=LogNormal.of_mean(11_500.0, 0.9)),
}

#: Where each preset's published figures come from.
SOURCES: Final[dict[str, str]] = {
    "lmsys": "Zheng et al., LMSYS-Chat-1M: A Large-Scale Real-World LLM Conversation "
             "Dataset, ICLR 2024, Table 1 (https://arxiv.org/abs/2309.11998)",
    "wildchat": "Zhao et al., WildChat: 1M ChatGPT Interaction Logs in the Wild, ICLR 2024 "
                "(https://arxiv.org/abs/2405.01470): 1,039,785 conversations, 2,639,415 "
                "turns; token statistics per turn in its Table 2",
    "kimi": "Qin et al., Mooncake: Trading More Storage for Less Computation, FAST 2025, "
            "trace statistics of the conversation workload "
            "(https://www.usenix.org/system/files/fast25-qin.pdf)",
}


class _Ids:
    """Fresh block ids, counted up from 0 (shared by every session of one trace)."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


@dataclass(slots=True)
class _Session:
    """One conversation's growing context: tokens so far and its full blocks' ids."""

    tokens: int
    full: list[int]


def _block_ids(session: _Session, new_tokens: int, ids: _Ids) -> tuple[int, ...]:
    """Grow ``session`` by ``new_tokens``; the turn's block ids (full blocks kept, new
    full blocks and the partial tail fresh)."""
    session.tokens += new_tokens
    n_full = session.tokens // BLOCK_TOKENS
    if n_full > len(session.full):
        session.full.extend(ids.take(n_full - len(session.full)))
    tail = ids.take(1) if session.tokens % BLOCK_TOKENS else []
    return (*session.full, *tail)


def _turns(spec: ConversationSpec, rng: np.random.Generator) -> int:
    mean = spec.long_turns if rng.random() < spec.long_share else spec.short_turns
    return int(rng.geometric(1.0 / mean))


def _session(
    spec: ConversationSpec,
    rng: np.random.Generator,
    ids: _Ids,
    start_s: float,
    system: tuple[int, list[int]],
) -> list[Request]:
    """Every turn of one session starting at ``start_s`` with system prompt ``system``
    (its tokens, its full blocks' shared ids)."""
    out: list[Request] = []
    session = _Session(tokens=system[0], full=list(system[1]))
    t, pending = start_s, 0
    for k in range(_turns(spec, rng)):
        user = max(1, round(spec.user.draw(rng)))
        if k == 0 and rng.random() < spec.doc_prob:
            user += round(spec.doc.draw(rng))
        if session.tokens + pending + user > spec.max_context:
            break
        hash_ids = _block_ids(session, pending + user, ids)
        answer = max(1, round(spec.output.draw(rng)))
        if t >= spec.duration_s:
            break
        out.append(Request(rid=0, arrival_ns=round(t * NS_PER_S), input_tokens=session.tokens,
                           output_tokens=answer, hash_ids=hash_ids, source="conversation"))
        pending = answer
        think = spec.think.draw(rng)
        t += think + answer * spec.decode_s_per_token
    return out


def _system_prompts(spec: ConversationSpec, rng: np.random.Generator,
                    ids: _Ids) -> list[tuple[int, list[int]]]:
    out = []
    for _ in range(spec.system_prompts):
        tokens = max(1, round(spec.system.draw(rng)))
        out.append((tokens, ids.take(tokens // BLOCK_TOKENS)))
    return out


def generate(spec: ConversationSpec, rng: np.random.Generator) -> list[Request]:
    """Requests of ``spec`` over ``[0, duration_s)``, sorted by arrival, rids 0, 1, ..."""
    ids = _Ids()
    systems = _system_prompts(spec, rng, ids)
    ranks = np.arange(1, spec.system_prompts + 1, dtype=np.float64)
    popularity = ranks ** -spec.zipf_s
    popularity /= popularity.sum()
    reqs: list[Request] = []
    t = float(rng.exponential(1.0 / spec.session_rate))
    while t < spec.duration_s:
        system = systems[int(rng.choice(spec.system_prompts, p=popularity))]
        reqs.extend(_session(spec, rng, ids, t, system))
        t += float(rng.exponential(1.0 / spec.session_rate))
    return renumber(reqs)


@dataclass(frozen=True, slots=True)
class TraceStats:
    """Summary of a trace: requests, sessions' mean input/output (tokens) and the
    prefix-cache ratio with an unbounded cache (hit blocks / all blocks)."""

    requests: int
    mean_input: float
    mean_output: float
    cache_ratio: float


def stats(reqs: Sequence[Request]) -> TraceStats:
    """:class:`TraceStats` of ``reqs`` in arrival order (a block hits if seen before and
    every block before it in the request hit: prefix semantics)."""
    seen: set[int] = set()
    hits = blocks = 0
    for r in reqs:
        prefix = True
        for h in r.hash_ids:
            prefix = prefix and h in seen
            hits += prefix
            seen.add(h)
        blocks += len(r.hash_ids)
    n = max(1, len(reqs))
    return TraceStats(
        requests=len(reqs),
        mean_input=sum(r.input_tokens for r in reqs) / n,
        mean_output=sum(r.output_tokens for r in reqs) / n,
        cache_ratio=hits / blocks if blocks else 0.0,
    )


def write_jsonl(reqs: Sequence[Request], path: Path) -> None:
    """Write ``reqs`` as Mooncake JSONL (``timestamp`` ms, lengths, ``hash_ids``), which
    ``fulcrum simulate --trace`` reads."""
    with path.open("w") as f:
        for r in reqs:
            f.write(json.dumps({"timestamp": r.arrival_ns // 1_000_000,
                                "input_length": r.input_tokens,
                                "output_length": r.output_tokens,
                                "hash_ids": list(r.hash_ids)}) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fulcrum.sim.conversations --preset kimi --out trace.jsonl``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="wildchat")
    ap.add_argument("--duration-s", type=float, default=None)
    ap.add_argument("--session-rate", type=float, default=None, help="sessions per second")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    spec = PRESETS[args.preset]
    over = {k: v for k, v in (("duration_s", args.duration_s),
                              ("session_rate", args.session_rate)) if v is not None}
    spec = replace(spec, **over)
    reqs = generate(spec, np.random.default_rng(args.seed))
    write_jsonl(reqs, args.out)
    print(json.dumps({"preset": args.preset, "source": SOURCES[args.preset],
                      "spec": asdict(spec), "stats": asdict(stats(reqs))}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
