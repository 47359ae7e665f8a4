"""A complete local cluster as supervised processes: the API behind `globalkv up`.

    from globalkv.stack.cluster import LocalCluster, StackConfig

    with LocalCluster(StackConfig(prefill=2, decode=2)) as cluster:
        httpx.post(f"{cluster.gateway_url}/generate", json={"text": "hello"})
        cluster.kill("decode-1")

`start()` (called on entering the block) plans the cluster, checks every component's
arguments with its own `check_config` (`ValueError` naming the component, before any
process starts), starts all of them at once and returns when the cluster is ready
(`globalkv.stack.readiness`). A component that exits during the start, or a start that
times out, raises `ClusterError` with the tail of its log, after everything else was
stopped; later deaths are collected by `deaths()`. Leaving the block stops every process.

Children see none of the `GLOBALKV_*` variables of this process: their configuration is
exactly their command line, which `cluster.json` in the run directory records, and the
admin token, which each gets through its own variables (`plan.Component.env`) so that it
shows in neither.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import httpx

from globalkv.stack.children import Child, stop_all
from globalkv.stack.config import StackConfig
from globalkv.stack.plan import (
    Component,
    Plan,
    Role,
    check_plan,
    plan_stack,
    ports_needed,
    reserve_ports,
)
from globalkv.stack.readiness import Readiness

__all__ = ["ClusterError", "ComponentStatus", "Death", "LocalCluster", "StackConfig"]

_POLL_SECONDS = 0.1


class ClusterError(RuntimeError):
    """The cluster could not start, or was used in a way it cannot serve."""


@dataclass(frozen=True, slots=True)
class ComponentStatus:
    name: str
    role: Role
    url: str
    pid: int
    log_path: Path
    returncode: int | None
    """None while it runs."""
    bootstrap_url: str | None = None
    pod: str | None = None

    @property
    def alive(self) -> bool:
        return self.returncode is None


@dataclass(frozen=True, slots=True)
class Death:
    name: str
    returncode: int
    log_path: Path
    tail: str

    def describe(self) -> str:
        how = f"signal {-self.returncode}" if self.returncode < 0 else f"code {self.returncode}"
        return f"{self.name} exited ({how}); last lines of {self.log_path}:\n" + "\n".join(
            f"  | {line}" for line in self.tail.splitlines()
        )


def default_run_dir() -> Path:
    """A fresh `runs/up-<time>-<random>` in the working directory, else in the temp dir."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for base in (Path.cwd() / "runs", Path(tempfile.gettempdir()) / "globalkv-runs"):
        try:
            base.mkdir(parents=True, exist_ok=True)
            return Path(tempfile.mkdtemp(prefix=f"up-{stamp}-", dir=base))
        except OSError:
            continue
    raise ClusterError("no writable directory for the run: give a run directory")


