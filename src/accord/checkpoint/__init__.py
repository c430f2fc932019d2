"""Checkpoints: their format, written atomically, read safely, inspected and converted.

The engine-neutral parts of checkpointing live in this package, one concept a module:

- `accord.checkpoint.formats`: the format version, the directory formats and how each is
  recognized, whether a save finished, the finished checkpoints in a folder;
- `accord.checkpoint.writing`: atomic writes, directories and links switched in whole,
  removal, and the clean-up of what a killed save left;
- `accord.checkpoint.reading`: safe reading of a file, and of any engine's directory whole
  (each engine registers its reader);
- `accord.checkpoint.compiled_names`: the plain parameter names checkpoints hold for
  ``torch.compile``'d models;
- `accord.checkpoint.cli`: ``python -m accord.checkpoint inspect|convert``.

The parts that belong to a layer above stay in it, so imports keep pointing downward: the
checkpoint methods every strategy inherits are `accord.core.strategy_checkpoints`; what a
training checkpoint holds, ``ckpt_path="last"``, restore and resume are
`accord.trainer.training_checkpoints`; `ModelCheckpoint`'s names and directories are
`accord.callbacks.model_checkpoint_files`. Each engine writes and reads its own format in
its folder: `accord.engines.torch.fsdp_checkpoint_directory` (with the safe DCP reader
`accord.engines.torch.safe_dcp`) and `accord.engines.deepspeed.checkpoint_directory`
(with `checkpoint_reading`, `checkpoint_staging` and `zero_partitions`); their strategy
methods are `accord.engines.torch.fsdp_strategy_checkpoints` and
`accord.engines.deepspeed.strategy_checkpoints`.
"""

from __future__ import annotations

from accord.checkpoint.cli import convert_checkpoint, describe_checkpoint, format_description, main
from accord.checkpoint.formats import (
    CHECKPOINT_FORMAT_VERSION,
    DIRECTORY_FORMATS,
    check_format_version,
    checkpoint_format,
)
from accord.checkpoint.reading import (
    DirectoryReader,
    load_checkpoint_file,
    read_checkpoint,
    register_directory_reader,
)
from accord.checkpoint.writing import (
    fsync_path,
    remove_checkpoint_path,
    save_checkpoint_file,
    write_bytes_atomically,
)

__all__ = [
    "CHECKPOINT_FORMAT_VERSION",
    "DIRECTORY_FORMATS",
    "DirectoryReader",
    "check_format_version",
    "checkpoint_format",
    "convert_checkpoint",
    "describe_checkpoint",
    "format_description",
    "fsync_path",
    "load_checkpoint_file",
    "main",
    "read_checkpoint",
    "register_directory_reader",
    "remove_checkpoint_path",
    "save_checkpoint_file",
    "write_bytes_atomically",
]
