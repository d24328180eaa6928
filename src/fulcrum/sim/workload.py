"""Workloads for the simulator: request records, trace readers, scaling and mixing.

A :class:`Request` carries everything the simulator needs about one request: its
arrival time (ns, virtual clock), input and output lengths (tokens), the prefix-cache
block ids of its input (Mooncake-style ``hash_ids``: one id per 512-token block, equal ids
mean equal prefix blocks) and the patches of each of its images.

Readers (all deterministic; random sampling takes a ``numpy.random.Generator``):

* :func:`read_mooncake` -- Mooncake JSONL (``timestamp`` ms, ``input_length``,
  ``output_length``, ``hash_ids``);
* :func:`read_azure` -- Azure LLM inference CSV (``TIMESTAMP``, ``ContextTokens``,
  ``GeneratedTokens``); no prefix information, so no cache hits;
* :func:`servegen_requests` -- ServeGen client distributions (per ten-minute window:
  rate and inter-arrival shape; per window of the dataset: distributions of input and
  output tokens, or for multimodal data of text tokens, images per request, tokens per
  image and output tokens);
* :mod:`fulcrum.sim.traces` -- any supported trace file by its content (Mooncake /
  minimal JSONL, Azure 2023/2024 CSV, BurstGPT CSV, ServeGen): :func:`read_trace`;
* :mod:`fulcrum.sim.synthetic` -- long-context agent sessions, screenshots, tier surges.

Transforms: :func:`scale_rate` (arrival rate), :func:`scale_length` (input lengths, with
block ids remapped so shared prefixes stay shared), :func:`window`, :func:`merge`.
"""

from __future__ import annotations

import ast
import csv
import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

import numpy as np

from fulcrum.sim.rows import azure_label, iter_csv, iter_jsonl
from fulcrum.units import NS_PER_S as NS_PER_S  # re-exported (synthetic imports it here)

BLOCK_TOKENS: Final = 512
"""Tokens per prefix-cache block (Mooncake ``hash_ids`` granularity)."""

PATCHES_PER_IMAGE_TOKEN: Final = 4
"""Vision patches per image token after the encoder's 2x2 patch merge (our decision)."""



@dataclass(frozen=True, slots=True)
class Request:
    """One request of a workload.

    ``arrival_ns`` -- arrival on the virtual clock (ns); ``input_tokens`` -- total context
    (tokens, text + image tokens); ``output_tokens`` -- generated tokens (>= 1);
    ``hash_ids`` -- prefix-cache block ids, one per :data:`BLOCK_TOKENS` tokens of input
    (may be empty: no prefix information); ``image_patches`` -- patches of each image
    (patches); ``source`` -- a short label of where the request came from;
    ``tenant`` (fairness id, ``""``: the default class), ``priority`` (higher first) and
    ``ttft_slo_ms`` (TTFT deadline, ms; None: none) -- its class (issue 23).
    """

    rid: int
    arrival_ns: int
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()
    image_patches: tuple[int, ...] = ()
    source: str = ""
    tenant: str = ""
    priority: int = 0
    ttft_slo_ms: int | None = None


def traces_dir() -> Path:
    """Directory of the shared traces: ``$FULCRUM_TRACES`` or ``<repo>/../shared/traces``."""
    env = os.environ.get("FULCRUM_TRACES")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[3]
    return repo.parent / "shared" / "traces"


def renumber(reqs: Iterable[Request]) -> list[Request]:
    """Requests sorted by (arrival, rid) with ``rid`` renumbered 0, 1, ..."""
    ordered = sorted(reqs, key=lambda r: (r.arrival_ns, r.rid))
    return [replace(r, rid=i) for i, r in enumerate(ordered)]


_renumber = renumber


def read_mooncake(path: Path, *, limit: int | None = None) -> list[Request]:
    """Read a Mooncake JSONL trace; ``timestamp`` is ms from the start (not re-based).

    Raises :class:`fulcrum.sim.rows.TraceError` (one line: file, line, field) on a
    malformed row.
    """

    return renumber(
        Request(rid=i, arrival_ns=t, input_tokens=inp, output_tokens=out, hash_ids=h,
                source="mooncake", tenant=c[0], priority=c[1], ttft_slo_ms=c[2])
        for i, (t, inp, out, h, c) in enumerate(iter_jsonl(Path(path), limit=limit))
    )


