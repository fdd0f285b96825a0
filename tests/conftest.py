"""Suite-wide setup: the name ``tests`` means this folder inside the test run.

``tests/`` has no ``__init__.py``, so outside pytest it never shadows a ``tests`` package another
distribution installs. Inside the run, helpers are imported as ``tests.<module>``; a regular
``tests`` package elsewhere on ``sys.path`` would win over this namespace folder, so the name is
bound here, before any test module is collected.
"""

import sys
import types
from pathlib import Path

import tracestore  # noqa: F401 - first: from the checkout client/ and server/ then never answer their names

_HERE = str(Path(__file__).resolve().parent)

if list(getattr(sys.modules.get("tests"), "__path__", [])) != [_HERE]:
    _tests = types.ModuleType("tests", "The tracestore test suite (a namespace bound by tests/conftest.py).")
    _tests.__path__ = [_HERE]
    sys.modules["tests"] = _tests

_OUTCOMES: dict[str, str] = {}  # nodeid -> passed / failed / skipped, for tests/findings.py's table


def pytest_runtest_logreport(report) -> None:  # type: ignore[no-untyped-def]
    if report.when == "call" or (report.when == "setup" and not report.passed):
        _OUTCOMES[report.nodeid] = report.outcome
    elif report.when == "teardown" and report.failed:
        _OUTCOMES[report.nodeid] = "failed"


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    from tests.findings import format_findings

    table = format_findings(_OUTCOMES)
    if table:
        terminalreporter.section("tracestore adversarial review: findings and their tests")
        terminalreporter.write_line(table)
