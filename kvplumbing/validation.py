"""A pydantic error in words a person can act on: one line naming every offending field.

Used for 4xx bodies, refused settings (`globalkv --check …` ends with this line) and
invalid answers read from peers, so the same mistake reads the same everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any

from pydantic import ValidationError


def describe_errors(errors: Iterable[Mapping[str, Any]], *, most: int | None = None) -> str:
    """`loc.path: message; …` for pydantic's error dicts, the first `most` of them.

    Our validators' own words are shown without pydantic's "Value error, " in front.
    """
    parts = []
    for number, err in enumerate(errors):
        if most is not None and number >= most:
            break
        where = ".".join(str(p) for p in err["loc"])
        message = str(err["msg"]).removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)


def validation_message(exc: ValidationError) -> str:
    """Every offending field of `exc`, on one line."""
    return describe_errors(exc.errors(include_url=False))


def validation_as_value_error() -> _AsValueError:
    """`with validation_as_value_error(): …` turns a pydantic `ValidationError` into a
    `ValueError` with `validation_message`'s line: what every command's `check_config`
    raises for settings that cannot be (the dispatcher prints it and exits with 2)."""
    return _AsValueError()


class _AsValueError:
    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if isinstance(exc, ValidationError):
            raise ValueError(validation_message(exc)) from None
