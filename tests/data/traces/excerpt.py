"""Rebuild the trace excerpts of this directory from the full public traces.

    python tests/data/traces/excerpt.py /path/to/traces   # the directory the README names

Each excerpt is the head of its trace (ServeGen: a few clients' 36,000 s and 36,600 s
windows and the distributions in force then), rows and distributions are copied, never edited.
The tests read these files through ``$FULCRUM_TRACES`` (see tests/sim/traces.py).
"""

from __future__ import annotations

import csv
import io
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).parent
#: file -> data rows kept from its head (the CSV header is kept as well)
HEADS = {"mooncake_synthetic_trace.jsonl": 60, "azure2023_code.csv": 200,
         "azure2023_conv.csv": 100}
#: ServeGen clients kept: busy at mid-morning, small distributions
SERVEGEN_CLIENTS = (0, 2, 5, 8, 21)
SERVEGEN_WINDOWS = ("36000", "36600")
LICENCES = ("LICENSE-mooncake-Apache-2.0", "LICENSE-azure-CC-BY-4.0")


def _head(src: Path, dst: Path, rows: int) -> None:
    lines = src.read_text().splitlines(keepends=True)
    header = 1 if src.suffix == ".csv" else 0
    dst.write_text("".join(lines[: header + rows]))


def _servegen(src: Path, dst: Path) -> None:
    dst.mkdir(exist_ok=True)
    shutil.copy(src / "LICENSE-Apache-2.0", dst / "LICENSE-Apache-2.0")
    for c in SERVEGEN_CLIENTS:
        trace = (src / f"chunk-{c}-trace.csv").read_text().splitlines(keepends=True)
        (dst / f"chunk-{c}-trace.csv").write_text(
            "".join(line for line in trace if line.split(",", 1)[0] in SERVEGEN_WINDOWS))
        dists = json.loads((src / f"chunk-{c}-dataset.json").read_text())
        first = min(int(w) for w in SERVEGEN_WINDOWS)
        key = max((int(k) for k in dists if int(k) <= first), default=min(map(int, dists)))
        later = [k for k in dists if first < int(k) <= max(map(int, SERVEGEN_WINDOWS))]
        keep = {k: dists[k] for k in [str(key), *later]}
        (dst / f"chunk-{c}-dataset.json").write_text(json.dumps(keep, indent=2) + "\n")
        assert list(csv.reader(io.StringIO((dst / f"chunk-{c}-trace.csv").read_text())))


def main(argv: list[str]) -> int:
    src = Path(argv[0])
    for name, rows in HEADS.items():
        _head(src / name, HERE / name, rows)
    for name in LICENCES:
        shutil.copy(src / name, HERE / name)
    _servegen(src / "servegen-mm-image", HERE / "servegen-mm-image")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
