"""Sidecar gauges that must move on their own (shared-memory staging in use, backlog age during a
storage outage) and a shutdown that keeps to its grace period while storage hangs."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from tracestore.client import RolloutRecorder, SiteOutput
from tracestore.server.config import ServerConfig
from tracestore.server.service import Sidecar
from tracestore.server.testing import SPEC

SITE = SPEC.site("layers.1.mlp.input")


def _gauge(sc: Sidecar, name: str) -> float:
    value = sc.metrics.registry.get_sample_value(name)
    return 0.0 if value is None else float(value)


def _wait(what: str, fn: Any, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _rows(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    codes = rng.integers(0, 256, (n, SITE.code_bytes), dtype=np.uint8)
    scales = rng.integers(0, 256, (n, SITE.scale_bytes), dtype=np.uint8)
    return codes, scales


def test_shm_in_use_counts_descriptors_until_durable(tmp_path: Path, memory_url: str) -> None:
    """tracestore_shm_in_use_bytes: staging bytes named by shared-memory descriptors the sidecar
    received and has not acknowledged as durable (the writer cannot reuse them yet)."""
    cfg = ServerConfig(storage=memory_url, wal_dir=None, port=0, metrics_port=None,
                       unix_socket=str(tmp_path / "s.sock"), flush_interval_s=600.0)  # fmt: skip
    sc = Sidecar(cfg).start()
    rec = RolloutRecorder(f"unix://{tmp_path / 's.sock'}", SPEC, "shm-gauge", linger_s=0.0)
    try:
        codes, scales = _rows(np.random.default_rng(0), 16)
        assert rec.record_forward([("shm-t0", 0, 16)], {SITE.name: SiteOutput(codes, scales, 0.5)})
        held = _wait("the descriptor to arrive", lambda: _gauge(sc, "tracestore_shm_in_use_bytes"))
        assert held == codes.nbytes + scales.nbytes  # one single-piece chunk travels as a descriptor
        assert _gauge(sc, "tracestore_shm_capacity_bytes") >= rec.pool.capacity
        assert sc.engine is not None and sc.engine.flush(30)  # committed = durable (no WAL)
        assert rec.flush(30), rec.stats
        assert _gauge(sc, "tracestore_shm_in_use_bytes") == 0
    finally:
        rec.close(timeout=5)
        sc.stop(5)
