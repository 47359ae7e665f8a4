"""The compiled build's module list (`[tool.globalkv.compile]`, setup.py): every module it
names exists and is type-checked; run from a compiled export (`.ci/compiled`), each is
imported compiled, so the suite that follows tests the compiled code."""

from __future__ import annotations

import importlib
import os
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
MODULES: list[str] = PYPROJECT["tool"]["globalkv"]["compile"]["modules"]


def test_every_module_the_compiled_build_names_exists_and_is_type_checked() -> None:
    checked = PYPROJECT["tool"]["mypy"]["packages"]
    assert sorted(set(MODULES)) == MODULES, "the list is sorted, each module once"
    for path in MODULES:
        assert (ROOT / path).is_file(), f"{path} is named in [tool.globalkv.compile]"
        assert path.split("/")[0] in checked, f"{path} is not in a package mypy checks"


@pytest.mark.skipif(
    os.environ.get("GLOBALKV_EXPECT_COMPILED") != "1",
    reason="run by .ci/compiled, from an export built with GLOBALKV_COMPILE=1",
)
def test_every_listed_module_is_imported_compiled() -> None:
    interpreted = []
    for path in MODULES:
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        if not str(module.__file__).endswith(".so"):
            interpreted.append(module.__file__)
    assert not interpreted, f"imported from their sources: {interpreted}"
