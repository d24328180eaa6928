"""``fulcrum simulate`` through ``main([...])``: trace files, --goodput --json, errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fulcrum.sim import cli
from fulcrum.sim.workload import traces_dir

DATA = Path(__file__).parent / "data"


def tiny_trace(path: Path, n: int = 40, seed: int = 3) -> Path:
    """A minimal-JSONL trace: ``n`` requests over ``n`` seconds, mostly short prompts and
    a few in the 16K-64K tier."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n):
        inp = int(rng.integers(200, 6_000)) if i % 10 else int(rng.integers(17_000, 30_000))
        lines.append(json.dumps({"timestamp": i * 1000 + int(rng.integers(0, 900)),
                                 "input_length": inp,
                                 "output_length": int(rng.integers(2, 40))}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_goodput_json_per_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tiny_trace(tmp_path / "tiny.trace")
    argv = ["--trace", str(trace), "--goodput", "--json", "--quiet", "--jobs", "1",
            "--policies", "default,least_work", "--fixed-load", "0.3", "--goodput-runs", "6",
            "--drain", "600"]
    assert cli.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    meta, runs = doc["meta"], doc["runs"]
    assert meta["requests"] == 40 and meta["fixed_load"] == 0.3
    assert set(meta["slo"]["ttft_p99_s"]) == {"<16K", "16K-64K", "64K-256K", ">=256K"}
    assert [r["policy"] for r in runs] == ["default", "least_work"]
    for r in runs:
        for key in ("goodput_rps", "prefill_utilisation", "decode_utilisation",
                    "ttft_by_tier", "at_fixed_load", "search"):
            assert key in r, key
        assert r["goodput_rps"] > 0
        # goodput_rps is the trace's arrival rate at the verified scale.
        assert r["goodput_rps"] == pytest.approx(meta["base_rps"] * r["goodput_rate_scale"])
        passed = [p["rate_scale"] for p in r["search"]["runs"] if p["passed"]]
        assert r["goodput_rate_scale"] in passed
        assert len(r["search"]["runs"]) <= 6
        # Never a rate above the fleet's compute (offered load 1.0, the default cap).
        assert r["goodput_offered_load"] <= 1.0 + 1e-9
        assert r["goodput_capped"] == (r["goodput_offered_load"] >= 1.0 - 1e-9)
        fixed = r["at_fixed_load"]
        assert fixed["offered_load"] == pytest.approx(0.3)
        assert set(fixed["ttft_by_tier"]) == {"<16K", "16K-64K"}
        assert fixed["ttft_by_tier"]["<16K"]["p99_s"] > 0
        assert 0 < r["prefill_utilisation"] <= 1
    # Deterministic, and the same through a process pool.
    argv2 = [a if a != "1" else "2" for a in argv]
    assert cli.main(argv2) == 0
    doc2 = json.loads(capsys.readouterr().out)
    for a, b in zip(runs, doc2["runs"], strict=True):
        assert a["goodput_rps"] == b["goodput_rps"]
        assert a["search"]["runs"] == b["search"]["runs"]


def test_plain_run_on_a_trace_file_still_works(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tiny_trace(tmp_path / "t.jsonl", n=20)
    assert cli.main(["--trace", str(trace), "--policies", "default", "--load", "0.5",
                     "--json", "--quiet"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["meta"]["requests"] == 20 and doc["runs"][0]["finished"] == 20


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("broken_missing_output.jsonl", "missing field 'output_length'"),
        ("broken_azure_missing_generated.csv", "lacks field 'GeneratedTokens'"),
        ("broken-servegen-missing-field", "lacks field 'output_tokens'"),
        ("no_such_trace", "no such file"),
    ],
)
def test_unreadable_trace_is_one_line_and_exit_2(
    name: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["--trace", str(DATA / name), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and name in err and words in err
    assert "Traceback" not in err


def test_goodput_refuses_a_fixed_rate(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--trace", str(DATA / "mooncake.jsonl"), "--goodput", "--load", "0.5"]) == 2
    assert "--goodput" in capsys.readouterr().err


def test_help_names_where_builtin_traces_are(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "$FULCRUM_TRACES" in out and "<repo>/../shared/traces" in out
    assert str(traces_dir()) in out
    for word in ("--goodput", "--fixed-load", "--slo-ttft", "BurstGPT", "ServeGen", "Azure"):
        assert word in out


def test_one_engine_policy_is_bounded_by_the_short_tier_slo(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The hand-made bad policy sends everything to one engine: the <16K tier's TTFT p99
    # misses its SLO from the fixed load down to the lowest load searched, so its goodput
    # is reported as 0 (below the rate it failed at), far under the default's.
    trace = tiny_trace(tmp_path / "t.jsonl", n=60)
    assert cli.main(["--trace", str(trace), "--goodput", "--json", "--quiet",
                     "--policies", "default,one_engine", "--goodput-runs", "3",
                     "--drain", "600"]) == 0
    runs = {r["policy"]: r for r in json.loads(capsys.readouterr().out)["runs"]}
    bad, good = runs["one_engine"], runs["default"]
    assert bad["goodput_rps"] == 0.0 and bad["goodput_rate_scale"] is None
    assert bad["fails_at_rps"] < good["goodput_rps"]
    assert all(not p["passed"] and any("TTFT p99 <16K" in m for m in p["misses"])
               for p in bad["search"]["runs"])
    assert not bad["at_fixed_load"]["slo_met"] and good["at_fixed_load"]["slo_met"]
