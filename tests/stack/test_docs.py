"""The reference docs cannot drift from the code they describe.

docs/configuration.md must list every flag of every `globalkv` command in that command's
section (sglang-router's flags that the gateway refuses, hidden from its `--help`, are
listed in docs/sglang-router-flags.md instead), in a well-formed row with the environment
variable the dispatcher reads for it and its default (any words where the parser's default
is None, since the meaning then comes from elsewhere), and name a command's nested
commands (`globalkv bench replay`); docs/operations.md must name every Prometheus metric
the packages define.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from globalkv.cli import build_parser
from kvplumbing.environment import env_var_name

ROOT = Path(__file__).resolve().parents[2]
CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text()
OPERATIONS = (ROOT / "docs" / "operations.md").read_text()
PEER_FLAGS_DOC = "docs/sglang-router-flags.md"
PEER_FLAGS = (ROOT / PEER_FLAGS_DOC).read_text()
_, COMMANDS = build_parser()


def _section(command: str) -> str:
    match = re.search(
        rf"^### `globalkv {command}`\n(.*?)(?=^#{{2,3}} |\Z)", CONFIGURATION, re.S | re.M
    )
    assert match is not None, f"docs/configuration.md has no section for globalkv {command}"
    return match.group(1)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_is_documented_with_its_variable(command: str) -> None:
    section = _section(command)
    rows = {
        line.split("|")[1].strip(): line
        for line in section.splitlines()
        if line.startswith("| `--")
    }
    for action in COMMANDS[command]._actions:
        if isinstance(action, argparse._SubParsersAction):
            for nested in action.choices:
                assert f"`globalkv {command} {nested}`" in section, f"{command} {nested}"
            continue
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs or longs[0] == "--help":
            continue
        if action.help == argparse.SUPPRESS:  # sglang-router's, refused: listed there
            assert f"| `{longs[0]}` |" in PEER_FLAGS, f"{longs[0]} is not in {PEER_FLAGS_DOC}"
            continue
        key = f"`{' / '.join(action.option_strings)}`"
        assert key in rows, f"globalkv {command} {longs[0]} is not in docs/configuration.md"
        cells = [cell.strip() for cell in rows[key].split("|")[1:-1]]
        assert len(cells) == 4, f"{key}: flag, variable, default, meaning: {rows[key]}"
        assert cells[1] == f"`{env_var_name(command, longs[0])}`", key
        documented = _documented_default(action)
        assert documented is None or cells[2] == f"`{documented}`", f"{key}: {cells[2]}"


def _documented_default(action: argparse.Action) -> str | None:
    """What the default cell must say, or None when the parser's default is None."""
    if action.nargs == 0:
        return "on" if action.default else "off"
    if action.required:
        return "required"
    if action.default is None:
        return None
    if action.default == []:
        return "—"
    return str(action.default)


def test_every_metric_is_documented() -> None:
    names = set()
    for package in ("bootstrap", "globalkv", "gateway", "enginesim"):
        for path in (ROOT / package).rglob("*.py"):
            names.update(re.findall(r'"(globalkv_[a-z_]+)"', path.read_text()))
    assert len(names) > 40
    missing = sorted({n.removesuffix("_total") for n in names} - set(_metric_names()))
    assert missing == [], f"metrics not in docs/operations.md: {missing}"


def _metric_names() -> list[str]:
    return re.findall(r"`(globalkv_[a-z_]+)`", OPERATIONS)
