"""How a check says a contract line is broken: `BrokenContractError` and the comparisons raising it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

import torch

from accord.core.collective import Collective

__all__ = [
    "BrokenContractError",
    "Unsupported",
    "expect",
    "optional_op",
    "raises_value_error",
    "same",
    "same_each",
]

T = TypeVar("T")


class BrokenContractError(AssertionError):
    """A check found its contract line broken; the message says how."""


def expect(condition: bool, message: str) -> None:
    """Raise `BrokenContractError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise BrokenContractError(message)


def same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """``actual`` has ``expected``'s dtype, shape and values (floating point: to 1e-5).

    Raises:
        BrokenContractError: naming ``what`` and the first property that differs.
    """
    expect(
        actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    )
    expect(
        tuple(actual.shape) == tuple(expected.shape),
        f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}",
    )
    ok = (
        torch.allclose(actual.cpu(), expected.cpu(), rtol=1e-5, atol=1e-6)
        if expected.is_floating_point()
        else torch.equal(actual.cpu(), expected.cpu())
    )
    expect(ok, f"{what}: got {actual.tolist()}, expected {expected.tolist()}")


def same_each(results: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """`same` for each ``what: (actual, expected)`` pair, in order."""
    for what, (actual, expected) in results.items():
        same(actual, expected, what)


class Unsupported:
    """What `optional_op` returns when the backend does not have the op."""


def optional_op(c: Collective, op: str, call: Callable[[], T]) -> T | Unsupported:
    """``call()``'s result, or `Unsupported` when it raised NotImplementedError naming the backend.

    Raises:
        BrokenContractError: the NotImplementedError does not name ``c.backend_name``.
    """
    try:
        return call()
    except NotImplementedError as err:
        expect(
            c.backend_name in str(err),
            f"{op}: NotImplementedError does not name the backend {c.backend_name!r}: {err}",
        )
        return Unsupported()


def raises_value_error(call: Callable[[], object], what: str) -> ValueError:
    """Call ``call``, which must raise ValueError; returns the error.

    Raises:
        BrokenContractError: ``call`` returned instead (``what`` describes the call).
    """
    try:
        call()
    except ValueError as err:
        return err
    raise BrokenContractError(f"{what} did not raise ValueError")
