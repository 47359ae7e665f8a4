"""The compiled build's module list (`[tool.globalkv.compile]`, setup.py): every module it
names exists and is type-checked; run from a compiled export (`.ci/compiled`), each is
imported compiled, so the suite that follows tests the compiled code."""

from __future__ import annotations

import dataclasses
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


BUILT_OFF_THE_REQUEST_PATH = {
    "gateway.legs.dispatch.Begun": "a retry's first step, built only when an attempt failed",
    "gateway.load.progress.CostFit": "one per worker",
    "gateway.load.progress.PrefillProgress": "one per worker",
    "gateway.load.tracker.WorkerLoad": "one per worker",
    "gateway.load.tracker.LoadTracker": "one per gateway",
    "gateway.policies.placement._Worker": "one per worker",
    "gateway.requests.namespace.RequestNamespace": "frozen (hashed); built where a model is named",
    "gateway.requests.namespace.ServedAdapter": "frozen (hashed); built where adapters are named",
    "gateway.workers.breaker.BreakerStats": "frozen; built when a breaker is read",
    "gateway.workers.directory.Directory": "one per prefill",
    "gateway.workers.pool.Worker": "one per worker",
    "gateway.workers.pool.Served": "frozen; one per worker",
    "kvplumbing.auth.Refusal": "frozen; built when a stranger is refused",
    "kvplumbing.auth.ProtectionFlags": "frozen; configuration",
    "kvplumbing.auth.ProtectedMode": "frozen; configuration",
}
"""Dataclasses of the compiled modules that keep the `__init__` dataclasses generates, and
why that costs no request anything."""


def test_dataclasses_built_per_request_in_compiled_modules_write_their_own_init() -> None:
    """The `__init__` a dataclass generates is Python made at import, so it runs interpreted
    in the compiled build (five times the cost of a compiled one): a class built per request
    writes its own (docs/gateway-design.md)."""
    generated = []
    for path in MODULES:
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        for name, cls in vars(module).items():
            if not (isinstance(cls, type) and cls.__module__ == module.__name__):
                continue
            if dataclasses.is_dataclass(cls) and cls.__dataclass_params__.init:
                generated.append(f"{module.__name__}.{name}")
    assert sorted(generated) == sorted(BUILT_OFF_THE_REQUEST_PATH)
