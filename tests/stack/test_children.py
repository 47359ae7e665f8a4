"""Supervised children: logs, group signals, SIGKILL after the grace period, no orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from globalkv.stack.children import Child, stop_all, tail
from tests.support.net import wait_for

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def log_line(path: Path, prefix: str) -> str:
    wait_for(lambda: prefix in path.read_text(), timeout=20, what=f"{prefix!r} in {path}")
    line = next(x for x in path.read_text().splitlines() if x.startswith(prefix))
    return line[len(prefix) :]


def test_output_goes_to_the_log_and_the_exit_code_is_kept(tmp_path: Path) -> None:
    child = Child(
        "talker",
        python("import sys\nfor i in range(30): print('line', i)\nsys.exit(3)"),
        tmp_path / "logs" / "talker.log",
        ENV,
    )
    wait_for(lambda: not child.alive, timeout=20, what="the child to exit")
    assert child.returncode == 3
    assert child.tail(2) == "line 28\nline 29"
    assert tail(tmp_path / "missing.log").startswith("(log ")


def test_stop_all_kills_what_ignores_sigterm(tmp_path: Path) -> None:
    polite = Child("polite", python("import time\ntime.sleep(60)"), tmp_path / "p.log", ENV)
    stubborn = Child(
        "stubborn",
        python(
            """
            import signal, time
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            print('ready', flush=True)
            time.sleep(60)
            """
        ),
        tmp_path / "s.log",
        ENV,
    )
    log_line(tmp_path / "s.log", "ready")
    stop_all([polite, stubborn], grace=0.5)
    assert polite.returncode == -signal.SIGTERM
    assert stubborn.returncode == -signal.SIGKILL


def test_signals_reach_the_child_s_own_children(tmp_path: Path) -> None:
    child = Child(
        "parent",
        python(
            """
            import subprocess, sys, time
            grandchild = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
            print('grandchild', grandchild.pid, flush=True)
            time.sleep(60)
            """
        ),
        tmp_path / "parent.log",
        ENV,
    )
    grandchild = int(log_line(tmp_path / "parent.log", "grandchild "))
    assert running(grandchild)
    stop_all([child], grace=5)
    wait_for(lambda: not running(grandchild), timeout=10, what="the grandchild to stop")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_children_die_with_a_supervisor_killed_by_sigkill(tmp_path: Path) -> None:
    log = tmp_path / "supervisor.log"
    with log.open("w") as out:
        supervisor = subprocess.Popen(
            python(
                f"""
            import time
            from pathlib import Path
            from globalkv.stack.children import Child
            child = Child('sleeper', ['sleep', '60'], Path({str(tmp_path / "c.log")!r}), {{}})
            print('child', child.pid, flush=True)
            time.sleep(60)
            """
            ),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=ENV,
        )
    try:
        orphan = int(log_line(log, "child "))
        assert running(orphan)
        supervisor.kill()
        supervisor.wait(10)
        wait_for(lambda: not running(orphan), timeout=10, what="the orphan to be stopped")
    finally:
        supervisor.kill()
        supervisor.wait(10)
