"""How a flag of a `globalkv` command is named in the environment, written once.

The dispatcher (`globalkv/cli.py`) reads `--foo-bar` of `globalkv <command>` from
`GLOBALKV_<COMMAND>_FOO_BAR`, and a refusal that tells an operator which setting to change
names the same variable, so the two cannot disagree.
"""

from __future__ import annotations


def env_var_name(command: str, option: str) -> str:
    """`GLOBALKV_<COMMAND>_<FLAG>` for `option` (`--redis-url`) of `globalkv <command>`."""
    return f"GLOBALKV_{command}_{option.lstrip('-')}".upper().replace("-", "_")
