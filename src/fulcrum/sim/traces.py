"""Trace files by content: which format a file holds, and its requests.

:func:`read_trace` looks inside the file (never at its extension) and reads:

* **JSONL** (one JSON object a line; the first non-blank line decides), the project's
  *minimal format*, of which the Mooncake trace is a superset:

  - ``timestamp`` -- arrival, **milliseconds** (integer or decimal) from any origin;
    arrivals are re-based so the first request arrives at 0;
  - ``input_length`` -- prompt tokens (integer >= 0; 0 is read as 1);
  - ``output_length`` -- generated tokens (integer >= 0; 0 is read as 1);
  - ``hash_ids`` (optional) -- prefix-cache block ids of the prompt, one per 512-token
    block (Mooncake's convention: equal ids mean equal prefix blocks); without them
    the request has no prefix-cache information (no cache hits);
  - ``tenant`` (optional, string) -- who sent it (the fairness id; default: the default
    class), ``priority`` (optional, integer, higher first; default 0) and
    ``ttft_slo_ms`` (optional, ms > 0) -- its TTFT deadline (issue 23; the ``tenants``
    settings of ``--cluster`` give weights, caps and which classes are sheddable).

  Other keys are ignored. Example line::

      {"timestamp": 1250, "input_length": 8000, "output_length": 200, "hash_ids": [0, 1],
       "tenant": "acme", "priority": 1, "ttft_slo_ms": 2000}

* **Azure LLM inference CSV** (Splitwise 2023 and DynamoLLM 2024 releases, and the
  2025 multimodal one): header ``TIMESTAMP, ContextTokens, GeneratedTokens`` (column
  names case-insensitive; the 2025 trace's ``NumImages`` is ignored, its image tokens
  are already in ``ContextTokens``); timestamps ``2023-11-16 18:17:03.9799600`` (2023)
  or ``2024-05-10 00:00:00.009930+00:00`` (2024, with or without a fraction); arrivals
  relative to the earliest row.
* **BurstGPT CSV**: header ``Timestamp, Model, Request tokens, Response tokens,
  Total tokens, Log Type``; ``Timestamp`` in seconds from the trace start; only the
  timestamp and the two token columns are required. Failed requests (``Response
  tokens`` = 0) are kept with one output token: their prefill still ran.
* **ServeGen** client data (alibaba/ServeGen ``data/<category>/<model>/``): a directory
  of ``chunk-N-trace.csv`` (per ten-minute window: start s, rate req/s, CV, arrival
  distribution and its two parameters) and ``chunk-N-dataset.json`` (per window:
  token distributions as ``"{value: probability}"`` strings), or one client's
  ``chunk-N-trace.csv`` / ``chunk-N-dataset.json`` (its sibling is found beside it). The
  layout is told by the dataset fields:

  - *language* -- ``input_tokens``, ``output_tokens``;
  - *reasoning* -- the same plus ``reason_ratio`` (reasoning share of the output;
    reasoning tokens are decoded like any other output token, so it does not change
    the simulated work and is not used);
  - *multimodal* -- ``text_tokens``, ``image_count``, ``image_tokens`` (per image),
    ``output_tokens`` (audio and video fields are not modelled).

  ServeGen publishes distributions, not requests: requests are sampled
  (:func:`fulcrum.sim.workload.servegen_requests`) over ``[start_s, start_s +
  duration_s)`` seconds of the day with a seeded generator.

A file that cannot be read raises :class:`TraceError`, whose message is one line naming
the file and what is missing or malformed (the field, and the line for row errors).
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

import numpy as np

from fulcrum.sim.rows import AZURE_COLUMNS as AZURE_COLUMNS
from fulcrum.sim.rows import BURSTGPT_COLUMNS as BURSTGPT_COLUMNS
from fulcrum.sim.rows import JSONL_FIELDS as JSONL_FIELDS
from fulcrum.sim.rows import NO_CLASS, _norm
from fulcrum.sim.rows import NS_PER_MS as NS_PER_MS
from fulcrum.sim.rows import JsonlRow as JsonlRow
from fulcrum.sim.rows import TraceError as TraceError
from fulcrum.sim.rows import azure_label as azure_label
from fulcrum.sim.rows import azure_timestamp_ns as azure_timestamp_ns
from fulcrum.sim.rows import iter_csv as iter_csv
from fulcrum.sim.rows import iter_jsonl as iter_jsonl
from fulcrum.sim.workload import Request, renumber, servegen_requests

FORMATS: Final = (
    "mooncake", "jsonl", "azure", "burstgpt",
    "servegen-language", "servegen-reasoning", "servegen-multimodal",
)
"""Format names :func:`detect` returns (``mooncake`` = JSONL whose rows carry ``hash_ids``)."""

SERVEGEN_FIELDS: Final[Mapping[str, tuple[str, ...]]] = {
    "servegen-multimodal": ("text_tokens", "image_count", "image_tokens", "output_tokens"),
    "servegen-reasoning": ("input_tokens", "output_tokens", "reason_ratio"),
    "servegen-language": ("input_tokens", "output_tokens"),
}

_SNIFF_BYTES: Final = 64 * 1024
_CHUNK_RE: Final = re.compile(r"^chunk-(\d+)-(trace\.csv|dataset\.json)$")


# -- detection ----------------------------------------------------------------------------
def _first_line(path: Path) -> str:
    try:
        with path.open("rb") as fh:
            head = fh.read(_SNIFF_BYTES)
    except OSError as exc:
        raise TraceError(path, f"cannot open: {exc.strerror or exc}") from None
    if b"\x00" in head:
        raise TraceError(path, "binary file (expected JSONL or CSV text; gunzip it first?)")
    text = head.decode("utf-8", errors="replace").lstrip("\ufeff")
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    raise TraceError(path, "empty file: no request")


def _csv_kind(path: Path, header: Sequence[str]) -> str:
    """``azure`` / ``burstgpt`` by the header's columns, or a TraceError naming what lacks."""
    have = {_norm(h) for h in header}
    best: tuple[int, str, tuple[str, ...]] | None = None
    for kind, cols in (("azure", AZURE_COLUMNS), ("burstgpt", BURSTGPT_COLUMNS)):
        missing = tuple(c for c in cols if _norm(c) not in have)
        if not missing:
            return kind
        hits = len(cols) - len(missing)
        if best is None or hits > best[0]:
            best = (hits, kind, missing)
    assert best is not None
    hits, kind, missing = best
    if hits >= 2:
        name = "Azure" if kind == "azure" else "BurstGPT"
        raise TraceError(path, f"{name} CSV header lacks field {missing[0]!r}")
    shown = ", ".join(h.strip() for h in header[:6])
    raise TraceError(
        path,
        f"unrecognised CSV header ({shown}): expected field 'TIMESTAMP' with "
        "'ContextTokens' and 'GeneratedTokens' (Azure) or 'Timestamp' with 'Request tokens' "
        "and 'Response tokens' (BurstGPT)",
    )


