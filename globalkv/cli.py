"""The `globalkv` command: one dispatcher, subcommands contributed by each package.

Subcommands are found through the `globalkv.commands` entry-point group. Each entry point
is a function `register(subparsers)` that adds one subparser and sets two defaults on it:
`run(args) -> int` (starts the component) and `check_config(args)` (builds and validates
the component's configuration without starting anything, raising `ValueError` on bad
input, and may return lines saying what the configuration gives, which `--check` prints).
This keeps the dispatcher free of imports of `gateway/` and `enginesim/`.

The dispatcher calls `check_config` before `run` too, so an invalid configuration ends
every command the same way, one line on stderr and exit status 2, before anything starts.
A command whose optional dependencies are missing (`globalkv.extras`) ends the same way,
naming the extra to install. A plugin that cannot even be imported (a broken install, a
third-party command) is listed as unavailable with the reason, and every other command
keeps working.

Every flag of a subcommand can also come from the environment, which is how containers
configure the same commands: `--foo-bar` of `globalkv gateway` reads
`GLOBALKV_GATEWAY_FOO_BAR`. The value is split like a shell line into the flag's
arguments; for a repeatable flag, occurrences are separated by commas; a boolean flag is
set by `1`, `true`, `yes` or `on`. A flag given on the command line wins over the
environment.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from globalkv.extras import MissingExtra
from kvplumbing.environment import env_var_name
from kvplumbing.release import VERSION

ENTRY_POINT_GROUP = "globalkv.commands"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def build_parser(
    env: Mapping[str, str] = os.environ,
) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        prog="globalkv",
        description="KV-cache-aware control plane for prefill/decode disaggregated LLM serving.",
    )
    parser.add_argument(
        "--log-level",
        default=env.get("GLOBALKV_LOG_LEVEL", "INFO"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level (env GLOBALKV_LOG_LEVEL)",
    )
    parser.add_argument("--version", action="version", version=f"globalkv {VERSION}")
    parser.add_argument(
        "--check",
        action="store_true",
        help="validate the subcommand's arguments and configuration, then exit without starting",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        _register(sub, ep)
    return parser, dict(sub.choices)


def _register(sub: Any, ep: EntryPoint) -> None:
    try:
        register = ep.load()
    except ImportError as exc:
        reason = f"globalkv {ep.name} is unavailable: {exc}"
        # No option prefix: whatever follows the command is taken, to be refused with the reason.
        parser = sub.add_parser(ep.name, help=f"(unavailable: {exc})", prefix_chars="\0")
        parser.add_argument("rest", nargs="*")

        def unavailable(args: argparse.Namespace) -> None:
            raise ValueError(reason)

        parser.set_defaults(run=unavailable, check_config=unavailable)
        return
    register(sub)


def env_argv(
    command: str, subparser: argparse.ArgumentParser, argv: Sequence[str], env: Mapping[str, str]
) -> list[str]:
    """Translate `GLOBALKV_<COMMAND>_<FLAG>` variables into argv tokens for flags not given."""
    given = {tok.split("=", 1)[0] for tok in argv if tok.startswith("--")}
    tokens: list[str] = []
    for action in subparser._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs or longs[0] in {"--help"}:
            continue
        flag = longs[0]
        if any(o in given for o in action.option_strings):
            continue
        value = env.get(env_var_name(command, flag))
        if value is None:
            continue
        if action.nargs == 0:
            lowered = value.strip().lower()
            if lowered in _TRUE:
                tokens.append(flag)
            elif lowered not in _FALSE:
                raise ValueError(f"{env_var_name(command, flag)}={value!r} is not a boolean")
            continue
        occurrences = value.split(",") if isinstance(action, argparse._AppendAction) else [value]
        for occurrence in occurrences:
            if occurrence.strip():
                tokens.append(flag)
                tokens.extend(shlex.split(occurrence))
    return tokens


def parse(argv: Sequence[str], env: Mapping[str, str]) -> argparse.Namespace:
    parser, commands = build_parser(env)
    args = list(argv)
    command_pos = next((i for i, tok in enumerate(args) if tok in commands), None)
    if command_pos is not None:
        command = args[command_pos]
        try:
            extra = env_argv(command, commands[command], args[command_pos + 1 :], env)
        except ValueError as exc:
            parser.error(str(exc))
        args = [*args[: command_pos + 1], *extra, *args[command_pos + 1 :]]
    return parser.parse_args(args)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv, os.environ)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # httpx logs every request at INFO: health checks and keep-alives would drown the
    # lines that matter. Our components log their own failures.
    if args.log_level != "DEBUG":
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        described = args.check_config(args) or ()
    except MissingExtra as exc:
        print(exc, file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"globalkv {args.command}: invalid configuration: {exc}", file=sys.stderr)
        return 2
    if args.check:
        print(f"globalkv {args.command}: configuration ok")
        for line in described:
            print(f"  {line}")
        return 0
    result: int = args.run(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
