"""Generate the Python code of the public API from ``proto/fulcrum/v1/*.proto``.

``python -m fulcrum.tools.genproto`` writes ``src/fulcrum/v1/*_pb2*.py`` and their
mypy-protobuf stubs; ``--check`` regenerates into a temporary folder and exits 1 when the
committed code differs (stale), naming the files.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "src"
PACKAGE = Path("fulcrum") / "v1"

_INIT = '"""Generated protobuf and gRPC code of the fulcrum.v1 API (``make proto``)."""\n'


def generate(out: Path) -> None:
    """Run protoc (grpcio-tools) with the gRPC and mypy plugins into ``out``."""
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in (PROTO_DIR / PACKAGE).glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    bindir = Path(sys.executable).parent
    args = [
        "protoc",
        f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *protos,
    ]
    code = protoc.main(args)
    if code != 0:
        raise SystemExit(f"protoc failed with status {code}")
    (out / PACKAGE / "__init__.py").write_text(_INIT)


def generated_files(base: Path) -> set[str]:
    """Names of the generated files under ``base/fulcrum/v1``."""
    folder = base / PACKAGE
    return {p.name for p in folder.iterdir() if p.is_file() and p.suffix in {".py", ".pyi"}}


def check() -> list[str]:
    """Return the generated files that are missing, extra or differ from a fresh run."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        (fresh / PACKAGE).mkdir(parents=True)
        generate(fresh)
        want = generated_files(fresh)
        have = generated_files(OUT_DIR) if (OUT_DIR / PACKAGE).exists() else set()
        stale = sorted(want ^ have)
        for name in sorted(want & have):
            if not filecmp.cmp(fresh / PACKAGE / name, OUT_DIR / PACKAGE / name, shallow=False):
                stale.append(name)
        return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="genproto", description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the code is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = check()
        if stale:
            print("generated code is stale (run `make proto`): " + ", ".join(stale))
            return 1
        print("generated code is up to date")
        return 0
    (OUT_DIR / PACKAGE).mkdir(parents=True, exist_ok=True)
    for old in (OUT_DIR / PACKAGE).glob("*_pb2*.py*"):
        old.unlink()
    generate(OUT_DIR)
    print(f"generated {len(generated_files(OUT_DIR))} files in {OUT_DIR / PACKAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