def _looks_servegen_trace_row(row: Sequence[str]) -> bool:
    if len(row) < 3:
        return False
    try:
        float(row[0])
        float(row[1])
    except ValueError:
        return False
    return True


def detect(path: Path) -> str:
    """The format of ``path`` (one of :data:`FORMATS`), decided by content.

    Raises :class:`TraceError` when the content matches no format.
    """
    path = Path(path)
    if path.is_dir():
        return _servegen_kind(path, _servegen_files(path)[0][1])
    if not path.exists():
        raise TraceError(path, "no such file or directory")
    first = _first_line(path)
    if first.startswith("{"):
        try:
            row = json.loads(first)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict):
            if _is_servegen_dataset(row):
                return _servegen_kind(path, path)
            return "mooncake" if "hash_ids" in row else "jsonl"
        # A multi-line JSON document: a ServeGen dataset file?
        if _CHUNK_RE.match(path.name) or first == "{":
            return _servegen_kind(path, path)
        raise TraceError(path, "line 1 is not a JSON object (expected JSONL: one object a line)")
    if first.startswith("["):
        raise TraceError(path, "a JSON array, not JSONL (expected one JSON object a line)")
    row = next(csv.reader([first]))
    if _looks_servegen_trace_row(row):
        files = _servegen_files(path)
        return _servegen_kind(path, files[0][1])
    return _csv_kind(path, row)


# -- ServeGen -----------------------------------------------------------------------------
def _is_servegen_dataset(obj: Mapping[str, object]) -> bool:
    return bool(obj) and all(
        isinstance(k, str) and k.lstrip("-").isdigit() and isinstance(v, dict)
        for k, v in obj.items()
    )


def _servegen_files(path: Path) -> list[tuple[int, Path]]:
    """``(client, dataset file)`` of a ServeGen directory or of one client's file, each with
    its ``chunk-N-trace.csv`` present; TraceError when none or one is missing."""
    if path.is_dir():
        found = []
        for p in sorted(path.iterdir()):
            m = _CHUNK_RE.match(p.name)
            if m and m.group(2) == "dataset.json":
                found.append((int(m.group(1)), p))
            elif m and not (path / f"chunk-{m.group(1)}-dataset.json").exists():
                raise TraceError(
                    path / f"chunk-{m.group(1)}-dataset.json",
                    f"missing: ServeGen client {m.group(1)} has a trace but no dataset",
                )
        if not found:
            raise TraceError(
                path, "directory holds no ServeGen 'chunk-N-dataset.json' / 'chunk-N-trace.csv'"
            )
        directory = path
    else:
        m = _CHUNK_RE.match(path.name)
        if m is None:
            raise TraceError(
                path, "looks like ServeGen client data but is not named chunk-N-trace.csv "
                "or chunk-N-dataset.json (needed to find its sibling file)",
            )
        n = int(m.group(1))
        found = [(n, path.with_name(f"chunk-{n}-dataset.json"))]
        directory = path.parent
    for n, ds in sorted(found):
        if not ds.exists():
            raise TraceError(ds, "missing: a ServeGen client needs its dataset beside its trace")
        if not (directory / f"chunk-{n}-trace.csv").exists():
            raise TraceError(
                directory / f"chunk-{n}-trace.csv",
                "missing: a ServeGen client needs its trace beside its dataset",
            )
    return sorted(found)


