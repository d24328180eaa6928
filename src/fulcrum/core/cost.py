"""Prefill cost model: predicted time of one prefill step, its closed-form inverse, and a fit.

Rule (SPEC section 2, form is our decision)::

    cost(q, c) = a * q * (c + q / 2) + b * q + k        [nanoseconds]

* ``q`` -- tokens computed in this step (tokens), ``c`` -- prefix of the same sequence
  already computed or cached (tokens).
* ``a`` -- attention coefficient (ns per token^2), ``b`` -- linear + MoE coefficient
  (ns per token), ``k`` -- fixed per-step overhead (ns).

The inverse :meth:`CostModel.max_tokens` returns the largest integer ``q`` with
``cost(q, c) <= budget`` (capped at :data:`MAX_CHUNK_TOKENS` and at the tokens the request
still needs), solved in closed form from the quadratic, followed by a one-token correction
for floating-point rounding. It is zero when even one token does not fit.

:func:`fit` estimates ``a, b, k`` by non-negative least squares from measured
``(q, c, ns)`` samples and reports the fit quality; :func:`should_adopt` decides whether a
refit is better than the coefficients in use by a configured margin.

Default coefficients (our decision, :data:`DEFAULT_COST_MODEL`): a DeepSeek-V3-like prefill
at EP4DP4 on H800-class GPUs, per DP rank:

* ``b = 56_000`` ns/token -- about 17.9K fresh tokens/s per GPU for the linear + MoE part;
* ``a = 2.0`` ns/token^2 -- attention overtakes the linear part at ``c = b / a = 28K``
  tokens of context, inside the 16K-32K band where MLA attention starts to dominate;
* ``k = 5_000_000`` ns -- 5 ms of fixed per-step overhead (launches, all-to-all latency).

With these, a fresh 8K-token chunk costs about 0.53 s, and the worked example of SPEC
section 8 (``q = 3,104``, ``c = 96,896``) costs about 0.79 s: it fits one step of the
default ``compute_quota_limit`` of 1 s (:data:`DEFAULT_STEP_BUDGET_NS`), and it costs more
than four times a fresh 3,000-token request (about 0.18 s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

NAME: Final = "quadratic"

MAX_CHUNK_TOKENS: Final = 32_768
"""Hard cap on tokens computed by one rank in one prefill step (tokens)."""

DEFAULT_STEP_BUDGET_NS: Final = 1_000_000_000
"""Default ``compute_quota_limit``: time budget of one prefill step (ns), our decision."""

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class CostModel:
    """Coefficients of ``cost(q, c) = a*q*(c + q/2) + b*q + k`` (ns).

    ``a`` is in ns/token^2, ``b`` in ns/token, ``k`` in ns; all must be finite and >= 0.
    """

    a: float
    b: float
    k: float

    def __post_init__(self) -> None:
        for name in ("a", "b", "k"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}: must be finite and >= 0, got {value!r}")

    # -- forward ----------------------------------------------------------------------
    def cost(self, q: int, c: int) -> float:
        """Predicted time (ns) of computing ``q`` tokens on top of a prefix of ``c`` tokens."""
        return self.a * q * (c + q / 2.0) + self.b * q + self.k

    def cost_ns(self, q: int, c: int) -> int:
        """:meth:`cost` rounded up to an integer number of nanoseconds."""
        return math.ceil(self.cost(q, c))

    def cost_array(
        self, q: npt.ArrayLike, c: npt.ArrayLike
    ) -> FloatArray:
        """Vectorised :meth:`cost`; ``q`` and ``c`` broadcast, result in ns (float64)."""
        qf = np.asarray(q, dtype=np.float64)
        cf = np.asarray(c, dtype=np.float64)
        out: FloatArray = self.a * qf * (cf + qf / 2.0) + self.b * qf + self.k
        return out

    # -- inverse ----------------------------------------------------------------------
    def max_tokens(
        self,
        c: int,
        budget_ns: float,
        *,
        cap: int = MAX_CHUNK_TOKENS,
        need: int | None = None,
    ) -> int:
        """Largest integer ``q`` with ``cost(q, c) <= budget_ns`` (tokens).

        Capped at ``cap`` tokens and at ``need`` (tokens the request still needs) when
        given. Zero when even one token does not fit. Closed form: the positive root of
        ``(a/2) q^2 + (a c + b) q + (k - budget) = 0``, written in the cancellation-free
        form ``2R / (B + sqrt(B^2 + 2aR))``, floored, then corrected by at most one token
        in either direction for rounding.
        """
        if c < 0:
            raise ValueError(f"c: must be >= 0, got {c}")
        limit = cap if need is None else min(cap, need)
        if limit <= 0:
            return 0
        lin = self.a * c + self.b
        if lin == 0.0 and self.a == 0.0:
            # Every token is free: only the fixed overhead and the caps bind.
            return limit if self.k <= budget_ns else 0
        if math.isinf(budget_ns) and budget_ns > 0:
            return limit
        rest = budget_ns - self.k
        if not rest > 0:  # also catches NaN
            return 0
        denom = lin + math.sqrt(lin * lin + 2.0 * self.a * rest)
        # a budget just past k (a subnormal rest) can underflow the denominator to 0;
        # the root is then below one token, and the correction below decides (as in
        # max_tokens_array)
        root = 2.0 * rest / denom if denom > 0 else 0.0
        q = min(limit, int(root))
        # One-token corrections for floating-point rounding of the root (not a search).
        if q < limit and self.cost(q + 1, c) <= budget_ns:
            q += 1
        if q > 0 and self.cost(q, c) > budget_ns:
            q -= 1
        return q

    def max_tokens_array(
        self,
        c: npt.ArrayLike,
        budget_ns: npt.ArrayLike,
        *,
        cap: int = MAX_CHUNK_TOKENS,
        need: npt.ArrayLike | None = None,
    ) -> IntArray:
        """Vectorised :meth:`max_tokens`; ``c``, ``budget_ns``, ``need`` broadcast (tokens)."""
        cf = np.asarray(c, dtype=np.float64)
        bf = np.asarray(budget_ns, dtype=np.float64)
        if np.any(cf < 0):
            raise ValueError("c: must be >= 0")
        limit = np.full(np.broadcast(cf, bf).shape, cap, dtype=np.int64)
        if need is not None:
            limit = np.minimum(limit, np.asarray(need, dtype=np.int64))
        limit = np.maximum(limit, 0)
        bf = np.where(np.isnan(bf), -np.inf, bf)
        finite = np.isfinite(bf)
        rest = np.where(finite, np.maximum(bf - self.k, 0.0), 0.0)
        lin = self.a * cf + self.b
        with np.errstate(divide="ignore", invalid="ignore"):
            denom = lin + np.sqrt(lin * lin + 2.0 * self.a * rest)
            root = 2.0 * rest / np.where(denom > 0, denom, 1.0)
        root = np.where(rest > 0, root, 0.0)
        free = (lin == 0.0) & (self.a == 0.0) & (bf >= self.k)
        root = np.where(free | np.isposinf(bf), np.inf, root)
        q = np.minimum(limit.astype(np.float64), np.floor(root)).astype(np.int64)
        up = (q < limit) & (self.cost_array(q + 1, cf) <= bf)
        q = q + up.astype(np.int64)
        down = (q > 0) & (self.cost_array(q, cf) > bf)
        q = q - down.astype(np.int64)
        result: IntArray = np.broadcast_to(q, limit.shape).astype(np.int64)
        return result


DEFAULT_COST_MODEL: Final = CostModel(a=2.0, b=56_000.0, k=5_000_000.0)


# -- fitting -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class FitQuality:
    """How well a model predicts a set of samples.

    ``r2`` is the coefficient of determination of predicted vs measured ns (1.0 is
    perfect); ``rel_err_*`` are percentiles / mean of ``|predicted - measured| / measured``
    (dimensionless); ``n`` is the number of samples.
    """

    n: int
    r2: float
    rel_err_mean: float
    rel_err_p50: float
    rel_err_p90: float
    rel_err_p99: float

    @property
    def score(self) -> float:
        """The figure :func:`should_adopt` compares: p90 relative error (lower is better)."""
        return self.rel_err_p90


@dataclass(frozen=True, slots=True)
class FitResult:
    """Fitted coefficients and their quality on the samples they were fitted to."""

    model: CostModel
    quality: FitQuality


def _samples(
    q: npt.ArrayLike, c: npt.ArrayLike, ns: npt.ArrayLike
) -> tuple[FloatArray, FloatArray, FloatArray]:
    qf = np.asarray(q, dtype=np.float64).ravel()
    cf = np.asarray(c, dtype=np.float64).ravel()
    nf = np.asarray(ns, dtype=np.float64).ravel()
    if not (qf.shape == cf.shape == nf.shape):
        raise ValueError(f"q, c, ns: must have equal lengths, got {qf.size}, {cf.size}, {nf.size}")
    if not (np.all(np.isfinite(qf)) and np.all(np.isfinite(cf)) and np.all(np.isfinite(nf))):
        raise ValueError("q, c, ns: must be finite")
    if np.any(qf <= 0):
        raise ValueError("q: must be > 0")
    if np.any(cf < 0):
        raise ValueError("c: must be >= 0")
    if np.any(nf <= 0):
        raise ValueError("ns: must be > 0")
    return qf, cf, nf


def evaluate(
    model: CostModel, q: npt.ArrayLike, c: npt.ArrayLike, ns: npt.ArrayLike
) -> FitQuality:
    """Quality of ``model`` on samples ``q, c`` (tokens, shape (n,)) and ``ns`` measured (ns)."""
    qf, cf, nf = _samples(q, c, ns)
    if qf.size == 0:
        raise ValueError("samples: need at least 1")
    pred = model.cost_array(qf, cf)
    resid = nf - pred
    ss_res = float(np.dot(resid, resid))
    centred = nf - float(nf.mean())
    ss_tot = float(np.dot(centred, centred))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    rel = np.abs(resid) / nf
    p50, p90, p99 = (float(x) for x in np.percentile(rel, [50.0, 90.0, 99.0]))
    return FitQuality(
        n=int(qf.size),
        r2=r2,
        rel_err_mean=float(rel.mean()),
        rel_err_p50=p50,
        rel_err_p90=p90,
        rel_err_p99=p99,
    )


def fit(
    q: npt.ArrayLike, c: npt.ArrayLike, ns: npt.ArrayLike, relative: bool = False
) -> FitResult:
    """Least-squares fit of ``a, b, k`` (all >= 0) to samples.

    ``q`` (tokens), ``c`` (tokens) and ``ns`` (measured step time, ns) are arrays of shape
    (n,), n >= 3. Non-negativity is exact: every subset of the three features is solved by
    ordinary least squares (columns scaled for conditioning) and the feasible solution with
    the smallest residual wins. ``relative``: minimise the squared *relative* residuals
    (each sample weighted by ``1 / ns``), the measure :func:`evaluate` and
    :func:`should_adopt` judge by; a sample many times its fitted cost (an engine's stall)
    then moves the fit far less than in absolute terms.
    """
    qf, cf, nf = _samples(q, c, ns)
    if qf.size < 3:
        raise ValueError(f"samples: need at least 3, got {qf.size}")
    features = np.column_stack([qf * (cf + qf / 2.0), qf, np.ones_like(qf)])
    w = 1.0 / nf if relative else np.ones_like(nf)
    best: tuple[float, npt.NDArray[np.float64]] | None = None
    for mask in range(1, 8):
        cols = [j for j in range(3) if mask & (1 << j)]
        x = features[:, cols] * w[:, None]
        scale = np.linalg.norm(x, axis=0)
        scale[scale == 0] = 1.0
        sol, *_ = np.linalg.lstsq(x / scale, nf * w, rcond=None)
        coef = np.zeros(3)
        coef[cols] = sol / scale
        if np.any(coef < 0):
            continue
        resid = (nf - features @ coef) * w
        ss = float(np.dot(resid, resid))
        if best is None or ss < best[0]:
            best = (ss, coef)
    if best is None:  # unreachable: a single non-negative column always fits ns > 0
        raise ValueError("samples: no non-negative fit")
    a, b, k = (float(v) for v in best[1])
    model = CostModel(a=a, b=b, k=k)
    return FitResult(model=model, quality=evaluate(model, qf, cf, nf))


def should_adopt(old: FitQuality, new: FitQuality, margin: float) -> bool:
    """True when ``new`` beats ``old`` (both evaluated on the same samples) by ``margin``.

    ``margin`` is a fraction in [0, 1): adopt iff
    ``new.score < old.score * (1 - margin)`` where ``score`` is the p90 relative error.
    """
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin: must be in [0, 1), got {margin}")
    return new.score < old.score * (1.0 - margin)
