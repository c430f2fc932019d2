"""`ModelCheckpoint`'s own rules: where it writes by default, how it names a checkpoint, its
arguments checked, its scores as YAML; and `CheckpointNames`, the naming and directory
methods `ModelCheckpoint` inherits.

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

from accord.checkpoint.formats import finished_checkpoints
from accord.errors import ConfigurationError
from accord.loggers.logger import version_directory

if TYPE_CHECKING:
    from accord.trainer.trainer import Trainer

__all__ = [
    "CheckpointNames",
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


class CheckpointNames:
    """The names and directories of `ModelCheckpoint`, which inherits them: where its
    checkpoints go and are looked for, the name each gets, and the free name a save takes.

    Lightning's class attributes are here: a subclass may change the join and equals
    characters, the last checkpoint's name, the extension and the first ``-v<n>``.
    """

    CHECKPOINT_JOIN_CHAR = "-"
    CHECKPOINT_EQUALS_CHAR = "="
    CHECKPOINT_NAME_LAST = "last"
    FILE_EXTENSION = ".ckpt"
    STARTING_VERSION = 1

    _given_dirpath: Path | None
    dirpath: Path | None
    filename: str | None
    auto_insert_metric_name: bool
    enable_version_counter: bool

    def _resolve_dirpath(self, trainer: Trainer) -> Path:
        if self._given_dirpath is not None:
            return self._given_dirpath
        return default_checkpoint_dir(trainer)

    def checkpoint_dirs(self, trainer: Trainer) -> list[Path]:
        """Where ``ckpt_path="last"`` and a restarted job look for this callback's files.

        ``dirpath`` when given. Otherwise the default directory of ``trainer``'s run and,
        when its logger numbers versions itself, the ``checkpoints`` of the experiment's
        other versions (a restarted job writes to a new version).
        """
        if self._given_dirpath is not None:
            return [self._given_dirpath]
        return experiment_checkpoint_dirs(trainer)

    def find_checkpoints(self, trainer: Trainer) -> list[Path]:
        """The finished checkpoints in `checkpoint_dirs` (in the sub-directories a ``/`` in
        the file name makes too); saves cut short are left out."""
        return finished_checkpoints(
            self.checkpoint_dirs(trainer), self.FILE_EXTENSION, self._name_depth()
        )

    # ------------------------------------------------------------------ names
    def format_checkpoint_name(
        self,
        metrics: Mapping[str, Any],
        filename: str | None = None,
        ver: int | None = None,
        prefix: str | None = None,
    ) -> str:
        """The path a checkpoint with ``metrics`` gets, as in Lightning.

        ``filename`` (default: this callback's) is formatted with ``metrics``, each field
        as ``name=value`` with ``auto_insert_metric_name`` (a field not in ``metrics`` is
        0); ``prefix`` goes in front and ``-v<ver>`` behind, joined with
        `CHECKPOINT_JOIN_CHAR`; then `FILE_EXTENSION`, under ``dirpath`` once it is known.

        Example: with ``filename="{epoch}-{val_loss:.2f}"``,
        ``format_checkpoint_name({"epoch": 2, "val_loss": 0.123})`` ends in
        ``epoch=2-val_loss=0.12.ckpt``.
        """
        name = self._format_checkpoint_name(
            filename or self.filename, metrics, prefix, self.auto_insert_metric_name
        )
        if ver is not None:
            name = self.CHECKPOINT_JOIN_CHAR.join((name, f"v{ver}"))
        name += self.FILE_EXTENSION
        return str(self.dirpath / name) if self.dirpath is not None else name

    def _format_checkpoint_name(
        self,
        filename: str | None,
        metrics: Mapping[str, Any],
        prefix: str | None = None,
        auto_insert_metric_name: bool = True,
    ) -> str:
        template = filename or "{epoch}" + self.CHECKPOINT_JOIN_CHAR + "{step}"
        return format_name(
            template,
            metrics,
            prefix,
            auto_insert_metric_name,
            join=self.CHECKPOINT_JOIN_CHAR,
            equals=self.CHECKPOINT_EQUALS_CHAR,
        )

    def _check_name(self, template: str | None, values: Mapping[str, Any]) -> None:
        """Refuse a name whose fields are not all logged (Lightning would write 0), or that
        does not format; every rank checks, so a bad name stops every rank together."""
        template = template or "{epoch}{step}"
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
        missing = sorted(fields - set(values))
        if missing:
            raise ConfigurationError(
                f"ModelCheckpoint(filename={template!r}) uses {missing}, which are not "
                f"logged. Available: {sorted(values)}."
            )
        try:
            self._format_checkpoint_name(template, values, None, self.auto_insert_metric_name)
        except (ValueError, TypeError) as err:
            raise ConfigurationError(
                f"ModelCheckpoint(filename={template!r}) does not format with the logged "
                f"values: {err}. Fix the format specs (a float metric takes '.4f', not 'd')."
            ) from err

    def _name_depth(self) -> int:
        """How many directories deep under ``dirpath`` the names put checkpoints."""
        depth = 0
        for template in (self.filename, self.CHECKPOINT_NAME_LAST):
            try:
                name = self._format_checkpoint_name(
                    template, {}, None, self.auto_insert_metric_name
                )
            except (ValueError, TypeError):
                continue
            depth = max(depth, name.count("/"))
        return depth

    def _free_name(
        self, values: Mapping[str, Any], template: str | None, reusable: set[str]
    ) -> str:
        """The path for ``template``: its formatted name, with the first ``-v<n>`` not on
        disk if that is taken (by a file this save does not replace)."""
        path = self.format_checkpoint_name(values, template)
        version = self.STARTING_VERSION
        while self.enable_version_counter and path not in reusable and taken(path):
            path = self.format_checkpoint_name(values, template, ver=version)
            version += 1
        return path

    def _monitor_candidates(self, trainer: Trainer) -> dict[str, Any]:
        """The values names are formatted with: the logged metrics, ``epoch`` and ``step``."""
        values: dict[str, Any] = dict(trainer.callback_metrics)
        epoch, step = values.get("epoch"), values.get("step")
        values["epoch"] = (
            epoch.int() if isinstance(epoch, torch.Tensor) else torch.tensor(trainer.current_epoch)
        )
        values["step"] = (
            step.int() if isinstance(step, torch.Tensor) else torch.tensor(trainer.global_step)
        )
        return values
