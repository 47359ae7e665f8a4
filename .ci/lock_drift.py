"""Which installed packages differ from the lock (constraints.txt): moved, or not in it.

`python .ci/lock_drift.py [constraints.txt]` prints one line per package whose installed
version is not the one the lock pins for this interpreter and platform, and exits 1 if
any moved. `.ci/newest` prints it after installing without the lock; tests/test_release.py
runs it in the suite's own environment, which the README's test command installed through
the lock. Packages the lock does not name (pip, tools installed beside) are listed apart
and do not count.
"""

from __future__ import annotations

import sys
from importlib.metadata import distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def pins(lock: Path) -> dict[str, str]:
    """The lock's `name==version` lines whose markers hold here, by canonical name."""
    pinned: dict[str, str] = {}
    for line in lock.read_text().splitlines():
        if not line or line.startswith((" ", "#")):
            continue
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        (spec,) = requirement.specifier
        pinned[canonicalize_name(requirement.name)] = spec.version
    return pinned


def installed() -> dict[str, str]:
    return {canonicalize_name(d.metadata["Name"]): d.version for d in distributions()}


def main(argv: list[str]) -> int:
    lock = Path(argv[0] if argv else Path(__file__).parent.parent / "constraints.txt")
    pinned, present = pins(lock), installed()
    moved = sorted(
        f"{name} {pinned[name]} -> {version}"
        for name, version in present.items()
        if name in pinned and pinned[name] != version
    )
    unlocked = sorted(f"{n} {v}" for n, v in present.items() if n not in pinned)
    for line in moved:
        print(f"moved: {line}")
    print(f"{len(moved)} of the {len(pinned)} locked packages moved")
    if unlocked:
        print(f"not in the lock (not counted): {', '.join(unlocked)}")
    return 1 if moved else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