def read_azure(path: Path, *, limit: int | None = None) -> list[Request]:
    """Read an Azure LLM inference trace CSV (2023 or 2024 timestamps); arrivals are
    relative to the earliest row. Raises :class:`fulcrum.sim.rows.TraceError` on a
    malformed file."""

    path = Path(path)
    rows = list(iter_csv(path, "azure", limit=limit))
    if not rows:
        return []
    t0 = min(r[0] for r in rows)
    label = azure_label(path)
    return renumber(
        Request(rid=i, arrival_ns=t - t0, input_tokens=inp, output_tokens=out, source=label)
        for i, (t, inp, out) in enumerate(rows)
    )


# -- ServeGen -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Discrete:
    """A discrete distribution: ``values`` (shape (n,)) with probabilities ``probs``."""

    values: tuple[int, ...]
    probs: tuple[float, ...]

    @staticmethod
    def parse(text: str) -> Discrete:
        """Parse ServeGen's ``"{value: probability, ...}"`` string."""
        raw = ast.literal_eval(text)
        if not isinstance(raw, dict) or not raw:
            raise ValueError(f"distribution: expected a non-empty dict, got {text[:40]!r}")
        vals = tuple(int(v) for v in raw)
        total = float(sum(float(p) for p in raw.values()))
        if not (total > 0 and math.isfinite(total)) or any(float(p) < 0 for p in raw.values()):
            raise ValueError("distribution: probabilities must be >= 0 with a positive sum")
        probs = tuple(float(p) / total for p in raw.values())
        return Discrete(vals, probs)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` draws (shape (n,), int64)."""
        idx = rng.choice(len(self.values), size=n, p=np.asarray(self.probs))
        return np.asarray(self.values, dtype=np.int64)[idx]

    def mean(self) -> float:
        """Expected value."""
        return float(np.dot(self.values, self.probs))


@dataclass(frozen=True, slots=True)
class ServeGenWindow:
    """One ten-minute window of one ServeGen client: start (s), rate (req/s), inter-arrival
    distribution (``Gamma`` or ``Weibull`` with ``shape`` and ``scale`` in s)."""

    start_s: int
    rate: float
    dist: str
    shape: float
    scale: float


SERVEGEN_LAYOUT_FIELDS: Final = {
    "multimodal": ("text_tokens", "image_count", "image_tokens", "output_tokens"),
    "language": ("input_tokens", "output_tokens"),
}
"""Distributions each ServeGen layout needs (reasoning data is the language layout plus
``reason_ratio``, which is not needed: reasoning tokens are output tokens)."""


def servegen_layout(fields: Iterable[str]) -> str:
    """``multimodal`` when a dataset window has image fields, else ``language``."""
    return "multimodal" if {"text_tokens", "image_count", "image_tokens"} & set(fields) else (
        "language"
    )


def read_servegen_client(
    directory: Path, chunk: int
) -> tuple[list[ServeGenWindow], dict[int, dict[str, Discrete]]]:
    """Windows and distributions (keyed by their start second) of one ServeGen client.

    Dataset windows holding an empty distribution are skipped (as ServeGen does); only the
    fields of the window's layout (:data:`SERVEGEN_LAYOUT_FIELDS`) are parsed. A missing
    field raises ValueError naming it.
    """
    windows: list[ServeGenWindow] = []
    with (directory / f"chunk-{chunk}-trace.csv").open(newline="") as fh:
        for row in csv.reader(fh):
            if not row:
                continue
            windows.append(
                ServeGenWindow(
                    start_s=int(float(row[0])),
                    rate=float(row[1]),
                    dist=row[3] if len(row) > 3 else "",
                    shape=float(row[4]) if len(row) > 4 and row[4] else 0.0,
                    scale=float(row[5]) if len(row) > 5 and row[5] else 0.0,
                )
            )
    with (directory / f"chunk-{chunk}-dataset.json").open() as fh:
        raw = json.load(fh)
    dists: dict[int, dict[str, Discrete]] = {}
    for k, v in raw.items():
        names = SERVEGEN_LAYOUT_FIELDS[servegen_layout(v)]
        missing = [n for n in names if n not in v]
        if missing:
            raise ValueError(
                f"chunk-{chunk}-dataset.json: window {k}: missing field {missing[0]!r}"
            )
        if any(str(v[n]).strip() in ("{}", "") for n in names):
            continue
        parsed = {}
        for name in names:
            try:
                parsed[name] = Discrete.parse(v[name])
            except (ValueError, SyntaxError, TypeError) as exc:
                raise ValueError(
                    f"chunk-{chunk}-dataset.json: window {k}: field {name!r}: {exc}"
                ) from None
        dists[int(k)] = parsed
    return windows, dists


def _interarrivals(w: ServeGenWindow, rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` inter-arrival gaps (s) of window ``w``."""
    if w.dist == "Gamma" and w.shape > 0 and w.scale > 0:
        return rng.gamma(w.shape, w.scale, size=n)
    if w.dist == "Weibull" and w.shape > 0 and w.scale > 0:
        return w.scale * rng.weibull(w.shape, size=n)
    return rng.exponential(1.0 / w.rate, size=n)


def servegen_requests(
    directory: Path,
    rng: np.random.Generator,
    *,
    start_s: int = 0,
    duration_s: float = 600.0,
    clients: Sequence[int] | None = None,
    patches_per_token: int = PATCHES_PER_IMAGE_TOKEN,
    source: str = "servegen",
) -> list[Request]:
    """Sample requests from ServeGen client distributions (language, reasoning or
    multimodal layout, see :mod:`fulcrum.sim.traces`).

    Arrivals of each client follow its window's inter-arrival distribution, rescaled so
    the window's mean rate is the published rate. Multimodal: each request draws its text
    tokens, image count, tokens per image (independently per image) and output tokens
    from the client's distributions in force; ``input_tokens`` = text + image tokens;
    ``image_patches`` = image tokens x ``patches_per_token``. Language / reasoning: each
    request draws its input and output tokens.
    """
    if clients is None:
        clients = sorted(
            int(p.name.split("-")[1]) for p in directory.glob("chunk-*-trace.csv")
        )
    out: list[Request] = []
    end_s = start_s + duration_s
    for chunk in clients:
        windows, dists = read_servegen_client(directory, chunk)
        keys = sorted(dists)
        if not keys:
            continue
        for w in windows:
            times = _window_times(w, rng, start_s, end_s)
            if times is None:
                continue
            d = dists[max([k for k in keys if k <= w.start_s] or [keys[0]])]
            arrivals = [int((t - start_s) * NS_PER_S) for t in times]
            if "input_tokens" in d:
                out.extend(_language(d, rng, arrivals, source))
            else:
                out.extend(_multimodal(d, rng, arrivals, source, patches_per_token))
    return renumber(out)


def _window_times(w: ServeGenWindow, rng: np.random.Generator, start_s: float,
                  end_s: float) -> np.ndarray | None:
    """Arrival times (s) of one client window clipped to ``[start_s, end_s)``, its
    inter-arrivals rescaled to the window's published rate; None when there are none."""
    lo, hi = max(w.start_s, start_s), min(w.start_s + 600.0, end_s)
    if w.rate <= 0 or hi <= lo:
        return None
    n_expect = w.rate * (hi - lo)
    gaps = _interarrivals(w, rng, int(n_expect * 2 + 20))
    mean_gap = float(gaps.mean()) if gaps.size else 1.0
    gaps *= (1.0 / w.rate) / mean_gap if mean_gap > 0 else 1.0
    times = lo + np.cumsum(gaps) - gaps[0] * rng.random()
    times = times[(times >= lo) & (times < hi)]
    return times if times.size else None


