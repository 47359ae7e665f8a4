"""Real child processes for end-to-end tests, always reaped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from globalkv.stack.children import PARENT_DEATH_HOOK
from tests.support.net import http_ok, wait_for


class Proc:
    """A `globalkv` subcommand (or any argv) running with its output in a log file."""

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        name: str = "proc",
    ) -> None:
        self.name = name
        self.argv = list(argv)
        fd, path = tempfile.mkstemp(prefix=f"globalkv-{name}-", suffix=".log")
        os.close(fd)
        self.log_path = Path(path)
        self._log = self.log_path.open("wb")
        self._final_log: str | None = None
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.popen = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
            preexec_fn=PARENT_DEATH_HOOK,  # a killed test runner leaves no orphans
        )

    @classmethod
    def globalkv(
        cls, *args: str, env: Mapping[str, str] | None = None, name: str = "globalkv"
    ) -> Proc:
        return cls([sys.executable, "-m", "globalkv", *args], env=env, name=name)

    def log(self) -> str:
        if self._final_log is not None:
            return self._final_log
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_http(self, url: str, timeout: float = 30.0) -> None:
        def ready() -> bool:
            if not self.alive():
                raise RuntimeError(
                    f"{self.name} exited with {self.popen.returncode}:\n{self.log()}"
                )
            return http_ok(url)()

        try:
            wait_for(ready, timeout=timeout, what=f"{self.name} at {url}")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n--- {self.name} log ---\n{self.log()}") from None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.killpg(self.popen.pid, sig)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit code."""
        if self.alive():
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.popen.wait(timeout)
        if self._final_log is None:
            self._log.close()
            self._final_log = self.log()
            self.log_path.unlink(missing_ok=True)
        return self.popen.returncode

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.popen.wait(10)
