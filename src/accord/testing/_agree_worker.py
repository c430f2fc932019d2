"""One rank of an `assert_strategies_agree` run that an outside launcher (horovodrun) started.

Usage: ``python -m accord.testing._agree_worker ARGS_FILE``. The file holds, pickled, the
caller's ``sys.path`` and then the arguments of the training; this rank trains and leaves
its record file beside the arguments, as every rank of the kit does.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    """Train one rank from the arguments file ``argv[0]``."""
    with Path(argv[0]).open("rb") as f:
        paths = pickle.load(f)
        # The caller's import paths first, so its make_module and make_data unpickle here.
        sys.path[:0] = [p for p in paths if p not in sys.path]
        args = pickle.load(f)

    from accord.testing._agree_launch import _fit

    _fit(*args)


if __name__ == "__main__":
    main(sys.argv[1:])
