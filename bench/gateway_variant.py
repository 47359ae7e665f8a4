"""An export of another revision run as a variant beside this checkout's gateway or picker.

`bench.gateway`, `bench.gateway_instructions` and `bench.epp` take `--variant LABEL=DIR`:
DIR holds a `git archive` of another revision (or `bench.gateway_compiled`'s compiled
export), started with `python -m globalkv gateway` (or `epp`) from DIR, so before and after
are measured in one run.
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

_REGISTERS = ("gateway.standalone.cli", "gateway.cli")
"""Where the gateway command's `register` has lived, the newest first (for an export whose
pyproject.toml names no commands)."""


def _commands(pyproject: Path) -> dict[str, str]:
    """The `globalkv` commands the export's own pyproject.toml names, by name."""
    if not pyproject.is_file():
        return {}
    with pyproject.open("rb") as file:
        project = tomllib.load(file).get("project", {})
    return dict(project.get("entry-points", {}).get("globalkv.commands", {}))


def variant(value: str) -> tuple[str, str]:
    """LABEL=DIR, DIR/gateway/ an export; DIR gets the entry point that starts it."""
    label, sep, path = value.partition("=")
    if not sep or not label or not Path(path, "gateway").is_dir():
        raise argparse.ArgumentTypeError(f"want LABEL=DIR with DIR/gateway/, got {value!r}")
    commands = _commands(Path(path, "pyproject.toml"))
    if "gateway" not in commands:
        found = [m for m in _REGISTERS if Path(path, *m.split(".")).with_suffix(".py").is_file()]
        if not found:
            raise argparse.ArgumentTypeError(f"no {' or '.join(_REGISTERS)} under {path}")
        commands["gateway"] = f"{found[0]}:register"
    # The dispatcher finds its commands by the installed distribution's entry points, which
    # name today's modules: an export from before one moved would be started half from the
    # checkout. Under `python -m` DIR is first on sys.path, and the first distribution of a
    # name found there is the one whose entry points count, so a `globalkv` dist-info in DIR
    # naming the export's own modules starts the export (its version reads 0+variant).
    info = Path(path, "globalkv-0+variant.dist-info")
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: globalkv\nVersion: 0+variant\n")
    lines = [f"{name} = {target}" for name, target in commands.items()]
    (info / "entry_points.txt").write_text("\n".join(["[globalkv.commands]", *lines, ""]))
    return label, path
