"""`accord.imports`: one table of optional packages with their supported versions, and one
error that says how to install them."""

from __future__ import annotations

import pickle
import re
import subprocess
import sys

import pytest
import torch
from lightning_utilities.core.imports import RequirementCache

from accord.errors import MissingDependencyError
from accord.imports import OPTIONAL_PACKAGES, OptionalPackage, import_optional, require
from tests.helpers.processes import ROOT


def test_the_table_holds_the_versions_of_the_pip_extras() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    for name, package in OPTIONAL_PACKAGES.items():
        requirement = package.available.requirement
        assert requirement is not None and requirement.startswith(name)
        # The same specifier as the extra that installs it.
        assert f'{package.extra} = ["{requirement}"]' in pyproject, (name, requirement)


def test_a_version_outside_the_supported_range_says_which_is_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(
        OPTIONAL_PACKAGES, "torch", OptionalPackage("torch", RequirementCache("torch<1"), "old")
    )
    with pytest.raises(MissingDependencyError) as info:
        require("torch", "TimeMachine")
    message = str(info.value)
    installed = torch.__version__.split("+")[0]
    assert message.startswith("TimeMachine needs the `torch` package, which is installed")
    assert installed in message and "accord supports `torch<1`" in message
    assert "pip install 'accord[old]'" in message
    assert isinstance(info.value, ImportError)


def test_a_package_that_is_missing_is_named_with_its_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    missing = OptionalPackage("no_such_package", RequirementCache("no_such_package>=1"), "nope")
    monkeypatch.setitem(OPTIONAL_PACKAGES, missing.name, missing)
    with pytest.raises(MissingDependencyError) as info:
        import_optional("no_such_package.sub", "Feature")
    assert (info.value.feature, info.value.package, info.value.extra) == (
        "Feature",
        "no_such_package",
        "nope",
    )
    assert "which is not installed" in str(info.value)


def test_a_module_that_does_not_import_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    present = OptionalPackage("torch", RequirementCache("torch"), "torchy")
    monkeypatch.setitem(OPTIONAL_PACKAGES, "torch", present)
    with pytest.raises(MissingDependencyError, match=r"does not import \(No module named"):
        import_optional("torch.no_such_module", "Feature")


def test_only_listed_packages_can_be_required() -> None:
    with pytest.raises(KeyError, match=re.escape(str(sorted(OPTIONAL_PACKAGES)))):
        require("requests", "Feature")


def test_the_error_survives_pickling_with_its_reason() -> None:
    err = MissingDependencyError("F", "pkg", "extra", reason="is too old")
    copy = pickle.loads(pickle.dumps(err))
    assert str(copy) == str(err)
    assert (copy.feature, copy.package, copy.extra, copy.reason) == (
        "F",
        "pkg",
        "extra",
        "is too old",
    )


def test_checking_a_package_imports_nothing() -> None:
    code = (
        "import sys\n"
        "from accord.imports import OPTIONAL_PACKAGES, NUMPY_AVAILABLE\n"
        "[bool(p.available) for p in OPTIONAL_PACKAGES.values()], bool(NUMPY_AVAILABLE)\n"
        "print(sorted({'deepspeed', 'horovod', 'torch_xla', 'tensorboard'} & set(sys.modules)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "[]"


def test_a_package_hidden_from_imports_counts_as_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(MissingDependencyError, match="which is not installed"):
        require("tensorboard", "TensorBoardLogger")
