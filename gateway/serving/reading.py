"""Reading an inference request once, the same way at every entry point.

The gateway's handler (and with it a decode's sidecar) and the endpoint picker turn a
request's path, body and headers into what it is served by, here and only here:

- the parsed body (`gateway.requests.bodies`: validated just enough to route; a body that
  cannot be routed is the client's 400, before anything is sent);
- its KV-cache namespace (`Router.namespace`: model, LoRA adapter, salt, over what the
  workers serve now; an adapter none serves is a 404);
- the prompt's tokens, as the engine will compute them;
- the session it names and, for a sidecar, the prefill its picker named
  (`gateway.requests.headers`);
- with flow control, its flow (tenant and objective, `gateway.flow.keys`) and its price;

the choosing part of it gathered in one `RouteQuery`, and all of it, with the path and
what of the client's headers the workers are sent, in one `Request`
(`gateway.requests.request`), made here once. The index is asked after (`Router.look_up`, by
`gateway.serving.intake`).

A prompt to tokenize in a body over `TOKENIZE_INLINE_MAX` bytes is tokenized in a worker
thread: a long text held the event loop, and every other request with it, for as long as
its tokenizer ran (Hugging Face's releases the GIL). Shorter ones are tokenized inline,
where a thread would cost more than the work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from gateway.flow.keys import FlowKeys
from gateway.flow.queues import FlowRequest
from gateway.requests.bodies import (
    Endpoint,
    ParsedRequest,
    PromptTokens,
    decode_body,
    parse_request,
    prompt_tokens,
)
from gateway.requests.headers import (
    PREFILL_HEADERS,
    SESSION_HEADERS,
    Picked,
    named_prefill,
    session,
)
from gateway.requests.namespace import RequestNamespace
from gateway.requests.query import RouteQuery
from gateway.requests.request import Request
from gateway.routing.router import Router
from globalkv.tokenize import Tokenizer

TOKENIZE_INLINE_MAX = 64 * 1024
INFERENCE_PATHS: dict[str, Endpoint] = {
    "/generate": "generate",
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
}


class RequestReader:
    """Reads inference requests for one entry point.

    `flow`: flow control's header reader, when it is on; `named_prefill`: the entry point
    binds a request to the prefill its picker named (a decode's sidecar)."""

    def __init__(
        self,
        router: Router,
        tokenizer: Tokenizer | None,
        flow: FlowKeys | None = None,
        *,
        named_prefill: bool = False,
    ) -> None:
        self._router = router
        self._tokenizer = tokenizer
        self._flow = flow
        self._named_prefill = named_prefill
        flow_headers = () if flow is None else flow.header_names
        self.header_names = frozenset(
            {*SESSION_HEADERS, *(PREFILL_HEADERS if named_prefill else ()), *flow_headers}
        )
        """The request headers `read` looks at (names in lowercase)."""

    async def read(
        self,
        path: str,
        body: bytes,
        picked: Picked,
        authorization: str | None = None,
        request_id: str | None = None,
        trace_context: Sequence[tuple[bytes, bytes]] = (),
    ) -> tuple[Request, FlowRequest | None]:
        """The request of `body` to `path` (one of `INFERENCE_PATHS`), `picked` holding its
        `header_names` it sent, and with flow control its flow and price (None without).
        `request_id` and `trace_context`: what of its headers the workers are sent.

        Raises `gateway.requests.bodies.BadRequest` (a body or header that cannot be
        read), `gateway.requests.namespace.UnknownAdapter` and
        `globalkv.tokenize.TokenizeError` (messages the chat template refuses)."""
        inline = self.read_now(path, body, picked, authorization, request_id, trace_context)
        if inline is not None:
            return inline
        named, parsed, namespace = self._parse(path, body, picked)
        if parsed.token_ids is None:
            tokens = await asyncio.to_thread(prompt_tokens, parsed, self._tokenizer)
        else:
            tokens = prompt_tokens(parsed, self._tokenizer)
        return self._made(
            path,
            body,
            picked,
            authorization,
            request_id,
            trace_context,
            named,
            parsed,
            namespace,
            tokens,
        )

    def read_now(
        self,
        path: str,
        body: bytes,
        picked: Picked,
        authorization: str | None = None,
        request_id: str | None = None,
        trace_context: Sequence[tuple[bytes, bytes]] = (),
    ) -> tuple[Request, FlowRequest | None] | None:
        """`read` without awaiting anything, for a body of up to `TOKENIZE_INLINE_MAX`
        bytes (None for a longer one); raises as `read` does."""
        if len(body) > TOKENIZE_INLINE_MAX:
            return None
        named, parsed, namespace = self._parse(path, body, picked)
        tokens = prompt_tokens(parsed, self._tokenizer)
        return self._made(
            path,
            body,
            picked,
            authorization,
            request_id,
            trace_context,
            named,
            parsed,
            namespace,
            tokens,
        )

    def _parse(
        self, path: str, body: bytes, picked: Picked
    ) -> tuple[str | None, ParsedRequest, RequestNamespace]:
        """The prefill the request names (a sidecar's), its body parsed, its namespace."""
        named = named_prefill(picked) if self._named_prefill and picked else None
        parsed = parse_request(INFERENCE_PATHS[path], decode_body(body))
        return named, parsed, self._router.namespace(parsed.body)

    def _made(
        self,
        path: str,
        body: bytes,
        picked: Picked,
        authorization: str | None,
        request_id: str | None,
        trace_context: Sequence[tuple[bytes, bytes]],
        named: str | None,
        parsed: ParsedRequest,
        namespace: RequestNamespace,
        tokens: PromptTokens,
    ) -> tuple[Request, FlowRequest | None]:
        query = RouteQuery(
            tokens.tokens,
            tokens.text,
            prefill=named,
            session=session(picked) if picked else None,
            missing=tokens.missing,
            namespace=namespace,
            kind="sglang" if parsed.endpoint == "generate" else namespace.kind,
            batch=parsed.batch,
        )
        flow = None
        if self._flow is not None:
            key = self._flow.read(picked, namespace.lora_name, authorization)
            flow = FlowRequest(key, _price(tokens, len(body)), len(body), query)
        return Request(path, parsed, query, request_id, trace_context), flow


def _price(tokens: PromptTokens, size: int) -> int:
    """What the request costs flow control: its prompt tokens, or without a tokenizer
    about four bytes a token."""
    if tokens.tokens is not None:
        return len(tokens.tokens)
    return max(1, len(tokens.text or "") // 4 or size // 4)