def _language(d: dict[str, Discrete], rng: np.random.Generator, arrivals: list[int],
              source: str) -> list[Request]:
    """Language / reasoning requests: input and output tokens drawn per request."""
    n = len(arrivals)
    inputs = d["input_tokens"].sample(rng, n)
    outs = d["output_tokens"].sample(rng, n)
    return [
        Request(rid=0, arrival_ns=arrivals[i], input_tokens=int(inputs[i]),
                output_tokens=max(1, int(outs[i])), source=source)
        for i in range(n) if int(inputs[i]) > 0
    ]


def _multimodal(d: dict[str, Discrete], rng: np.random.Generator, arrivals: list[int],
                source: str, patches_per_token: int) -> list[Request]:
    """Multimodal requests: text tokens, image count, tokens per image, output tokens."""
    n = len(arrivals)
    text = d["text_tokens"].sample(rng, n)
    counts = d["image_count"].sample(rng, n)
    outs = d["output_tokens"].sample(rng, n)
    per_image = d["image_tokens"].sample(rng, int(counts.sum()))
    out: list[Request] = []
    pos = 0
    for i in range(n):
        k = int(counts[i])
        toks = [int(t) for t in per_image[pos : pos + k]]
        pos += k
        inp = int(text[i]) + sum(toks)
        if inp <= 0:
            continue
        out.append(Request(
            rid=0, arrival_ns=arrivals[i], input_tokens=inp,
            output_tokens=max(1, int(outs[i])),
            image_patches=tuple(t * patches_per_token for t in toks if t > 0),
            source=source,
        ))
    return out


