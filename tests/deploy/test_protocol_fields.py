"""docs/protocol.md names the protos' fields: every ``Name{field, sub{...}}`` it writes
(an RPC's request, or a message) lists fields that exist, nested ones included; its
Python quickstart runs against a real daemon (the Node one runs in tests/node)."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

from google.protobuf.descriptor import Descriptor

from fulcrum.testing import running_server
from fulcrum.v1 import (
    decode_pb2,
    diagnostics_pb2,
    expert_pb2,
    fleet_pb2,
    prefill_pb2,
    vision_pb2,
)

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "protocol.md").read_text()
MODULES = (decode_pb2, diagnostics_pb2, expert_pb2, fleet_pb2, prefill_pb2, vision_pb2)


def _types() -> dict[str, Descriptor]:
    """RPC name -> request message, and message name -> message."""
    out: dict[str, Descriptor] = {}
    for mod in MODULES:
        fd = mod.DESCRIPTOR
        for msg in fd.message_types_by_name.values():
            out[msg.name] = msg
        for svc in fd.services_by_name.values():
            for m in svc.methods:
                out.setdefault(m.name, m.input_type)
    return out


def _split(text: str) -> list[str]:
    items, depth, cur = [], 0, ""
    for ch in text:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    return [*items, cur]


def _check(msg: Descriptor, body: str, where: str, problems: list[str]) -> None:
    for item in _split(body):
        m = re.match(r"\s*([a-z_][a-z0-9_]*)\s*(.*)", item, re.S)
        if m is None:
            continue
        name, rest = m.group(1), m.group(2).strip()
        field = msg.fields_by_name.get(name)
        if field is None:
            problems.append(f"{where}: {msg.name} has no field {name!r}")
            continue
        nested = re.match(r"^\[?\{(.*)\}\]?$", rest, re.S)
        if nested and field.message_type is not None:
            _check(field.message_type, nested.group(1), where, problems)


def _mentions(text: str) -> list[tuple[str, str]]:
    """(Name, body) of every ``Name{...}`` with balanced braces."""
    out = []
    for m in re.finditer(r"\b([A-Z][A-Za-z]+)\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append((m.group(1), text[m.end() : i - 1]))
    return out


def _flatten_diagrams(doc: str) -> str:
    """Prose as is; each sequence diagram's left columns joined (arrows and the daemon's
    column dropped), so a message written over several lines reads as one."""
    parts = re.split(r"```(?:\w*)\n(.*?)```", doc, flags=re.S)
    out = []
    for i, part in enumerate(parts):
        if i % 2 == 0 or "|" not in part:
            out.append(part if i % 2 == 0 else "")
            continue
        cols = []
        for line in part.splitlines():
            if line.count("|") >= 2:
                line = line[line.index("|") + 1 : line.rindex("|")]
            cols.append(re.sub(r"<?--+>?|->", " ", line))
        out.append(" ".join(cols))
    return "\n".join(out)


def test_field_names_match_the_protos() -> None:
    types, problems, seen = _types(), [], 0
    for name, body in _mentions(_flatten_diagrams(DOC)):
        if name in types:
            seen += 1
            _check(types[name], body, f"{name}{{{body[:40]}...}}", problems)
    assert seen >= 20 and problems == []


def test_no_internal_notes() -> None:
    assert "issue 13" not in DOC and "(changes with" not in DOC


def _block(title: str, lang: str) -> str:
    section = DOC[DOC.index(title):]
    return section[section.index(f"```{lang}\n") + len(lang) + 4 :].split("```", 1)[0]


def test_quickstarts_are_short() -> None:
    assert len(_block("### Python", "python").strip().splitlines()) <= 20
    assert len(_block("### Node.js", "js").strip().splitlines()) <= 20


async def test_python_quickstart_runs(tmp_path: Path) -> None:
    script = tmp_path / "quickstart.py"
    script.write_text(_block("### Python", "python"))
    async with running_server() as daemon:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(script), daemon.address, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, cwd=tmp_path)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert re.search(r"decode on decode-0 GPU [01]", out.decode()), out.decode()
