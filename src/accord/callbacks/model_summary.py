"""`ModelSummary`: the module's layers and parameters, printed when fit starts."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn
from typing_extensions import override

from accord.callbacks.callback import Callback
from accord.errors import ConfigurationError

if TYPE_CHECKING:
    from accord.module import Module
    from accord.trainer.trainer import Trainer

log = logging.getLogger(__name__)

__all__ = ["LayerSummary", "ModelSummary", "summarize"]

OTHER_PARAMS = "other params"
"""The name of the row of the parameters no listed layer holds (Lightning's)."""


@dataclass
class LayerSummary:
    """One row of a model summary.

    Attributes:
        name: the layer's name as ``named_modules`` gives it (``"encoder.0"``), or
            ``"other params"`` for the parameters no listed layer holds.
        type: the layer's class name (``"n/a"`` for ``"other params"``).
        trainable: parameters with ``requires_grad`` (each counted once per row).
        frozen: parameters without it.
        size_bytes: the bytes the parameters take.
        training: whether the layer is in train mode (None for ``"other params"``).
    """

    name: str
    type: str
    trainable: int
    frozen: int
    size_bytes: int
    training: bool | None = None

    @property
    def params(self) -> int:
        """All parameters of the row."""
        return self.trainable + self.frozen


def _numel(param: nn.Parameter) -> int:
    # A ZeRO-3 parameter is an empty placeholder; DeepSpeed records its full size.
    return int(getattr(param, "ds_numel", param.numel()))


def _row(name: str, kind: str, params: list[nn.Parameter], training: bool | None) -> LayerSummary:
    trainable = sum(_numel(p) for p in params if p.requires_grad)
    frozen = sum(_numel(p) for p in params if not p.requires_grad)
    size = sum(_numel(p) * p.element_size() for p in params)
    return LayerSummary(name, kind, trainable, frozen, size, training)


def _layers(module: nn.Module, max_depth: int) -> list[tuple[str, nn.Module]]:
    """The layers a summary of ``max_depth`` lists, with Lightning's names."""
    if max_depth == 0:
        return []
    if max_depth == 1:
        return list(module.named_children())
    layers = list(module.named_modules())[1:]
    if max_depth > 1:
        layers = [(name, layer) for name, layer in layers if name.count(".") < max_depth]
    return layers


def _check_depth(max_depth: int) -> None:
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < -1:
        raise ConfigurationError(
            f"max_depth={max_depth!r}: use -1 (every layer), 0 (no summary) or a depth >= 1."
        )


def summarize(module: nn.Module, max_depth: int = 1) -> list[LayerSummary]:
    """One `LayerSummary` per layer of ``module`` down to ``max_depth``, as Lightning
    lists them.

    ``max_depth=1`` lists the top-level children (``encoder``), 2 their children too
    (``encoder``, ``encoder.0``, ...), -1 every layer, 0 none. Each row counts all the
    parameters inside its layer, so a layer's row includes its children's. Parameters
    that no listed layer holds (the module's own) come last, as ``"other params"``.

    Raises:
        ConfigurationError: ``max_depth`` below -1 or not an int.
    """
    _check_depth(max_depth)
    rows = []
    covered: set[int] = set()
    for name, layer in _layers(module, max_depth):
        params = list(layer.parameters())
        covered.update(id(p) for p in params)
        rows.append(_row(name, type(layer).__name__, params, layer.training))
    if max_depth != 0:
        other = [p for p in module.parameters() if id(p) not in covered]
        if other:
            rows.append(_row(OTHER_PARAMS, "n/a", other, None))
    return rows


def _count(number: int) -> str:
    for limit, unit in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if number >= limit:
            return f"{number / limit:.1f} {unit}"
    return str(number)


def summary_columns(rows: list[LayerSummary]) -> list[tuple[str, list[str]]]:
    """The table's columns for ``rows``: each a header and its cells, as Lightning hands
    them to `ModelSummary.summarize`."""
    modes = ["n/a" if r.training is None else "train" if r.training else "eval" for r in rows]
    return [
        (" ", [str(i) if r.training is not None else " " for i, r in enumerate(rows)]),
        ("Name", [r.name for r in rows]),
        ("Type", [r.type for r in rows]),
        ("Params", [_count(r.params) for r in rows]),
        ("Trainable", [_count(r.trainable) for r in rows]),
        ("Frozen", [_count(r.frozen) for r in rows]),
        ("Mode", modes),
        ("Size (MB)", [f"{r.size_bytes / 1e6:.3f}" for r in rows]),
    ]


def render_summary(
    summary_data: list[tuple[str, list[str]]],
    total_parameters: int,
    trainable_parameters: int,
    model_size: float,
    total_training_modes: dict[str, int],
) -> str:
    """The text `ModelSummary` prints: the table of ``summary_data`` and the totals."""
    table = [[header, *cells] for header, cells in summary_data]
    widths = [max(len(cell) for cell in column) for column in table]
    lines = [
        " | ".join(column[i].ljust(w) for column, w in zip(table, widths, strict=True))
        for i in range(len(table[0]) if table else 0)
    ]
    rule = "-" * max((len(line) for line in lines), default=40)
    totals = [
        f"{_count(trainable_parameters):<10} Trainable params",
        f"{_count(total_parameters - trainable_parameters):<10} Non-trainable params",
        f"{_count(total_parameters):<10} Total params",
        f"{model_size:<10.3f} Total estimated model params size (MB)",
        f"{total_training_modes['train']:<10} Modules in train mode",
        f"{total_training_modes['eval']:<10} Modules in eval mode",
    ]
    table_lines = [lines[0], rule, *lines[1:], rule] if len(lines) > 1 else []
    return "\n".join([*table_lines, *totals])


class ModelSummary(Callback):
    """Print a table of the module's layers on global rank zero when fit starts.

    One row per layer down to ``max_depth``, named as Lightning names them: its class,
    parameter count, trainable and frozen counts, train or eval mode, and size in MB; then
    the totals (trainable, non-trainable, total, size, modules in train and eval mode).
    Unlike Lightning's, the table has no FLOPs and no input and output sizes: accord does
    not run ``example_input_array`` through the model for it. The text is also kept in
    `text`.

    Args:
        max_depth: how deep to list layers: 1 (the top-level children), ``n`` (down to
            ``n`` levels), -1 (every layer) or 0 (no summary at all).
        **summarize_kwargs: passed to `summarize` (the static method), for a subclass that
            overrides it to print its own table; the table `ModelSummary` prints itself
            takes none.

    Raises:
        ConfigurationError: ``max_depth`` below -1, or ``summarize_kwargs`` given to a
            class that does not override `summarize`.
    """

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        _check_depth(max_depth)
        if summarize_kwargs and type(self).summarize is ModelSummary.summarize:
            raise ConfigurationError(
                f"ModelSummary got summarize_kwargs {sorted(summarize_kwargs)}, which its "
                "table does not take (in Lightning they style RichModelSummary's table, "
                "which accord does not provide). Drop them, or subclass ModelSummary and "
                "override summarize() to use them."
            )
        self._max_depth = max_depth
        self._summarize_kwargs = summarize_kwargs
        self.text = ""

    @property
    def max_depth(self) -> int:
        """How deep the summary lists layers."""
        return self._max_depth

    @override
    def on_fit_start(self, trainer: Trainer, module: Module) -> None:
        if not self._max_depth:
            return
        rows = summarize(module, self._max_depth)
        params = list(module.parameters())
        total = sum(_numel(p) for p in params)
        trainable = sum(_numel(p) for p in params if p.requires_grad)
        size = sum(_numel(p) * p.element_size() for p in params) / 1e6
        modes = [layer.training for layer in list(module.modules())[1:]]
        training_modes = {"train": modes.count(True), "eval": modes.count(False)}
        data = summary_columns(rows)
        self.text = render_summary(data, total, trainable, size, training_modes)
        if trainer.is_global_zero:
            self.summarize(
                data, total, trainable, size, training_modes, 0, **self._summarize_kwargs
            )

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        """Print the summary (global rank zero only); override to show it your own way.

        Args:
            summary_data: the table's columns, each a header and its cells.
            total_parameters: all parameters of the module.
            trainable_parameters: those with ``requires_grad``.
            model_size: the parameters' size in MB.
            total_training_modes: the number of layers in ``"train"`` and ``"eval"`` mode.
            total_flops: always 0 (accord does not count FLOPs).
            **summarize_kwargs: what the callback was given.
        """
        table = render_summary(
            summary_data, total_parameters, trainable_parameters, model_size, total_training_modes
        )
        log.info("%s", table)
