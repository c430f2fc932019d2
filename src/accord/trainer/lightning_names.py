"""Lightning's names that accord refuses or takes differently, each with the reason.

Every name of Lightning's ``Trainer`` (its arguments and properties), ``LightningModule``
and ``Callback`` either exists in accord with Lightning's meaning, or is listed here; the
table in docs/from-lightning.md is checked against these tables and Lightning 2.6.6's own
names by the test suite, so neither can drift.
"""

from __future__ import annotations

__all__ = [
    "MODULE_NAMES_NOT_PROVIDED",
    "REFUSED_MODULE_NAMES",
    "TRAINER_ARGUMENTS_DIFFERENT",
    "TRAINER_NAMES_NOT_PROVIDED",
]

_REMOVED_IN_2 = (
    "Lightning removed it in 2.0 and accord never had it: use the on_{0} hook instead, "
    "and keep the step outputs you need in an attribute of the module."
)

REFUSED_MODULE_NAMES: dict[str, str] = {
    "configure_sharded_model": (
        "it is Lightning's deprecated name of configure_model; rename the method to "
        "configure_model."
    ),
    "training_epoch_end": _REMOVED_IN_2.format("train_epoch_end"),
    "validation_epoch_end": _REMOVED_IN_2.format("validation_epoch_end"),
    "test_epoch_end": _REMOVED_IN_2.format("test_epoch_end"),
}
"""`Module` hooks a module may not override: the Trainer refuses the module when a run
starts, with the reason."""

MODULE_NAMES_NOT_PROVIDED: dict[str, str] = {
    "fabric": "accord has no Fabric; a Module runs under accord's Trainer only.",
    "to_tensorrt": "accord does not export to TensorRT; use torch_tensorrt.compile directly.",
}
"""``LightningModule`` names `accord.Module` does not have."""

TRAINER_NAMES_NOT_PROVIDED: dict[str, str] = {}
"""``Trainer`` properties and methods accord's `Trainer` does not have."""

TRAINER_ARGUMENTS_DIFFERENT: dict[str, str] = {
    "plugins": (
        "takes an accord Precision and/or ClusterEnvironment; Lightning's other plugins "
        "(checkpoint IO, layer sync, custom precision plugins) are refused."
    ),
    "profiler": (
        "'collectives' or 'timeline' (accord's collective profilers); Lightning's 'simple', "
        "'advanced', 'pytorch' and profiler objects are refused."
    ),
    "model_registry": "refused unless None: accord has no model registry.",
    "logger": "True or None is a CSVLogger (Lightning's default is TensorBoard's).",
    "sync_batchnorm": (
        "accord's SyncBatchNorm, through the strategy's collective: it runs on CPU too."
    ),
}
"""``Trainer`` arguments accord takes with a difference worth knowing."""
