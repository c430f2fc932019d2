"""Without horovod installed, asking for it fails early and says how to install it.

The real Horovod fits are in ``test_horovod.py``, which runs where horovod is installed
(``make test-horovod``).
"""

from __future__ import annotations

import importlib.util

import pytest

import accord
from accord.engines.horovod.collective import HorovodCollective
from accord.engines.horovod.strategy import HorovodStrategy
from accord.errors import MissingDependencyError
from accord.strategies import StrategyRegistry

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("horovod") is not None,
    reason="horovod is installed here; test_horovod.py runs the real thing",
)

INSTALL = "pip install 'accord[horovod]'"


def _check(err: MissingDependencyError, feature: str) -> None:
    assert (err.feature, err.package, err.extra) == (feature, "horovod", "horovod")
    assert INSTALL in str(err)


def test_trainer_strategy_name_says_how_to_install() -> None:
    with pytest.raises(MissingDependencyError) as info:
        accord.Trainer(strategy="horovod", accelerator="cpu", logger=False)
    _check(info.value, "HorovodStrategy")
    # It is an ImportError too, so `except ImportError` in user code catches it.
    assert isinstance(info.value, ImportError)


def test_strategy_and_collective_classes_say_how_to_install() -> None:
    with pytest.raises(MissingDependencyError) as strategy:
        HorovodStrategy()
    _check(strategy.value, "HorovodStrategy")
    with pytest.raises(MissingDependencyError) as collective:
        HorovodCollective()
    _check(collective.value, "HorovodCollective")


def test_the_name_is_registered_without_horovod() -> None:
    assert "horovod" in StrategyRegistry.available_strategies()
    assert StrategyRegistry.get("horovod").strategy_cls is HorovodStrategy
