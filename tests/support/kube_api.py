"""An in-process stand-in for the part of kube-apiserver that pod discovery uses: listing and
watching pods, over real HTTP/1.1 (h11 on asyncio streams) on a free local port.

It is not a kube-apiserver and checks nothing a real one would (no authentication, no
schema, no admission): a test stores whatever pod dicts it likes, malformed ones included.
What it does follow is the API's contract for a list-watch client:

- `GET /api/v1/pods` and `/api/v1/namespaces/{ns}/pods` list with `metadata.resourceVersion`
  and page with `limit`/`continue` (a page after the first is served from the same
  snapshot; a continue token older than the compacted history is 410 Expired);
- the same paths with `watch=1|true` stream JSON lines (`ADDED`, `MODIFIED`, `DELETED`,
  `BOOKMARK`, `ERROR`) with chunked encoding: from a `resourceVersion`, every change after
  it, then live; without one (or `0`), the current objects as ADDED first. A version older
  than the compacted history is an `ERROR` event carrying a 410 `Status`, as the watch
  cache answers. `timeoutSeconds` ends the stream (after a bookmark when bookmarks were
  asked for);
- `labelSelector` filters with `=`, `==`, `!=`, `in`, `notin`, `key` and `!key`; an object
  whose labels stop (start) matching a watch's selector reaches it as DELETED (ADDED);
- `restart()` closes every connection and listens again on the same port, the objects and
  their history kept; `compact()` forgets the history so older versions are gone;
  `end_watches()` ends watch streams cleanly, `drop_watches()` cuts their connections.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import itertools
import json
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

import h11

from tests.support.net import free_port

Obj = dict[str, Any]

_PATH = re.compile(r"/api/v1/(?:namespaces/(?P<ns>[^/]+)/)?pods")
_SET = re.compile(r"\s*(?P<key>[^\s!=(),]+)\s+(?P<op>in|notin)\s*\((?P<values>[^()]*)\)\s*")
_EQ = re.compile(r"\s*(?P<key>[^\s!=(),]+)\s*(?P<op>==|=|!=)\s*(?P<value>[^\s!=(),]*)\s*")
_EXISTS = re.compile(r"\s*(?P<neg>!?)\s*(?P<key>[^\s!=(),]+)\s*")


class BadSelector(ValueError):
    pass


def parse_selector(text: str) -> list[tuple[str, str, frozenset[str]]]:
    """`labelSelector` as (key, op, values) requirements; op is in, notin, exists or !exists."""
    requirements = []
    for part in _split(text):
        if m := _SET.fullmatch(part):
            values = frozenset(v.strip() for v in m["values"].split(","))
            requirements.append((m["key"], m["op"], values))
        elif m := _EQ.fullmatch(part):
            op = "notin" if m["op"] == "!=" else "in"
            requirements.append((m["key"], op, frozenset([m["value"]])))
        elif m := _EXISTS.fullmatch(part):
            requirements.append((m["key"], "!exists" if m["neg"] else "exists", frozenset()))
        else:
            raise BadSelector(f"unable to parse requirement: {part!r}")
    return requirements


def _split(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if current.strip() or parts:
        parts.append(current)
    return [p for p in parts if p.strip()] if text.strip() else []


def selector_matches(requirements: list[tuple[str, str, frozenset[str]]], labels: Any) -> bool:
    labels = labels if isinstance(labels, dict) else {}
    for key, op, values in requirements:
        present = key in labels
        if op == "exists" and not present:
            return False
        if op == "!exists" and present:
            return False
        if op == "in" and (not present or labels[key] not in values):
            return False
        if op == "notin" and present and labels[key] in values:
            return False
    return True


def status(code: int, reason: str, message: str) -> Obj:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def pod(
    name: str,
    labels: dict[str, str],
    *,
    ip: str | None = "127.0.0.2",
    ready: bool = True,
    phase: str = "Running",
    namespace: str = "default",
    annotations: dict[str, str] | None = None,
) -> Obj:
    """A pod as the API server shows one (the fields discovery reads, and a few more)."""
    status_: Obj = {
        "phase": phase,
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ],
    }
    if ip is not None:
        status_["podIP"] = ip
        status_["podIPs"] = [{"ip": ip}]
    metadata: Obj = {"name": name, "namespace": namespace, "labels": labels}
    if annotations is not None:
        metadata["annotations"] = annotations
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": metadata,
        "spec": {"containers": [{"name": "engine", "image": "sglang"}]},
        "status": status_,
    }


def _visible(
    namespace: str | None, selector: list[tuple[str, str, frozenset[str]]], obj: Obj
) -> bool:
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    if namespace is not None and meta.get("namespace") != namespace:
        return False
    return selector_matches(selector, meta.get("labels"))


@dataclass
class _Change:
    version: int
    old: Obj | None
    new: Obj  # the object at `version`; for a deletion, its last state at that version
    deleted: bool


@dataclass(eq=False)
class _Watch:
    namespace: str | None
    selector: list[tuple[str, str, frozenset[str]]]
    bookmarks: bool
    writer: asyncio.StreamWriter
    lines: asyncio.Queue[Obj | None] = field(default_factory=asyncio.Queue)

    def sees(self, obj: Obj | None) -> bool:
        return obj is not None and _visible(self.namespace, self.selector, obj)

    def event_for(self, change: _Change) -> Obj | None:
        was = self.sees(change.old)
        now = not change.deleted and self.sees(change.new)
        if was and change.deleted:
            return {"type": "DELETED", "object": change.new}
        if was and now:
            return {"type": "MODIFIED", "object": change.new}
        if now:
            return {"type": "ADDED", "object": change.new}
        if was:  # its labels no longer match: gone, as far as this watch can tell
            return {"type": "DELETED", "object": change.new}
        return None


class FakeKubeApi:
    """Pods in memory behind a local HTTP port; see the module for what it serves."""

    def __init__(self) -> None:
        self.port = free_port()
        self.requests: list[tuple[str, dict[str, str]]] = []
        self._objects: dict[tuple[str, str], Obj] = {}
        self._version = 100
        self._oldest = self._version
        self._history: list[_Change] = []
        self._pages: dict[str, tuple[int, list[Obj]]] = {}
        self._tokens = itertools.count(1)
        self._uids = itertools.count(1)
        self._watches: set[_Watch] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def version(self) -> int:
        return self._version

    @property
    def watching(self) -> int:
        """Watch streams open now."""
        return len(self._watches)

    def watch_requests(self) -> list[dict[str, str]]:
        return [query for _, query in self.requests if query.get("watch") in ("1", "true")]

    def list_requests(self) -> list[dict[str, str]]:
        return [query for _, query in self.requests if query.get("watch") not in ("1", "true")]

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, "127.0.0.1", self.port, reuse_address=True
        )

    async def stop(self) -> None:
        """Stop listening and cut every connection, as a crashed API server does."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        self._watches.clear()
        handlers = list(self._handlers)
        if handlers:
            await asyncio.wait(handlers, timeout=5)

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    # The objects, as a controller or the kubelet would change them.

    def apply(self, obj: Obj) -> Obj:
        """Create or replace a pod (by namespace and name); the stored copy is returned."""
        stored = copy.deepcopy(obj)
        meta = stored.setdefault("metadata", {})
        key = (meta.setdefault("namespace", "default"), meta["name"])
        old = self._objects.get(key)
        self._version += 1
        meta["resourceVersion"] = str(self._version)
        meta.setdefault("uid", old["metadata"]["uid"] if old else f"uid-{next(self._uids)}")
        self._objects[key] = stored
        self._record(_Change(self._version, old, stored, deleted=False))
        return stored

    def delete(self, name: str, namespace: str = "default") -> None:
        old = self._objects.pop((namespace, name))
        self._version += 1
        last = copy.deepcopy(old)
        last["metadata"]["resourceVersion"] = str(self._version)
        self._record(_Change(self._version, old, last, deleted=True))

    def compact(self) -> None:
        """Forget every change so far: a watch or continue token from before now is gone."""
        self._history.clear()
        self._oldest = self._version

    def bookmark(self) -> None:
        """A BOOKMARK at the current version to every watch that asked for them."""
        for watch in self._watches:
            if watch.bookmarks:
                watch.lines.put_nowait(self._bookmark())

    def end_watches(self) -> None:
        """End every watch stream cleanly, as the server does at `timeoutSeconds`."""
        for watch in self._watches:
            watch.lines.put_nowait(None)

    def drop_watches(self) -> None:
        """Cut every watch's connection, as a failing load balancer does."""
        for watch in list(self._watches):
            watch.writer.transport.abort()
        self._watches.clear()

    def _record(self, change: _Change) -> None:
        self._history.append(change)
        for watch in self._watches:
            event = watch.event_for(change)
            if event is not None:
                watch.lines.put_nowait(event)

    def _bookmark(self) -> Obj:
        return {
            "type": "BOOKMARK",
            "object": {
                "kind": "Pod",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self._version)},
            },
        }

    # HTTP

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._writers.add(writer)
        connection = h11.Connection(h11.SERVER)
        try:
            while True:
                request = await self._next_request(connection, reader)
                if request is None:
                    break
                await self._answer(connection, reader, writer, request)
                if connection.our_state is not h11.DONE or connection.their_state is not h11.DONE:
                    break
                connection.start_next_cycle()
        except (ConnectionError, h11.ProtocolError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers.discard(writer)
            self._handlers.discard(task)
            writer.transport.abort()

    @staticmethod
    async def _next_request(
        connection: h11.Connection, reader: asyncio.StreamReader
    ) -> h11.Request | None:
        request = None
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(65536)
                connection.receive_data(data)
            elif isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.EndOfMessage):
                return request
            elif isinstance(event, h11.ConnectionClosed):
                return None

    async def _answer(
        self,
        connection: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        request: h11.Request,
    ) -> None:
        target = urlsplit(request.target.decode())
        query = {k: v[-1] for k, v in parse_qs(target.query, keep_blank_values=True).items()}
        self.requests.append((target.path, query))
        path = _PATH.fullmatch(target.path)
        if request.method != b"GET" or path is None:
            await _send(
                connection,
                writer,
                404,
                status(404, "NotFound", "the server could not find the requested resource"),
            )
            return
        try:
            selector = parse_selector(query.get("labelSelector", ""))
        except BadSelector as error:
            await _send(connection, writer, 400, status(400, "BadRequest", str(error)))
            return
        namespace = path["ns"]
        if query.get("watch") in ("1", "true"):
            await self._watch(connection, reader, writer, namespace, selector, query)
        else:
            code, body = self._list(namespace, selector, query)
            await _send(connection, writer, code, body)

    def _list(
        self,
        namespace: str | None,
        selector: list[tuple[str, str, frozenset[str]]],
        query: dict[str, str],
    ) -> tuple[int, Obj]:
        token = query.get("continue")
        if token:
            if token not in self._pages:
                return 400, status(400, "BadRequest", "invalid continue token")
            version, items = self._pages.pop(token)
            if version < self._oldest:
                return 410, status(
                    410,
                    "Expired",
                    "The provided continue parameter is too old to display a consistent list "
                    "result.",
                )
        else:
            version = self._version
            items = [
                copy.deepcopy(obj)
                for _, obj in sorted(self._objects.items())
                if _visible(namespace, selector, obj)
            ]
        limit = int(query.get("limit") or 0)
        metadata: Obj = {"resourceVersion": str(version)}
        if limit and len(items) > limit:
            following = base64.urlsafe_b64encode(f"page-{next(self._tokens)}".encode()).decode()
            self._pages[following] = (version, items[limit:])
            metadata["continue"] = following
            metadata["remainingItemCount"] = len(items) - limit
            items = items[:limit]
        return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": metadata, "items": items}

    async def _watch(
        self,
        connection: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        namespace: str | None,
        selector: list[tuple[str, str, frozenset[str]]],
        query: dict[str, str],
    ) -> None:
        watch = _Watch(namespace, selector, query.get("allowWatchBookmarks") == "true", writer)
        since = query.get("resourceVersion", "")
        if since not in ("", "0") and not since.isdigit():
            await _send(
                connection,
                writer,
                400,
                status(400, "BadRequest", f"invalid resource version {since!r}"),
            )
            return
        await _start_stream(connection, writer)
        if since in ("", "0"):
            for _, obj in sorted(self._objects.items()):
                if watch.sees(obj):
                    watch.lines.put_nowait({"type": "ADDED", "object": copy.deepcopy(obj)})
        elif int(since) < self._oldest:
            message = f"too old resource version: {since} ({self._oldest})"
            await _line(
                connection, writer, {"type": "ERROR", "object": status(410, "Expired", message)}
            )
            await _end(connection, writer)
            return
        else:
            for change in self._history:
                event = watch.event_for(change) if change.version > int(since) else None
                if event is not None:
                    watch.lines.put_nowait(event)
        self._watches.add(watch)
        timeout = float(query.get("timeoutSeconds") or 3600)
        try:
            await self._stream(connection, reader, writer, watch, timeout)
        finally:
            self._watches.discard(watch)

    async def _stream(
        self,
        connection: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        watch: _Watch,
        timeout: float,
    ) -> None:
        closed = asyncio.ensure_future(reader.read(1))  # the client hanging up
        try:
            async with asyncio.timeout(timeout):
                while True:
                    line = asyncio.ensure_future(watch.lines.get())
                    done, _ = await asyncio.wait(
                        {line, closed}, return_when=asyncio.FIRST_COMPLETED
                    )
                    if closed in done:
                        line.cancel()
                        return
                    event = line.result()
                    if event is None:
                        break
                    await _line(connection, writer, event)
        except TimeoutError:
            if watch.bookmarks:
                await _line(connection, writer, self._bookmark())
        finally:
            closed.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await closed
        await _end(connection, writer)


async def _send(
    connection: h11.Connection, writer: asyncio.StreamWriter, code: int, body: Obj
) -> None:
    data = json.dumps(body).encode()
    headers = [("content-type", "application/json"), ("content-length", str(len(data)))]
    writer.write(connection.send(h11.Response(status_code=code, headers=headers)))
    writer.write(connection.send(h11.Data(data=data)))
    writer.write(connection.send(h11.EndOfMessage()))
    await writer.drain()


async def _start_stream(connection: h11.Connection, writer: asyncio.StreamWriter) -> None:
    headers = [("content-type", "application/json"), ("transfer-encoding", "chunked")]
    writer.write(connection.send(h11.Response(status_code=200, headers=headers)))
    await writer.drain()


async def _line(connection: h11.Connection, writer: asyncio.StreamWriter, event: Obj) -> None:
    writer.write(connection.send(h11.Data(data=json.dumps(event).encode() + b"\n")))
    await writer.drain()


async def _end(connection: h11.Connection, writer: asyncio.StreamWriter) -> None:
    writer.write(connection.send(h11.EndOfMessage()))
    await writer.drain()
