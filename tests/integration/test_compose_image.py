"""The Dockerfile, checked without Docker: a slim non-root image whose build context holds
everything globalkv needs.

The image installs globalkv from the files the Dockerfile copies (minus .dockerignore), so
the test assembles exactly that context, builds the wheel from it with pip, and checks the
wheel has every package, the Redis scripts, the health-check module and every command.
"""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from tests.stack.compose import ROOT

DOCKERFILE = ROOT / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _ignored(rel: str, patterns: list[str]) -> bool:
    for pattern in patterns:
        candidates = [pattern] + ([pattern[3:]] if pattern.startswith("**/") else [])
        parts = rel.split("/")
        for candidate in candidates:
            anywhere = candidate is not pattern
            starts = range(len(parts)) if anywhere else [0]
            for start in starts:
                for end in range(start + 1, len(parts) + 1):
                    if fnmatch.fnmatchcase("/".join(parts[start:end]), candidate):
                        return True
    return False


def _ignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _copied_sources() -> list[str]:
    sources = []
    for word, rest in _instructions():
        if word == "COPY" and not rest.startswith("--from"):
            *srcs, _ = rest.split()
            sources.extend(srcs)
    return sources


def _packages() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    includes = config["tool"]["setuptools"]["packages"]["find"]["include"]
    return [pattern.rstrip("*") for pattern in includes]


def test_the_image_is_slim_non_root_and_runs_globalkv() -> None:
    instructions = _instructions()
    bases = [rest.split()[0] for word, rest in instructions if word == "FROM"]
    assert bases
    assert all(base.startswith("python:3.11-slim") for base in bases)
    final = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    runtime = instructions[final:]
    users = [rest for word, rest in runtime if word == "USER"]
    assert users
    assert users[-1] not in {"root", "0"}
    words = [word for word, _ in runtime]
    assert words.index("USER") < words.index("ENTRYPOINT")
    assert ("ENTRYPOINT", '["globalkv"]') in runtime
    assert not [rest for word, rest in runtime if word == "COPY" and "--from" not in rest]


def test_the_build_context_holds_every_package_and_the_readme() -> None:
    sources = _copied_sources()
    patterns = _ignore_patterns()
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: no such path"
        assert not _ignored(source, patterns), f"COPY {source} is excluded by .dockerignore"
    assert set(_packages()) <= set(sources)
    readme = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["readme"]
    assert readme in sources
    assert "pyproject.toml" in sources


def test_the_context_builds_a_wheel_with_every_command(tmp_path: Path) -> None:
    context = tmp_path / "context"
    patterns = _ignore_patterns()
    for source in _copied_sources():
        path = ROOT / source
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for file in files:
            rel = file.relative_to(ROOT).as_posix()
            if not _ignored(rel, patterns):
                (context / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(file, context / rel)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), "."],
        cwd=context,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    (wheel,) = tmp_path.glob("globalkv-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in _packages():
        assert f"{package}/__init__.py" in names
    for script in (ROOT / "globalkv" / "index").glob("*.lua"):
        assert f"globalkv/index/{script.name}" in names
    assert "globalkv/stack/healthcheck.py" in names
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    for command, target in declared["globalkv.commands"].items():
        assert f"{command} = {target}" in text
    assert {"up", "doctor", "indexer", "gateway", "engine"} <= set(declared["globalkv.commands"])


def test_dockerignore_keeps_caches_tests_and_runs_out() -> None:
    patterns = _ignore_patterns()
    for rel in ("tests/conftest.py", "globalkv/__pycache__/cli.cpython-311.pyc", "runs/x.log"):
        assert _ignored(rel, patterns), rel
    for rel in ("globalkv/index/redis_apply.lua", "globalkv/cli.py", "bench/__init__.py"):
        assert not _ignored(rel, patterns), rel
