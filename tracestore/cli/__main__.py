"""``python -m tracestore.cli``: the ``tracestore`` command."""

import sys

from tracestore.cli import main

sys.exit(main())
