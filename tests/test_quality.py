"""The repository's own promises: lint, format, types and layering clean; CI runs the README's
command."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvplumbing", "bootstrap", "globalkv", "gateway", "enginesim", "bench")
MAX_LINES = 400


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


def _sources() -> Iterator[Path]:
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path, modules: set[str], root: Path = ROOT) -> set[str]:
    """Our modules `path` imports anywhere in it (in functions, under TYPE_CHECKING): a
    cycle there is still two modules that cannot be read, tested or moved apart. A name
    imported from a package is the submodule when there is one, else the package."""
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    wanted: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            wanted += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            wanted += [f"{base}.{alias.name}" for alias in node.names]
    found = set()
    for target in wanted:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_import_cycle_between_modules() -> None:
    """import-linter checks layers and the gateway's siblings, at package level; this
    checks every module against every other, counting function-level and TYPE_CHECKING
    imports too."""
    paths = list(_sources())
    modules = {_module_name(path) for path in paths}
    graph = {_module_name(path): _imported(path, modules) for path in paths}
    cycles = _cycles(graph)
    assert cycles == [], "modules importing each other: " + "; ".join(map(" ".join, cycles))


def test_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_imports_in_functions_and_under_type_checking_count(tmp_path: Path) -> None:
    files = {
        "pkg/__init__.py": "",
        "pkg/rules.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from pkg.watch import Source\n",
        "pkg/watch.py": "def source():\n    from . import rules\n    import pkg.sub.deep\n",
        "pkg/sub/__init__.py": "from .. import *\n",
        "pkg/sub/deep.py": "from pkg import sub\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    paths = sorted(tmp_path.rglob("*.py"))
    modules = {_module_name(path, tmp_path) for path in paths}
    graph = {_module_name(path, tmp_path): _imported(path, modules, tmp_path) for path in paths}
    assert graph == {
        "pkg": set(),
        "pkg.rules": {"pkg.watch"},
        "pkg.watch": {"pkg.rules", "pkg.sub.deep"},
        "pkg.sub": {"pkg"},
        "pkg.sub.deep": {"pkg.sub"},
    }
    assert _cycles(graph) == [["pkg.rules", "pkg.watch"]]


def test_every_source_directory_is_a_package() -> None:
    """import-linter skips a directory without `__init__.py` (a namespace package), and
    with it every contract on its modules."""
    folders = {path.parent for path in _sources()}
    missing = sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").exists())
    assert missing == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_over_the_line_limit(package: str) -> None:
    lengths = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    over = {path: lines for path, lines in lengths.items() if lines > MAX_LINES}
    assert over == {}, f"split by role: {over}"


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
