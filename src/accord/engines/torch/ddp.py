"""`DDPStrategy`: one process per device, gradients averaged by DistributedDataParallel.

DDP's reducer runs on the process group of the strategy's `TorchCollective`
(`TorchCollective.process_group`, reached through any debug, statistics or watchdog
wrappers), so a collective on a sub-group averages gradients within the sub-group.
With ``gradient_sync="collective"`` every gradient bucket goes through the collective's
own ``all_reduce`` instead; so do they wherever the collective asks for an engine's own
traffic (`Collective.wants_engine_traffic`: debug mode), so the debug check fingerprints
the gradient traffic along with the user's collectives.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from accord.accelerators.accelerator import Accelerator
from accord.core.collective import Collective
from accord.core.parallel import ParallelStrategy, StartMethod
from accord.core.step_module import StepModule
from accord.core.timeouts import DEFAULT_TIMEOUT
from accord.core.wrappers.policy import has_layer
from accord.engines.torch.collective import TorchCollective, default_torch_backend
from accord.engines.torch.ddp_decision import DECISION_PARAMETER, DecisionSlots, add_decision_slots
from accord.environments.cluster_environment import ClusterEnvironment
from accord.errors import ConfigurationError
from accord.precision import Precision

__all__ = ["DDPStrategy"]

GradientSync = Literal["native", "collective"]


class DDPStrategy(ParallelStrategy):
    """Data parallel training with `torch.nn.parallel.DistributedDataParallel`.

    Args:
        start_method: how accord starts the local ranks when nothing else did:
            ``"popen"`` re-runs the script (the default, like ``torchrun``), ``"spawn"``
            and ``"fork"`` start them from this process. Under torchrun or SLURM nothing
            is started.
        gradient_sync: ``"native"`` lets DDP's reducer average gradients on the
            collective's process group, overlapped with backward; ``"collective"`` sends
            every gradient bucket through ``self.collective.all_reduce`` (a DDP comm hook),
            so a custom collective also carries the gradients. Debug mode (``debug=True``
            or ``ACCORD_DEBUG_COLLECTIVES``) always uses ``"collective"``, so a gradient
            bucket that meets another rank's user collective is a
            `CollectiveMismatchError`, not a backend crash.
        max_restarts: with ``Trainer(on_rank_loss="continue")``, how many times accord's own
            launcher (``start_method="popen"``) starts a lost rank's process again; the new
            process joins the run in progress at the next step boundary and takes the
            training state from the others (under torchrun, its ``--max-restarts`` does
            this). 0 (the default): the run goes on without it.
        find_unused_parameters: passed to `DistributedDataParallel`. None (the default)
            means False under automatic optimization and True under manual optimization,
            where a backward often reaches only some parameters (a GAN's generator step
            leaves the discriminator's frozen by ``toggle_optimizer``).
        **ddp_kwargs: passed to `DistributedDataParallel`.
        process_group_backend, timeout: as `ParallelStrategy` (the backend's default: nccl
            on CUDA, gloo otherwise).
        accelerator, parallel_devices, cluster_environment, collective, precision, num_nodes, debug:
            as `ParallelStrategy`.
    """

    survives_rank_loss = True

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        *,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        collective: Collective | None = None,
        precision: Precision | None = None,
        num_nodes: int = 1,
        start_method: StartMethod = "popen",
        process_group_backend: str | None = None,
        timeout: float | timedelta = DEFAULT_TIMEOUT,
        gradient_sync: GradientSync = "native",
        find_unused_parameters: bool | None = None,
        max_restarts: int = 0,
        debug: bool = False,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__(
            accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            collective=collective,
            precision=precision,
            num_nodes=num_nodes,
            start_method=start_method,
            process_group_backend=process_group_backend,
            timeout=timeout,
            debug=debug,
        )
        if gradient_sync not in ("native", "collective"):
            raise ConfigurationError(
                f"gradient_sync={gradient_sync!r}: use 'native' or 'collective'."
            )
        self.gradient_sync = gradient_sync
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise ConfigurationError(
                f"max_restarts={max_restarts!r}: pass how many times a lost rank may be "
                "started again, an int >= 0."
            )
        if max_restarts and start_method != "popen":
            raise ConfigurationError(
                f"max_restarts={max_restarts} with start_method={start_method!r}: only "
                "accord's own launcher (start_method='popen') starts a lost rank again. "
                "Use start_method='popen', or run under torchrun --max-restarts N."
            )
        self.max_restarts = max_restarts
        self.ddp_kwargs = {"find_unused_parameters": find_unused_parameters, **ddp_kwargs}
        # Depth of `no_backward_sync` contexts entered for a manual backward.
        self._manual_sync_blocked = 0
        # The step-decision parameter of the module last wrapped (found on first use).
        self._slots: DecisionSlots | None = None

    @override
    def default_collective(self) -> Collective:
        backend = self.process_group_backend or default_torch_backend(self.root_device)
        return TorchCollective(backend, timeout=self.timeout)

    @override
    def configure_launcher(self) -> None:
        super().configure_launcher()
        if self._launcher is not None:
            self._launcher.max_restarts = self.max_restarts

    @override
    def teardown(self) -> None:
        self._slots = None
        super().teardown()

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        self._slots = None
        module = super().setup_module(module)
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigurationError(
                f"DDPStrategy wraps the model in DistributedDataParallel, which needs a "
                f"torch.distributed process group, but {type(self.collective).__name__} did "
                "not create or join one. Use a collective built on TorchCollective."
            )
        device_ids = [self.root_device.index] if self.root_device.type == "cuda" else None
        kwargs = dict(self.ddp_kwargs)
        if kwargs["find_unused_parameters"] is None:
            kwargs["find_unused_parameters"] = self.run_settings.manual_optimization
        step_module = StepModule(module)
        if self._can_carry_decision(kwargs):
            # One slot per rank; DDP averages its gradient along with the others.
            add_decision_slots(step_module, self.world_size, self.root_device)
        wrapped = DistributedDataParallel(
            step_module,
            device_ids=device_ids,
            process_group=self.process_group,
            **kwargs,
        )
        if self.gradient_sync == "collective" or self.collective.wants_engine_traffic:
            wrapped.register_comm_hook(self.collective, _ddp_gradient_bucket_hook)
        return wrapped

    @override
    def rewrap(self, module: nn.Module) -> nn.Module:
        """A new `DistributedDataParallel` on the new group; the old wrapper's reducer lets
        go of the parameters first (its hooks would reduce on the old group)."""
        if not isinstance(module, DistributedDataParallel):
            return module
        module._remove_autograd_hooks()  # type: ignore[no-untyped-call]
        return self.setup_module(self.unwrap(module))

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group DDP's reducer runs on: a `TorchCollective`'s own (a sub-group
        included), else None, the default group the collective created or joined."""
        if has_layer(self.collective, TorchCollective):
            return self.engine_collective(TorchCollective).process_group
        return None

    @override
    def check_manual_optimization(self) -> None:
        """DDP runs manual optimization: each `backward` reduces the gradients it makes."""

    @override
    def step(self, model: nn.Module, name: str, *args: Any) -> Any:
        if not isinstance(model, DistributedDataParallel):
            return super().step(model, name, *args)
        if not (self.run_settings.manual_optimization and name == "training_step"):
            return model(name, *args)
        # A manual training_step runs its backward passes inside this forward, and each
        # `backward` prepares DDP's reducer itself. Left to the forward, the reducer would
        # be prepared after the step, for a backward that never comes, and the next
        # step's first backward would be reduced even inside `no_backward_sync`.
        with model.no_sync():
            output = model(name, *args)
        # Buffers (broadcast_buffers) are sent before the next forward, as after a
        # synchronised step.
        model.require_forward_param_sync = True
        return output

    @override
    def backward(
        self,
        loss: torch.Tensor,
        module: nn.Module,
        backward_fn: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        if (
            self.run_settings.manual_optimization
            and isinstance(module, DistributedDataParallel)
            and not self._manual_sync_blocked
            and torch.is_grad_enabled()
        ):
            _prepare_manual_backward(module, loss)
        super().backward(loss, module, backward_fn)

    def _can_carry_decision(self, ddp_kwargs: dict[str, Any]) -> bool:
        """Whether DDP's gradient reduction can carry the step decision: every backward
        then reduces every parameter (no ``find_unused_parameters`` or ``static_graph``),
        gradients are not scaled (no fp16 loss scaler), and automatic optimization. In
        debug mode the decision rides in the checked gradient buckets like any gradient."""
        return (
            self.world_size > 1
            and not self.run_settings.manual_optimization
            and not ddp_kwargs.get("find_unused_parameters")
            and not ddp_kwargs.get("static_graph")
            and self.precision.scaler is None
        )

    @override
    def carries_step_decision(self, module: nn.Module) -> bool:
        """True where DDP's gradient reduction carries the decision (see `setup_module`):
        it then costs no collective of its own, and under load no second meeting of the
        ranks per step."""
        return isinstance(module, DistributedDataParallel) and hasattr(
            module.module, DECISION_PARAMETER
        )

    @override
    def step_decision_term(
        self, module: nn.Module, bits: int | torch.Tensor, loss: torch.Tensor | None
    ) -> torch.Tensor:
        # The parameter stays zero, so the term adds nothing to the loss's value; its
        # gradient is ``bits`` in this rank's slot and zero in the others. (Called on every
        # batch: the cached slots and weights are looked up inline.)
        slots = self._slots
        if slots is None or slots.owner is not module:
            slots = self._decision_slots(module)
        weights = slots.by_bits.get(bits) if type(bits) is int else None
        term = torch.dot(slots.param, weights if weights is not None else slots.weights(bits))
        if loss is not None:
            return loss + (term if term.dtype == loss.dtype else term.to(loss.dtype))
        # A skipped batch: zero gradients for every parameter, so this rank's reduction
        # meets the other ranks'.
        inner = self.unwrap(module)
        zeros = [p.sum().float() * 0.0 for p in inner.parameters() if p.requires_grad]
        return term + torch.stack(zeros).sum() if zeros else term

    @override
    def read_step_decision(self, module: nn.Module) -> list[int]:
        slots = self._slots
        if slots is None or slots.owner is not module:
            slots = self._decision_slots(module)
        return slots.read()

    @override
    def step_function(self, model: nn.Module, name: str) -> Callable[..., Any]:
        """Under automatic optimization, the DDP wrapper's own call (its ``forward`` runs
        the hook through the `StepModule`)."""
        if isinstance(model, DistributedDataParallel) and not self.run_settings.manual_optimization:
            return functools.partial(model, name)
        return super().step_function(model, name)

    def _decision_slots(self, module: nn.Module) -> DecisionSlots:
        slots = self._slots
        if slots is None or slots.owner is not module:
            assert isinstance(module, DistributedDataParallel)
            param: nn.Parameter = getattr(module.module, DECISION_PARAMETER)
            slots = self._slots = DecisionSlots(module, param, self.global_rank)
        return slots

    @override
    def no_backward_sync(
        self, module: nn.Module, enabled: bool
    ) -> contextlib.AbstractContextManager[Any]:
        if not (enabled and isinstance(module, DistributedDataParallel)):
            return contextlib.nullcontext()
        if self.run_settings.manual_optimization:
            return self._manual_no_sync()
        return module.no_sync()

    @contextlib.contextmanager
    def _manual_no_sync(self) -> Iterator[None]:
        self._manual_sync_blocked += 1
        try:
            yield
        finally:
            self._manual_sync_blocked -= 1

    @override
    def unwrap(self, module: nn.Module) -> nn.Module:
        if isinstance(module, DistributedDataParallel):
            module = module.module
        if isinstance(module, StepModule):
            module = module.module
        return module


def _prepare_manual_backward(module: DistributedDataParallel, loss: torch.Tensor) -> None:
    """Arm DDP's reducer for one backward of ``loss`` run outside DDP's forward.

    What DDP's forward does after the module runs, for a backward the caller starts
    itself: the reducer then averages the gradients this backward makes, and with
    ``find_unused_parameters`` the parameters ``loss`` does not reach (frozen, or used
    by another optimizer's loss) count as ready instead of being waited for.
    """
    reducer = module.reducer
    # The reducer rebuilds its buckets in the first forward after a synchronised backward;
    # with several backward passes in one forward it must happen before the next one.
    reducer._rebuild_buckets()
    unused_search = module.find_unused_parameters and not module.static_graph
    reducer.prepare_for_backward([loss] if unused_search else [])
    module.require_forward_param_sync = True


def _ddp_gradient_bucket_hook(
    collective: Collective, bucket: Any
) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook that averages a gradient bucket in place through ``collective``.

    The all-reduce is asynchronous (``async_op=True``): DDP gets the collective's future and
    goes on with backward, as with its own reducer. Its name shows in a debug mismatch
    report as the place a gradient bucket was sent from.
    """
    buffer = bucket.buffer()
    return collective.all_reduce(buffer, "mean", out=buffer, async_op=True).get_future()


# DDP validates a hook's annotations as objects; this module's are strings (postponed).
_ddp_gradient_bucket_hook.__annotations__.update(
    {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}  # type: ignore[attr-defined]
)
