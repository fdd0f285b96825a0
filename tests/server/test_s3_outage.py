"""S3 (moto's standalone server on loopback) stopped mid-ingest, then restarted: acks continue from
the WAL, the backlog rises within the memory budget and drains; everything reads back."""

from __future__ import annotations

import socket
import time
import uuid
from typing import Any

import numpy as np
import pytest
from tracestore.client import RolloutRecorder, SiteOutput
from tracestore.server.config import ServerConfig
from tracestore.server.service import Sidecar
from tracestore.server.testing import SPEC

from tracestore.plan import MicrobatchPlan
from tracestore.storage.reader import StoreReader
from tracestore.storage.store import Store

SITE = SPEC.site("layers.1.mlp.input")


def _options(endpoint: str) -> dict[str, Any]:
    return {
        "endpoint_url": endpoint,
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"region_name": "us-west-2"},
        "config_kwargs": {"connect_timeout": 1.0, "read_timeout": 1.0, "retries": {"max_attempts": 1}},
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.s3
@pytest.mark.slow
def test_s3_outage_delays_commits_only(tmp_path: Any) -> None:
    moto = pytest.importorskip("moto.server", reason="needs moto[server]>=5.2.5")
    s3fs = pytest.importorskip("s3fs", reason="needs the [s3] extra")
    port = _free_port()
    server = moto.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    bucket = f"ts-{uuid.uuid4().hex[:10]}"
    s3fs.S3FileSystem(**_options(endpoint)).mkdir(bucket)
    url = f"s3://{bucket}/root"
    budget = 4 << 20
    cfg = ServerConfig(storage=url, storage_options=_options(endpoint), wal_dir=str(tmp_path / "wal"), port=0,
                       metrics_port=None, flush_interval_s=0.1, memory_budget_bytes=budget,
                       max_message_bytes=1 << 20, storage_timeout_s=2.0)  # fmt: skip
    sc = Sidecar(cfg).start()
    rec = RolloutRecorder(f"127.0.0.1:{sc.port}", SPEC, "s3-writer", batch_bytes=64 << 10, give_up_s=120)
    rng = np.random.default_rng(0)
    sent: dict[str, np.ndarray] = {}

    def forward(i: int) -> None:
        t = f"s3t-{i}"
        codes = rng.integers(0, 256, (16, SITE.code_bytes), dtype=np.uint8)
        scales = rng.integers(0, 256, (16, SITE.scale_bytes), dtype=np.uint8)
        assert rec.record_forward([(t, 0, 16)], {SITE.name: SiteOutput(codes, scales, 0.5)})
        rec.finish(t, 17)
        sent[t] = np.concatenate([codes, scales], axis=1)

    try:
        for i in range(20):
            forward(i)
        assert rec.flush(30) and sc.engine is not None and sc.engine.flush(30)
        server.stop()  # outage
        peak = 0
        for i in range(20, 60):
            forward(i)
            peak = max(peak, sc.engine.in_use)
        assert rec.flush(30), rec.stats  # acked from the WAL while S3 is down
        time.sleep(1.5)  # flushes are attempted, fail, and are retried
        backlog = sc.engine.stat()["backlog_bytes"]
        assert backlog > 0, "nothing was pending during the outage"
        assert peak <= budget
        failures = sum(
            sample.value
            for metric in (sc.metrics.storage_errors, sc.metrics.storage_retries)
            for family in metric.collect()
            for sample in family.samples
            if sample.name.endswith("_total")
        )
        assert failures >= 1, "the outage left no trace in the storage metrics"
        ops = {
            sample.labels["op"]
            for metric in (sc.metrics.storage_errors, sc.metrics.storage_retries)
            for family in metric.collect()
            for sample in family.samples
        }
        assert all(" " not in op and SPEC.run not in op for op in ops), ops  # bounded labels, no ids
        server = moto.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()  # moto keeps its state across restarts in one process
        assert sc.engine.flush(60), sc.engine.stat()
        assert sc.engine.stat()["backlog_bytes"] == 0
        store = Store(url, _options(endpoint))
        trajs = sorted(sent)
        rows = StoreReader(store, SPEC.run).read(MicrobatchPlan([(t, 0, 16) for t in trajs]), sites=[SITE.name])
        got = np.concatenate([rows[SITE.name].codes, rows[SITE.name].scales], axis=1)
        assert np.array_equal(got, np.concatenate([sent[t] for t in trajs]))
    finally:
        rec.close(timeout=5)
        sc.stop(5)
        server.stop()
