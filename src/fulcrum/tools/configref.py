"""Print the configuration reference (markdown) generated from the settings models.

``python -m fulcrum.tools.configref`` prints it; docs/configuration.md carries the same
text between the ``<!-- config-reference:begin -->`` and ``<!-- config-reference:end -->``
markers, and ``--write docs/configuration.md`` (``make configref``) refreshes it there, or
creates the file (a test fails when it is out of date).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from fulcrum.config import Settings, is_restart_only

BEGIN = "<!-- config-reference:begin -->"
END = "<!-- config-reference:end -->"


def _default(value: Any) -> str:
    if isinstance(value, BaseModel):
        return "(section)"
    return "`" + json.dumps(value, default=str) + "`"


def _bounds(info: Any) -> str:
    parts = []
    for meta in info.metadata:
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            v = getattr(meta, attr, None)
            if v is not None:
                parts.append(f"{sym} {v}")
    return ", ".join(parts)


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows: list[str] = []
    instance = model()
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        value = getattr(instance, name)
        if isinstance(value, BaseModel):
            rows.extend(_rows(type(value), key + "."))
            continue
        desc = (info.description or "").replace("|", "\\|")
        cls = "restart-only" if is_restart_only(info) else "reloadable"
        rows.append(f"| `{key}` | {_default(value)} | {_bounds(info)} | {cls} | {desc} |")
    return rows


def render() -> str:
    """The reference as markdown tables, one per top-level section."""
    out = [
        BEGIN,
        "",
        "Class: *reloadable* keys take effect on `SIGHUP` (`kill -HUP <pid>`); *restart-only* "
        "keys keep their running value until a restart (the reload logs them by name, event "
        "`config_restart_required`, and counts "
        "`fulcrum_config_reloads_total{outcome=\"restart_required\"}`).",
        "",
    ]
    for name, info in Settings.model_fields.items():
        section = info.default_factory() if info.default_factory else None  # type: ignore[call-arg]
        if not isinstance(section, BaseModel):
            continue
        doc = (type(section).__doc__ or "").strip().splitlines()[0]
        out += [f"#### `{name}` — {doc}", "", "| key | default | bounds | class | meaning |",
                "|---|---|---|---|---|", *_rows(type(section), f"{name}."), ""]
    out.append(END)
    return "\n".join(out)


HEADER = """\
# Configuration reference

Generated from the settings models (`src/fulcrum/config/`) by
`python -m fulcrum.tools.configref --write docs/configuration.md` (`make configref`); a
test fails when it is out of date. Every key has a default: an empty file, or none, is a
working single-node configuration. `fulcrum check-config FILE` validates a file (exit 2,
one line per problem, naming the key path); it also checks the rules that tie keys
together (a heartbeat interval below the timeout, a submit wait below the call deadline,
one port per listener) and suggests the closest key for a misspelt one. `fulcrum serve
--host/--port/--metrics-port` override `server.host`, `server.port` and `metrics.port`.

"""


def refresh(path: Path) -> bool:
    """Rewrite the reference between the markers of ``path`` (created with a header when
    missing); True if it changed."""
    text = path.read_text() if path.exists() else HEADER + BEGIN + "\n" + END + "\n"
    if not path.exists():
        path.write_text(text)
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    new = head + render() + tail
    if new != text:
        path.write_text(new)
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="configref", description=__doc__)
    parser.add_argument("--write", type=Path, help="refresh the reference inside this file")
    args = parser.parse_args(argv)
    if args.write:
        changed = refresh(args.write)
        print(f"{args.write}: {'updated' if changed else 'up to date'}")
    else:
        print(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
