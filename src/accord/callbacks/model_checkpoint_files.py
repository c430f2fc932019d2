"""`ModelCheckpoint`'s own rules: where it writes by default, how it names a checkpoint, its
arguments checked, its scores as YAML.

What is not `ModelCheckpoint`'s alone (finished checkpoints found, links switched in
atomically, the leftovers of killed saves) is `accord.checkpoint`'s
(`accord.checkpoint.formats`, `accord.checkpoint.writing`).
"""

from __future__ import annotations

import math
import string
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from accord.errors import ConfigurationError
from accord.loggers.logger import version_directory

if TYPE_CHECKING:
    from accord.trainer.trainer import Trainer

__all__ = [
    "check_arguments",
    "default_checkpoint_dir",
    "experiment_checkpoint_dirs",
    "format_name",
    "remove_empty_parents",
    "taken",
    "write_scores_yaml",
]

CHECKPOINTS_DIR = "checkpoints"


def default_checkpoint_dir(trainer: Trainer) -> Path:
    """Lightning's default checkpoint directory for ``trainer``'s run.

    With a logger: ``<save_dir>/<name>/<version>/checkpoints`` of the first logger (its
    ``log_dir``, without a `TensorBoardLogger`'s ``sub_dir``; ``default_root_dir`` when the
    logger has no ``save_dir``), the version as ``version_<n>`` or the string given.
    Without one: ``<default_root_dir>/checkpoints``.
    """
    if not trainer.loggers:
        return Path(trainer.default_root_dir) / CHECKPOINTS_DIR
    logger = trainer.loggers[0]
    return _experiment_root(trainer) / version_directory(logger.version) / CHECKPOINTS_DIR


def experiment_checkpoint_dirs(trainer: Trainer) -> list[Path]:
    """The default checkpoint directories a run of ``trainer`` resumes from.

    The current one (`default_checkpoint_dir`) and, when the first logger numbers its
    versions itself, those of the experiment's other ``version_<n>`` directories too: a
    restarted job gets a new version, and its checkpoints are in an earlier one.
    """
    current = default_checkpoint_dir(trainer)
    if not trainer.loggers or not trainer.loggers[0].auto_version:
        return [current]
    root = _experiment_root(trainer)
    earlier = [
        entry / CHECKPOINTS_DIR
        for entry in (root.iterdir() if root.is_dir() else ())
        if entry.name.startswith("version_") and entry.name[8:].isdigit()
    ]
    return list(dict.fromkeys([current, *sorted(earlier)]))


def _experiment_root(trainer: Trainer) -> Path:
    logger = trainer.loggers[0]
    save_dir = logger.save_dir if logger.save_dir is not None else trainer.default_root_dir
    return Path(save_dir) / logger.name


def remove_empty_parents(path: Path, root: Path) -> None:
    """Remove the directories between ``path`` and ``root`` that are left empty."""
    parent = path.parent
    while parent != root and root in parent.parents:
        try:
            parent.rmdir()
        except OSError:
            return
        parent = parent.parent


def write_scores_yaml(scores: Mapping[str, float], path: Path) -> None:
    """Write ``{checkpoint path: score}`` as a YAML mapping (as ``ModelCheckpoint.to_yaml``)."""
    lines = [f"{_quoted(name)}: {_yaml_float(value)}" for name, value in sorted(scores.items())]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n" if lines else "{}\n")


def _quoted(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def _yaml_float(value: float) -> str:
    if math.isnan(value):
        return ".nan"
    if math.isinf(value):
        return ".inf" if value > 0 else "-.inf"
    return repr(float(value))


def check_arguments(
    mode: str,
    save_top_k: int,
    save_last: bool | str | None,
    save_on_exception: bool,
    every_n_epochs: int | None,
    every_n_train_steps: int | None,
    train_time_interval: timedelta | None,
) -> list[str]:
    """Refuse bad `ModelCheckpoint` arguments; return the save triggers given."""
    if mode not in ("min", "max"):
        raise ConfigurationError(f"ModelCheckpoint(mode={mode!r}): use 'min' or 'max'.")
    if save_top_k < -1:
        raise ConfigurationError(f"ModelCheckpoint(save_top_k={save_top_k}) must be >= -1.")
    if save_last not in (None, False, True, "link"):
        raise ConfigurationError(
            f"ModelCheckpoint(save_last={save_last!r}): use True, False, None or 'link'."
        )
    if save_on_exception:
        raise ConfigurationError(
            "ModelCheckpoint(save_on_exception=True) is not supported: a save needs every "
            "rank, and after an exception on one rank the others cannot take part. Save "
            "regularly (every_n_train_steps=...) instead; a preemption signal saves a "
            "checkpoint by itself (Trainer(preemption_signals=...))."
        )
    for name, value in (
        ("every_n_epochs", every_n_epochs),
        ("every_n_train_steps", every_n_train_steps),
    ):
        if value is not None and (isinstance(value, bool) or value < 0):
            raise ConfigurationError(
                f"ModelCheckpoint({name}={value!r}) must be an int >= 0 (0: off)."
            )
    if train_time_interval is not None and (
        not isinstance(train_time_interval, timedelta) or train_time_interval.total_seconds() <= 0
    ):
        raise ConfigurationError(
            f"ModelCheckpoint(train_time_interval={train_time_interval!r}) must be a "
            "positive datetime.timedelta, e.g. timedelta(minutes=30)."
        )
    triggers = [
        name
        for name, on in (
            ("every_n_epochs", bool(every_n_epochs)),
            ("every_n_train_steps", bool(every_n_train_steps)),
            ("train_time_interval", train_time_interval is not None),
        )
        if on
    ]
    if len(triggers) > 1:
        raise ConfigurationError(
            f"ModelCheckpoint: {' and '.join(triggers)} were both given; pick one trigger "
            "(use two ModelCheckpoint callbacks to save on both)."
        )
    return triggers


_CONVERSIONS: dict[str, Callable[[Any], str]] = {"r": repr, "s": str, "a": ascii}
"""The ``!r``, ``!s`` and ``!a`` of a format field."""


def format_name(
    template: str,
    metrics: Mapping[str, Any],
    prefix: str | None,
    auto_insert_metric_name: bool,
    *,
    join: str,
    equals: str,
) -> str:
    """``template`` formatted with ``metrics`` as Lightning formats checkpoint names: each
    field as ``name=value`` with ``auto_insert_metric_name`` (a field not in ``metrics`` is
    0), ``prefix`` in front joined with ``join``."""
    parts: list[str] = []
    for literal, field, spec, conversion in string.Formatter().parse(template):
        parts.append(literal)
        if field is None:
            continue
        value = metrics.get(field, torch.tensor(0))
        if conversion:
            value = _CONVERSIONS[conversion](value)
        text = format(value, spec or "")
        parts.append(f"{field}{equals}{text}" if auto_insert_metric_name else text)
    name = "".join(parts)
    return join.join((prefix, name)) if prefix is not None else name


def taken(path: str) -> bool:
    """Whether something (a file, a directory, a link, a broken one too) is at ``path``."""
    target = Path(path)
    return target.exists() or target.is_symlink()
