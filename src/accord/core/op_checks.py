"""The checks every `accord.core.collective.Collective` op makes of its arguments, and the
errors they raise: each says what was wrong and what to do instead.

A backend's collective and a wrapper (`accord.core.wrappers.debug.DebugCollective`) reach
them through the collective's ``_check_ready``, ``_check_rank`` and ``_check_divisible``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_divisible", "check_rank", "check_tensor", "unsupported"]


def check_tensor(op: str, tensor: Any) -> None:
    """Refuse anything but a tensor as the input of ``op``.

    Raises:
        TypeError: ``tensor`` is not a `torch.Tensor`; for ``broadcast`` and
            ``all_gather`` the message names their object form too.
    """
    if not isinstance(tensor, torch.Tensor):
        has_object_form = op in ("broadcast", "all_gather")
        objects = f", or use {op}_object for Python objects" if has_object_form else ""
        raise TypeError(
            f"{op} expects a torch.Tensor, got {type(tensor).__name__}. Wrap the value "
            f"with torch.tensor(...){objects}."
        )


def check_divisible(op: str, tensor: torch.Tensor, world_size: int) -> None:
    """Refuse a ``tensor`` whose first dimension ``op`` cannot split into ``world_size``
    equal parts.

    Raises:
        ValueError: a scalar, or a first dimension not divisible by ``world_size``.
    """
    if tensor.dim() == 0 or tensor.shape[0] % world_size:
        raise ValueError(
            f"{op} needs a first dimension divisible by world_size={world_size}, got "
            f"shape {tuple(tensor.shape)}. Pad the tensor first."
        )


def check_rank(role: str, rank: int, world_size: int) -> None:
    """Refuse a ``rank`` (the op's ``role``: ``src``, ``dst``) outside a group of
    ``world_size``.

    Raises:
        ValueError: ``rank`` is not an int in ``[0, world_size)``.
    """
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
        raise ValueError(
            f"{role}={rank!r} is not a rank of this group; use an int in [0, {world_size - 1}]."
        )


def unsupported(op: str, backend_name: str, collective: str) -> NotImplementedError:
    """The error for ``op`` on a backend that does not provide it (``collective``: the
    collective's class name)."""
    return NotImplementedError(
        f"{op} is not available on the {backend_name} backend "
        f"({collective}). Use another op or a backend that provides it."
    )
