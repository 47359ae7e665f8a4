"""A pydantic error as one line naming each field, our validators' words unprefixed."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError, field_validator

from kvplumbing.validation import describe_errors, validation_message


class _Inner(BaseModel):
    port: int


class _Outer(BaseModel):
    name: str
    inner: _Inner

    @field_validator("name")
    @classmethod
    def _no_spaces(cls, value: str) -> str:
        if " " in value:
            raise ValueError("name holds a space")
        return value


def _error(data: object) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        _Outer.model_validate(data)
    return info.value


def test_fields_by_path_and_our_words_unprefixed() -> None:
    exc = _error({"name": "a b", "inner": {"port": "x"}})
    assert validation_message(exc) == (
        "name: name holds a space; "
        "inner.port: Input should be a valid integer, unable to parse string as an integer"
    )


def test_an_error_of_the_whole_body_has_no_path() -> None:
    assert validation_message(_error([1])) == (
        "Input should be a valid dictionary or instance of _Outer"
    )


def test_most_keeps_the_first_errors() -> None:
    exc = _error({})
    assert describe_errors(exc.errors(), most=1) == "name: Field required"
    assert describe_errors(exc.errors()) == "name: Field required; inner: Field required"
