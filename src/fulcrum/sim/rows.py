"""Row readers of trace files that need no request model: JSONL and Azure/BurstGPT CSV.

:func:`iter_jsonl` and :func:`iter_csv` yield plain tuples (arrival ns, tokens, block ids),
raising :class:`TraceError` (one line: file, line, field) on a bad row. Both
:mod:`fulcrum.sim.workload` (the Mooncake and Azure readers) and
:mod:`fulcrum.sim.traces` (any trace by its content) build on them, so neither imports
the other's readers (no import cycle).
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

from fulcrum.units import NS_PER_S

NS_PER_MS: Final = 1_000_000

AZURE_COLUMNS: Final = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS: Final = ("Timestamp", "Request tokens", "Response tokens")
JSONL_FIELDS: Final = ("timestamp", "input_length", "output_length")


class TraceError(ValueError):
    """A trace the simulator cannot read; ``str()`` is one line naming file and problem."""

    def __init__(self, path: Path | str, problem: str, *, line: int | None = None) -> None:
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {problem}")


def _norm(name: str) -> str:
    return " ".join(name.strip().lower().replace("_", " ").split())


# -- JSONL --------------------------------------------------------------------------------
def _to_ns(v: float, ns_per_unit: int) -> int:
    """``v`` units -> ns, exact for integers and without float overflow of precision for
    large epoch-based values (whole units and the fraction are converted apart)."""
    if isinstance(v, int):
        return v * ns_per_unit
    whole = math.floor(v)
    return int(whole) * ns_per_unit + round((v - whole) * ns_per_unit)


def _int_field(path: Path, line: int, row: Mapping[str, object], key: str) -> int:
    if key not in row:
        raise TraceError(path, f"missing field {key!r}", line=line)
    v = row[key]
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise TraceError(path, f"field {key!r}: expected a number, got {v!r}", line=line)
    if v < 0:
        raise TraceError(path, f"field {key!r}: must be >= 0, got {v!r}", line=line)
    return int(v)


def _ms_field(path: Path, line: int, row: Mapping[str, object], key: str) -> int:
    if key not in row:
        raise TraceError(path, f"missing field {key!r}", line=line)
    v = row[key]
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise TraceError(path, f"field {key!r}: expected milliseconds, got {v!r}", line=line)
    return _to_ns(v, NS_PER_MS)


def _hash_ids(path: Path, line: int, row: Mapping[str, object]) -> tuple[int, ...]:
    raw = row.get("hash_ids", ())
    if raw is None:
        return ()
    if not isinstance(raw, list | tuple) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in raw
    ):
        raise TraceError(path, "field 'hash_ids': expected a list of integers", line=line)
    return tuple(raw)


#: A request's class fields as a trace gives them: ``(tenant, priority, ttft_slo_ms)``
#: (``""``, 0, None when absent; issue 23).
ClassFields = tuple[str, int, int | None]
NO_CLASS: Final[ClassFields] = ("", 0, None)

JsonlRow = tuple[int, int, int, tuple[int, ...], ClassFields]


def _class_fields(path: Path, line: int, row: Mapping[str, object]) -> ClassFields:
    """The optional ``tenant`` (string), ``priority`` (integer) and ``ttft_slo_ms``
    (positive number, ms) of a row."""
    tenant = row.get("tenant", "")
    if tenant is None:
        tenant = ""
    if not isinstance(tenant, str):
        raise TraceError(path, f"field 'tenant': expected a string, got {tenant!r}", line=line)
    prio = row.get("priority", 0)
    if prio is None:
        prio = 0
    if isinstance(prio, bool) or not isinstance(prio, int):
        raise TraceError(path, f"field 'priority': expected an integer, got {prio!r}",
                         line=line)
    slo = row.get("ttft_slo_ms")
    if slo is not None and (isinstance(slo, bool) or not isinstance(slo, int | float)
                            or not math.isfinite(slo) or slo <= 0):
        raise TraceError(path, f"field 'ttft_slo_ms': expected milliseconds > 0, got {slo!r}",
                         line=line)
    return (tenant, prio, None if slo is None else max(1, round(slo)))


def iter_jsonl(path: Path, *, limit: int | None = None) -> Iterator[JsonlRow]:
    """Rows ``(arrival_ns, input_tokens, output_tokens, hash_ids, class fields)`` of a
    JSONL trace, in file order, arrivals not re-based; stops after ``limit`` rows."""
    n = 0
    try:
        with path.open(encoding="utf-8") as fh:
            for lineno, text in enumerate(fh, start=1):
                if not text.strip():
                    continue
                try:
                    row = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise TraceError(path, f"not JSON ({exc.msg})", line=lineno) from None
                if not isinstance(row, dict):
                    raise TraceError(path, "expected a JSON object", line=lineno)
                yield (
                    _ms_field(path, lineno, row, "timestamp"),
                    max(1, _int_field(path, lineno, row, "input_length")),
                    max(1, _int_field(path, lineno, row, "output_length")),
                    _hash_ids(path, lineno, row),
                    _class_fields(path, lineno, row),
                )
                n += 1
                if limit is not None and n >= limit:
                    return
    except UnicodeDecodeError:
        raise TraceError(path, "not UTF-8 text") from None


# -- CSV ----------------------------------------------------------------------------------
_AZURE_TS_RE: Final = re.compile(
    r"^(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})(?:\.(\d+))?\s*(Z|[+-]\d{2}:?\d{2})?$"
)


def azure_timestamp_ns(text: str) -> int:
    """Azure trace time -> ns since the epoch (UTC unless an offset is given).

    Accepts the 2023 form ``2023-11-16 18:17:03.9799600`` (any number of fraction
    digits, no zone) and the 2024 form ``2024-05-10 00:00:00.009930+00:00`` (the
    fraction may be absent). Raises ValueError otherwise.
    """
    m = _AZURE_TS_RE.match(text.strip())
    if m is None:
        raise ValueError(f"expected 'YYYY-MM-DD HH:MM:SS[.fraction][+HH:MM]', got {text!r}")
    day, clock, frac, zone = m.groups()
    dt = datetime.strptime(f"{day} {clock}", "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
    secs = int(dt.timestamp())
    if zone and zone != "Z":
        sign = -1 if zone[0] == "-" else 1
        digits = zone[1:].replace(":", "")
        secs -= sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
    return secs * NS_PER_S + int(((frac or "") + "000000000")[:9])


def _columns(path: Path, header: Sequence[str], wanted: Sequence[str]) -> list[int]:
    index = {_norm(h): i for i, h in enumerate(header)}
    out = []
    for col in wanted:
        if _norm(col) not in index:
            raise TraceError(path, f"CSV header lacks field {col!r}")
        out.append(index[_norm(col)])
    return out


def _csv_int(path: Path, line: int, name: str, text: str) -> int:
    try:
        v = float(text)
    except ValueError:
        raise TraceError(
            path, f"field {name!r}: expected a number, got {text!r}", line=line
        ) from None
    if not math.isfinite(v) or v < 0:
        raise TraceError(path, f"field {name!r}: must be a number >= 0, got {text!r}", line=line)
    return int(v)


def iter_csv(
    path: Path, kind: str, *, limit: int | None = None
) -> Iterator[tuple[int, int, int]]:
    """Rows ``(arrival_ns, input_tokens, output_tokens)`` of an Azure or BurstGPT CSV in
    file order, arrivals as in the file (Azure: since the epoch; BurstGPT: since the
    trace start); stops after ``limit`` rows."""
    cols = AZURE_COLUMNS if kind == "azure" else BURSTGPT_COLUMNS
    n = 0
    try:
        with path.open(newline="", encoding="utf-8-sig") as fh:
            reader = csv.reader(fh)
            header = next(reader, None)
            if header is None:
                raise TraceError(path, "empty file: no header")
            idx = _columns(path, header, cols)
            it, ii, io = idx
            for row in reader:
                if not row or not any(c.strip() for c in row):
                    continue
                line = reader.line_num
                for name, i in zip(cols, idx, strict=True):
                    if i >= len(row) or not row[i].strip():
                        raise TraceError(path, f"row lacks field {name!r}", line=line)
                if kind == "azure":
                    try:
                        t = azure_timestamp_ns(row[it])
                    except ValueError as exc:
                        raise TraceError(path, f"field {cols[0]!r}: {exc}", line=line) from None
                else:
                    try:
                        secs = float(row[it])
                    except ValueError:
                        secs = math.nan
                    if not math.isfinite(secs):
                        raise TraceError(
                            path, f"field {cols[0]!r}: expected seconds, got {row[it]!r}",
                            line=line,
                        )
                    t = _to_ns(secs, NS_PER_S)
                yield (
                    t,
                    max(1, _csv_int(path, line, cols[1], row[ii])),
                    max(1, _csv_int(path, line, cols[2], row[io])),
                )
                n += 1
                if limit is not None and n >= limit:
                    return
    except UnicodeDecodeError:
        raise TraceError(path, "not UTF-8 text") from None
    except csv.Error as exc:
        raise TraceError(path, f"malformed CSV ({exc})") from None


def azure_label(path: Path) -> str:
    """Source label of an Azure trace: ``azure-`` + the last ``_``-part of its stem."""
    return "azure-" + path.stem.rsplit("_", 1)[-1]
