"""`assert_strategies_agree`: the same seeded training under several strategies, compared.

accord promises that every strategy computes the same training. This kit checks it for a
user's own module, data and strategies: each strategy trains from the same seed on the
same global batches (one process per rank, real processes, for the multi-rank ones), and
the samples each step saw, the loss of each step and the final weights are compared to
training on a single device.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from accord.core.strategy import Strategy
from accord.errors import ConfigurationError
from accord.module import Module
from accord.testing._agree_launch import _label, _read_ranks, run_strategy

__all__ = ["DEFAULT_TOLERANCES", "StrategySpec", "TrainingRecord", "assert_strategies_agree"]

StrategySpec = str | type[Strategy] | Callable[[], Strategy]
"""A strategy to check: a registered name (``"ddp"``), a `Strategy` subclass built with no
arguments, or a function returning a new `Strategy` (called in every rank). Classes and
functions must be importable (defined at a module's top level), since multi-rank runs
start fresh processes (under an outside launcher such as horovodrun, the ranks import them
from the caller's ``sys.path``)."""

DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-9, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (5e-2, 1e-2),
}
"""``(rtol, atol)`` per dtype: a value ``a`` agrees with the reference ``b`` when
``|a - b| <= atol + rtol * |b|``. float32 allows for other summation orders (an all-reduce
against a reduce-scatter, a norm over shards); a lost or doubled gradient moves the values
by far more."""

_COMPUTE_DTYPE = {"bf16": torch.bfloat16, "16": torch.float16, "64": torch.float64}


@dataclass
class TrainingRecord:
    """What one strategy's training did, as `assert_strategies_agree` compares it.

    Attributes:
        strategy: the strategy's label (its name, or its class or function name).
        losses: the loss of each optimizer step, averaged over the ranks.
        samples: the dataset indices each step's global batch held, sorted.
        weights: the final weights, whole, by parameter name (read from a checkpoint the
            strategy wrote, so sharded strategies are compared whole).
    """

    strategy: str
    losses: list[float] = field(default_factory=list)
    samples: list[list[int]] = field(default_factory=list)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)


def _record(label: str, ranks: list[dict[str, Any]]) -> TrainingRecord:
    steps = min(len(r["losses"]) for r in ranks)
    return TrainingRecord(
        strategy=label,
        losses=[math.fsum(r["losses"][k] for r in ranks) / len(ranks) for k in range(steps)],
        samples=[sorted(i for r in ranks for i in r["samples"][k]) for k in range(steps)],
        weights=ranks[0]["weights"],
    )


def _tolerance(
    dtype: torch.dtype, precision: str, tolerances: Mapping[torch.dtype, tuple[float, float]]
) -> tuple[float, float]:
    """The looser of the tolerances of ``dtype`` and of the precision's compute dtype."""
    compute = next((d for p, d in _COMPUTE_DTYPE.items() if precision.startswith(p)), dtype)
    known = [tolerances[d] for d in (dtype, compute) if d in tolerances]
    if not known:
        raise ConfigurationError(
            f"assert_strategies_agree has no tolerance for {dtype}; pass "
            f"tolerances={{{dtype}: (rtol, atol)}}."
        )
    return max(t[0] for t in known), max(t[1] for t in known)


def _compare(
    reference: TrainingRecord,
    other: TrainingRecord,
    precision: str,
    tolerances: Mapping[torch.dtype, tuple[float, float]],
) -> None:
    name = other.strategy
    if len(other.losses) != len(reference.losses):
        raise AssertionError(
            f"{name} ran {len(other.losses)} optimizer steps where single_device ran "
            f"{len(reference.losses)}."
        )
    for step, (ours, theirs) in enumerate(zip(other.samples, reference.samples, strict=True)):
        if ours != theirs:
            raise AssertionError(
                f"{name} trained step {step} on other samples than single_device: dataset "
                f"indices {ours} against {theirs}. Each step's global batch must be the same "
                "samples; check the sampler and the batch size per rank."
            )
    rtol, atol = _tolerance(torch.float32, precision, tolerances)
    loss_step = next(
        (
            step
            for step, (ours, theirs) in enumerate(zip(other.losses, reference.losses, strict=True))
            if not abs(ours - theirs) <= atol + rtol * abs(theirs)
        ),
        None,
    )
    param = None
    for key, expected in reference.weights.items():
        got = other.weights.get(key)
        if got is None:
            raise AssertionError(f"{name}'s final weights have no {key!r}.")
        if got.shape != expected.shape:
            raise AssertionError(
                f"{name}'s final {key!r} has shape {tuple(got.shape)}, single_device's "
                f"{tuple(expected.shape)}."
            )
        if not expected.is_floating_point():
            continue
        p_rtol, p_atol = _tolerance(expected.dtype, precision, tolerances)
        diff = (got.double() - expected.double()).abs()
        allowed = p_atol + p_rtol * expected.double().abs()
        if bool((diff > allowed).any()):
            param = f"{key!r} (max |difference| {float(diff.max()):.3g})"
            break
    if loss_step is None and param is None:
        return
    if loss_step is not None:
        where = (
            f"the loss of step {loss_step} differs ({other.losses[loss_step]!r} against "
            f"single_device's {reference.losses[loss_step]!r}, rtol={rtol}, atol={atol})"
        )
        if loss_step > 0:
            where += f", so the update of step {loss_step - 1} already differed"
    else:
        where = f"every step's loss agrees, so the update of the last step (step {len(reference.losses) - 1}) differs"
    raise AssertionError(
        f"{name} does not train as single_device does: {where}; the first parameter that "
        f"parts is {param if param is not None else 'none (the final weights agree)'}."
    )


