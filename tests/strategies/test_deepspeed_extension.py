"""DeepSpeed's shared-memory extension build: a notice before it, a clear error on a stale lock.

Each process test sets up a real one-rank `DeepSpeedCollective` in a fresh process with a
temporary ``TORCH_EXTENSIONS_DIR``, so it sees exactly the build directory it prepared:
empty (DeepSpeed really compiles), a copy of an already built extension, or a ``lock``
file left behind. Nothing of DeepSpeed or torch is mocked.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from accord.engines.deepspeed.extension import (
    LOCK_TIMEOUT_ENV_VAR,
    ExtensionBuild,
    lock_timeout,
    prepare_extension_build,
)
from accord.errors import CollectiveError, ConfigurationError
from tests.helpers.processes import ROOT

pytest.importorskip(
    "deepspeed", reason="the extension is DeepSpeed's: pip install 'accord[deepspeed]'"
)

NAME = "deepspeed_shm_comm"
SETUP = (
    "from accord.engines.deepspeed.collective import DeepSpeedCollective\n"
    "DeepSpeedCollective().setup().teardown()\n"
    "print('setup done', flush=True)\n"
)
# Generous for importing DeepSpeed and probing its ops on two busy cores; far below a
# build, and a process that hangs on a lock never finishes at all.
NO_BUILD_TIMEOUT = 120.0


def _env(extensions: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")
    }
    env.pop(LOCK_TIMEOUT_ENV_VAR, None)
    # Unbuffered, so the merged output keeps the order in which things were printed.
    env.update(TORCH_EXTENSIONS_DIR=str(extensions), PYTHONUNBUFFERED="1", **extra)
    return env


def _run(
    code: str, extensions: Path, timeout: float, **extra: str
) -> subprocess.CompletedProcess[str]:
    """Run ``python -c code`` with its own extensions directory; stdout and stderr merged."""
    return subprocess.run(
        [sys.executable, "-c", code],
        env=_env(extensions, **extra),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


def _built_extension() -> Path | None:
    """An extension this environment has built already: where the Makefile or torch put it."""
    candidates = [Path(sys.prefix) / "torch_extensions" / NAME]
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        candidates.insert(0, Path(os.environ["TORCH_EXTENSIONS_DIR"]) / NAME)
    return next((c for c in candidates if (c / f"{NAME}.so").is_file()), None)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A built extension directory to copy: this environment's, or one built here once."""
    found = _built_extension()
    if found is not None:
        return found
    extensions = tmp_path_factory.mktemp("built")
    result = _run(SETUP, extensions, timeout=600)
    assert result.returncode == 0, result.stdout
    return extensions / NAME


@pytest.fixture
def copied(built: Path, tmp_path: Path) -> Path:
    """A temporary extensions directory holding a copy (mtimes kept) of a built extension."""
    extensions = tmp_path / "extensions"
    shutil.copytree(built, extensions / NAME, ignore=shutil.ignore_patterns("lock"))
    return extensions


# ----------------------------------------------------------------- real processes
@pytest.mark.timeout(600)  # this one really compiles: about 45-95 s on two cores
def test_the_notice_comes_before_a_real_build(tmp_path: Path) -> None:
    extensions = tmp_path / "extensions"
    result = _run(SETUP, extensions, timeout=590)
    assert result.returncode == 0, result.stdout
    lines = result.stdout.splitlines()
    notices = [i for i, line in enumerate(lines) if "compiling" in line and NAME in line]
    assert len(notices) == 1, result.stdout
    assert str(extensions / NAME) in lines[notices[0]]
    assert "minute" in lines[notices[0]]
    # DeepSpeed reports the loaded extension after the build; the notice came before it.
    loaded = [i for i, line in enumerate(lines) if "built successfully" in line]
    assert loaded and notices[0] < loaded[0], result.stdout
    assert (extensions / NAME / f"{NAME}.so").is_file()


def test_a_built_extension_is_reused_without_a_notice(copied: Path) -> None:
    library = copied / NAME / f"{NAME}.so"
    before = library.stat().st_mtime_ns
    result = _run(SETUP, copied, timeout=NO_BUILD_TIMEOUT)
    assert result.returncode == 0, result.stdout
    assert "setup done" in result.stdout
    assert "compiling" not in result.stdout and "[accord]" not in result.stdout
    # The copy was accepted as it is: ninja rebuilt nothing.
    assert library.stat().st_mtime_ns == before


def test_a_stale_lock_is_refused_naming_the_file(tmp_path: Path) -> None:
    extensions = tmp_path / "extensions"
    lock = extensions / NAME / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    an_hour_ago = time.time() - 3600
    os.utime(lock, (an_hour_ago, an_hour_ago))
    # Without the check, torch's FileBaton waits for this lock forever: the timeout fails it.
    result = _run(SETUP, extensions, timeout=NO_BUILD_TIMEOUT)
    assert result.returncode != 0, result.stdout
    assert "CollectiveError" in result.stdout
    assert str(lock) in result.stdout
    assert "delete" in result.stdout
    assert lock.exists(), "accord must not delete a lock itself"