def load_servegen_dataset(path: Path) -> dict[int, dict[str, str]]:
    """Raw dataset of one ServeGen client: window start (s) -> field -> distribution text."""
    try:
        with path.open(encoding="utf-8") as fh:
            raw = json.load(fh)
    except json.JSONDecodeError as exc:
        raise TraceError(path, f"not JSON ({exc.msg}, line {exc.lineno})") from None
    except UnicodeDecodeError:
        raise TraceError(path, "not UTF-8 text") from None
    if not isinstance(raw, dict) or not _is_servegen_dataset(raw):
        raise TraceError(path, "expected a ServeGen dataset: {window start s: {field: dist}}")
    return {int(k): v for k, v in raw.items()}


def _servegen_kind(where: Path, dataset: Path) -> str:
    raw = load_servegen_dataset(dataset)
    fields = set(next(iter(raw.values())).keys())
    if {"text_tokens", "image_count", "image_tokens"} & fields:
        kind = "servegen-multimodal"
    elif "reason_ratio" in fields:
        kind = "servegen-reasoning"
    else:
        kind = "servegen-language"
    missing = [f for f in SERVEGEN_FIELDS[kind] if f not in fields]
    if missing:
        raise TraceError(dataset, f"ServeGen dataset lacks field {missing[0]!r}")
    return kind


def servegen_source(path: Path) -> tuple[Path, list[int]]:
    """Directory and client ids of a ServeGen directory or one client's file."""
    path = Path(path)
    files = _servegen_files(path)
    directory = path if path.is_dir() else path.parent
    return directory, [n for n, _ in files]


def _check_servegen_rows(directory: Path, clients: Sequence[int]) -> None:
    for n in clients:
        p = directory / f"chunk-{n}-trace.csv"
        with p.open(newline="", encoding="utf-8") as fh:
            for lineno, row in enumerate(csv.reader(fh), start=1):
                if not row:
                    continue
                if len(row) < 2 or not _looks_servegen_trace_row(row):
                    raise TraceError(
                        p, "expected 'start s, rate req/s, cv, distribution, shape, scale'",
                        line=lineno,
                    )


def read_trace(
    path: Path | str,
    *,
    limit: int | None = None,
    rng: np.random.Generator | None = None,
    start_s: float = 0.0,
    duration_s: float | None = None,
) -> list[Request]:
    """Requests of the trace at ``path``, any supported format (module docstring).

    Record formats (JSONL, Azure, BurstGPT) are read in full (or their first ``limit``
    rows) with arrivals re-based to the first request; ``start_s`` / ``duration_s`` are
    left to :func:`fulcrum.sim.workload.window`. ServeGen data is sampled with ``rng``
    (default: seed 0) over ``[start_s, start_s + duration_s)`` seconds of the day
    (``duration_s`` default 600), then cut to its first ``limit`` requests.
    """
    path = Path(path)
    kind = detect(path)
    if kind.startswith("servegen"):
        directory, clients = servegen_source(path)
        _check_servegen_rows(directory, clients)
        try:
            reqs = servegen_requests(
                directory,
                rng if rng is not None else np.random.default_rng(0),
                start_s=int(start_s),
                duration_s=600.0 if duration_s is None else duration_s,
                clients=clients,
                source=kind,
            )
        except (ValueError, SyntaxError, KeyError, IndexError) as exc:
            raise TraceError(path, f"ServeGen data: {exc}") from None
        return reqs[:limit] if limit is not None else reqs
    rows: list[JsonlRow]
    if kind in ("mooncake", "jsonl"):
        rows = list(iter_jsonl(path, limit=limit))
    else:
        rows = [(t, i, o, (), NO_CLASS) for t, i, o in iter_csv(path, kind, limit=limit)]
    if not rows:
        raise TraceError(path, "no request rows")
    label = azure_label(path) if kind == "azure" else kind
    t0 = min(r[0] for r in rows)
    return renumber(
        Request(rid=i, arrival_ns=t - t0, input_tokens=inp, output_tokens=out,
                hash_ids=h, source=label, tenant=c[0], priority=c[1], ttft_slo_ms=c[2])
        for i, (t, inp, out, h, c) in enumerate(rows)
    )
