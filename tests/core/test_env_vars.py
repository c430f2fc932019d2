"""`env_number`: the one parser for numbers in environment variables."""

from __future__ import annotations

import math

import pytest

from accord.core.env_vars import env_number
from accord.errors import ConfigurationError

NAME = "ACCORD_TEST_NUMBER"


@pytest.mark.parametrize("raw", [None, "", "   "])
def test_unset_or_blank_is_the_default(monkeypatch: pytest.MonkeyPatch, raw: str | None) -> None:
    if raw is None:
        monkeypatch.delenv(NAME, raising=False)
    else:
        monkeypatch.setenv(NAME, raw)
    assert env_number(NAME, int, 7) == 7
    assert env_number(NAME, float, None) is None


def test_numbers_are_read_as_their_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NAME, " 12 ")
    assert env_number(NAME, int, 0) == 12
    assert env_number(NAME, float, 0.0) == 12.0
    monkeypatch.setenv(NAME, "inf")
    assert math.isinf(env_number(NAME, float, 0.0, positive=True))


@pytest.mark.parametrize(
    ("kind", "raw", "positive", "unit", "said"),
    [
        (int, "three", False, "", "is not an integer."),
        (int, "2.5", False, "", "is not an integer."),
        (float, "soon", False, "", "is not a number."),
        (int, "0", True, "", "is not a positive integer."),
        (float, "-1", True, "seconds", "is not a positive number of seconds."),
        (float, "nan", True, "seconds", "is not a positive number of seconds."),
    ],
)
def test_a_bad_value_names_the_variable(
    monkeypatch: pytest.MonkeyPatch,
    kind: type[int] | type[float],
    raw: str,
    positive: bool,
    unit: str,
    said: str,
) -> None:
    monkeypatch.setenv(NAME, raw)
    with pytest.raises(ConfigurationError) as info:
        env_number(NAME, kind, 1, positive=positive, unit=unit)
    assert str(info.value) == f"{NAME}={raw!r} {said}"


def test_the_hint_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NAME, "x")
    with pytest.raises(ConfigurationError, match=r"is not an integer; unset it\.$"):
        env_number(NAME, int, 1, hint="unset it")
