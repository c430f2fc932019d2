"""The DeepSpeed config: built from the strategy's options, completed with the Trainer's settings.

`build_config` turns ``DeepSpeedStrategy``'s options (or a complete config) into a checked
config when the strategy is built. When a run starts, `training_config` and
`evaluation_config` add what the Trainer decides (accumulation, clipping, precision) and
refuse a config that contradicts it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from accord.core.strategy import RunSettings
from accord.engines.deepspeed.precision import DeepSpeedPrecision
from accord.errors import ConfigurationError

__all__ = ["build_config", "evaluation_config", "training_config", "zero_stage"]

_STAGES = (1, 2, 3)
_OFF = (None, "none")
"""The ``device`` values of an offload section that mean no offload."""


def build_config(
    stage: int | None,
    offload_optimizer: bool,
    offload_parameters: bool,
    config: dict[str, Any] | str | Path | None,
    entries: dict[str, Any],
) -> dict[str, Any]:
    """The DeepSpeed config from a complete ``config`` or from the keyword options.

    Args:
        stage, offload_optimizer, offload_parameters: as `DeepSpeedStrategy`.
        config: a complete config (a dict or the path of a JSON file), or None.
        entries: more top-level config entries; ``zero_optimization`` is merged with
            ``stage`` and the offload options.

    Raises:
        ConfigurationError: ``config`` together with other options, an unreadable config
            file, a ZeRO stage other than 1-3, or parameter offload below stage 3.
    """
    if config is not None:
        if stage is not None or offload_optimizer or offload_parameters or entries:
            given = _given(stage, offload_optimizer, offload_parameters, entries)
            raise ConfigurationError(
                "Pass either config= (a complete DeepSpeed config) or stage=/offload_*=/config "
                f"entries, not both (got config and {given})."
            )
        result = _read_config(config)
        zero = result.setdefault("zero_optimization", {})
        if not isinstance(zero, dict):
            raise ConfigurationError("The DeepSpeed config's zero_optimization must be a dict.")
        zero.setdefault("stage", 2)
    else:
        zero = dict(entries.pop("zero_optimization", None) or {})
        if stage is not None and "stage" in zero and int(zero["stage"]) != stage:
            raise ConfigurationError(
                f"stage={stage} but zero_optimization sets stage={zero['stage']}; pass one."
            )
        zero["stage"] = stage if stage is not None else int(zero.get("stage", 2))
        if offload_optimizer:
            zero.setdefault("offload_optimizer", {"device": "cpu"})
        if offload_parameters:
            zero.setdefault("offload_param", {"device": "cpu"})
        result = {**copy.deepcopy(entries), "zero_optimization": zero}
    stage_value = zero["stage"]
    if isinstance(stage_value, bool) or stage_value not in _STAGES:
        raise ConfigurationError(
            f"ZeRO stage {stage_value!r} is not supported: use 1, 2 or 3 (for plain data "
            "parallel training use strategy='ddp')."
        )
    if zero.get("offload_param", {}).get("device", "none") not in _OFF and stage_value != 3:
        raise ConfigurationError(
            f"offload_parameters needs ZeRO stage 3 (stage is {stage_value}): only stage 3 "
            "shards the parameters."
        )
    return result


def zero_stage(config: dict[str, Any]) -> int:
    """The ZeRO stage of a config `build_config` made."""
    return int(config["zero_optimization"]["stage"])


def training_config(
    config: dict[str, Any],
    settings: RunSettings,
    precision: DeepSpeedPrecision,
    device_type: str,
) -> dict[str, Any]:
    """A copy of ``config`` completed for a training engine.

    Adds ``gradient_accumulation_steps`` and ``gradient_clipping`` from ``settings``, the
    precision section, a micro batch size when the config has no batch size, and what the
    optimizer needs: ``zero_allow_untested_optimizer`` for the client optimizer, or
    ``torch_adam`` for an Adam the config names on the CPU (``device_type``).

    Raises:
        ConfigurationError: the config sets accumulation, clipping or a precision section
            that differs from the Trainer's.
    """
    result = copy.deepcopy(config)
    accumulate = settings.accumulate_grad_batches
    clip = settings.gradient_clip_val
    if "train_micro_batch_size_per_gpu" not in result and "train_batch_size" not in result:
        result["train_micro_batch_size_per_gpu"] = 1
    steps = result.get("gradient_accumulation_steps")
    if steps is not None and int(steps) != accumulate:
        raise ConfigurationError(
            f"The DeepSpeed config sets gradient_accumulation_steps={steps} but the Trainer "
            f"accumulates {accumulate} batch(es). Set Trainer(accumulate_grad_batches=...) "
            "and leave gradient_accumulation_steps out of the config."
        )
    result["gradient_accumulation_steps"] = accumulate
    if clip is not None:
        configured = result.get("gradient_clipping")
        if configured not in (None, 0, 0.0) and float(configured) != float(clip):
            raise ConfigurationError(
                f"The DeepSpeed config sets gradient_clipping={configured} but the Trainer "
                f"has gradient_clip_val={clip}. Set one of them only."
            )
        result["gradient_clipping"] = float(clip)
    else:
        # DeepSpeed clips to 1.0 when the config is silent; the Trainer asked for none.
        result.setdefault("gradient_clipping", 0.0)
    _apply_precision(result, precision)
    zero = result["zero_optimization"]
    offloads = zero.get("offload_optimizer", {}).get("device", "none") not in _OFF
    if "optimizer" in result:
        optimizer = result["optimizer"]
        kind = str(optimizer.get("type", "")).lower()
        if kind in ("adam", "adamw") and device_type == "cpu":
            optimizer.setdefault("params", {}).setdefault("torch_adam", True)
    else:
        result.setdefault("zero_allow_untested_optimizer", True)
        if offloads:
            # A client optimizer steps the offloaded fp32 partition on the CPU.
            result.setdefault("zero_force_ds_cpu_optimizer", False)
    return result


def evaluation_config(config: dict[str, Any], precision: DeepSpeedPrecision) -> dict[str, Any]:
    """The config of an engine without an optimizer: ZeRO only where it shards parameters.

    Stage 3 keeps its ``zero_optimization`` section (the parameters stay partitioned);
    the other stages evaluate a plain replicated model.

    Raises:
        ConfigurationError: the config enables a precision the Trainer's differs from.
    """
    result: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": config.get("train_micro_batch_size_per_gpu", 1)
    }
    for key in ("fp16", "bf16", "steps_per_print", "wall_clock_breakdown"):
        if key in config:
            result[key] = copy.deepcopy(config[key])
    if zero_stage(config) == 3:
        result["zero_optimization"] = copy.deepcopy(config["zero_optimization"])
    _apply_precision(result, precision)
    return result


def _apply_precision(config: dict[str, Any], precision: DeepSpeedPrecision) -> None:
    """Enable the precision's section; refuse one the config enables for another mode."""
    wanted = precision.config_key
    for key in ("fp16", "bf16"):
        enabled = bool(config.get(key, {}).get("enabled", False))
        if enabled and key != wanted:
            raise ConfigurationError(
                f"The DeepSpeed config enables {key!r} but the Trainer's precision is "
                f"{precision.mode.value!r}. Pass "
                f"precision={'16-mixed' if key == 'fp16' else 'bf16-mixed'!r} to the Trainer "
                "(or remove the entry from the config)."
            )
    if wanted is not None:
        config.setdefault(wanted, {})["enabled"] = True


def _given(
    stage: int | None, offload_opt: bool, offload_params: bool, entries: dict[str, Any]
) -> str:
    """The names of the keyword options that were passed, for an error message."""
    names = [
        name
        for name, value in (
            ("stage", stage is not None),
            ("offload_optimizer", offload_opt),
            ("offload_parameters", offload_params),
        )
        if value
    ]
    return ", ".join([*names, *sorted(entries)])


def _read_config(config: dict[str, Any] | str | Path) -> dict[str, Any]:
    """A copy of a config dict, or the JSON object a config file holds."""
    if isinstance(config, dict):
        return copy.deepcopy(config)
    path = Path(config)
    if not path.is_file():
        raise ConfigurationError(
            f"DeepSpeed config {str(path)!r} does not exist. Pass a dict or the path of a JSON "
            "file."
        )
    try:
        loaded = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigurationError(
            f"DeepSpeed config {str(path)!r} is not valid JSON: {err}"
        ) from err
    if not isinstance(loaded, dict):
        raise ConfigurationError(f"DeepSpeed config {str(path)!r} must hold a JSON object.")
    return loaded
