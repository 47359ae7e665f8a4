"""The distribution's one build option: `GLOBALKV_COMPILE=1` compiles the gateway's request
path with mypyc (the modules `[tool.globalkv.compile]` in pyproject.toml lists) into C
extensions installed beside their sources; without it the distribution is pure Python.

mypyc type-checks what it compiles, so the build needs mypy and every dependency
installed where it runs: `pip install --no-build-isolation` in an environment that has
them (docs/compiled.md gives the commands).
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def compiled_modules() -> list[str]:
    with (ROOT / "pyproject.toml").open("rb") as file:
        return list(tomllib.load(file)["tool"]["globalkv"]["compile"]["modules"])


def ext_modules() -> list[object]:
    switch = os.environ.get("GLOBALKV_COMPILE", "")
    if switch not in ("", "0", "1"):
        raise SystemExit(f"GLOBALKV_COMPILE={switch!r}: want 1 (compiled) or 0 (pure Python)")
    if switch != "1":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError as exc:
        raise SystemExit(
            "GLOBALKV_COMPILE=1 needs mypy (and globalkv's dependencies) where the build "
            "runs: install them, then build with `pip install --no-build-isolation`"
        ) from exc
    # Errors in the modules not compiled are the project's type check's to report (the
    # modules of extras not installed here cannot be found, and need not be).
    options = ["--follow-imports=silent"]
    return list(mypycify([*options, *compiled_modules()], opt_level="3"))


setup(ext_modules=ext_modules())
