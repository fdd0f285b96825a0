"""The fault suite: ``tracestore serve`` as a subprocess on loopback under crashes, disk and storage
faults and hostile input (marker ``faults``; ``python -m pytest -m faults``, ~3-4 min on 2 cores).
Its results table (per scenario: trials, acknowledged record chunks, lost, duplicated, wedged, peak
RSS - idle RSS of the sidecar) is printed at the end of the session, so CI's log shows it, and
beside it the memory-bound table of scenario 12 (idle and peak RSS against budget + 64 MiB).

Knobs (environment): ``TRACESTORE_FUZZ_S`` (fuzz seconds, 20), ``TRACESTORE_FUZZ_SEED`` (replay a
fuzz run; the seed is in the table), ``TRACESTORE_STATEFUL_EXAMPLES`` (250),
``TRACESTORE_STATEFUL_SHRINK=1`` (shrink a stateful failure), ``FAULTS_SIDECAR_PYTHONPATH`` (run
another checkout's sidecar, e.g. ``git archive <commit>`` unpacked with ``tracestore/{server,client,
kernels}`` symlinked to its top-level dirs: a check that the suite fails an older, known-bad build).
Needs gcc for the LD_PRELOAD shim (faultshim.c); the real-tmpfs ENOSPC test needs mount rights.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .harness import _CURRENT, RESULTS, format_table
from .rss import RSS_ROWS, format_rss_table

_T0: list[float] = []


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.faults)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    _CURRENT["nodeid"] = item.nodeid
    if not _T0:
        _T0.append(time.monotonic())
    yield
    _CURRENT["nodeid"] = ""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call" or (rep.when == "setup" and not rep.passed):
        verdict = "pass" if rep.passed else "skip" if rep.skipped else "FAIL"
        crash = getattr(getattr(rep, "longrepr", None), "reprcrash", None)
        reason = (crash.message.strip().splitlines() or [""])[0] if crash is not None else ""
        for r in RESULTS:
            if r.nodeid == item.nodeid:
                r.outcome = verdict
                if verdict != "pass" and not r.note and reason:
                    r.note = reason[:160]  # an exception the test did not note itself


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not RESULTS:
        return
    elapsed = time.monotonic() - _T0[0] if _T0 else 0.0
    terminalreporter.section("tracestore fault suite")
    terminalreporter.write_line(format_table(RESULTS, elapsed))
    if RSS_ROWS:
        terminalreporter.write_line("")
        terminalreporter.write_line(format_rss_table(RSS_ROWS))


@pytest.fixture(scope="session")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The LD_PRELOAD fault shim (tests/faults/faultshim.c), built once per session."""
    from .harness import build_shim

    return build_shim(tmp_path_factory.mktemp("shim"))