def child_env(environ: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in environ.items() if not k.startswith("GLOBALKV_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


class LocalCluster:
    def __init__(
        self,
        config: StackConfig,
        *,
        python: str = sys.executable,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config
        self._python = python
        self._env = child_env(os.environ if environ is None else environ)
        self._run_dir = config.run_dir
        self._plan: Plan | None = None
        self._children: dict[str, Child] = {}
        self._reported: set[str] = set()

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> LocalCluster:
        if self._children:
            raise ClusterError("this cluster was already started")
        run_dir = self._run_dir or default_run_dir()
        run_dir.mkdir(parents=True, exist_ok=True)
        self._run_dir = run_dir
        plan = plan_stack(self.config, iter(reserve_ports(ports_needed(self.config))), run_dir)
        check_plan(plan)
        self._plan = plan
        try:
            for component in plan.components:
                self._children[component.name] = Child(
                    component.name,
                    [self._python, "-m", "globalkv", *component.argv],
                    component.log_path,
                    {**self._env, **component.env},
                )
            self._wait_ready(plan)
        except BaseException:
            self.stop()
            raise
        self._write_manifest()
        return self

    def stop(self) -> None:
        """Stop the gateways first (no new traffic), then everything else; idempotent."""
        names = [] if self._plan is None else [g.name for g in self._plan.gateways]
        gateways = [self._children[n] for n in names if n in self._children]
        if gateways:
            stop_all(gateways, self.config.stop_timeout)
        stop_all(self._children.values(), self.config.stop_timeout)

    def _wait_ready(self, plan: Plan) -> None:
        deadline = time.monotonic() + self.config.start_timeout
        with httpx.Client() as client:
            readiness = Readiness(plan, client, token=self.config.token)
            while True:
                dead = self.deaths()
                if dead:
                    raise ClusterError(
                        "a component exited during start:\n" + "\n".join(d.describe() for d in dead)
                    )
                pending = readiness.pending()
                if not pending:
                    return
                if time.monotonic() > deadline:
                    raise ClusterError(
                        f"not ready after {self.config.start_timeout:.0f}s: "
                        + "; ".join(pending)
                        + f" (logs in {self.run_dir})"
                    )
                time.sleep(_POLL_SECONDS)

    def _write_manifest(self) -> None:
        manifest = {
            "gateway_url": self.gateway_url,
            "gateway_urls": self.gateway_urls,
            "indexer_url": self.indexer_url,
            "indexer_urls": self.indexer_urls,
            "config": self.config.model_dump(mode="json"),
            "components": [
                {
                    "name": s.name,
                    "role": s.role,
                    "url": s.url,
                    "pid": s.pid,
                    "log": str(s.log_path),
                    "bootstrap_url": s.bootstrap_url,
                    "pod": s.pod,
                    "argv": list(self.plan.get(s.name).argv),
                }
                for s in self.components
            ],
        }
        # Written whole, then renamed: its appearance is the readiness signal others watch.
        path = self.run_dir / "cluster.json"
        partial = path.with_suffix(".json.partial")
        partial.write_text(json.dumps(manifest, indent=2) + "\n")
        os.replace(partial, path)

    # ------------------------------------------------------------------ views

    @property
    def plan(self) -> Plan:
        if self._plan is None:
            raise ClusterError("the cluster has not been started")
        return self._plan

    @property
    def run_dir(self) -> Path:
        if self._run_dir is None:
            raise ClusterError("the cluster has not been started")
        return self._run_dir

    @property
    def gateway_url(self) -> str:
        return self.plan.gateway.url

    @property
    def gateway_urls(self) -> list[str]:
        return [c.url for c in self.plan.gateways]

    @property
    def indexer_url(self) -> str:
        return self.plan.indexer.url

    @property
    def indexer_urls(self) -> list[str]:
        return [c.url for c in self.plan.by_role("indexer")]

    @property
    def prefill_urls(self) -> list[str]:
        return [c.url for c in self.plan.by_role("prefill")]

    @property
    def decode_urls(self) -> list[str]:
        return [c.url for c in self.plan.by_role("decode")]

    @property
    def components(self) -> list[ComponentStatus]:
        return [self._status(c) for c in self.plan.components if c.name in self._children]

    def _status(self, component: Component) -> ComponentStatus:
        child = self._children[component.name]
        return ComponentStatus(
            name=component.name,
            role=component.role,
            url=component.url,
            pid=child.pid,
            log_path=component.log_path,
            returncode=child.returncode,
            bootstrap_url=component.bootstrap_url,
            pod=component.pod,
        )

    # ------------------------------------------------------------------ supervision

    def deaths(self) -> list[Death]:
        """Components that exited since the last call (each reported once)."""
        found = []
        for name, child in self._children.items():
            code = child.returncode
            if code is not None and name not in self._reported:
                self._reported.add(name)
                found.append(Death(name, code, child.log_path, child.tail()))
        return found

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal one component (SIGKILL by default) and wait until it has exited."""
        self.plan.get(name)
        child = self._children[name]
        child.signal(sig)
        if child.wait(self.config.stop_timeout) is None:
            raise ClusterError(f"{name} did not exit within {self.config.stop_timeout:.0f}s")
