"""The two walks in docs/architecture.md ("Follow one request", "Follow one event") name the
code a request and a KV event go through, function by function: every module, class,
method and function they cite exists, so a rename that leaves them behind fails here.

A walk cites a module by its path (`http/server.py`: the read path's under `gateway/` or
from the repository's root, the write path's from the root), then what it defines: `Class.method`,
`function`, or a name alone, looked up in the module cited last, then the class cited last,
then anything cited before in the walk (`LoadTracker.finish`, its module named earlier); a
lower-case `module.name` is a name of a module cited before (`border.received`) or of a
package of ours (`wire.replay_request`). A call's arguments are not checked
(`translate(batch, model)`); spans that are no Python name (headers, flags, values, which a
walk quotes: `"queue_full"`) are not names.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
WALKS = {"Follow one request": "gateway", "Follow one event": ""}
"""Each walk's section title, and the folder its module paths are relative to."""
_SPAN = re.compile(r"`([^`]+)`")
_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_PACKAGES = ("globalkv", "gateway", "kvplumbing", "bootstrap")


def _section(title: str) -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _module(path: str, base: str) -> ModuleType:
    """The module at `path` under `base`, or from the root (the read path's other
    packages: `globalkv/lookup.py`)."""
    relative = Path(base, path)
    if not (ROOT / relative).is_file():
        relative = Path(path)
    assert (ROOT / relative).is_file(), f"`{path}` does not exist"
    parts = relative.with_suffix("").parts
    return importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))


def _ours(name: str) -> ModuleType | None:
    """`name` as a module of one of our packages (`wire`: globalkv.wire)."""
    for package in _PACKAGES:
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError:
            continue
    return None


def citations(text: str, base: str) -> list[tuple[str, object | None]]:
    """Every name `text` cites, with what it names (None: nothing)."""
    modules: list[ModuleType] = []
    classes: list[type] = []
    cited: list[tuple[str, object | None]] = []
    for span in _SPAN.findall(text):
        if span.endswith(".py"):
            modules.append(_module(span, base))
            continue
        name = span.split("(", 1)[0]
        if not _NAME.fullmatch(name):
            continue
        parts = name.split(".")
        scopes: list[object] = [*modules[-1:], *classes[-1:], *reversed(modules), *classes]
        if len(parts) > 1 and parts[0][0].islower():  # module.name
            named = [m for m in modules if m.__name__.rpartition(".")[2] == parts[0]]
            scopes = [*named, *filter(None, [_ours(parts[0])])]
            parts = parts[1:]
        target = next((getattr(s, parts[0]) for s in scopes if hasattr(s, parts[0])), None)
        if isinstance(target, type) and target not in classes:
            classes.append(target)
        for part in parts[1:]:
            target = _attribute(target, part)
        cited.append((span, target))
    return cited


def _attribute(owner: object, name: str) -> object | None:
    """`owner.name`; for a class, also an attribute its instances get (`self.name = …`)."""
    found = getattr(owner, name, None)
    if found is None and isinstance(owner, type):
        source = inspect.getsource(owner)
        if re.search(rf"\bself\.{name}\b\s*(:[^=\n]*)?=", source):
            return name
    return found


@pytest.mark.parametrize("title", list(WALKS))
def test_every_name_a_walk_cites_exists(title: str) -> None:
    cited = citations(_section(title), WALKS[title])
    assert len(cited) > 40, "the walk is read"
    missing = [span for span, target in cited if target is None]
    assert missing == [], f"{title} (docs/architecture.md) cites what is not there: {missing}"


def test_a_name_that_is_not_there_is_missing() -> None:
    walk = "`routing/router.py` `Router.route` → `Router.look_up` → `_indexed_model`, `plan`"
    found = dict(citations(walk, "gateway"))
    assert found["Router.route"] is None
    assert found["Router.look_up"] is not None
    assert found["_indexed_model"] is not None, "a method of the class cited last"
    assert found["plan"] is not None
    assert dict(citations("`http/server.py` `plan`", "gateway"))["plan"] is None
    with pytest.raises(AssertionError, match="does not exist"):
        citations("`routing/routes.py` `Router`", "gateway")
