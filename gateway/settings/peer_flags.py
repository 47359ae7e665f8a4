"""sglang-router 0.3.2's flags that are no setting of the gateway: each refused with its
reason, or accepted with none to set, so that a launch line written for sglang-router
either starts with the same meaning or stops at once saying which flag and why.

Refusing is the rule: a flag that silently did nothing would leave a user believing they
had, say, TLS or a conversation store. A flag is accepted without effect only where the
gateway already behaves as the flag asks or the flag cannot matter to it
(`ACCEPTED`). `docs/sglang-router-flags.md` lists every flag of sglang-router 0.3.2, and a
test holds this module and that table to each other and to sglang-router's `--help`.
"""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger(__name__)

FLAGS_DOC = "docs/sglang-router-flags.md"

REFUSED: dict[str, str] = {
    "--mini-lb": "the Python debugging load balancer has no counterpart",
    "--enable-igw": "one gateway serves one model group; run a gateway per model",
    "--bucket-adjust-interval-secs": "the bucket policy is not implemented",
    "--max-idle-secs": "the manual policy is not implemented",
    "--assignment-mode": "the manual policy is not implemented",
    "--prometheus-duration-buckets": "the duration buckets are fixed",
    "--chat-template": "the chat template is the tokenizer's own (tokenizer_config.json)",
    "--tokenizer-cache-enable-l0": "no tokenizer cache: prompts are tokenized once, by the gateway",
    "--tokenizer-cache-l0-max-entries": "no tokenizer cache",
    "--tokenizer-cache-enable-l1": "no tokenizer cache",
    "--tokenizer-cache-l1-max-memory": "no tokenizer cache",
    "--reasoning-parser": "answers are passed through as the decode writes them",
    "--tool-call-parser": "answers are passed through as the decode writes them",
    "--mcp-config-path": "no MCP tool execution",
    "--backend": "the workers are SGLang or vLLM PD engines; no OpenAI backend proxy",
    "--history-backend": "no conversation or response store",
    "--oracle-wallet-path": "no conversation or response store",
    "--oracle-tns-alias": "no conversation or response store",
    "--oracle-connect-descriptor": "no conversation or response store",
    "--oracle-username": "no conversation or response store",
    "--oracle-password": "no conversation or response store",
    "--oracle-pool-min": "no conversation or response store",
    "--oracle-pool-max": "no conversation or response store",
    "--oracle-pool-timeout-secs": "no conversation or response store",
    "--postgres-db-url": "no conversation or response store",
    "--postgres-pool-max": "no conversation or response store",
    "--redis-pool-max": "--redis-url is the index's Redis here, not a history store",
    "--redis-retention-days": "--redis-url is the index's Redis here, not a history store",
    "--client-cert-path": "no mTLS to workers: run a service mesh for it",
    "--client-key-path": "no mTLS to workers: run a service mesh for it",
    "--ca-cert-paths": "no TLS to workers: run a service mesh for it",
    "--tls-cert-path": "no TLS on the gateway's port: terminate TLS in front of it",
    "--tls-key-path": "no TLS on the gateway's port: terminate TLS in front of it",
    "--control-plane-api-keys": "one admin token (--admin-token) guards the worker API",
    "--control-plane-audit-enabled": "one admin token (--admin-token) guards the worker API",
    "--jwt-issuer": "one admin token (--admin-token) guards the worker API",
    "--jwt-audience": "one admin token (--admin-token) guards the worker API",
    "--jwt-jwks-uri": "one admin token (--admin-token) guards the worker API",
    "--jwt-role-mapping": "one admin token (--admin-token) guards the worker API",
}
"""sglang-router's flags refused, each with why (in the message, and in `FLAGS_DOC`)."""

ACCEPTED: dict[str, str] = {
    "--worker-startup-timeout-secs": "a worker not yet healthy is checked every "
    "--worker-startup-check-interval until it is, never given up on, so there is no timeout",
}
"""sglang-router's flags accepted with nothing to set, each with why."""


def _dest(flag: str) -> str:
    return "peer" + flag.replace("-", "_")


def add_peer_flags(parser: argparse.ArgumentParser) -> None:
    """sglang-router's flags of `REFUSED` and `ACCEPTED`, hidden from `--help` (the doc
    lists them); each takes any values, so that the refusal, not argparse, says why."""
    for flag in (*REFUSED, *ACCEPTED):
        parser.add_argument(flag, dest=_dest(flag), nargs="*", help=argparse.SUPPRESS)


def check_peer_flags(args: argparse.Namespace) -> None:
    """ValueError naming the first refused flag given; a log line for each accepted one."""
    for flag, why in REFUSED.items():
        if getattr(args, _dest(flag)) is not None:
            raise ValueError(f"sglang-router's {flag} is not supported: {why} (see {FLAGS_DOC})")
    for flag, why in ACCEPTED.items():
        if getattr(args, _dest(flag)) is not None:
            log.info("%s is accepted and has no effect: %s", flag, why)
