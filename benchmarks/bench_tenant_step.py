"""Cost of the tenant step (issue 23) on the decode table's decision path.

``run(quick)`` returns a markdown section: microseconds per PlaceDecode + ReleaseDecode
on the daemon's decode table (in process, 16 instances x 4 GPUs), with no tenant step
(the default configuration: no cap, no sheddable class) and with the step installed
(a tenant with a cap), for a request of the default class and one of the capped tenant;
ratios to the no-step figure of the same run (best of repeats).

Run alone: ``.venv/bin/python benchmarks/bench_tenant_step.py [--quick]``.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import structlog

from fulcrum.config.decode import DecodeSettings
from fulcrum.core.tenants import DEFAULT_CLASS, RequestClass, TenantPolicy, TenantSpec, TenantTable
from fulcrum.core.types import DecodeInstanceShape, Member, MemberKind
from fulcrum.metrics import tenants as tm
from fulcrum.service.tenants import decode_caps
from fulcrum.state.decode import DecodeRequest, DecodeState
from fulcrum.state.tenant_filter import TenantFilter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import best_of, fmt_us, md_table, ratio


def _table(step: bool) -> DecodeState:
    state = DecodeState(DecodeSettings(), np.random.default_rng(0))
    shape = DecodeInstanceShape((256,) * 4, (10**7,) * 4)
    for i in range(16):
        state.on_join(Member(f"d{i}", MemberKind.DECODE_INSTANCE, 1, shape, 0), 0)
    if step:
        table = TenantTable(TenantPolicy(classes={"t": TenantSpec(decode_max_concurrency=10**6)}))
        f: TenantFilter[DecodeRequest] = TenantFilter(
            "decode", table, decode_caps, lambda r: int(r.kv_tokens), state.fill,
            lambda: 0.1, lambda: 500, (tm.DECODE_HELD, tm.DECODE_KV))
        state.filters.append(f)
    return state


def _per_call(step: bool, cls: RequestClass, n: int, repeat: int) -> float:
    state = _table(step)
    ids = itertools.count()

    def batch() -> None:
        for _ in range(n):
            rid = f"r{next(ids)}"
            state.place(rid, 1000, 1, cls=cls)
            state.release(rid, 2)

    return best_of(batch, repeat=repeat) / n


def run(quick: bool) -> str:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    n, repeat = (2_000, 3) if quick else (20_000, 5)
    base = _per_call(False, DEFAULT_CLASS, n, repeat)
    rows = [("no tenant step (default configuration)", fmt_us(base), "1.00x")]
    for what, cls in (("tenant step, default class", DEFAULT_CLASS),
                      ("tenant step, capped tenant", RequestClass("t", 1, None))):
        t = _per_call(True, cls, n, repeat)
        rows.append((what, fmt_us(t), ratio(t, base)))
    cmd = "make bench" + ("-quick" if quick else "")
    alone = "benchmarks/bench_tenant_step.py" + (" --quick" if quick else "")
    return f"""### Tenant step on the decode path

PlaceDecode + ReleaseDecode on the daemon's decode table, in process (16 instances x 4
GPUs, best of {repeat} runs of {n:,} pairs). The step is installed only when a tenant
cap or a sheddable class with `decode.band_reserve` is configured.

{md_table(("configuration", "us per place+release", "vs no step"), rows)}

Command: `{cmd}` (or `.venv/bin/python {alone}`).
"""


if __name__ == "__main__":
    print(run("--quick" in sys.argv))
