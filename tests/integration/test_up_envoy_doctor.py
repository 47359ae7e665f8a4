"""`globalkv up --entry envoy` prints a doctor command, and that command, run as printed
against the stack `up` started, finds the stack healthy: the probe enters at Envoy, the
picker is read as the gateway, and the sidecars' missing /server_info is no warning."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.net import free_port, wait_for
from tests.support.procs import Proc

pytestmark = pytest.mark.integration


def _printed_doctor(log: str) -> list[str]:
    (line,) = [line.strip() for line in log.splitlines() if " globalkv doctor " in line]
    argv = shlex.split(line)
    assert argv[:3] == ["python", "-m", "globalkv"], line
    return [sys.executable, *argv[1:]]


@pytest.mark.timeout(180)
def test_the_doctor_line_up_prints_passes_on_the_envoy_stack_it_started(tmp_path: Path) -> None:
    up = Proc.globalkv(
        "up",
        *("--entry", "envoy", "--port", str(free_port()), "--run-dir", str(tmp_path)),
        *("--health-check-interval", "1"),
        name="up",
    )
    try:

        def printed() -> bool:
            if not up.alive():
                raise RuntimeError(f"globalkv up exited:\n{up.log()}")
            return "Ctrl-C stops everything" in up.log()

        wait_for(printed, timeout=90, what="globalkv up --entry envoy to be ready")
        doctor = _printed_doctor(up.log())
        assert "--entry" in doctor
        done = subprocess.run(
            [*doctor, "--json"], capture_output=True, text=True, timeout=90, check=False
        )
        assert done.returncode == 0, done.stdout + done.stderr
        report = json.loads(done.stdout)
        found = {
            stage["key"]: [f for f in stage["findings"] if f["level"] != "ok"]
            for stage in report["stages"]
        }
        assert found["gateway"] == [], found["gateway"]
        assert found["probe"] == [], found["probe"]
        routing = {f["subject"]: f for s in report["stages"] for f in s["findings"]}
        assert routing["repeated probe"]["level"] == "ok", routing["repeated probe"]
    finally:
        up.stop(timeout=30)
