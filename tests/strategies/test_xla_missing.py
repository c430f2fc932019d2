"""Without torch_xla installed, asking for XLA fails early and says how to install it.

The real XLA fits are in ``test_xla.py``, which runs where torch_xla is installed
(``make test-xla``).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

import accord
from accord.engines.xla.collective import XLACollective
from accord.engines.xla.environment import XLAEnvironment
from accord.engines.xla.strategy import SingleDeviceXLAStrategy, XLAStrategy
from accord.errors import MissingDependencyError
from accord.strategies import StrategyRegistry

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch_xla") is not None,
    reason="torch_xla is installed here; test_xla.py runs the real thing",
)

INSTALL = "pip install 'accord[xla]'"


def _check(err: MissingDependencyError, feature: str) -> None:
    assert (err.feature, err.package, err.extra) == (feature, "torch_xla", "xla")
    assert INSTALL in str(err)
    # It is an ImportError too, so `except ImportError` in user code catches it.
    assert isinstance(err, ImportError)


@pytest.mark.parametrize(
    ("name", "feature"), [("xla", "strategy='xla'"), ("single_xla", "strategy='single_xla'")]
)
def test_trainer_strategy_names_say_how_to_install(name: str, feature: str) -> None:
    with pytest.raises(MissingDependencyError) as info:
        accord.Trainer(strategy=name, logger=False)
    _check(info.value, feature)


@pytest.mark.parametrize("name", ["xla", "tpu"])
def test_trainer_accelerator_says_how_to_install(name: str) -> None:
    with pytest.raises(MissingDependencyError) as info:
        accord.Trainer(accelerator=name, logger=False)
    _check(info.value, "accelerator='xla'")


def test_the_classes_say_how_to_install() -> None:
    for build, feature in (
        (XLAStrategy, "strategy='xla'"),
        (SingleDeviceXLAStrategy, "strategy='single_xla'"),
        (XLACollective, "XLACollective"),
        (XLAEnvironment, "XLAEnvironment"),
    ):
        with pytest.raises(MissingDependencyError) as info:
            build()
        _check(info.value, feature)


def test_the_names_are_registered_without_torch_xla() -> None:
    assert {"xla", "single_xla"} <= set(StrategyRegistry.available_strategies())
    assert StrategyRegistry.get("xla").strategy_cls is XLAStrategy
    assert StrategyRegistry.get("single_xla").strategy_cls is SingleDeviceXLAStrategy


def test_importing_accord_does_not_import_torch_xla() -> None:
    code = (
        "import sys, accord, accord.engines.xla.strategy, accord.engines.xla.collective; "
        "assert 'torch_xla' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
