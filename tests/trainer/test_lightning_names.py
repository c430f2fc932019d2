"""Every name a Lightning 2.6.6 user writes exists in accord or is refused with a reason.

``data/lightning_2_6_6_names.json`` holds Lightning's own names: its ``Trainer`` arguments
and attributes, ``LightningModule``, ``Callback`` and ``LightningDataModule``. Where
Lightning is installed (the benchmarks' venv, ``make .venv-bench/.installed``) the file is
checked against Lightning itself. Each name must be provided by accord's class, or be in
`accord.trainer.lightning_names` with the reason it is not; docs/from-lightning.md carries
the table made from both (``python tests/trainer/test_lightning_names.py --write``
rewrites it).
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from accord import DataModule, Module, Trainer
from accord.callbacks import Callback
from accord.trainer import lightning_names as accord_names
from tests.helpers.processes import ROOT

NAMES_FILE = Path(__file__).with_name("data") / "lightning_2_6_6_names.json"
DOC = ROOT / "docs" / "from-lightning.md"
START, END = "<!-- lightning-names:start -->", "<!-- lightning-names:end -->"
BENCH_PYTHON = ROOT / ".venv-bench" / "bin" / "python"
# The names the issue lets accord leave out without a word.
EXCUSED = {
    "model_registry",
    "enable_autolog_hparams",
    "plugins",
    "to_onnx",
    "to_tensorrt",
    "fabric",
}

DUMP = """\
import inspect, json
import pytorch_lightning as pl
from pytorch_lightning import Callback, LightningDataModule, LightningModule, Trainer

def public(cls):
    names = set()
    for klass in cls.__mro__:
        if klass.__module__.startswith(("pytorch_lightning", "lightning")):
            names.update(n for n in vars(klass) if not n.startswith("_"))
    return sorted(names)

print(json.dumps({
    "lightning_version": pl.__version__,
    "callback": sorted(n for n in vars(Callback) if not n.startswith("_")),
    "module": public(LightningModule),
    "datamodule": public(LightningDataModule),
    "trainer_arguments": list(inspect.signature(Trainer.__init__).parameters)[1:],
    "trainer": sorted(n for n in vars(Trainer) if not n.startswith("_")),
}))
"""


def lightning_names() -> dict[str, Any]:
    return dict(json.loads(NAMES_FILE.read_text()))


def _trainer_attributes() -> set[str]:
    trainer = Trainer(logger=False, enable_progress_bar=False, enable_checkpointing=False)
    return {n for n in dir(Trainer)} | set(vars(trainer))


def provided(kind: str) -> set[str]:
    """The names accord's counterpart of Lightning's ``kind`` provides."""
    if kind == "trainer_arguments":
        return set(inspect.signature(Trainer.__init__).parameters)
    if kind == "trainer":
        return _trainer_attributes()
    cls = {"module": Module, "callback": Callback, "datamodule": DataModule}[kind]
    return set(dir(cls))


def refused(kind: str) -> dict[str, str]:
    """The names accord leaves out of ``kind``, with the reason."""
    return {
        "module": accord_names.MODULE_NAMES_NOT_PROVIDED,
        "trainer": accord_names.TRAINER_NAMES_NOT_PROVIDED,
    }.get(kind, {})


def differs(kind: str) -> dict[str, str]:
    """The names of ``kind`` accord takes with a difference, with what it is."""
    return {"trainer_arguments": accord_names.TRAINER_ARGUMENTS_DIFFERENT}.get(kind, {})


KINDS = ("trainer_arguments", "trainer", "module", "callback", "datamodule")


@pytest.mark.parametrize("kind", KINDS)
def test_every_lightning_name_is_provided_or_refused_with_a_reason(kind: str) -> None:
    names = lightning_names()[kind]
    have, without = provided(kind), refused(kind)
    silent = [n for n in names if n not in have and n not in without]
    assert not silent, f"Lightning {kind} names accord neither provides nor refuses: {silent}"
    for name, reason in without.items():
        assert name not in have, f"{name} is provided, but listed as not provided"
        assert len(reason) > 20, f"the reason for {name} says nothing: {reason!r}"
    counted = [n for n in names if n not in EXCUSED]
    share = sum(n in have for n in counted) / len(counted)
    assert share >= 0.95, f"accord provides {share:.0%} of Lightning's {kind} names"


def test_the_snapshot_is_lightnings_own() -> None:
    if not BENCH_PYTHON.exists():
        pytest.skip("Lightning is not installed (make .venv-bench/.installed)")
    result = subprocess.run(
        [str(BENCH_PYTHON), "-c", DUMP], capture_output=True, text=True, timeout=300, check=True
    )
    live = json.loads(result.stdout.strip().splitlines()[-1])
    assert live == lightning_names()


def render_table() -> str:
    """The markdown tables of docs/from-lightning.md's Lightning-name section."""
    data = lightning_names()
    titles = {
        "trainer_arguments": ("`Trainer` argument", "Trainer({}=...)"),
        "trainer": ("`Trainer` attribute or method", "trainer.{}"),
        "module": ("`LightningModule` name", "{}"),
        "callback": ("`Callback` name", "{}"),
        "datamodule": ("`LightningDataModule` name", "{}"),
    }
    parts = []
    for kind in KINDS:
        title, form = titles[kind]
        rows = [f"| {title} | accord |", "|---|---|"]
        without, different = refused(kind), differs(kind)
        for name in lightning_names()[kind] if kind in data else []:
            if name in without:
                status = f"not in accord: {without[name]}"
            elif name in different:
                status = f"same name; {different[name]}"
            else:
                status = "same name and meaning"
            rows.append(f"| `{form.format(name)}` | {status} |")
        parts.append("\n".join(rows))
    return "\n\n".join(parts)


def _doc_section() -> str:
    text = DOC.read_text()
    assert START in text and END in text, f"{DOC} lacks the {START} ... {END} section"
    return text.split(START, 1)[1].split(END, 1)[0].strip()


def test_the_docs_table_is_the_one_the_names_make() -> None:
    expected = render_table()
    assert _doc_section() == expected, (
        "docs/from-lightning.md's table of Lightning names is out of date; run "
        "`python tests/trainer/test_lightning_names.py --write`"
    )


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    text = DOC.read_text()
    before, rest = text.split(START, 1)
    after = rest.split(END, 1)[1]
    DOC.write_text(f"{before}{START}\n{render_table()}\n{END}{after}")
