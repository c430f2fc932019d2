"""``python -m accord.checkpoint inspect|convert``: see `accord.checkpoint.cli.main`."""

from __future__ import annotations

import sys

from accord.checkpoint.cli import main

if __name__ == "__main__":
    sys.exit(main())
