"""The documentation's examples run, and its API reference covers every public name.

Every ```python block in ``docs/**/*.md`` and ``README.md`` is written to a file and run
as ``python <file>`` in a fresh process and a fresh temporary working directory, so
multi-process examples (which need a script file and an ``if __name__ == "__main__":``
guard) run exactly as a reader would run them. An HTML comment on the line before a
block's fence (invisible in the rendered page) changes that:

``<!-- docs-test: continue -->``
    The block runs after the page's last block that is not marked ``continue``: that
    block's code is put in front of this one. For an example split into a block that
    defines things and blocks that use them.
``<!-- docs-test: skip -->``
    The block is not run. Only for blocks that cannot run here (say why in the prose).
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.processes import ROOT

DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference"

MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<kind>[\w-]+)\s*-->\s*$")
FENCE_OPEN = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w+-]*)\s*$")
KINDS = ("skip", "continue")
BLOCK_TIMEOUT = 280.0  # under pytest-timeout's 300 s; DeepSpeed may compile its extension first

# Variables that would make an example join a job it is not part of.
_JOB_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "ACCORD_DEBUG_COLLECTIVES",
    "ACCORD_COLLECTIVE_TIMEOUT",
)

# The packages the API reference must cover name by name (their ``__all__``), and the
# public modules that their packages do not re-export.
PUBLIC_MODULES = (
    "accord",
    "accord.module",
    "accord.trainer",
    "accord.strategies",
    "accord.launchers",
    "accord.collectives",
    "accord.callbacks",
    "accord.loggers",
    "accord.accelerators",
    "accord.environments",
    "accord.precision",
    "accord.checkpoint",
    "accord.seed",
    "accord.testing",
    "accord.errors",
    "accord.imports",
    "accord.log",
)
SUBMODULES = (
    "accord.engines.torch.collective",
    "accord.engines.torch.topology",
    "accord.engines.torch.backend",
    "accord.engines.torch.ddp_decision",
    "accord.engines.deepspeed.collective",
    "accord.engines.deepspeed.extension",
    "accord.engines.horovod.collective",
    "accord.engines.xla.collective",
    "accord.core.wrappers.wrapper",
    "accord.core.wrappers.debug",
    "accord.core.wrappers.debug_fingerprint",
    "accord.core.wrappers.debug_fold",
    "accord.core.wrappers.stats",
    "accord.core.wrappers.watchdog",
    "accord.core.wrappers.policy",
    "accord.core.reduce_op",
    "accord.core.buffers",
    "accord.core.objects",
    "accord.core.op_checks",
    "accord.core.parallel",
    "accord.core.lazy",
    "accord.core.one_device",
    "accord.core.membership",
    "accord.core.liveness",
    "accord.core.regroup",
    "accord.core.connections",
    "accord.launchers.loss_notes",
    "accord.launchers.lost_children",
    "accord.launchers.unpicklable",
    "accord.launchers.supervisor",
    "accord.callbacks.model_checkpoint_top_k",
    "accord.trainer.rank_loss",
    "accord.engines.horovod.dtypes",
    "accord.engines.horovod.environment",
    "accord.engines.horovod.optimizer",
    "accord.engines.xla.base",
    "accord.core.strategy_checkpoints",
    "accord.core.communication",
    "accord.core.run_settings",
    "accord.core.process_group",
    "accord.core.group_membership",
    "accord.core.timeouts",
    "accord.core.rendezvous_address",
    "accord.core.env_vars",
    "accord.core.overrides",
    "accord.core.backend_threads",
    "accord.core.rendezvous",
    "accord.engines.torch.fsdp_checkpoint_directory",
    "accord.engines.torch.fsdp_units",
    "accord.engines.torch.safe_dcp",
    "accord.engines.torch.fsdp",
    "accord.engines.deepspeed.strategy",
    "accord.engines.horovod.strategy",
    "accord.engines.xla.strategy",
    "accord.engines.xla.launcher",
    "accord.launchers.launcher",
    "accord.launchers.multiprocessing",
    "accord.loggers.logger",
    "accord.engines.xla.environment",
    "accord.checkpoint.formats",
    "accord.checkpoint.writing",
    "accord.checkpoint.reading",
    "accord.checkpoint.compiled_names",
    "accord.checkpoint.cli",
    "accord.trainer.compile",
)


@dataclass(frozen=True)
class Block:
    """One ```python block of a Markdown file."""

    path: Path
    line: int
    code: str
    kind: str | None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def markdown_files() -> list[Path]:
    return [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]


def python_blocks(path: Path) -> list[Block]:
    """The page's ```python blocks, with the marker in front of each (if any)."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    pending: tuple[str, int] | None = None
    index = 0
    while index < len(lines):
        line = lines[index]
        marker = MARKER.match(line)
        if marker:
            kind = marker.group("kind")
            if kind not in KINDS:
                raise ValueError(f"{path}:{index + 1}: unknown marker {kind!r}; use {KINDS}.")
            pending = (kind, index + 1)
            index += 1
            continue
        fence = FENCE_OPEN.match(line)
        if fence is None:
            if pending is not None and line.strip():
                raise ValueError(f"{path}:{pending[1]}: a marker must come right before a fence.")
            index += 1
            continue
        indent, lang = fence.group("indent"), fence.group("lang")
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise ValueError(f"{path}:{index + 1}: the code fence is never closed.")
        body = [
            text[len(indent) :] if text.startswith(indent) else text
            for text in lines[index + 1 : end]
        ]
        if lang in ("python", "py"):
            kind = pending[0] if pending is not None else None
            blocks.append(Block(path, index + 1, "\n".join(body) + "\n", kind))
        elif pending is not None:
            raise ValueError(f"{path}:{pending[1]}: a marker before a {lang or 'plain'} block.")
        pending = None
        index = end + 1
    return blocks