@pytest.mark.timeout(2 * NO_BUILD_TIMEOUT)
def test_a_fresh_lock_is_waited_for_with_a_notice(copied: Path) -> None:
    lock = copied / NAME / "lock"
    lock.touch()
    with subprocess.Popen(
        [sys.executable, "-c", SETUP],
        env=_env(copied),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as proc:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "waiting" in line:
                break
        assert seen and str(lock) in seen[-1], "".join(seen)
        assert proc.poll() is None, "the process must wait, not fail"
        # The build "in the other process" ends: its lock goes, and this setup goes on.
        lock.unlink()
        rest, _ = proc.communicate(timeout=NO_BUILD_TIMEOUT)
    assert proc.returncode == 0, "".join(seen) + rest
    assert "setup done" in rest


@pytest.mark.timeout(2 * NO_BUILD_TIMEOUT)
def test_a_lock_that_outlives_the_timeout_is_refused(copied: Path) -> None:
    lock = copied / NAME / "lock"
    lock.touch()
    result = _run(SETUP, copied, timeout=NO_BUILD_TIMEOUT, **{LOCK_TIMEOUT_ENV_VAR: "3"})
    assert result.returncode != 0, result.stdout
    output = result.stdout
    # Whether it waited first depends on how long the process took to start; either way the
    # lock ends in the error, not in a wait without end.
    assert "CollectiveError" in output, output
    assert f"{LOCK_TIMEOUT_ENV_VAR}=3" in output


def test_the_default_directory_is_torchs(tmp_path: Path) -> None:
    code = (
        "from accord.engines.deepspeed.extension import shm_extension_build\n"
        "print('directory', shm_extension_build().directory)\n"
    )
    env = _env(tmp_path, HOME=str(tmp_path))
    for name in ("TORCH_EXTENSIONS_DIR", "XDG_CACHE_HOME"):
        env.pop(name, None)
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=NO_BUILD_TIMEOUT,
    )
    assert result.returncode == 0, result.stderr
    tag = f"py{sys.version_info.major}{sys.version_info.minor}{sys.abiflags}_cpu"
    expected = tmp_path.resolve() / ".cache" / "torch_extensions" / tag / NAME
    assert f"directory {expected}\n" in result.stdout


# ---------------------------------------------------------- the check on its own
def test_only_an_announcing_rank_prints(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="accord")
    build = ExtensionBuild(NAME, tmp_path)
    prepare_extension_build(build, announce=False)
    assert caplog.records == []
    prepare_extension_build(build, announce=True)
    (notice,) = caplog.records
    assert notice.name == "accord.engines.deepspeed.extension"
    assert "\n" not in notice.getMessage() and str(tmp_path) in notice.getMessage()


def test_a_library_counts_as_built_only_if_torch_would_not_rebuild_it(tmp_path: Path) -> None:
    source = tmp_path / "src" / "shm.cpp"
    source.parent.mkdir()
    source.touch()
    library = tmp_path / f"{NAME}.so"
    recipe = tmp_path / "build.ninja"
    build = ExtensionBuild(NAME, tmp_path, sources=(source,))
    recipe.write_text(f"build shm.o: compile {source}\n")
    assert not build.is_built  # no library yet
    library.touch()
    assert build.is_built
    # Another environment's sources: ninja's command changes, and it compiles again.
    recipe.write_text("build shm.o: compile /elsewhere/site-packages/shm.cpp\n")
    assert not build.is_built
    recipe.write_text(f"build shm.o: compile {source}\n")
    # Sources newer than the library (DeepSpeed was upgraded in place).
    an_hour_ago = time.time() - 3600
    os.utime(library, (an_hour_ago, an_hour_ago))
    assert not build.is_built


@pytest.mark.parametrize("raw", ["ten", "-1", "0"])
def test_a_bad_lock_timeout_is_a_configuration_error(
    raw: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(LOCK_TIMEOUT_ENV_VAR, raw)
    with pytest.raises(ConfigurationError, match=LOCK_TIMEOUT_ENV_VAR):
        lock_timeout()


def test_the_lock_timeout_defaults_to_ten_minutes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LOCK_TIMEOUT_ENV_VAR, raising=False)
    assert lock_timeout() == 600.0
    monkeypatch.setenv(LOCK_TIMEOUT_ENV_VAR, "90")
    assert lock_timeout() == 90.0


def test_a_stale_lock_is_refused_in_process(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    os.utime(lock, (time.time() - 30, time.time() - 30))
    with pytest.raises(CollectiveError, match="delete it"):
        prepare_extension_build(ExtensionBuild(NAME, tmp_path), announce=True, stale_after=10)
