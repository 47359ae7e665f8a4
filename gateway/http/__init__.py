"""The gateway's HTTP/1.1 server and client, knowing nothing of prefill or decode.

The server listens, parses requests and writes answers; the POSTs its handler claims go to
that handler, every other request to an ASGI app. The client is a keep-alive pool on
asyncio protocols, behind the two-method `upstream.Upstream` and httpx's interface.
"""
