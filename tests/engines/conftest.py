"""Fixtures shared by the engine tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tracestore.server.testing import ServeProcess


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    sp = ServeProcess(tmp_path_factory.mktemp("sidecar"), flags=["--flush-interval", "0.2"])
    sp.start()
    try:
        yield sp
    finally:
        sp.terminate()