# -- transforms ---------------------------------------------------------------------------
def scale_rate(reqs: Sequence[Request], factor: float) -> list[Request]:
    """Arrival rate x ``factor`` (inter-arrival times / ``factor``)."""
    if not factor > 0:
        raise ValueError(f"rate scale: must be > 0, got {factor}")
    return [replace(r, arrival_ns=int(r.arrival_ns / factor)) for r in reqs]


def _scale_blocks(ids: tuple[int, ...], n_new: int, factor: float) -> tuple[int, ...]:
    """Block ids of a request whose length was scaled by ``factor``.

    New block ``j`` covers the tokens of old block ``i = floor(j / factor)``; its id is
    derived from (old id, offset inside old block), so two requests sharing an old prefix
    share the new prefix that covers it.
    """
    if not ids:
        return ()
    sub = max(1, math.ceil(factor) + 1)
    out: list[int] = []
    for j in range(n_new):
        i = min(int(j / factor), len(ids) - 1)
        first = math.ceil(i * factor)
        out.append(ids[i] * sub + max(0, j - first) % sub)
    return tuple(out)


def scale_length(
    reqs: Sequence[Request], factor: float, *, outputs: bool = False
) -> list[Request]:
    """Input lengths x ``factor`` (and outputs too when ``outputs``); prefixes stay shared."""
    if not factor > 0:
        raise ValueError(f"length scale: must be > 0, got {factor}")
    if factor == 1.0:
        return list(reqs)
    out: list[Request] = []
    for r in reqs:
        inp = max(1, round(r.input_tokens * factor))
        n_new = math.ceil(inp / BLOCK_TOKENS)
        out.append(
            replace(
                r,
                input_tokens=inp,
                output_tokens=max(1, round(r.output_tokens * factor)) if outputs else
                r.output_tokens,
                hash_ids=_scale_blocks(r.hash_ids, n_new, factor),
            )
        )
    return out


def window(
    reqs: Sequence[Request], *, start_s: float = 0.0, duration_s: float | None = None,
    limit: int | None = None,
) -> list[Request]:
    """Requests arriving in ``[start_s, start_s + duration_s)``, re-based to 0."""
    lo = int(start_s * NS_PER_S)
    hi = None if duration_s is None else lo + int(duration_s * NS_PER_S)
    sel = [
        replace(r, arrival_ns=r.arrival_ns - lo)
        for r in reqs
        if r.arrival_ns >= lo and (hi is None or r.arrival_ns < hi)
    ]
    if limit is not None:
        sel = sel[:limit]
    return _renumber(sel)


def merge(*workloads: Sequence[Request]) -> list[Request]:
    """Union of workloads by arrival time, renumbered; block ids of each workload are
    offset so that workloads never share a prefix by accident."""
    out: list[Request] = []
    for n, reqs in enumerate(workloads):
        offset = n << 48
        out.extend(
            replace(r, hash_ids=tuple(h + offset for h in r.hash_ids)) for r in reqs
        )
    return _renumber(out)


def duration_ns(reqs: Sequence[Request]) -> int:
    """Time from the first to the last arrival (ns)."""
    if not reqs:
        return 0
    return max(r.arrival_ns for r in reqs) - min(r.arrival_ns for r in reqs)
