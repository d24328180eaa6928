"""A request's predicted time to first token on each engine, from its cached prefix there.

One function for every cache-aware decision (the gateway's pick for engines that serve
prefill and decode, and the prefill pull's affinity)::

    ttft_ns[e] = load_ns[e] + cost_e(q = prompt - cached[e], c = cached[e])
               [- k_e when load_ns[e] > 0 and the engines share steps]

* ``load_ns`` -- outstanding prefill work queued ahead of the request on engine ``e`` (ns);
* ``cached[e]`` -- the request's leading prompt tokens engine ``e`` holds in its prefix
  cache (tokens), clipped to ``[0, prompt_tokens - 1]``: the last prompt token is always
  computed, as every engine does;
* ``cost_e`` -- the cost model of :mod:`fulcrum.core.cost` (``a*q*(c + q/2) + b*q + k``),
  one model for all engines or one per engine (coefficient arrays: a learnt model per
  engine or engine class).

:func:`rank` turns the predictions into a decision: the engine with the least predicted
TTFT (ties: the smaller tie-break key, then the lower index) and the best other one, whose
prediction the caller reports next to the chosen one. :func:`recompute_ns` is the work a
choice adds for the prefix it recomputes (beyond the best holder's hit), which a caller may
charge on top of the TTFT so that a request leaves the engine holding its prefix only
when the wait it saves is worth the work it adds; :func:`move_charge_ns` is that charge,
shared among the requests in flight that use the same prefix.

Pure: numpy in, numpy out; no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fulcrum.core.cost import CostModel

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Coefficients:
    """Cost-model coefficients per engine: ``a`` (ns/token^2), ``b`` (ns/token), ``k``
    (ns), each a float64 array of shape ``(n,)`` or a scalar shared by every engine."""

    a: FloatArray | float
    b: FloatArray | float
    k: FloatArray | float

    @staticmethod
    def of(model: CostModel) -> Coefficients:
        """One model for every engine."""
        return Coefficients(model.a, model.b, model.k)


def miss_tokens(prompt_tokens: int, cached_tokens: npt.ArrayLike) -> tuple[IntArray, IntArray]:
    """``(q, c)`` per engine: ``c`` = cached tokens clipped to ``[0, prompt_tokens - 1]``
    and ``q = prompt_tokens - c`` (both int64, shape of ``cached_tokens``, tokens). An
    empty prompt (0 tokens) has ``q = c = 0``."""
    hit = np.asarray(cached_tokens, dtype=np.int64)
    top = max(int(prompt_tokens) - 1, 0)
    # Two ufuncs, not np.clip: clip's Python wrapper costs more than the work at the
    # sizes the pick sees (a few endpoints; ~10 us per call).
    c = np.minimum(np.maximum(hit, 0), top)
    q = np.maximum(int(prompt_tokens) - c, 0)
    return q, c


def _cost(qf: FloatArray | np.float64, cf: FloatArray | np.float64,
          co: Coefficients) -> FloatArray:
    """``cost_e(q, c)`` per engine (ns): ``a*q*(c + q/2) + b*q + k`` (``q``, ``c``:
    tokens per engine, or one split for all). Evaluated in that order, in place where it
    can be: the pick calls this on a few endpoints, where each numpy call's fixed cost
    (about 1 us) is the whole cost."""
    a, b, k = co.a, co.b, co.k
    t = np.multiply(qf, 0.5)
    t += cf
    t *= np.multiply(a, qf)  # (a*q) * (c + q/2)
    t += np.multiply(b, qf)
    t += k
    out: FloatArray = t
    return out


def request_cost_ns(
    cached_tokens: npt.ArrayLike, prompt_tokens: int, coefficients: Coefficients
) -> FloatArray:
    """The request's whole prefill cost on each engine, ``cost_e(q_e, c_e)`` with ``(q,
    c)`` split by :func:`miss_tokens` (ns, float64, shape of ``cached_tokens``). A
    caller that needs both :func:`predicted_ttft_ns` and :func:`recompute_ns` computes it
    once and passes it to each (``cost_ns=``)."""
    p = int(prompt_tokens)
    # The split of miss_tokens, in floats (4 numpy calls instead of 7).
    c = np.minimum(np.asarray(cached_tokens), max(p - 1, 0)).astype(np.float64)
    np.maximum(c, 0.0, out=c)
    q = p - c  # >= 0: c <= max(p - 1, 0)
    cost = _cost(q, c, coefficients)
    out: FloatArray = cost if cost.shape == q.shape else np.broadcast_to(cost, q.shape)
    return out


def recompute_ns(
    cached_tokens: npt.ArrayLike,
    prompt_tokens: int,
    coefficients: Coefficients,
    cost_ns: FloatArray | None = None,
) -> FloatArray:
    """The prefill work the request adds on each engine for the prefix it lacks there
    (ns, float64, shape ``(n,)``, >= 0; 0 on the engines holding the most):
    ``cost_e(q_e, c_e) - cost_e(q*, c*)``, with ``c*`` the most leading tokens any of the
    engines holds, each engine priced on its own model. It is the recompute a move there
    causes, GPU time every request queued behind it waits. Engines' models differ (a
    model learnt per engine); that difference is in the TTFT already, and a charge
    counting it again made identical engines look several times apart while one had
    adopted its learnt model and the other not (BENCHMARKS.md, "Real engines", stop 43).
    With one model for all engines it is ``cost_e - min_j cost_j`` (the cost falls as
    the cached part grows). ``cached_tokens``: shape ``(n,)``, n >= 1 (tokens);
    ``cost_ns``: the :func:`request_cost_ns` of the same arguments, when the caller has
    it."""
    hit = np.asarray(cached_tokens, dtype=np.int64)
    cost = request_cost_ns(hit, prompt_tokens, coefficients) if cost_ns is None else cost_ns
    top = max(int(prompt_tokens) - 1, 0)  # the split of miss_tokens, for one hit
    c_best = min(max(max(hit.tolist()), 0), top)  # Python: a few endpoints
    q_best = max(int(prompt_tokens) - c_best, 0)
    best = _cost(np.float64(q_best), np.float64(c_best), coefficients)  # per engine
    out: FloatArray = np.maximum(cost - best, 0.0)
    return out


def move_charge_ns(
    cached_tokens: npt.ArrayLike,
    prompt_tokens: int,
    coefficients: Coefficients,
    weight: float,
    sharers: int = 0,
    cost_ns: FloatArray | None = None,
) -> FloatArray:
    """What a caller adds to each engine's predicted TTFT for the prefix it would
    recompute there (ns, float64, shape ``(n,)``, >= 0): ``weight x``
    :func:`recompute_ns` ``/ (1 + sharers)``. ``sharers``: requests in flight that use the
    best holder's prefix (>= 0); a second copy of a prefix they use at once serves
    the requests after them too, so its one recompute is shared among them. ``weight``
    (ns per ns, >= 0): 1 weighs a ns of added work against a ns of wait."""
    share = float(weight) / (1 + max(int(sharers), 0))
    out: FloatArray = recompute_ns(cached_tokens, prompt_tokens, coefficients, cost_ns) * share
    return out


def predicted_ttft_ns(
    load_ns: npt.ArrayLike,
    cached_tokens: npt.ArrayLike,
    prompt_tokens: int,
    coefficients: Coefficients,
    shared_steps: bool = False,
    cost_ns: FloatArray | None = None,
) -> FloatArray:
    """Predicted time to first token of one request on each engine (ns, float64, shape
    ``(n,)``).

    ``load_ns``: outstanding prefill work per engine, shape ``(n,)`` (ns, >= 0; negative
    values count as 0). ``cached_tokens``: the request's cached leading tokens per engine,
    shape ``(n,)`` (tokens). ``prompt_tokens``: the request's prompt length (tokens).
    ``coefficients``: the cost model, scalars or per-engine arrays of shape ``(n,)``.
    ``shared_steps``: the engines batch waiting prompts into one step (continuous
    batching), so behind outstanding work (``load_ns > 0``) the request shares a step's
    fixed overhead and adds ``cost - k``; on an idle engine it pays the whole ``cost``.
    ``cost_ns``: the :func:`request_cost_ns` of the same arguments, when the caller has it.
    """
    co = coefficients
    cost = request_cost_ns(cached_tokens, prompt_tokens, co) if cost_ns is None else cost_ns
    load = np.maximum(np.asarray(load_ns, dtype=np.float64), 0.0)
    if shared_steps:
        cost = cost - np.where(load > 0.0, np.asarray(co.k, dtype=np.float64), 0.0)
    out: FloatArray = load + cost
    return out


def predicted_ttft_one_ns(
    load_ns: int, cached_tokens: int, prompt_tokens: int, cost_ns: Callable[[int, int], int],
) -> int:
    """:func:`predicted_ttft_ns` for one engine, in integers: ``max(load_ns, 0) +
    cost_ns(q, c)`` with ``(q, c)`` split as :func:`miss_tokens` does (``c`` = cached
    tokens clipped to ``[0, prompt_tokens - 1]``, ``q = prompt_tokens - c``; tokens).
    ``cost_ns(q, c)``: the cost model in integer ns (e.g. :meth:`CostModel.cost_ns`). The
    scalar form for decisions that price a few engines per request without numpy (the
    prefill pull's affinity, :mod:`fulcrum.core.prefill.order`), with ``shared_steps``
    off: the pull prices whole costs (sharing ``k`` there was measured worse, BENCHMARKS.md
    issue 21)."""
    top = max(int(prompt_tokens) - 1, 0)
    c = min(max(int(cached_tokens), 0), top)
    return max(int(load_ns), 0) + cost_ns(max(int(prompt_tokens) - c, 0), c)


@dataclass(frozen=True, slots=True)
class Ranked:
    """The decision over ``n >= 1`` candidates: index of the chosen one and of the best
    other (-1 when there is one candidate), and their predictions (ns; ``other_ns`` is
    NaN without a second candidate)."""

    chosen: int
    other: int
    chosen_ns: float
    other_ns: float


def rank(ttft_ns: FloatArray, tiebreak: IntArray | None = None) -> Ranked:
    """Least predicted TTFT first; equal predictions go to the smaller ``tiebreak`` key
    (e.g. the decode view's ``order_conc``: fewer requests, then more KV), then to the
    lower index. ``ttft_ns`` shape ``(n,)``, n >= 1; ``tiebreak`` int64 of the same shape."""
    n = int(ttft_ns.shape[0])
    if n == 0:
        raise ValueError("ttft_ns: need at least one candidate")
    if tiebreak is None:
        order = np.argsort(ttft_ns, kind="stable")[:2] if n > 1 else np.zeros(1, np.int64)
    else:
        # lexsort: the last key is the primary one.
        order = np.lexsort((tiebreak, ttft_ns))[:2]
    chosen = int(order[0])
    if n == 1:
        return Ranked(chosen, -1, float(ttft_ns[chosen]), float("nan"))
    other = int(order[1])
    return Ranked(chosen, other, float(ttft_ns[chosen]), float(ttft_ns[other]))
