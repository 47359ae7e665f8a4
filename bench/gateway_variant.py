"""An export of another revision run as a variant beside this checkout's gateway.

`bench.gateway` and `bench.gateway_instructions` take `--variant LABEL=DIR`: DIR holds a
`git archive` of another revision (or `bench.gateway_compiled`'s compiled export), started
with `python -m globalkv gateway` from DIR, so before and after are measured in one run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

_REGISTERS = ("gateway.standalone.cli", "gateway.cli")
"""Where the gateway command's `register` has lived, the newest first."""


def variant(value: str) -> tuple[str, str]:
    """LABEL=DIR, DIR/gateway/ an export; DIR gets the entry point that starts it."""
    label, sep, path = value.partition("=")
    if not sep or not label or not Path(path, "gateway").is_dir():
        raise argparse.ArgumentTypeError(f"want LABEL=DIR with DIR/gateway/, got {value!r}")
    found = [m for m in _REGISTERS if Path(path, *m.split(".")).with_suffix(".py").is_file()]
    if not found:
        raise argparse.ArgumentTypeError(f"no {' or '.join(_REGISTERS)} under {path}")
    # The dispatcher finds the gateway command by the installed distribution's entry point,
    # which names today's module: an export from before it moved would be started half from
    # the checkout. Under `python -m` DIR is first on sys.path, and the first distribution
    # of a name found there is the one whose entry points count, so a `globalkv` dist-info
    # in DIR naming the export's own module starts the export (its version reads 0+variant).
    info = Path(path, "globalkv-0+variant.dist-info")
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: globalkv\nVersion: 0+variant\n")
    entry = f"[globalkv.commands]\ngateway = {found[0]}:register\n"
    (info / "entry_points.txt").write_text(entry)
    return label, path
