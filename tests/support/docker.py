"""A real Docker engine and `docker compose` for the tests that need them.

`compose_or_skip()` finds a running engine and a compose command (`docker compose` v2, or
the `docker-compose` v1 that Debian ships) and the base images the project's Dockerfile
and compose file name; where any is missing the test is skipped with the reason (CI
starts an engine and builds local stand-ins for the base images: `.ci/docker/`). The
image is built once per session; its layers are cached by the engine between builds, so
a rebuild after a change of sources takes one step.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "globalkv:local"
BASE_IMAGES = ("python:3.11-slim", "redis:7-alpine")
BUILD_SECONDS = 900.0


def _run(
    argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        check=False,
    )


def _works(argv: Sequence[str], timeout: float = 20.0) -> bool:
    try:
        return _run(argv, timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def compose_command() -> list[str] | None:
    if _works(["docker", "compose", "version"]):
        return ["docker", "compose"]
    if shutil.which("docker-compose") and _works(["docker-compose", "version"]):
        return ["docker-compose"]
    return None


def compose_or_skip() -> list[str]:
    """The compose command, once a Docker engine answers and the base images are here."""
    if shutil.which("docker") is None:
        pytest.skip("no docker client on the PATH (CI installs one: .ci/docker/engine.sh)")
    if not _works(["docker", "info"]):
        pytest.skip("no Docker engine answers `docker info` (CI starts one: .ci/docker/engine.sh)")
    command = compose_command()
    if command is None:
        pytest.skip("neither `docker compose` nor `docker-compose` works")
    for image in BASE_IMAGES:
        if not _works(["docker", "image", "inspect", image]) and not _works(
            ["docker", "pull", image], timeout=120.0
        ):
            pytest.skip(
                f"base image {image} is neither here nor pullable "
                "(.ci/docker/standins.sh builds local stand-ins)"
            )
    return command


def build_image() -> float:
    """Build the project's image as `docker build .` does; returns the seconds it took.

    `--network host`: on machines whose engine has no bridge (like CI's), the build
    reaches the package registry only through the host's network; elsewhere it is
    harmless.
    """
    started = time.monotonic()
    result = _run(["docker", "build", "--network", "host", "-t", IMAGE, "."], BUILD_SECONDS)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return time.monotonic() - started


@dataclass
class ComposeProject:
    """One `docker compose -p NAME` project of the repository's compose file."""

    command: list[str]
    name: str
    env: dict[str, str] = field(default_factory=dict)
    files: list[Path] = field(default_factory=lambda: [ROOT / "docker-compose.yml"])

    def run(
        self, *args: str, timeout: float = 120.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        argv = [*self.command, "-p", self.name]
        for path in self.files:
            argv += ["-f", str(path)]
        result = _run([*argv, *args], timeout, self.env)
        if check:
            assert result.returncode == 0, (
                f"{' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
            )
        return result

    def containers(self) -> dict[str, str]:
        """Service name → container id, for every container of the project."""
        ids = self.run("ps", "-q").stdout.split()
        if not ids:
            return {}
        result = _run(["docker", "inspect", *ids], 30.0)
        assert result.returncode == 0, result.stderr
        return {
            c["Config"]["Labels"]["com.docker.compose.service"]: c["Id"]
            for c in json.loads(result.stdout)
        }

    def health(self) -> dict[str, str]:
        """Service → `healthy`, `starting` or `unhealthy` while running, else its state."""
        ids = self.containers()
        if not ids:
            return {}
        result = _run(["docker", "inspect", *ids.values()], 30.0)
        assert result.returncode == 0, result.stderr
        out = {}
        for c in json.loads(result.stdout):
            state = c["State"]
            running = state["Status"] == "running" and state.get("Health")
            status = state["Health"]["Status"] if running else state["Status"]
            out[c["Config"]["Labels"]["com.docker.compose.service"]] = status
        return out

    def up(self, timeout: float = 300.0) -> None:
        """`up -d --no-build`; when it fails (a dependency went unhealthy, say), the error
        holds each container's state, its last health-check results and, for any not
        healthy, the tail of its log: a start-up failure in CI must say which and why."""
        result = self.run("up", "-d", "--no-build", timeout=timeout, check=False)
        if result.returncode != 0:
            raise AssertionError(
                f"up exited {result.returncode}:\n{result.stdout}\n{result.stderr}\n"
                + self.diagnosis()
            )

    def diagnosis(self) -> str:
        """Per container: state, health, the last health-check outputs, a log tail."""
        ids = self.containers()
        if not ids:
            return "no containers"
        result = _run(["docker", "inspect", *ids.values()], 30.0)
        if result.returncode != 0:
            return f"docker inspect failed: {result.stderr}"
        lines = []
        for c in json.loads(result.stdout):
            service = c["Config"]["Labels"]["com.docker.compose.service"]
            state = c["State"]
            health = state.get("Health") or {}
            lines.append(
                f"== {service}: {state['Status']} (exit {state.get('ExitCode')}, "
                f"restarts {c.get('RestartCount')}, started {state.get('StartedAt')}), "
                f"health {health.get('Status')}, failing streak {health.get('FailingStreak')}"
            )
            for probe in health.get("Log", [])[-5:]:
                output = " ".join(str(probe.get("Output", "")).split())[:300]
                lines.append(
                    f"   check {probe.get('Start')} exit {probe.get('ExitCode')}: {output}"
                )
            if health.get("Status") != "healthy":
                tail = _run(["docker", "logs", "--tail", "40", c["Id"]], 30.0)
                lines.append(tail.stdout[-4000:] + tail.stderr[-4000:])
        return "\n".join(lines)

    def wait_healthy(self, services: set[str], timeout: float) -> float:
        """Seconds until every service's health check passes; fails with their logs."""
        started = time.monotonic()
        deadline = started + timeout
        while True:
            health = self.health()
            if set(health) >= services and all(health[s] == "healthy" for s in services):
                return time.monotonic() - started
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"not all healthy after {timeout:.0f}s: {health}\n{self.diagnosis()}"
                )
            time.sleep(0.5)

    def down(self) -> None:
        self.run("down", "-v", "--remove-orphans", "--timeout", "5", check=False, timeout=180.0)
