from __future__ import annotations

import uuid

import pytest


@pytest.fixture
def memory_url() -> str:
    return f"memory://tracestore-test-{uuid.uuid4().hex}"
