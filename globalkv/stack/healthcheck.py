"""`python -m globalkv.stack.healthcheck URL…`: exit 0 when every URL answers 200.

The container health checks of docker-compose.yml run this, because the slim image has
no curl. It uses only the standard library, so a check costs an interpreter start and
nothing more, and prints why a URL failed so `docker inspect` shows the reason.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request
from collections.abc import Sequence

TIMEOUT_SECONDS = 2.0


def problem(url: str, timeout: float = TIMEOUT_SECONDS) -> str | None:
    """None when `GET url` answers 200, else what went wrong."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            status = int(response.status)
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if status == 200 else f"HTTP {status}"


def main(urls: Sequence[str]) -> int:
    if not urls:
        print("usage: python -m globalkv.stack.healthcheck URL [URL…]", file=sys.stderr)
        return 2
    failed = False
    for url in urls:
        reason = problem(url)
        if reason is not None:
            print(f"{url}: {reason}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
