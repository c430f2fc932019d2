"""``python -m accord.checkpoint``: what a checkpoint holds, and one format turned into another.

``python -m accord.checkpoint inspect PATH`` prints what a checkpoint is (its format and
version, the strategy and world size that wrote it, sharded or full, the loop position in
steps, epochs and samples consumed) with its tensors and sizes. ``python -m
accord.checkpoint convert SRC DST --to full|sharded [--world-size N]`` writes any
checkpoint accord reads (a file, an FSDP sharded directory, a DeepSpeed ZeRO directory of
any stage) as one full file, or as a sharded `torch.distributed.checkpoint` directory that
FSDP reads at any world size. Both run in one process, without a process group or a
model; every file is read with ``weights_only=True``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from accord.checkpoint.formats import (
    CHECKPOINT_FORMAT_VERSION,
    DIRECTORY_FORMATS,
    checkpoint_format,
)
from accord.checkpoint.reading import read_checkpoint
from accord.checkpoint.writing import save_checkpoint_file
from accord.errors import CheckpointError

__all__ = ["convert_checkpoint", "describe_checkpoint", "format_description", "main"]

# The engines whose checkpoint directories accord reads register their readers on import.
_READER_MODULES = (
    "accord.engines.torch.fsdp_checkpoint_directory",
    "accord.engines.deepspeed.checkpoint_directory",
)


def _read(path: Path) -> dict[str, Any]:
    for name in _READER_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    # DeepSpeed's consolidation prints its progress; the command prints its own report.
    with contextlib.redirect_stdout(io.StringIO()):
        return read_checkpoint(path)


def describe_checkpoint(path: str | Path) -> dict[str, Any]:
    """What the checkpoint at ``path`` is, read whole in this process.

    Returns:
        ``path``, ``format`` (``"file"`` or a key of `DIRECTORY_FORMATS`), ``version``,
        ``strategy``, ``world_size``, ``sharded``, ``epoch``, ``global_step``,
        ``epoch_finished``, ``samples_consumed`` and ``epoch_samples`` (the length of the
        epoch's global order; None when unrecorded), ``tensors`` (name to shape, dtype) of
        the model, ``model_bytes``, ``optimizers`` (per optimizer: parameters with state,
        the state's keys, bytes) and ``disk_bytes``.

    Raises:
        CheckpointError: nothing accord reads at ``path``.
    """
    source = Path(path)
    found = checkpoint_format(source)
    if found is None:
        raise CheckpointError(
            f"No checkpoint at {str(source)!r}: it is missing, or a directory of no format "
            f"accord knows ({', '.join(sorted(DIRECTORY_FORMATS))}). Pass a checkpoint file "
            "or directory."
        )
    checkpoint = _read(source)
    model = checkpoint.get("state_dict", {})
    tensors = {
        name: (tuple(value.shape), str(value.dtype).removeprefix("torch."))
        for name, value in model.items()
        if isinstance(value, torch.Tensor)
    }
    optimizers = []
    for state in checkpoint.get("optimizer_states", []):
        per_parameter = state.get("state", {})
        keys = sorted({key for entry in per_parameter.values() for key in entry})
        optimizers.append(
            {
                "parameters": len(per_parameter),
                "keys": keys,
                "bytes": sum(_bytes(entry) for entry in per_parameter.values()),
            }
        )
    order = checkpoint.get("data_order")
    files = [source] if source.is_file() else [f for f in source.rglob("*") if f.is_file()]
    return {
        "path": str(source),
        "format": found,
        "version": checkpoint.get("accord_checkpoint_version", CHECKPOINT_FORMAT_VERSION),
        "strategy": checkpoint.get("strategy"),
        "world_size": checkpoint.get("world_size"),
        "sharded": checkpoint.get("sharded", found != "file"),
        "epoch": checkpoint.get("epoch"),
        "global_step": checkpoint.get("global_step"),
        "epoch_finished": checkpoint.get("epoch_finished"),
        "samples_consumed": checkpoint.get("samples_consumed"),
        "epoch_samples": order.get("length") if isinstance(order, dict) else None,
        "tensors": tensors,
        "model_bytes": _bytes(model),
        "optimizers": optimizers,
        "disk_bytes": sum(f.stat().st_size for f in files),
    }


def format_description(info: dict[str, Any]) -> str:
    """`describe_checkpoint`'s answer as the lines ``inspect`` prints."""
    what = "a checkpoint file" if info["format"] == "file" else DIRECTORY_FORMATS[info["format"]]
    unknown = "not recorded"
    samples = info["samples_consumed"]
    position = (
        f"epoch {info['epoch']}, global step {info['global_step']}"
        + (", at the epoch's end" if info["epoch_finished"] else ", mid-epoch")
        + (
            f", {samples} of the epoch's {info['epoch_samples']} samples consumed"
            if samples is not None
            else ""
        )
    )
    lines = [
        f"path:        {info['path']}",
        f"format:      {what}, format version {info['version']}",
        f"written by:  {info['strategy'] or unknown}, world size {info['world_size'] or unknown}",
        f"layout:      {'sharded' if info['sharded'] else 'full'}",
        f"position:    {position}",
        f"model:       {len(info['tensors'])} tensors, "
        f"{sum(_numel(shape) for shape, _ in info['tensors'].values())} elements, "
        f"{_size(info['model_bytes'])}",
    ]
    for index, optimizer in enumerate(info["optimizers"]):
        lines.append(
            f"optimizer {index}: state for {optimizer['parameters']} parameters "
            f"({', '.join(optimizer['keys']) or 'none'}), {_size(optimizer['bytes'])}"
        )
    lines.append(f"on disk:     {_size(info['disk_bytes'])}")
    lines.append("tensors:")
    lines += [
        f"  {name}  {list(shape)}  {dtype}" for name, (shape, dtype) in info["tensors"].items()
    ]
    return "\n".join(lines)


def convert_checkpoint(
    source: str | Path, destination: str | Path, to: str, world_size: int | None = None
) -> Path:
    """Write the checkpoint at ``source`` as a full file or a sharded directory.

    Args:
        source: any checkpoint accord reads: a file, an FSDP sharded directory, a
            DeepSpeed directory (ZeRO-1, 2 or 3; the optimizer state comes along).
        destination: where to write it (atomically); an existing checkpoint there is
            replaced.
        to: ``"full"``: one file any strategy resumes from; ``"sharded"``: a
            `torch.distributed.checkpoint` directory FSDP reads at any world size (and the
            other strategies read whole).
        world_size: for ``"sharded"``, the world size recorded as the writer's (default
            1); the directory itself reshards to any world size on load.

    Returns:
        ``destination`` as a `Path`.

    Raises:
        CheckpointError: ``source`` is not a readable checkpoint; ``to`` is neither
            ``"full"`` nor ``"sharded"``; ``world_size`` with ``"full"`` or below 1; an
            optimizer state whose parameters cannot be named from the model's.
    """
    if to not in ("full", "sharded"):
        raise CheckpointError(f"--to {to!r}: use 'full' or 'sharded'.")
    if world_size is not None and (to == "full" or world_size < 1):
        raise CheckpointError(
            f"--world-size {world_size}: give it only with --to sharded, as a number >= 1."
        )
    info_format = checkpoint_format(source)
    if info_format is None:
        raise CheckpointError(f"No checkpoint at {str(source)!r}. Check the path.")
    target = Path(destination)
    checkpoint = _read(Path(source))
    checkpoint.pop("fsdp_sharded", None)
    checkpoint.pop("optimizer_states_missing", None)
    if to == "full":
        if target.is_dir():
            raise CheckpointError(
                f"{str(target)!r} is a directory; --to full writes one file. Pass a file path."
            )
        checkpoint["sharded"] = False
        return save_checkpoint_file(checkpoint, target)
    from accord.engines.torch.fsdp_checkpoint_directory import write_sharded_offline

    model = checkpoint.get("state_dict", {})
    checkpoint["optimizer_states"] = [
        _named(state, model) for state in checkpoint.get("optimizer_states", [])
    ]
    return write_sharded_offline(checkpoint, target, world_size or 1)


def _named(state: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name: a numbered one's parameters named from
    the model's state dict, in its order (a buffer skipped where the shapes of the state's
    tensors say the parameter is a later entry).

    Raises:
        CheckpointError: the numbers cannot be matched to the model's entries.
    """
    groups = state.get("param_groups", [])
    numbers = [n for g in groups for n in g.get("params", [])]
    if all(isinstance(n, str) for n in numbers):
        return state
    keys = list(model)
    per_parameter = state.get("state", {})
    names: dict[Any, str] = {}
    position = 0
    for number in numbers:
        shapes = {
            tuple(v.shape)
            for v in per_parameter.get(number, {}).values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        }
        while (
            len(numbers) < len(keys)
            and position < len(keys)
            and shapes
            and tuple(model[keys[position]].shape) not in shapes
        ):
            position += 1
        if position >= len(keys):
            raise CheckpointError(
                "The optimizer state's parameters cannot be matched to the model's entries "
                "by order and shape; convert --to full, and resume that file under FSDP."
            )
        names[number] = keys[position]
        position += 1
    return {
        "state": {names[n]: value for n, value in per_parameter.items()},
        "param_groups": [{**g, "params": [names[n] for n in g["params"]]} for g in groups],
    }


def _bytes(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_bytes(value) for value in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_bytes(value) for value in tree)
    return 0


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _size(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{count} B"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; return its exit status (0, or 2 when the checkpoint could not be
    read or written; the reason goes to stderr)."""
    parser = argparse.ArgumentParser(
        prog="python -m accord.checkpoint",
        description="Inspect or convert an accord checkpoint, without a training job.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="print what a checkpoint is and holds")
    inspect.add_argument("path", help="a checkpoint file or directory")
    convert = commands.add_parser("convert", help="write a checkpoint as full or sharded")
    convert.add_argument("source", help="a checkpoint file or directory")
    convert.add_argument("destination", help="where to write the converted checkpoint")
    convert.add_argument("--to", required=True, choices=("full", "sharded"))
    convert.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="with --to sharded: the world size recorded as the writer's (default 1)",
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            print(format_description(describe_checkpoint(args.path)))
        else:
            written = convert_checkpoint(args.source, args.destination, args.to, args.world_size)
            print(f"wrote {args.to} checkpoint {written}")
    except CheckpointError as err:
        print(f"accord.checkpoint: {err}", file=sys.stderr)
        return 2
    return 0
