"""A `globalkv` command run as an install with only some extras would run it: the modules
that only the other extras bring cannot be imported.

The test environment holds every extra (the `test` extra pulls them in), so an image built
with fewer (`docker build --build-arg EXTRAS=…`) is stood in for by hiding, in a child
process, the top-level modules of every distribution that neither the base dependencies
nor the kept extras need, transitively, as pip would have resolved them.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]

_HIDING_RUNNER = """
import importlib.abc, sys
hidden = set(filter(None, sys.argv[1].split(",")))
class Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in hidden:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Hidden())
from globalkv.cli import main
sys.exit(main(sys.argv[2:]))
"""


def project() -> dict[str, list[str]]:
    """The base dependencies (under "") and each extra's, as pyproject.toml lists them."""
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {"": table["dependencies"], **table["optional-dependencies"]}


def _closure(requirements: Iterable[str]) -> set[str]:
    """Every installed distribution `requirements` need, theirs included."""
    seen: set[str] = set()
    todo = [(Requirement(r), {""}) for r in requirements]
    while todo:
        requirement, extras = todo.pop()
        marker = requirement.marker
        if marker is not None and not any(marker.evaluate({"extra": e}) for e in extras):
            continue
        name = canonicalize_name(requirement.name)
        if name in seen:
            continue
        try:
            needs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        todo.extend((Requirement(r), {"", *requirement.extras}) for r in needs)
    return seen


def hidden_modules(kept_extras: Iterable[str]) -> list[str]:
    """Top-level modules an install with only `kept_extras` would not have."""
    listed = project()
    kept = {"", *kept_extras}
    unknown = kept - set(listed)
    assert not unknown, f"no such extras: {sorted(unknown)}"
    wanted = _closure(r for extra in kept for r in listed[extra])
    other = _closure(r for extra, reqs in listed.items() if extra not in kept for r in reqs)
    gone = other - wanted
    modules = metadata.packages_distributions()
    return sorted(
        module
        for module, dists in modules.items()
        if {canonicalize_name(d) for d in dists} <= gone and not module.startswith("_")
    )


def run_with_extras(
    kept_extras: Iterable[str], argv: list[str], env: Mapping[str, str]
) -> subprocess.CompletedProcess[str]:
    """`globalkv *argv` in a child that cannot import what only other extras install."""
    hidden = ",".join(hidden_modules(kept_extras))
    return subprocess.run(
        [sys.executable, "-c", _HIDING_RUNNER, hidden, *argv],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=60,
    )
