"""Smoke of `globalkv up` as a new user runs it: start, one chat through the gateway, stop.

Run with the interpreter of a fresh virtual environment that holds only what the README's
first command installed (`.ci/fresh-machine` makes one); it uses the standard library
alone, so it cannot hide a dependency the project forgot to declare. Every wait is
bounded; the stack is stopped with SIGINT, as Ctrl-C would, and must exit 0.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

READY_LINE = "Ctrl-C stops everything."
START_SECONDS = 120.0
STOP_SECONDS = 30.0


def _read_lines(proc: subprocess.Popen[str], lines: list[str], ready: threading.Event) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        sys.stdout.write("  | " + line)
        if line.strip() == READY_LINE:
            ready.set()
    ready.set()


def _chat(gateway: str) -> dict[str, object]:
    body = {
        "model": "emulated-model",
        "messages": [{"role": "user", "content": "Hello from a fresh machine!"}],
        "max_tokens": 8,
    }
    request = urllib.request.Request(
        gateway + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        answer: dict[str, object] = json.load(response)
        if response.status != 200:
            raise SystemExit(f"chat answered {response.status}: {answer}")
    return answer


def main() -> int:
    run_dir = Path(tempfile.mkdtemp(prefix="globalkv-smoke-"))
    argv = [sys.executable, "-m", "globalkv", "up", "--port", "0", "--run-dir", str(run_dir)]
    print("$ " + " ".join(argv), flush=True)
    # Started outside the checkout, so that only what was installed can be imported.
    proc = subprocess.Popen(
        argv,
        cwd=run_dir,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    lines: list[str] = []
    ready = threading.Event()
    reader = threading.Thread(target=_read_lines, args=(proc, lines, ready), daemon=True)
    reader.start()
    try:
        if not ready.wait(START_SECONDS) or proc.poll() is not None:
            print(f"smoke: `globalkv up` was not ready within {START_SECONDS:.0f} s", flush=True)
            return 1
        gateway = json.loads((run_dir / "cluster.json").read_text())["gateway_url"]
        answer = _chat(gateway)
        choices = answer.get("choices")
        if not isinstance(choices, list) or not choices:
            print(f"smoke: the chat answer has no choices: {answer}", flush=True)
            return 1
        print(f"smoke: chat through {gateway} answered: {json.dumps(choices[0])}", flush=True)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            status = proc.wait(STOP_SECONDS)
        except subprocess.TimeoutExpired:
            proc.kill()
            status = proc.wait()
            print(f"smoke: `globalkv up` did not stop within {STOP_SECONDS:.0f} s", flush=True)
        reader.join(5)
    if status != 0 or not any("globalkv up: stopped" in line for line in lines):
        print(f"smoke: `globalkv up` exited {status} without a clean stop", flush=True)
        return 1
    print("smoke: started, answered a chat, stopped cleanly", flush=True)
    return 0


if __name__ == "__main__":
    started = time.monotonic()
    result = main()
    print(f"smoke: {time.monotonic() - started:.1f} s", flush=True)
    sys.exit(result)
