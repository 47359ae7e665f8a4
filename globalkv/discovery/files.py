"""Workers listed in a YAML or JSON file that is read again whenever it changes, for machines
without Kubernetes.

    workers:
      - url: http://10.0.0.1:30000
        role: prefill
        bootstrap_port: 8998      # prefill only; absent or null: the engine's own
      - url: http://10.0.0.2:30000
        role: decode
        model: qwen3-8b           # optional
        id: decode-a              # optional; default: the URL

The file is read every `interval` seconds and parsed when its content hash changed. Its
modification time decides nothing: it is too coarse to tell two quick edits apart, and
copies and ConfigMap updates (a symlink swapped to a new directory) do not keep it
meaningful, while reading a file of a few workers costs nothing. `watchfiles`' inotify
would bring changes sooner but misses a ConfigMap's symlink swap unless its directory is
watched, sees nothing on network filesystems, and would still need a poll for a file that
does not exist yet.

A file that cannot be read, is not valid YAML or JSON, or holds one bad entry is refused
whole, and the workers stay as the last good file said: a typo must not remove workers. The
error is logged once per distinct content, not at every poll. To remove every worker,
list none (`workers: []`).

The file is outside input, so its shape is bounded before anything reads its fields: at
most `MAX_FILE_BYTES`, nested at most `MAX_DEPTH` levels (deeper JSON or YAML raised
RecursionError in the parser, which ended the polling for good), and at most `MAX_VALUES`
values with each YAML alias counted as what it repeats (nine levels of ten aliases make a
small file of a billion values). It is parsed in a worker thread: a megabyte of YAML
takes the pure-Python parser most of a second, which the event loop must not wait out.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections import Counter
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from globalkv.discovery.model import DiscoveredWorker, Role, Snapshot, Source
from kvplumbing.addresses import check_http_url
from kvplumbing.clock import Sleep
from kvplumbing.validation import validation_message

log = logging.getLogger(__name__)

MAX_FILE_BYTES = 1 << 20
MAX_WORKERS = 4096
MAX_DEPTH = 16
"""Levels of nesting a file may have; a good one has four (the file, its list, an entry, a
field's value)."""
MAX_VALUES = 100_000
"""Values (mappings, lists, keys, scalars) a file may hold, each YAML alias counted as
what it names; `MAX_WORKERS` entries of every field come to about 45,000."""


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    url: str
    role: Role
    bootstrap_port: int | None = Field(None, ge=1, le=65535)
    model: str | None = Field(None, min_length=1)
    id: str | None = Field(None, min_length=1)

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        return check_http_url(url)


class _WorkerFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    workers: list[_Entry] = Field(max_length=MAX_WORKERS)


def _load(text: str, *, as_json: bool) -> Any:
    """The file's data, its nesting and size bounded (see the module's docstring)."""
    kind = "JSON" if as_json else "YAML"
    try:
        data: Any = json.loads(text) if as_json else yaml.safe_load(text)
    except RecursionError:
        raise ValueError(f"{kind} nested deeper than {MAX_DEPTH} levels") from None
    except (ValueError, yaml.YAMLError) as error:
        raise ValueError(f"not valid {kind}: {_first_line(error)}") from None
    values = 0
    arriving: list[tuple[Any, int]] = [(data, 1)]
    while arriving:
        value, depth = arriving.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"{kind} nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            values += len(value)  # the keys
            arriving.extend((inner, depth + 1) for inner in value.values())
        elif isinstance(value, list):
            arriving.extend((inner, depth + 1) for inner in value)
        values += 1
        if values > MAX_VALUES:
            raise ValueError(f"more than {MAX_VALUES} values, each alias counted as what it names")
    return data


def parse_workers(text: str, *, as_json: bool) -> Snapshot:
    """The workers a file's text lists, or ValueError saying, in one line, what is wrong."""
    data = _load(text, as_json=as_json)
    if not isinstance(data, dict):
        raise ValueError("the file must hold a mapping with a 'workers' list")
    try:
        listed = _WorkerFile.model_validate(data)
    except ValidationError as error:
        raise ValueError(validation_message(error)) from None
    workers: dict[str, DiscoveredWorker] = {}
    ids: set[str] = set()
    for number, entry in enumerate(listed.workers):
        if entry.role == "decode" and entry.bootstrap_port is not None:
            raise ValueError(f"workers.{number}: a bootstrap_port is for a prefill only")
        worker = DiscoveredWorker(
            id=entry.id or entry.url,
            url=entry.url,
            role=entry.role,
            bootstrap_port=entry.bootstrap_port,
            model=entry.model,
        )
        if worker.url in workers or worker.id in ids:
            raise ValueError(f"workers.{number}: {worker.url} or id {worker.id} listed twice")
        workers[worker.url] = worker
        ids.add(worker.id)
    return frozenset(workers.values())


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


class FileSource(Source):
    """Follows a worker file; `async with` starts the polling, `snapshots()` yields each
    new worker set until exit. `errors` counts refused versions of the file by kind."""

    def __init__(self, path: Path, *, interval: float = 2.0, sleep: Sleep = asyncio.sleep) -> None:
        if interval <= 0:
            raise ValueError("the file poll interval must be positive")
        super().__init__()
        self.path = path
        self.interval = interval
        self.errors: Counter[str] = Counter()
        self._sleep = sleep
        self._seen: bytes | None = None
        """The content hash last acted on (published or refused), or of the last error."""

    def _loops(self) -> list[Coroutine[Any, Any, None]]:
        return [self._poll()]

    async def _poll(self) -> None:
        while True:
            await self._check()
            await self._sleep(self.interval)

    async def _check(self) -> None:
        """Read the file once and publish its workers if it changed and is good."""
        try:
            content = await asyncio.to_thread(self._read)
        except OSError as error:
            why = error.strerror or str(error)
            self._refuse("unreadable", why, f"unreadable: {why}".encode())
            return
        except ValueError as error:
            self._refuse("too large", str(error), b"too large")
            return
        digest = hashlib.sha256(content).digest()
        if digest == self._seen:
            return
        as_json = self.path.suffix.lower() == ".json"
        try:
            text = content.decode("utf-8")
            workers = await asyncio.to_thread(parse_workers, text, as_json=as_json)
        except ValueError as error:  # UnicodeDecodeError is one
            self._refuse("invalid", _first_line(error), digest)
            return
        self._seen = digest
        if await self._cell.publish(workers):
            log.info("discovery: %s lists %d workers", self.path, len(workers))

    def _read(self) -> bytes:
        with self.path.open("rb") as file:
            content = file.read(MAX_FILE_BYTES + 1)
        if len(content) > MAX_FILE_BYTES:
            raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
        return content

    def _refuse(self, kind: str, why: str, seen: bytes) -> None:
        """Keep the workers as they are; say why once for each distinct failure."""
        if seen == self._seen:
            return
        self._seen = seen
        self.errors[kind] += 1
        kept = self.current
        log.error(
            "discovery: %s refused (%s); keeping %s",
            self.path,
            why,
            "no workers yet" if kept is None else f"the last good file's {len(kept)} workers",
        )
