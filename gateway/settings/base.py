"""What every settings module shares: the workers' roles and kinds, the policies' names, how
a settings model is built (frozen, strict) and the number a flag may turn off."""

from __future__ import annotations

import argparse
from typing import Literal

from pydantic import ConfigDict

PolicyName = Literal["prefix", "cache_aware", "power_of_two", "round_robin", "random", "least_load"]
Role = Literal["prefill", "decode"]
Kind = Literal["sglang", "vllm"]
"""The PD protocol a worker speaks: SGLang's bootstrap rooms (both legs at once) or vLLM's
`kv_transfer_params` (prefill first, then the decode with the prefill's answer)."""


def frozen() -> ConfigDict:
    """Settings are fixed once built, unknown ones are errors, and no number is infinite
    or NaN (an infinite grace or timeout is a typo that would never end, not a choice)."""
    return ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


def optional_float(text: str) -> float | None:
    """A flag's number, or None for "none"/"off": the feature it sets is disabled."""
    if text.lower() in {"none", "off"}:
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number nor 'off'") from None
