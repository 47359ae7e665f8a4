"""Who may call what: bearer-token checks, and protected mode for the routes that change
state or read tenants' data.

Bearer checks: any header a client can send is a yes or a no, never an error. The scheme
is matched case-insensitively and the token stripped (RFC 9110 makes the scheme
case-insensitive; clients and proxies differ in both), and the token is compared in
constant time, so the answer's timing tells nothing about the secret.

Protected mode is Redis's, for every route that changes a component's state (the
indexer's pods, the gateway's workers, a directory's reset): with an admin token, every
such request must carry it; without one, only clients on this machine (loopback) may send
them, unless the operator said `--insecure`. The same rule guards reads that reveal what
tenants sent (the index's lookups: whether a prompt is cached is whether someone sent
it), which an operator may open on their own (`check(..., reads=True)`). The peer is the
TCP peer: a reverse proxy on the same machine makes every client look local, so put a
token on anything behind one.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass, field

from starlette.requests import Request

from kvplumbing.environment import env_var_name

PUBLISHED_DEFAULT_TOKEN = "globalkv-compose-default-token"
"""docker-compose.yml's admin token when `GLOBALKV_ADMIN_TOKEN` is not set. It is written in
the repository, so it protects nothing: every component warns when it is configured."""


def bearer_matches(authorization: str | None, secret: str | None) -> bool:
    """True when no secret is configured or `authorization` is `Bearer <secret>`."""
    if secret is None:
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        _octets(token.strip()), secret.encode("utf-8")
    )


def _octets(header_value: str) -> bytes:
    """The header's bytes: servers decode them as latin-1, so a UTF-8 secret still matches.

    Compared as bytes because `compare_digest` refuses str with non-ASCII characters
    (a TypeError, which would be a 500 for any such header).
    """
    try:
        return header_value.encode("latin-1")
    except UnicodeEncodeError:
        return header_value.encode("utf-8")


def bearer_ok(request: Request, secret: str | None) -> bool:
    """`bearer_matches` for the request's `Authorization` header."""
    return bearer_matches(request.headers.get("authorization"), secret)


def is_loopback(host: str | None) -> bool:
    """True for 127.0.0.0/8, ::1 and IPv4-mapped loopback addresses.

    Anything else is not: host names (a peer address is never one), a scoped or malformed
    address, and an unknown peer (None), so a peer that cannot be told apart is refused.
    """
    if host is None:
        return False
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request protected mode refuses: the status to answer and the words saying why."""

    status: int
    message: str


@dataclass(frozen=True, slots=True)
class ProtectionFlags:
    """Where an operator gives a component its admin token and `--insecure`: a `globalkv`
    command and its two flags, so that a refusal names the flag and the variable that would
    have let the request through."""

    command: str
    token: str = "--admin-token"
    insecure: str = "--insecure"

    def named(self, flag: str) -> str:
        """`--flag` (`GLOBALKV_<COMMAND>_<FLAG>`), as refusals and warnings name it."""
        return f"`{flag}` ({env_var_name(self.command, flag)})"


@dataclass(frozen=True, slots=True)
class ProtectedMode:
    """One component's rule for its state-changing routes (module docstring)."""

    component: str
    """How refusals name the component: "the indexer"."""
    token: str | None = field(repr=False)
    insecure: bool
    flags: ProtectionFlags

    def check(
        self,
        method: str,
        path: str,
        authorization: str | None,
        client: str | None,
        *,
        reads: str | None = None,
    ) -> Refusal | None:
        """None when `method path` from peer address `client` may change state; with
        `reads`, the flag that opens it, when it may read what that route reveals."""
        what = f"{method} {path}"
        if self.token is not None:
            if bearer_matches(authorization, self.token):
                return None
            return Refusal(
                401,
                f"{what} needs `Authorization: Bearer <token>` with the admin token "
                f"{self.component} was given ({self.flags.named(self.flags.token)})",
            )
        if self.insecure or is_loopback(client):
            return None
        if reads is not None:
            return Refusal(
                403,
                f"{what} tells which prompts the cache holds, that is, what tenants sent, and "
                f"{self.component} answers it only on this machine while it has no admin token "
                f"(protected mode); {client or 'this client'} is another host. Give "
                f"{self.component} a token with {self.flags.named(self.flags.token)} and send "
                f"it as `Authorization: Bearer <token>`, or start it with "
                f"{self.flags.named(reads)} to answer it to any host.",
            )
        return Refusal(
            403,
            f"{what} changes state, and {self.component} accepts changes only from this "
            f"machine while it has no admin token (protected mode); {client or 'this client'} "
            f"is another host. Give {self.component} a token with "
            f"{self.flags.named(self.flags.token)} and send it as `Authorization: Bearer <token>`, "
            f"or start it with {self.flags.named(self.flags.insecure)} to accept changes from any "
            "host.",
        )

    def check_request(self, request: Request, *, reads: str | None = None) -> Refusal | None:
        """`check` for a Starlette request, its peer taken from the ASGI scope."""
        client = request.client.host if request.client is not None else None
        return self.check(
            request.method,
            request.url.path,
            request.headers.get("authorization"),
            client,
            reads=reads,
        )

    def warnings(self) -> list[str]:
        """What an operator must hear when the component starts: doors left open."""
        found = []
        if self.token == PUBLISHED_DEFAULT_TOKEN:
            found.append(
                f"{self.component}'s admin token is docker-compose.yml's default, which is "
                "published with the code: anyone can change its state. Set "
                "GLOBALKV_ADMIN_TOKEN (in the environment or .env) for docker compose, "
                f"or {self.flags.named(self.flags.token)}."
            )
        if self.insecure and self.token is None:
            found.append(
                f"{self.component} accepts changes from any host without a token "
                f"({self.flags.named(self.flags.insecure)}): anyone who reaches its port can "
                "change its state"
            )
        elif self.insecure:
            found.append(
                f"{self.flags.named(self.flags.insecure)} has no effect: {self.component} has an "
                "admin token, and every change must carry it"
            )
        return found
