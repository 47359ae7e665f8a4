"""The gateway with its request path compiled by mypyc, as a variant for the gateway benches.

    python -m bench.gateway_compiled DIR [--revision HEAD]
    python -m bench.gateway_instructions --variant mypyc=DIR
    python -m bench.gateway --variant mypyc=DIR …

Exports a revision of this repository into DIR (`git archive`) and compiles `MODULES`, the
modules every whole or streamed answer runs through, with mypyc, unchanged and in place:
the benches' `--variant` then start that export, the compiled modules found before their
sources. It answers one question, what compiling the request path would buy, measured
beside the gateway as it ships in the same run; it is not a build of the project's. The
modules compile as they are (they pass `mypy --strict`), but compiled coroutines behave
differently where the tests cancel a request (its deadline passed, its client left), so
a compiled gateway would need that work first (docs/benchmarks.md). The export's
pyproject.toml is set aside while mypyc builds: setuptools reads it and refuses its
`license` field when driven by mypyc's generated setup.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path

MODULES = (
    "gateway/http/answer.py",
    "gateway/http/client_connection.py",
    "gateway/http/client_wire.py",
    "gateway/http/connection.py",
    "gateway/http/connections.py",
    "gateway/http/exchange.py",
    "gateway/http/reply.py",
    "gateway/http/server.py",
    "gateway/http/wire.py",
    "gateway/legs/calls.py",
    "gateway/legs/deadline.py",
    "gateway/legs/dispatch.py",
    "gateway/legs/racing.py",
    "gateway/legs/sglang.py",
    "gateway/legs/traced.py",
    "gateway/load/progress.py",
    "gateway/load/tracker.py",
    "gateway/policies/base.py",
    "gateway/policies/round_robin.py",
    "gateway/routing/pd_chooser.py",
    "gateway/routing/plan.py",
    "gateway/routing/router.py",
    "gateway/serving/edge.py",
    "gateway/serving/inference.py",
    "gateway/serving/reading.py",
    "gateway/telemetry/metrics.py",
    "gateway/workers/breaker.py",
    "gateway/workers/pool.py",
)
"""The request path of `bench.gateway`'s requests (`--policy round_robin`, SGLang pairs),
and the traced calls, which subclass the calls (an interpreted class cannot subclass a
compiled one)."""


def export(revision: str, directory: Path) -> None:
    """`revision` of the repository this file is in, its files written into `directory`."""
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryFile() as archive:
        subprocess.run(["git", "-C", str(root), "archive", revision], stdout=archive, check=True)
        archive.seek(0)
        with tarfile.open(fileobj=archive) as tar:
            tar.extractall(directory, filter="data")


def compile_modules(directory: Path) -> None:
    """`MODULES` of the export in `directory` compiled in place (mypyc, a C compiler)."""
    project = directory / "pyproject.toml"
    aside = directory / "pyproject.toml.aside"
    project.rename(aside)
    try:
        subprocess.run([sys.executable, "-m", "mypyc", *MODULES], cwd=directory, check=True)
    finally:
        aside.rename(project)


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
    print(f"compiled {len(MODULES)} modules in {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
