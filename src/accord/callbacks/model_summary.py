"""`ModelSummary`: the module's parameters per top-level child, printed when fit starts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn
from typing_extensions import override

from accord.callbacks.callback import Callback

if TYPE_CHECKING:
    from accord.module import Module
    from accord.trainer.trainer import Trainer

__all__ = ["LayerSummary", "ModelSummary", "summarize"]


@dataclass
class LayerSummary:
    """One row of a model summary.

    Attributes:
        name: the child's attribute name (``"<module>"`` for parameters the module
            owns directly).
        type: the child's class name.
        trainable: parameters with ``requires_grad``.
        frozen: parameters without it.
        size_bytes: the bytes the parameters take.
    """

    name: str
    type: str
    trainable: int
    frozen: int
    size_bytes: int

    @property
    def params(self) -> int:
        """All parameters of the row."""
        return self.trainable + self.frozen


def _numel(param: nn.Parameter) -> int:
    # A ZeRO-3 parameter is an empty placeholder; DeepSpeed records its full size.
    return int(getattr(param, "ds_numel", param.numel()))


def _row(name: str, kind: str, params: list[nn.Parameter]) -> LayerSummary:
    trainable = sum(_numel(p) for p in params if p.requires_grad)
    frozen = sum(_numel(p) for p in params if not p.requires_grad)
    size = sum(_numel(p) * p.element_size() for p in params)
    return LayerSummary(name, kind, trainable, frozen, size)


def summarize(module: nn.Module) -> list[LayerSummary]:
    """One `LayerSummary` per top-level child of ``module``, in definition order.

    Parameters shared between children are counted once, under the first child that
    holds them.
    """
    seen: set[int] = set()
    rows = []
    own = [p for p in module.parameters(recurse=False)]
    seen.update(id(p) for p in own)
    if own:
        rows.append(_row("<module>", type(module).__name__, own))
    for name, child in module.named_children():
        params = [p for p in child.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        rows.append(_row(name, type(child).__name__, params))
    return rows


def _count(number: int) -> str:
    for limit, unit in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if number >= limit:
            return f"{number / limit:.1f} {unit}"
    return str(number)


def format_summary(rows: list[LayerSummary]) -> str:
    """The table `ModelSummary` prints for ``rows``, with the totals under it."""
    header = ("", "Name", "Type", "Params", "Trainable", "Frozen", "Size (MB)")
    lines = [
        (
            str(i),
            r.name,
            r.type,
            _count(r.params),
            _count(r.trainable),
            _count(r.frozen),
            f"{r.size_bytes / 1e6:.3f}",
        )
        for i, r in enumerate(rows)
    ]
    widths = [max(len(row[c]) for row in [header, *lines]) for c in range(len(header))]
    render = [
        " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
        for row in [header, *lines]
    ]
    rule = "-" * max(len(line) for line in render)
    trainable = sum(r.trainable for r in rows)
    frozen = sum(r.frozen for r in rows)
    size = sum(r.size_bytes for r in rows)
    totals = [
        f"{_count(trainable):<10} Trainable params",
        f"{_count(frozen):<10} Non-trainable params",
        f"{_count(trainable + frozen):<10} Total params",
        f"{size / 1e6:<10.3f} Total estimated model params size (MB)",
    ]
    return "\n".join([render[0], rule, *render[1:], rule, *totals])


class ModelSummary(Callback):
    """Print a table of the module's parameters on global rank zero when fit starts.

    One row per top-level child: its name, class, parameter count, trainable and frozen
    counts, and size in MB; then the totals, as Lightning's summary shows them.
    """

    def __init__(self) -> None:
        self.text = ""

    @override
    def on_fit_start(self, trainer: Trainer, module: Module) -> None:
        self.text = format_summary(summarize(module))
        if trainer.is_global_zero:
            print(self.text)
