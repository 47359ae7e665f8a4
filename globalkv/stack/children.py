"""Child processes a supervisor owns: started with a log file, stopped as a group, reaped.

Each child runs in its own session, so a Ctrl-C typed in the terminal reaches only the
supervisor, which then stops the children in an orderly way (SIGTERM to each process
group, SIGKILL after a grace period). On Linux a child also receives SIGTERM when the
thread that started it dies (PR_SET_PDEATHSIG), so even a supervisor killed with SIGKILL
leaves no orphans behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _death_signal_hook() -> Callable[[], None] | None:
    """A pre-exec hook asking the kernel to SIGTERM the child when its parent dies.

    libc is resolved here, before any fork: the hook itself only makes one foreign call.
    """
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    prctl = ctypes.CDLL(name, use_errno=True).prctl

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)

    return hook


PARENT_DEATH_HOOK = _death_signal_hook()
"""Pass as `preexec_fn` so the child is stopped when the thread that started it dies."""


def tail(path: Path, lines: int = 20) -> str:
    """The last `lines` lines of a log (what to show when a component dies)."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 64 * 1024))
            text = handle.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return f"(log {path} unreadable: {exc})"
    return "\n".join(text.splitlines()[-lines:])


class Child:
    """One supervised process with its stdout and stderr in `log_path`."""

    def __init__(
        self, name: str, argv: Sequence[str], log_path: Path, env: Mapping[str, str]
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            self._popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env),
                start_new_session=True,
                preexec_fn=PARENT_DEATH_HOOK,
            )

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        """None while it runs; reaps it once it has exited."""
        return self._popen.poll()

    @property
    def alive(self) -> bool:
        return self.returncode is None

    def signal(self, sig: int) -> None:
        """Signal its whole process group (it and anything it started)."""
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._popen.pid, sig)

    def wait(self, timeout: float) -> int | None:
        try:
            return self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def tail(self, lines: int = 20) -> str:
        return tail(self.log_path, lines)


def stop_all(children: Iterable[Child], grace: float) -> None:
    """SIGTERM every child at once, then SIGKILL whatever is still running after `grace`."""
    running = [c for c in children if c.alive]
    for child in running:
        child.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for child in running:
        child.wait(max(0.0, deadline - time.monotonic()))
    for child in running:
        if child.alive:
            child.signal(signal.SIGKILL)
            child.wait(5.0)
