"""A ``torch.compile``'d model given to a `Trainer` entry point, as Lightning takes one.

``trainer.fit(torch.compile(model))`` passes the wrapper ``torch.compile`` returns, which is
not a `Module`. `unwrap_compiled` hands the Trainer the `Module` inside instead, with its
``forward`` and step methods run through the same compiler (`CompiledMethod`): the run
trains the compiled code, its checkpoints name the weights as the module does, and the
caller's ``model`` (the wrapper's, and the module's, weights are the same tensors) holds the
trained weights afterwards. The module keeps its compiled methods after the run, as a
Lightning module does; `to_uncompiled` takes them off again.

A strategy that cannot train a compiled model says why in `Strategy.compile_refusal`, and
`unwrap_compiled` refuses the model with that reason, for a module compiled whole or one
holding compiled parts, before any process starts.
"""

from __future__ import annotations

import types
from typing import Any

from accord.checkpoint.compiled_names import compiled_modules, is_compiled
from accord.core.strategy import Strategy
from accord.errors import ConfigurationError
from accord.module import Module

__all__ = ["COMPILED_METHODS", "CompiledMethod", "to_uncompiled", "unwrap_compiled"]

COMPILED_METHODS = ("forward", "training_step", "validation_step", "test_step", "predict_step")
"""The methods of a `Module` compiled whole that run through its compiler (Lightning's)."""


class CompiledMethod:
    """A method of ``module`` run through a ``torch.compile`` context, set on the module.

    It pickles (the module is copied into ``ddp_spawn``'s ranks with it) and compiles
    again where it is unpickled: what it keeps is the module, the method's name and the
    context, which ``torch.compile`` makes picklable.

    Args:
        module: the module whose method it runs.
        name: the method's name; the class's method of that name is compiled.
        context: the ``dynamo_ctx`` of the wrapper ``torch.compile(module)`` returned.
    """

    def __init__(self, module: Module, name: str, context: Any) -> None:
        self.module = module
        self.name = name
        self.context = context
        self._compiled = self._compile()

    def _compile(self) -> Any:
        method = types.MethodType(getattr(type(self.module), self.name), self.module)
        return self.context(method)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._compiled(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        # The compiled function is a closure: it is made again where this is unpickled.
        return {key: value for key, value in self.__dict__.items() if key != "_compiled"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._compiled = self._compile()


def unwrap_compiled(model: Any, strategy: Strategy) -> Module:
    """The `Module` a Trainer entry point runs, given what the user passed.

    ``torch.compile(module)`` of a `Module` gives that module, its `COMPILED_METHODS`
    running through the wrapper's compiler; a `Module` is given as it is.

    Raises:
        ConfigurationError: ``model`` is neither a `Module` nor ``torch.compile`` of one;
            ``strategy`` cannot train a compiled model (`Strategy.compile_refusal`) and
            ``model`` is compiled or holds compiled parts.
    """
    compiled = is_compiled(model)
    module = model._orig_mod if compiled else model
    if not isinstance(module, Module):
        what = f"torch.compile() of a {type(module).__name__}" if compiled else None
        raise ConfigurationError(
            f"The Trainer runs an accord.Module, got {what or type(model).__name__}. "
            "Subclass accord.Module (a LightningModule ports by changing its base class)."
        )
    refusal = strategy.compile_refusal
    parts = list(compiled_modules(module))
    # A module an earlier run of torch.compile(module) left with compiled methods counts too.
    whole = compiled or any(
        isinstance(module.__dict__.get(n), CompiledMethod) for n in COMPILED_METHODS
    )
    if refusal is not None and (whole or parts):
        which = "the model is torch.compile()'d" if whole else f"it compiles {parts[0]!r}"
        raise ConfigurationError(
            f"{type(strategy).__name__} cannot train a torch.compile()'d model ({which}): "
            f"{refusal} Pass the uncompiled model (to_uncompiled(model) takes off the "
            "compiled methods a run of torch.compile(model) left), or use another strategy."
        )
    if compiled:
        for name in COMPILED_METHODS:
            setattr(module, name, CompiledMethod(module, name, model.dynamo_ctx))
    return module


def to_uncompiled(model: Any) -> Module:
    """The `Module` without the compiled methods a run of ``torch.compile(module)`` set on it.

    Args:
        model: the `Module`, or the ``torch.compile(module)`` the Trainer ran.

    Raises:
        ConfigurationError: ``model`` is neither a `Module` nor ``torch.compile`` of one.
    """
    module = model._orig_mod if is_compiled(model) else model
    if not isinstance(module, Module):
        raise ConfigurationError(
            f"to_uncompiled() takes an accord.Module or torch.compile() of one, got "
            f"{type(module).__name__}."
        )
    for name in COMPILED_METHODS:
        if isinstance(module.__dict__.get(name), CompiledMethod):
            delattr(module, name)
    return module
