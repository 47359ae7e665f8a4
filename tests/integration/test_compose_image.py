"""The Dockerfile, checked without Docker: a slim non-root image whose build context holds
everything globalkv needs.

The image installs globalkv from the files the Dockerfile copies (minus .dockerignore), so
the test assembles exactly that context, builds the wheel from it with pip, and checks the
wheel has every package, the Redis scripts, the health-check module and every command.
"""

from __future__ import annotations

import os
import re
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


def _glob(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as Docker reads it: `*` within a name, `**` across names."""
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def _ignored(rel: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        regex = _glob(pattern.lstrip("!").strip("/"))
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            ignored = not negated
    return ignored


def _ignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _context() -> list[str]:
    """Every file `docker build .` sends, as paths relative to the checkout."""
    patterns = _ignore_patterns()
    negations = [p.lstrip("!").strip("/") for p in patterns if p.startswith("!")]
    files = []
    for directory, dirs, names in os.walk(ROOT):
        base = Path(directory).relative_to(ROOT).as_posix()
        prefix = "" if base == "." else base + "/"
        dirs[:] = [
            d
            for d in dirs
            if not _ignored(prefix + d, patterns)
            or any(n.startswith(f"{prefix}{d}/") for n in negations)
        ]
        files += [prefix + name for name in names if not _ignored(prefix + name, patterns)]
    return sorted(files)


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
    context = set(_context())
    for source in _copied_sources():
        assert source == "." or source in context, f"COPY {source}: not in the build context"
    for package in _packages():
        assert f"{package}/__init__.py" in context
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    readme, licenses = project["readme"], project["license-files"]
    assert {readme, "pyproject.toml", "setup.py", *licenses} <= context
    tops = {rel.split("/")[0] for rel in context}
    named = {source for source in _copied_sources() if source != "."}
    needed = {*_packages(), readme, "pyproject.toml", "setup.py", *licenses, *named}
    assert tops <= needed, "only what the image needs"


def test_the_context_builds_a_wheel_with_every_command(tmp_path: Path) -> None:
    context = tmp_path / "context"
    for rel in _context():
        (context / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, context / rel)
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
    ignored = (
        "tests/conftest.py",
        "globalkv/__pycache__/cli.cpython-311.pyc",
        "runs/x.log",
        ".env",
        ".venv/bin/python",
        ".git/HEAD",
        "bench/results/mooncake.json",
    )
    for rel in ignored:
        assert _ignored(rel, patterns), rel
    for rel in ("globalkv/index/redis_apply.lua", "globalkv/cli.py", "bench/__init__.py"):
        assert not _ignored(rel, patterns), rel
