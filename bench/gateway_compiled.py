"""The gateway with its request path compiled by mypyc, as a variant for the benches.

    python -m bench.gateway_compiled DIR [--revision HEAD]
    python -m bench.gateway_instructions --variant mypyc=DIR
    python -m bench.gateway --variant mypyc=DIR …
    python -m bench.epp --variant mypyc=DIR …

Exports a revision of this repository into DIR (`git archive`) and builds it as the
compiled distribution is built (`GLOBALKV_COMPILE=1`, setup.py: the modules pyproject.toml
lists under `[tool.globalkv.compile]`), its extensions in place beside their sources: the
benches' `--variant` then start that export, the compiled modules found before their
sources, beside the interpreted checkout in the same run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path


def export(revision: str, directory: Path) -> None:
    """`revision` of the repository this file is in, its files written into `directory`."""
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryFile() as archive:
        subprocess.run(["git", "-C", str(root), "archive", revision], stdout=archive, check=True)
        archive.seek(0)
        with tarfile.open(fileobj=archive) as tar:
            tar.extractall(directory, filter="data")


def compile_modules(directory: Path) -> None:
    """The export in `directory` built compiled, its extensions in place (mypyc, a C
    compiler, setuptools 77 or later)."""
    command = [sys.executable, "setup.py", "-q", "build_ext", "--inplace"]
    env = {**os.environ, "GLOBALKV_COMPILE": "1"}
    subprocess.run(command, cwd=directory, env=env, check=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway_compiled", description=__doc__)
    parser.add_argument("directory", type=Path, help="an empty or new directory")
    parser.add_argument("--revision", default="HEAD", help="what to export (git revision)")
    args = parser.parse_args(argv)
    directory: Path = args.directory
    if directory.exists() and any(directory.iterdir()):
        parser.error(f"{directory} is not empty")
    directory.mkdir(parents=True, exist_ok=True)
    export(args.revision, directory)
    compile_modules(directory)
    print(f"compiled in {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
