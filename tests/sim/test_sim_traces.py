"""Trace files by content: one small fixture per format, and broken ones (tests/sim/data)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from fulcrum.sim import traces as T
from fulcrum.sim import workload as W

DATA = Path(__file__).parent / "data"
#: Excerpts of the public traces, shipped with their licences (tests/data/traces/README.md).
SHIPPED = Path(__file__).parents[1] / "data" / "traces"

MS = 1_000_000
S = 1_000_000_000

# fixture, format, [(arrival_ns, input_tokens, output_tokens, n_hash_ids)] in arrival order
GOOD = [
    ("mooncake.jsonl", "mooncake",
     [(0, 1000, 10, 2), (250 * MS, 600, 3, 2), (1000 * MS, 20000, 1, 40)]),
    # Timestamps in ms from any origin (here the epoch, one a decimal), re-based; rows out
    # of order are sorted; unknown keys ignored.
    ("minimal.jsonl", "jsonl", [(0, 4096, 128, 0), (1500 * MS + 500_000, 300, 20, 0)]),
    ("azure2023.csv", "azure",
     [(0, 4808, 10, 0), (52 * MS, 3180, 8, 0), (1_020_040_000, 110, 1, 0)]),
    # 2024 form: zone offsets, fraction optional (02:00:01.5+02:00 is 00:00:01.5 UTC).
    ("azure2024.csv", "azure", [(0, 76, 15, 0), (9_930_000, 2162, 5, 0), (1500 * MS, 2376, 1, 0)]),
    ("azure2025_multimodal.csv", "azure", [(0, 3000, 40, 0), (500 * MS, 500, 7, 0)]),
    ("lowercase_azure.csv", "azure", [(0, 10, 2, 0), (500_000_100, 20, 3, 0)]),
    # Seconds from the trace start; a failed request (0 response tokens) keeps 1 token.
    ("burstgpt.csv", "burstgpt", [(0, 472, 18, 0), (40 * S, 1087, 1, 0), (113 * S, 417, 276, 0)]),
]


@pytest.mark.parametrize(("name", "kind", "expect"), GOOD, ids=[g[0] for g in GOOD])
def test_record_formats_read_by_content(
    name: str, kind: str, expect: list[tuple[int, int, int, int]], tmp_path: Path
) -> None:
    assert T.detect(DATA / name) == kind
    reqs = T.read_trace(DATA / name)
    assert [(r.arrival_ns, r.input_tokens, r.output_tokens, len(r.hash_ids)) for r in reqs] == (
        expect
    )
    assert [r.rid for r in reqs] == list(range(len(reqs)))
    # The extension plays no part: the same bytes under another name read the same.
    other = tmp_path / "trace.dat"
    shutil.copy(DATA / name, other)
    assert T.detect(other) == kind
    assert [(r.arrival_ns, r.input_tokens) for r in T.read_trace(other)] == [
        (e[0], e[1]) for e in expect
    ]


def test_limit_reads_only_the_first_rows() -> None:
    reqs = T.read_trace(DATA / "burstgpt.csv", limit=2)
    assert [r.input_tokens for r in reqs] == [472, 1087]


def test_azure_timestamp_forms() -> None:
    a = T.azure_timestamp_ns("2023-11-16 18:17:03.9799600")
    b = T.azure_timestamp_ns("2023-11-16 18:17:03.9799600+00:00")
    assert a == b
    assert T.azure_timestamp_ns("2024-05-10 02:00:00+02:00") == T.azure_timestamp_ns(
        "2024-05-10 00:00:00"
    )
    with pytest.raises(ValueError):
        T.azure_timestamp_ns("16/11/2023 18:17")


# directory, format, expected layout checks
SERVEGEN = [
    ("servegen-language", "servegen-language"),
    ("servegen-reasoning", "servegen-reasoning"),
    ("servegen-mm", "servegen-multimodal"),
]


@pytest.mark.parametrize(("name", "kind"), SERVEGEN, ids=[s[0] for s in SERVEGEN])
def test_servegen_layouts(name: str, kind: str) -> None:
    assert T.detect(DATA / name) == kind
    a = T.read_trace(DATA / name, rng=np.random.default_rng(1), duration_s=1200)
    b = T.read_trace(DATA / name, rng=np.random.default_rng(1), duration_s=1200)
    assert a == b and len(a) > 100
    times = [r.arrival_ns for r in a]
    assert times == sorted(times) and times[0] >= 0 and times[-1] < 1200 * S
    assert {r.source for r in a} == {kind}
    if kind == "servegen-language":
        assert {r.input_tokens for r in a} <= {100, 2000, 20000}
        assert {r.output_tokens for r in a} <= {10, 200, 50}
        assert 20000 in {r.input_tokens for r in a}  # client 1 (its rows lack a shape)
    elif kind == "servegen-reasoning":
        assert {r.input_tokens for r in a} == {300}
        assert {r.output_tokens for r in a} == {1500, 6000}
    else:
        # The 600 s window's distributions are empty: it uses the 0 s window's (ServeGen).
        assert any(r.arrival_ns >= 600 * S for r in a)
        for r in a:
            assert 1 <= len(r.image_patches) <= 2
            toks = [p // W.PATCHES_PER_IMAGE_TOKEN for p in r.image_patches]
            assert set(toks) <= {525, 1196}
            assert r.input_tokens - sum(toks) in (136, 372)
        # Rate 1.5 req/s over 1,200 s.
        assert math.isclose(len(a) / 1200, 1.5, rel_tol=0.15)


def test_one_servegen_client_file_reads_that_client() -> None:
    for f in ("chunk-1-trace.csv", "chunk-1-dataset.json"):
        assert T.detect(DATA / "servegen-language" / f) == "servegen-language"
        reqs = T.read_trace(DATA / "servegen-language" / f, duration_s=600)
        assert reqs and {r.input_tokens for r in reqs} == {20000}


def test_shipped_trace_excerpts_detected_and_read_as_before() -> None:
    assert T.detect(SHIPPED / "mooncake_synthetic_trace.jsonl") == "mooncake"
    assert T.detect(SHIPPED / "azure2023_conv.csv") == "azure"
    assert T.detect(SHIPPED / "servegen-mm-image") == "servegen-multimodal"
    mooncake = T.read_trace(SHIPPED / "mooncake_synthetic_trace.jsonl", limit=50)
    assert len(mooncake) == 50
    assert mooncake == W.read_mooncake(SHIPPED / "mooncake_synthetic_trace.jsonl", limit=50)
    azure = T.read_trace(SHIPPED / "azure2023_code.csv", limit=50)
    assert len(azure) == 50
    assert azure == W.read_azure(SHIPPED / "azure2023_code.csv", limit=50)
    a = T.read_trace(SHIPPED / "servegen-mm-image", rng=np.random.default_rng(0),
                     start_s=36_000, duration_s=60)
    b = W.servegen_requests(SHIPPED / "servegen-mm-image", np.random.default_rng(0),
                            start_s=36_000, duration_s=60)
    assert len(a) > 100  # about 3.7 requests/s from the five clients of the excerpt
    assert [(r.arrival_ns, r.input_tokens, r.image_patches) for r in a] == [
        (r.arrival_ns, r.input_tokens, r.image_patches) for r in b
    ]


# fixture, words the one-line message must hold (besides the file name)
BROKEN = [
    ("broken_missing_output.jsonl", [":2:", "missing field 'output_length'"]),
    ("broken_not_json.jsonl", [":2:", "not JSON"]),
    ("broken_bad_value.jsonl", [":1:", "'input_length'", "'many'"]),
    ("broken_hash_ids.jsonl", [":1:", "'hash_ids'"]),
    ("broken_azure_missing_generated.csv", ["lacks field 'GeneratedTokens'"]),
    ("broken_azure_bad_time.csv", [":2:", "'TIMESTAMP'"]),
    ("broken_burstgpt_missing_response.csv", ["lacks field 'Response tokens'"]),
    ("broken_burstgpt_short_row.csv", [":3:", "lacks field 'Request tokens'"]),
    ("broken_unknown_header.csv", ["'TIMESTAMP'", "'Timestamp'", "time, prompt, completion"]),
    ("broken_array.json", ["JSON array"]),
    ("broken_empty.jsonl", ["empty"]),
    ("broken_header_only.csv", ["no request"]),
    ("broken-servegen-missing-field", ["chunk-0-dataset.json", "lacks field 'output_tokens'"]),
    ("broken-servegen-no-dataset", ["chunk-0-dataset.json", "missing"]),
    ("broken-servegen-bad-dist", ["chunk-0-dataset.json", "'output_tokens'", "positive sum"]),
    ("no_such_file.jsonl", ["no such file"]),
]


@pytest.mark.parametrize(("name", "words"), BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_files_get_one_clear_line(name: str, words: list[str]) -> None:
    with pytest.raises(T.TraceError) as info:
        T.read_trace(DATA / name)
    msg = str(info.value)
    assert "\n" not in msg
    assert name in msg
    for w in words:
        assert w in msg, (w, msg)


def test_binary_file_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "trace.gz"
    p.write_bytes(b"\x1f\x8b\x08\x00\x00\x00")
    with pytest.raises(T.TraceError, match="binary"):
        T.read_trace(p)
