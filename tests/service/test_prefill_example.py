"""The runnable prefill engine example (examples/prefill_engine.py), briefly, against a
test daemon: it registers, pulls with the documented quota, acknowledges, and every
request the entrypoint submitted runs on it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from tests.service.prefill_helpers import prefill_daemon


async def test_example_prefill_engine_runs_against_a_daemon() -> None:
    path = Path(__file__).resolve().parents[2] / "examples" / "prefill_engine.py"
    spec = importlib.util.spec_from_file_location("example_prefill_engine", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example
    try:
        spec.loader.exec_module(example)
    finally:
        del sys.modules[spec.name]
    async with prefill_daemon() as (d, _c, st):
        lines: list[str] = []
        args = example.parse_args(
            ["--target", d.address, "--seconds", "1.0", "--rate", "40",
             "--time-scale", "0.001", "--dp-ranks", "2"]
        )
        counts = await example.run(args, log=lines.append)
        assert counts["submitted"] >= 10
        assert counts["ok"] == counts["ours"] == counts["submitted"], (counts, lines)
        assert counts["engine_steps"] >= 1 and counts["engine_rejected"] == 0
        assert any("registered" in line and "horizon 2 s" in line for line in lines), lines
        assert d.app.fleet.members() == [] and st.in_flight() == 0
