"""What a user checks of a release first: the lock it was tested with, its version, its
license and changelog, and documents that name only files the repository holds."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from kvplumbing.release import VERSION

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
LOCK = ROOT / "constraints.txt"


def _locked() -> dict[str, list[str]]:
    """Every version the lock pins for each package (one per marker branch)."""
    versions: dict[str, list[str]] = {}
    for line in LOCK.read_text().splitlines():
        if line and not line.startswith((" ", "#")):
            requirement = Requirement(line)
            (spec,) = requirement.specifier
            versions.setdefault(canonicalize_name(requirement.name), []).append(spec.version)
    return versions


def _requirements() -> list[Requirement]:
    extras = PROJECT["optional-dependencies"].values()
    return [Requirement(r) for r in [*PROJECT["dependencies"], *(r for e in extras for r in e)]]


def test_the_lock_pins_every_requirement_within_its_range() -> None:
    """An edit to pyproject.toml's dependencies needs `bash .ci/lock` to land with it."""
    locked = _locked()
    for requirement in _requirements():
        name = canonicalize_name(requirement.name)
        assert name in locked, f"{requirement} is not in constraints.txt: run `bash .ci/lock`"
        for version in locked[name]:
            assert requirement.specifier.contains(version, prereleases=True), (
                f"constraints.txt pins {name}=={version} outside {requirement}"
            )


def test_every_runtime_dependency_stops_below_its_next_major_version() -> None:
    for requirement in (Requirement(r) for r in PROJECT["dependencies"]):
        assert any(s.operator == "<" for s in requirement.specifier), str(requirement)


@pytest.mark.skipif(
    os.environ.get("GLOBALKV_UNLOCKED") == "1", reason="`.ci/newest` runs on unlocked releases"
)
def test_the_suite_runs_on_the_locked_set() -> None:
    """CI proves the lock: the README's test command installed exactly its pins."""
    result = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "lock_drift.py"), str(LOCK)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_version_is_the_packages() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "globalkv", "--version"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"globalkv {PROJECT['version']}" == f"globalkv {VERSION}"


def test_the_image_is_labelled_with_this_version_and_built_from_the_lock() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f"ARG VERSION={PROJECT['version']}\n" in dockerfile
    for label in ("version", "revision", "source", "licenses", "title"):
        assert f"org.opencontainers.image.{label}=" in dockerfile
    assert "pip install -c constraints.txt" in dockerfile
    assert "!constraints.txt" in (ROOT / ".dockerignore").read_text().splitlines()


def test_license_and_changelog() -> None:
    assert PROJECT["license"] == "Apache-2.0"
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[?{re.escape(PROJECT['version'])}\]?", changelog, re.M)


WRITTEN_BY_OUR_TOOLS = {"result.md"}
"""Names of files our commands write (a replay's report), not files of the repository."""


def _tracked() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True
    ).stdout.split()
    return [ROOT / name for name in listed if (ROOT / name).is_file()]


def test_every_document_named_is_in_the_repository() -> None:
    """A docstring, comment or page that names a `.md` file names one a reader can open:
    a path from the root or from the naming file's folder, or a bare name of a file the
    repository holds."""
    files = _tracked()
    names = {path.name for path in files}
    missing = []
    for path in files:
        if path.suffix not in {".py", ".md", ".toml", ".yml", ".yaml", ".sh", ""}:
            continue
        for match in re.finditer(r"[\w./-]*\w\.md\b", path.read_text(errors="replace")):
            ref = match.group()
            found = (
                (ROOT / ref).is_file()
                or (path.parent / ref).is_file()
                or ("/" not in ref and (ref in names or ref in WRITTEN_BY_OUR_TOOLS))
            )
            if not found:
                missing.append(f"{path.relative_to(ROOT)}: {ref}")
    assert not missing, "\n".join(missing)
