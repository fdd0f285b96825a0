"""``python -m tracestore``: the ``tracestore`` command."""

from __future__ import annotations

import sys

from tracestore.cli import main

if __name__ == "__main__":
    sys.exit(main())
