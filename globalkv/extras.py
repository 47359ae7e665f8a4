"""Optional parts of globalkv, and the extra that installs each.

`pip install globalkv` brings everything the services need (indexer, gateway, engines,
`up`, `doctor`); parts only some users want keep their heavier dependencies in an extra,
so that a plain install stays small and every command of it works. Such a part checks its
modules when it is used, never at import time, and a missing one ends that command alone
with one line that says what to install.
"""

from __future__ import annotations

import importlib.util


class MissingExtra(Exception):
    """A command needs modules that its extra installs; the message says which."""

    def __init__(self, feature: str, missing: list[str], extra: str) -> None:
        needs = " and ".join(missing)
        super().__init__(f"{feature} needs {needs}: pip install 'globalkv[{extra}]'")
        self.feature = feature
        self.missing = missing
        self.extra = extra


def require(feature: str, extra: str, *modules: str) -> None:
    """Raise `MissingExtra` naming each of `modules` that cannot be imported."""
    missing = [name for name in modules if not _found(name)]
    if missing:
        raise MissingExtra(feature, missing, extra)


def _found(name: str) -> bool:
    """Whether module `name` can be imported (a dotted name whose package is missing is not)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False
