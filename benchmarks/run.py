"""``make bench``: run every ``benchmarks/bench_*.py`` and write ``BENCHMARKS.md``.

Usage: ``python benchmarks/run.py [--quick] [--out BENCHMARKS.md] [--only NAME ...]``.
Each module's ``run(quick: bool) -> str`` returns a markdown section; a module that
raises is reported as failed in the document (and the exit code is 1) instead of
aborting the others. Full mode must finish within 10 minutes on a 2-core machine (aim:
7 minutes under load, for headroom), ``--quick`` within about a minute. Progress goes to
stderr (one line per module and per phase, via :func:`benchmarks.common.progress`); each
section of the document ends with its time taken and the header gives the total.

The document keeps what people wrote: ``make bench`` replaces only the region between
``<!-- make-bench:begin -->`` and ``<!-- make-bench:end -->`` (the latest run's header and
one section per module, each opened by ``<!-- bench:NAME -->``). Everything outside the
region (analyses written by hand, earlier runs with their dates and commands) is kept
verbatim; a file without the region gets one at its top, after the title. With
``--only``, the other modules' sections already in the region are kept too (:func:`merge`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import os
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Final

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import machine  # noqa: E402


def _loadavg() -> str:
    """The 1, 5 and 15-minute load averages ("-" where unavailable)."""
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "-"


def discover() -> list[Path]:
    """The benchmark modules, sorted by name (``bench_sim`` last: it is the longest)."""
    found = sorted(HERE.glob("bench_*.py"))
    return sorted(found, key=lambda p: (p.stem == "bench_sim", p.stem))


def load(path: Path) -> ModuleType:
    """Import ``benchmarks/<path>`` as ``benchmarks.<stem>``."""
    name = f"benchmarks.{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _select(paths: list[Path], only: list[str] | None) -> list[Path]:
    """The modules named in ``--only`` (``sim`` or ``bench_sim``); all when empty.

    Raises SystemExit on an unknown name, so that a typo does not run nothing quietly.
    """
    if not only:
        return paths
    known = {p.stem.removeprefix("bench_"): p for p in paths}
    wanted = [n.removeprefix("bench_") for n in only]
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise SystemExit(f"unknown bench {unknown}; known: {sorted(known)}")
    return [p for p in paths if p.stem.removeprefix("bench_") in wanted]


BEGIN: Final = "<!-- make-bench:begin -->"
END: Final = "<!-- make-bench:end -->"
_SECTION: Final = "<!-- bench:"
TITLE: Final = "# Benchmarks"
INTRO: Final = (
    "The region between the `make-bench` markers is written by `make bench`"
    " (`benchmarks/run.py`): do not edit inside it. Text outside the region is kept by"
    " every run: analyses written by hand, and earlier runs with their dates and commands."
)


def _split_sections(region: str) -> dict[str, str]:
    """The region's module sections by module name (text after each marker line)."""
    out: dict[str, str] = {}
    for part in region.split(_SECTION)[1:]:
        name, _, text = part.partition(" -->\n")
        out[name.strip()] = text.strip()
    return out


def merge(
    old: str | None, head: str, sections: dict[str, str], order: list[str], keep: bool
) -> str:
    """The document: ``old`` with its generated region replaced by ``head`` and
    ``sections`` (module name -> markdown, in ``order``). ``keep``: the modules of the old
    region that did not run this time keep their sections (``--only``). Text outside the
    region is kept verbatim; without a region, one is put after the title."""
    before, after, previous = f"{TITLE}\n\n{INTRO}\n\n", "", {}
    if old is not None and BEGIN in old and END in old:
        before, rest = old.split(BEGIN, 1)
        region, after = rest.split(END, 1)
        previous = _split_sections(region)
    elif old is not None:
        body = old[len(TITLE):].lstrip("\n") if old.startswith(TITLE) else old
        after = "\n\n" + body
    merged = {**previous, **sections} if keep else dict(sections)
    names = [n for n in order if n in merged] + [n for n in merged if n not in order]
    blocks = [f"{_SECTION}{n} -->\n{merged[n].strip()}\n" for n in names]
    region = "\n" + head.strip() + "\n\n" + "\n".join(blocks)
    return before + BEGIN + region + END + after


def _log(message: str) -> None:
    stamp = time.strftime("%H:%M:%S", time.gmtime())
    sys.stderr.write(f"[bench {stamp}] {message}\n")
    sys.stderr.flush()


def main(argv: list[str]) -> int:
    """Entry point; returns the exit code."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="CI smoke mode (about a minute)")
    ap.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md")
    ap.add_argument("--only", nargs="*", help="bench names (e.g. sim decode) to run")
    args = ap.parse_args(argv)
    paths = _select(discover(), args.only)
    cmd = "python benchmarks/run.py" + (" --quick" if args.quick else "")
    if args.only:
        cmd += " --only " + " ".join(p.stem.removeprefix("bench_") for p in paths)
    started = dt.datetime.now(dt.UTC)
    sections: dict[str, str] = {}
    timings: list[tuple[str, float, str]] = []
    failed = False
    t_start = time.perf_counter()
    mode = "quick" if args.quick else "full"
    _log(f"{len(paths)} modules ({mode}): " + ", ".join(p.stem for p in paths))
    for i, path in enumerate(paths, 1):
        t0 = time.perf_counter()
        _log(f"[{i}/{len(paths)}] {path.stem} ...")
        try:
            section = load(path).run(args.quick)
            status = "ok"
        except Exception:  # a failing bench must not hide the others
            failed = True
            status = "FAILED"
            section = (
                f"### {path.stem}: FAILED\n\n```\n{traceback.format_exc()}```\n"
            )
        took = time.perf_counter() - t0
        timings.append((path.stem, took, status))
        _log(f"[{i}/{len(paths)}] {path.stem}: {status} in {took:.1f} s "
             f"(total so far {time.perf_counter() - t_start:.0f} s)")
        when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        sections[path.stem] = (
            section.strip() + f"\n\n_Time taken ({path.stem}): {took:.1f} s; run {when}._\n"
        )
    total = time.perf_counter() - t_start
    head = [
        "Latest `make bench` run" + (" (these modules only; the other sections keep their"
                                     " own dates)" if args.only else "") + ":",
        "",
        f"- command: `{cmd}`",
        f"- date: {started.strftime('%Y-%m-%d %H:%M UTC')}",
        f"- machine: {machine()}",
        f"- load average at start (1/5/15 min): {_loadavg()}",
        f"- total wall time: {total:.0f} s ("
        + ", ".join(f"{n} {t:.0f} s{'' if s == 'ok' else ' FAILED'}" for n, t, s in timings)
        + ")",
        "",
    ]
    old = args.out.read_text() if args.out.exists() else None
    order = [p.stem for p in discover()]
    args.out.write_text(merge(old, "\n".join(head), sections, order, bool(args.only)))
    _log("time taken per module: "
         + ", ".join(f"{n} {t:.1f} s{'' if s == 'ok' else ' FAILED'}" for n, t, s in timings))
    _log(f"wrote {args.out}; total {total:.0f} s" + (" (with failures)" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
