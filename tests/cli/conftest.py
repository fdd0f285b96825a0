"""Every CLI test starts without TRACESTORE_* variables from the calling environment."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("TRACESTORE_"):
            monkeypatch.delenv(k)
