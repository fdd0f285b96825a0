"""Suite-wide setup: the name ``tests`` means this folder inside the test run.

``tests/`` has no ``__init__.py``, so outside pytest it never shadows a ``tests`` package another
distribution installs. Inside the run, helpers are imported as ``tests.<module>``; a regular
``tests`` package elsewhere on ``sys.path`` would win over this namespace folder, so the name is
bound here, before any test module is collected.
"""

import sys
import types
from pathlib import Path

import tracestore  # noqa: F401 - first: from the checkout its kernels/ folder then never answers `kernels`

_HERE = str(Path(__file__).resolve().parent)

if list(getattr(sys.modules.get("tests"), "__path__", [])) != [_HERE]:
    _tests = types.ModuleType("tests", "The tracestore test suite (a namespace bound by tests/conftest.py).")
    _tests.__path__ = [_HERE]
    sys.modules["tests"] = _tests
