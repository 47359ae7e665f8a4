"""The repository's own promises: lint, format, types and layering clean; CI runs the README's
command."""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_check_is_clean() -> None:
    result = _run(sys.executable, "-m", "ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_is_clean() -> None:
    result = _run(sys.executable, "-m", "ruff", "format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_clean() -> None:
    result = _run(sys.executable, "-m", "mypy")
    assert result.returncode == 0, result.stdout + result.stderr


def test_import_contracts_are_kept() -> None:
    """The layering in pyproject.toml's `[tool.importlinter]` (no cache: nothing written)."""
    lint_imports = Path(sysconfig.get_path("scripts")) / "lint-imports"
    result = _run(str(lint_imports), "--no-cache")
    assert result.returncode == 0, result.stdout + result.stderr


def _quick_start() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)
    return [block.strip() for block in blocks[:2]]


def test_ci_runs_the_readme_test_command() -> None:
    test_command = _quick_start()[1]
    assert "pytest" in test_command
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci_lines


def test_ci_installs_as_the_readme_first_command_then_smokes_up_before_the_tests() -> None:
    install, up = _quick_start()[0].split(" && ")
    assert up == "python -m globalkv up"
    assert "[" not in install, "the first command installs no extras"
    assert install in (ROOT / ".ci" / "fresh-machine").read_text().splitlines()
    smoke = (ROOT / ".ci" / "smoke_up.py").read_text()
    assert '[sys.executable, "-m", "globalkv", "up"' in smoke
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    fresh = ci_lines.index("bash .ci/fresh-machine")
    assert fresh < ci_lines.index(_quick_start()[1])
