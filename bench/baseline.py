"""The index as of an earlier commit, importable beside the current one.

A speed-up is only believable measured before and after in one run, turn by turn, so that
load from other processes hits both alike. `load(ref)` copies `globalkv/keys.py` and
`globalkv/index/` as of a git ref (`git show`, nothing checked out) into a temporary
package and imports it. Their imports are pointed at that package, except `index.base`:
events and results stay today's types, so the old index takes the batches today's ingest
builds. A ref whose events or results had other fields than today's is refused, since that
sharing would then be wrong.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

_ROOT = Path(__file__).resolve().parent.parent


def _show(ref: str, path: str) -> bytes:
    return subprocess.run(
        ["git", "show", f"{ref}:{path}"], cwd=_ROOT, capture_output=True, check=True
    ).stdout


def _files(ref: str, folder: str) -> list[str]:
    out = subprocess.run(
        ["git", "ls-tree", "--name-only", f"{ref}:{folder}"],
        cwd=_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.split()


_SHARED = ("StoreBlocks", "RemoveBlocks", "ClearSource", "SourceBatch", "ApplyResult", "Source")


def _check_shared_types(ref: str, folder: Path) -> None:
    """Refuse a ref whose events and results had other fields than today's."""
    path = folder / "base_at_ref.py"
    path.write_bytes(_show(ref, "globalkv/index/base.py"))
    spec = importlib.util.spec_from_file_location("globalkv_base_at_ref", path)
    assert spec is not None
    assert spec.loader is not None
    old = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = old  # dataclasses look their module up while building
    try:
        spec.loader.exec_module(old)
    finally:
        del sys.modules[spec.name]
    today = importlib.import_module("globalkv.index.base")
    for name in _SHARED:
        fields = [[f.name for f in dataclasses.fields(getattr(m, name))] for m in (old, today)]
        if fields[0] != fields[1]:
            raise SystemExit(f"{ref}: {name} had fields {fields[0]}, today {fields[1]}")


def load(ref: str) -> ModuleType:
    """The package as of `ref`: `.keys`, `.index.memory`, `.index.redis` and the rest."""
    name = "globalkv_at_" + re.sub(r"\W", "_", ref)
    folder = tempfile.mkdtemp(prefix="globalkv-baseline-")
    atexit.register(shutil.rmtree, folder, True)
    _check_shared_types(ref, Path(folder))
    package = Path(folder) / name
    (package / "index").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    sources = {"keys.py": "globalkv/keys.py"}
    sources |= {f"index/{f}": f"globalkv/index/{f}" for f in _files(ref, "globalkv/index")}
    for target, source in sources.items():
        data = _show(ref, source)
        if source.endswith(".py"):
            text = data.decode()
            text = re.sub(r"\bglobalkv\.(keys|index)\b", rf"{name}.\1", text)
            text = text.replace(f"{name}.index.base", "globalkv.index.base")
            data = text.encode()
        (package / target).write_bytes(data)
    (package / "index" / "__init__.py").touch()
    sys.path.insert(0, str(package.parent))
    for module in ("keys", "index.memory", "index.redis"):
        importlib.import_module(f"{name}.{module}")
    return importlib.import_module(name)
