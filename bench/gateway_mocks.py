"""Prefill and decode workers that answer at once, for measuring a router's own overhead.

Raw asyncio protocols on uvloop, every answer prebuilt bytes: the cost a worker adds to
a measurement should be as close to nothing as a Python process allows, and identical
for every router measured against it. One process serves every port given:

    python -m bench.gateway_mocks [vllm-prefill:|vllm-decode:]PORT ...

What each port answers (prefill and decode alike, so a router may use either role):
- `POST` any path: an SGLang `/generate`-style JSON answer, or with `"stream": true` in
  the body, an SSE stream of `STREAM_EVENTS` events and `[DONE]`, chunked;
- `GET /health`: 200; `GET /server_info`, `/get_server_info`, `/get_model_info`: a small
  JSON object; `GET /route?…` (the bootstrap topology snapshot): a ready SGLang 0.5.23
  snapshot, so a router that reads the directory sees it complete; anything else 404.
A port given as `vllm-prefill:PORT` or `vllm-decode:PORT` is a vLLM worker instead: every
`POST` to a prefill answers an OpenAI completion with `kv_transfer_params` (what vLLM's
NIXL connector returns), a decode answers an OpenAI completion or, streamed, an SSE stream
of `STREAM_EVENTS` chunks; `GET /v1/models` says `owned_by: vllm`, `GET /version` answers.
Keep-alive HTTP/1.1; request bodies are framed by Content-Length.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from typing import cast

STREAM_EVENTS = 8

_ANSWER = json.dumps(
    {
        "text": " the mock answer",
        "output_ids": [1, 2, 3, 4],
        "meta_info": {
            "prompt_tokens": 64,
            "completion_tokens": 4,
            "cached_tokens": 0,
            "finish_reason": {"type": "length", "length": 4},
        },
    }
).encode()
_TOPOLOGY = json.dumps(
    {
        "attn_tp_size": 1,
        "attn_cp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "page_size": 16,
        "kv_cache_dtype": "auto",
        "follow_bootstrap_room": True,
        "enable_dsa_cache_layer_split": False,
        "decode_allocation_policy": "early",
        "enable_kv_cache_sharding": False,
        "prefill_http_port": None,
        "target_tp_rank": None,
        "target_tp_ranks": None,
        "target_cp_ranks": None,
        "target_pp_ranks": None,
        "required_dst_info_num": None,
        "required_prefill_response_num": None,
    }
).encode()


def _whole(status: bytes, body: bytes, media: bytes = b"application/json") -> bytes:
    head = b"HTTP/1.1 " + status + b"\r\ncontent-type: " + media + b"\r\ncontent-length: "
    return head + str(len(body)).encode() + b"\r\n\r\n" + body


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _stream() -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    head += b"transfer-encoding: chunked\r\n\r\n"
    events = [
        b"data: " + json.dumps({"text": "x" * (i + 1), "index": 0}).encode() + b"\n\n"
        for i in range(STREAM_EVENTS)
    ]
    return head + b"".join(_chunk(e) for e in [*events, b"data: [DONE]\n\n"]) + b"0\r\n\r\n"


def _completion(**extra: object) -> bytes:
    body = {
        "id": "cmpl-mock",
        "object": "text_completion",
        "created": 0,
        "model": "mock",
        "choices": [{"index": 0, "text": " the mock answer", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 64, "completion_tokens": 4, "total_tokens": 68},
        **extra,
    }
    return json.dumps(body).encode()


_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "mock-engine",
    "remote_request_id": "mock-request",
    "remote_block_ids": [0, 1, 2, 3],
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
}


def _completion_stream() -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    head += b"transfer-encoding: chunked\r\n\r\n"
    chunk = {"id": "cmpl-mock", "object": "text_completion", "model": "mock"}
    events = [
        b"data: "
        + json.dumps(
            {**chunk, "choices": [{"index": 0, "text": "x", "finish_reason": None}]}
        ).encode()
        + b"\n\n"
        for _ in range(STREAM_EVENTS)
    ]
    return head + b"".join(_chunk(e) for e in [*events, b"data: [DONE]\n\n"]) + b"0\r\n\r\n"


ANSWER = _whole(b"200 OK", _ANSWER)
VLLM_PREFILL = _whole(b"200 OK", _completion(kv_transfer_params=_PARAMS))
VLLM_DECODE = _whole(b"200 OK", _completion(kv_transfer_params=None))
VLLM_STREAM = _completion_stream()
VLLM_MODELS = _whole(
    b"200 OK",
    json.dumps({"object": "list", "data": [{"id": "mock", "owned_by": "vllm"}]}).encode(),
)
VLLM_VERSION = _whole(b"200 OK", b'{"version": "mock"}')
STREAM = _stream()
HEALTH = _whole(b"200 OK", b"OK", b"text/plain")
INFO = _whole(b"200 OK", b'{"model_path": "mock", "is_generation": true}')
TOPOLOGY = _whole(b"200 OK", _TOPOLOGY)
NOT_FOUND = _whole(b"404 Not Found", b'{"detail": "Not Found"}')


def vllm_answer_for(role: str, method: bytes, target: bytes, body: bytes) -> bytes:
    if method == b"POST":
        if role == "vllm-prefill":
            return VLLM_PREFILL
        streamed = b'"stream": true' in body or b'"stream":true' in body
        return VLLM_STREAM if streamed else VLLM_DECODE
    path = target.split(b"?", 1)[0]
    if path == b"/health":
        return HEALTH
    if path == b"/v1/models":
        return VLLM_MODELS
    if path == b"/version":
        return VLLM_VERSION
    return NOT_FOUND


def answer_for(method: bytes, target: bytes, body: bytes) -> bytes:
    if method == b"POST":
        streamed = b'"stream": true' in body or b'"stream":true' in body
        return STREAM if streamed else ANSWER
    path = target.split(b"?", 1)[0]
    if path == b"/health":
        return HEALTH
    if path in (b"/server_info", b"/get_server_info", b"/get_model_info", b"/model_info"):
        return INFO
    if path == b"/route":
        return TOPOLOGY
    return NOT_FOUND


class MockWorker(asyncio.Protocol):
    """One connection: requests parsed from the buffer as they complete, answered in order."""

    def __init__(self, role: str = "") -> None:
        self._buffer = b""
        self._transport: asyncio.Transport | None = None
        self._role = role

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while True:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self._buffer[:end]
            length = 0
            lowered = head.lower()
            at = lowered.find(b"\r\ncontent-length:")
            if at >= 0:
                stop = lowered.find(b"\r\n", at + 2)
                length = int(lowered[at + 17 : stop if stop >= 0 else None])
            if b"\r\ntransfer-encoding: chunked" in lowered:
                # Envoy streams a body its ext_proc filter passed on, so it is chunked.
                found = _dechunk(self._buffer, end + 4)
                if found is None:
                    return
                body, used = found
            else:
                if len(self._buffer) < end + 4 + length:
                    return
                body, used = self._buffer[end + 4 : end + 4 + length], end + 4 + length
            self._buffer = self._buffer[used:]
            method, target, _ = head.split(b"\r\n", 1)[0].split(b" ", 2)
            assert self._transport is not None
            if self._role:
                self._transport.write(vllm_answer_for(self._role, method, target, body))
            else:
                self._transport.write(answer_for(method, target, body))


def _dechunk(buffer: bytes, at: int) -> tuple[bytes, int] | None:
    """A chunked body starting at `at`, and where it ends; None until all of it arrived."""
    pieces = []
    while True:
        line = buffer.find(b"\r\n", at)
        if line < 0:
            return None
        size = int(buffer[at:line].split(b";")[0], 16)
        if len(buffer) < line + 2 + size + 2:
            return None
        pieces.append(buffer[line + 2 : line + 2 + size])
        at = line + 2 + size + 2
        if size == 0:
            return b"".join(pieces), at


def _factory(role: str) -> Callable[[], MockWorker]:
    return lambda: MockWorker(role)


async def serve(ports: list[str], host: str = "127.0.0.1") -> None:
    loop = asyncio.get_running_loop()
    servers = []
    for given in ports:
        role, _, port = given.rpartition(":")
        if role not in ("", "vllm-prefill", "vllm-decode"):
            raise SystemExit(f"unknown worker kind {role!r} in {given!r}")
        servers.append(await loop.create_server(_factory(role), host, int(port), backlog=1024))
    print("ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def main() -> None:
    import uvloop

    uvloop.run(serve(sys.argv[1:]))


if __name__ == "__main__":
    main()
