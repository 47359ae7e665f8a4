"""The benches' `--variant LABEL=DIR`: `python -m globalkv gateway` run from DIR starts the
gateway exported there, wherever that export keeps the command, and every other command
the export's pyproject.toml names starts the export's own module."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gateway_variant import variant

_COMMAND = """
def register(subparsers):
    parser = subparsers.add_parser("gateway")
    parser.set_defaults(run=lambda args: print("the export's gateway") or 0,
                        check_config=lambda args: None)
"""


@pytest.mark.parametrize("module", ["cli", "standalone/cli"])
def test_the_exported_gateway_command_is_the_one_started(tmp_path: Path, module: str) -> None:
    """Today's entry point names a module the export may not have (the command moved);
    started without the export's own entry point, DIR's gateway would not be the one run."""
    where = tmp_path / "gateway" / f"{module}.py"
    where.parent.mkdir(parents=True)
    for package in {tmp_path / "gateway", where.parent}:
        (package / "__init__.py").write_text("")
    where.write_text(_COMMAND)
    assert variant(f"old={tmp_path}") == ("old", str(tmp_path))
    started = subprocess.run(
        [sys.executable, "-m", "globalkv", "gateway"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert started.returncode == 0, started.stderr
    assert started.stdout.strip() == "the export's gateway"


def test_a_directory_without_a_gateway_command_is_refused(tmp_path: Path) -> None:
    (tmp_path / "gateway").mkdir()
    with pytest.raises(argparse.ArgumentTypeError, match=r"no gateway\.standalone\.cli"):
        variant(f"old={tmp_path}")


def test_every_command_the_exports_pyproject_names_is_the_exports(tmp_path: Path) -> None:
    """An export whose pyproject.toml names its commands gets all of them, not the gateway
    alone: its other commands (`epp`, `sidecar`, ...) start the export's modules too."""
    package = tmp_path / "gateway"
    package.mkdir()
    (package / "__init__.py").write_text("")
    picker = _COMMAND.replace('"gateway"', '"epp"').replace("export's gateway", "export's picker")
    (package / "picker.py").write_text(picker)
    (package / "front.py").write_text(_COMMAND)
    (tmp_path / "pyproject.toml").write_text(
        '[project.entry-points."globalkv.commands"]\n'
        'gateway = "gateway.front:register"\n'
        'epp = "gateway.picker:register"\n'
    )
    variant(f"new={tmp_path}")
    started = subprocess.run(
        [sys.executable, "-m", "globalkv", "epp"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert started.returncode == 0, started.stderr
    assert started.stdout.strip() == "the export's picker"