def runnable_examples() -> list[Any]:
    params = []
    for path in markdown_files():
        base: Block | None = None
        for block in python_blocks(path):
            if block.kind == "continue":
                if base is None:
                    raise ValueError(f"{block.id}: 'continue' with no block before it.")
                code = base.code + "\n\n# --- continued ---\n" + block.code
            else:
                code = block.code
                base = block
            marks = (
                [pytest.mark.skip(reason="marked docs-test: skip")] if block.kind == "skip" else []
            )
            params.append(pytest.param(block, code, id=block.id, marks=marks))
    return params


def _example_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _JOB_VARIABLES}
    env.pop("PYTHONPATH", None)
    # The Makefile's directory (.venv/torch_extensions): DeepSpeed's extension is compiled
    # once per environment and then reused.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    return env


@pytest.mark.parametrize(("block", "code"), runnable_examples())
def test_example_runs(block: Block, code: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(code)
    try:
        result = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env=_example_env(),
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT,
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{block.id} did not finish within {BLOCK_TIMEOUT:.0f} s:\n{err.stderr}")
    if result.returncode != 0:
        pytest.fail(
            f"{block.id} exited with {result.returncode}.\n--- code ---\n{code}\n"
            f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-8000:]}"
        )


def test_markers_are_well_formed() -> None:
    # python_blocks raises on an unknown marker, a stray one, or an unclosed fence.
    blocks = [block for path in markdown_files() for block in python_blocks(path)]
    assert blocks, "no python examples found"
    skipped = [block.id for block in blocks if block.kind == "skip"]
    assert len(skipped) <= len(blocks) // 5, f"too many skipped examples: {skipped}"


# ------------------------------------------------------------------- API reference
def _reference_identifiers() -> list[str]:
    found = []
    for page in sorted(REFERENCE.glob("*.md")):
        found += re.findall(r"^:::\s+([\w.]+)\s*$", page.read_text(), flags=re.MULTILINE)
    return found


def _resolve(identifier: str) -> Any:
    parts = identifier.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            obj = getattr(obj, attribute)
        return obj
    raise ImportError(identifier)


def test_reference_identifiers_resolve() -> None:
    identifiers = _reference_identifiers()
    assert identifiers, "the API reference has no ::: blocks"
    broken = []
    for identifier in identifiers:
        try:
            _resolve(identifier)
        except (ImportError, AttributeError):
            broken.append(identifier)
    assert not broken, f"the API reference names objects that do not exist: {broken}"


@pytest.mark.parametrize("module_name", [*PUBLIC_MODULES, *SUBMODULES])
def test_reference_covers_every_public_name(module_name: str) -> None:
    module = importlib.import_module(module_name)
    identifiers = _reference_identifiers()
    documented: dict[str, list[Any]] = {}
    for identifier in identifiers:
        documented.setdefault(identifier.rsplit(".", 1)[-1], []).append(_resolve(identifier))
    missing = []
    for name in module.__all__:
        if f"{module_name}.{name}" in identifiers:
            continue
        # Documented under another path (e.g. accord.Trainer as accord.trainer.Trainer).
        target = getattr(module, name)
        if not any(obj is target for obj in documented.get(name, [])):
            missing.append(name)
    assert not missing, (
        f"{module_name}.__all__ names {missing}, which docs/reference/ does not document. "
        f"Add a '::: {module_name}.<name>' block to the page for {module_name}."
    )


def test_every_page_is_in_the_nav() -> None:
    config = (ROOT / "mkdocs.yml").read_text()
    pages = [p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")]
    missing = [page for page in pages if not re.search(rf":\s+{re.escape(page)}\s*$", config, re.M)]
    assert not missing, f"pages missing from mkdocs.yml's nav: {missing}"


def test_strategy_overview_lists_every_registered_name() -> None:
    from accord.strategies import StrategyRegistry

    page = (DOCS / "strategies" / "index.md").read_text()
    listed = set(re.findall(r"^\| `([\w-]+)` \|", page, flags=re.MULTILINE))
    registered = set(StrategyRegistry.available_strategies())
    assert listed == registered, (
        f"docs/strategies/index.md lists {sorted(listed - registered)} that are not "
        f"registered, and misses {sorted(registered - listed)}."
    )
