"""``fulcrum fit-cost`` warns when the samples cannot determine the fit, and its help
says what q, c and ns are."""

from __future__ import annotations

import io

import numpy as np
import pytest

from fulcrum.tools import fit_cost


def run(csv: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
        ) -> tuple[int, str, str]:
    monkeypatch.setattr("sys.stdin", io.StringIO(csv))
    code = fit_cost.main(["-"])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_four_identical_rows_warn_rank_deficient(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, err = run("q,c,ns\n" + "100,0,5000000\n" * 4, capsys, monkeypatch)
    assert code == 0 and "r2=1.0000" in out
    assert "rank-deficient" in err and "# warning: rank-deficient" in out


def test_nearly_alike_shapes_warn_ill_conditioned() -> None:
    q = [1000, 1001, 1002, 1003]
    assert any("ill-conditioned" in w for w in fit_cost.diagnose(q, [0, 0, 0, 0]))


def test_a_spread_of_shapes_fits_without_warning(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(0)
    q = rng.integers(64, 16_384, 200)
    c = rng.integers(0, 131_072, 200)
    ns = 2.0 * q * (c + q / 2) + 56_000 * q + 5e6
    csv = "q,c,ns\n" + "".join(f"{a},{b},{t}\n" for a, b, t in zip(q, c, ns, strict=True))
    code, out, err = run(csv, capsys, monkeypatch)
    assert code == 0 and err == "" and "warning" not in out


def test_help_explains_q_c_and_ns(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        fit_cost.main(["--help"])
    out = capsys.readouterr().out
    for words in ("tokens computed", "prefix tokens already in the KV cache", "nanoseconds"):
        assert words in out