def assert_strategies_agree(
    make_module: Callable[[], Module],
    make_data: Callable[[], Any],
    strategies: Sequence[StrategySpec],
    steps: int = 4,
    *,
    batch_size: int = 8,
    devices: int = 2,
    accelerator: str = "cpu",
    precision: str = "32-true",
    seed: int = 0,
    tolerances: Mapping[torch.dtype, tuple[float, float]] | None = None,
    trainer_kwargs: Mapping[str, Any] | None = None,
    timeout: float = 300.0,
) -> dict[str, TrainingRecord]:
    """Train the same module under each strategy and check they agree with one device.

    Every run seeds with ``seed``, builds the module with ``make_module()`` and the data
    with ``make_data()``, and takes ``steps`` optimizer steps on unshuffled global batches
    of ``batch_size`` samples (``batch_size / ranks`` per rank). One-process strategies
    (``"single_device"``, ``"dp"``) run in this process, or in a fresh one where
    `Strategy.needs_own_process` (``"single_xla"``); the others run on ``devices`` real
    processes, started as their ranks must be: by `run_distributed` (``"ddp"``,
    ``"fsdp"``, DeepSpeed), by the strategy's own launcher where
    `ParallelStrategy.launches_own_processes` (``"ddp_spawn"``, ``"xla"``), or under
    `ParallelStrategy.external_launch_command` (``"horovod"``: ``horovodrun``). Each rank
    leaves its record in a file. Then, against the ``"single_device"`` run:

    - each step's global batch must hold the same dataset indices;
    - each step's loss (averaged over the ranks) must agree;
    - the final weights (read whole from a checkpoint each strategy saves) must agree,

    within `DEFAULT_TOLERANCES` for the dtype (under a mixed or lower precision, the looser
    of the tensor's dtype and the compute dtype).

    Args:
        make_module: returns a new `Module` (importable, for the multi-rank runs).
        make_data: returns a map-style dataset of at least ``steps * batch_size`` samples
            (its length a multiple of ``batch_size``).
        strategies: the strategies to check (see `StrategySpec`).
        steps: optimizer steps per run.
        batch_size: the global batch size; a multiple of ``devices``.
        devices: ranks of each multi-rank strategy.
        accelerator: the Trainer's ``accelerator``; ``"auto"`` with strategies that bring
            their own (the XLA ones), which refuse any other.
        precision: the Trainer's ``precision``, the same for every run.
        seed: the seed of every run.
        tolerances: ``{dtype: (rtol, atol)}`` replacing entries of `DEFAULT_TOLERANCES`.
        trainer_kwargs: further `Trainer` arguments for every run
            (``gradient_clip_val``, say).
        timeout: seconds each multi-rank run may take before its ranks are stopped (runs
            whose own launcher starts the ranks in this process are not timed).

    Returns:
        The `TrainingRecord` of every run, by label (``"single_device"`` included).

    Raises:
        AssertionError: a strategy does not agree; the message names the strategy, the
            first step whose loss differs and the first parameter that differs.
        RankFailureError: a rank failed, or an outside launcher's job failed or timed out.
        ConfigurationError: settings that cannot give every rank the same batches.
    """
    _check_batches(len(make_data()), steps, batch_size, devices)
    _check_labels(strategies)
    limits = {**DEFAULT_TOLERANCES, **(tolerances or {})}
    settings = dict(seed=seed, batch_size=batch_size, steps=steps, accelerator=accelerator)
    settings.update(precision=precision, trainer_kwargs=dict(trainer_kwargs or {}))
    root = Path(tempfile.mkdtemp(prefix="accord-agree-"))
    try:
        records: dict[str, TrainingRecord] = {}
        for spec in ["single_device", *[s for s in strategies if s != "single_device"]]:
            label = _label(spec)
            ranks = run_strategy(spec, make_module, make_data, settings, root, devices, timeout)
            records[label] = _record(label, _read_ranks(root, label, ranks))
            if label != "single_device":
                _compare(records["single_device"], records[label], precision, limits)
        return records
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _check_labels(strategies: Sequence[StrategySpec]) -> None:
    """Refuse a strategy named twice: each run's records are filed under its label."""
    labels = [_label(spec) for spec in strategies]
    if len(set(labels)) != len(labels):
        raise ConfigurationError(f"strategies={labels} names a strategy twice.")


def _check_batches(length: int, steps: int, batch_size: int, devices: int) -> None:
    """Refuse settings that cannot give every rank the same whole global batches."""
    if steps < 1:
        raise ConfigurationError(f"steps={steps} must be >= 1.")
    if devices < 1 or batch_size % devices:
        raise ConfigurationError(
            f"batch_size={batch_size} must be a multiple of devices={devices}, so every rank "
            "gets an equal share of each global batch."
        )
    if length < steps * batch_size or length % batch_size:
        raise ConfigurationError(
            f"make_data() gives {length} samples; it needs at least steps * batch_size = "
            f"{steps * batch_size}, and a multiple of batch_size={batch_size}, so every step "
            "is a whole global batch on every strategy."
        )
