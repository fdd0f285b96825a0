"""gRPC health tells the truth: NOT_SERVING while the engine reports itself degraded (here: storage
refusing every commit for longer than storage_unhealthy_s), SERVING again once it recovers, and a
shutdown's NOT_SERVING is never turned back; Stat.degraded and tracestore_degraded{reason} agree."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tracestore.server.config import ServerConfig
from tracestore.server.engine.core import DEGRADED_REASONS
from tracestore.server.rpc.service import HEALTH_PERIOD_S, LIVENESS, SERVICE, Sidecar
from tracestore.server.testing import SPEC, make_chunk, wait_for, write_request

from tracestore.storage.store import Store
from tracestore.v1 import tracestore_pb2 as pb

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _statuses(ch: grpc.Channel) -> set[int]:
    stub = health_pb2_grpc.HealthStub(ch)
    return {int(stub.Check(health_pb2.HealthCheckRequest(service=s), timeout=5).status) for s in ("", SERVICE)}


def _stat(ch: grpc.Channel) -> pb.StatResponse:
    raw = ch.unary_unary("/tracestore.v1.TraceStore/Stat")(pb.StatRequest().SerializeToString(), timeout=5)
    return pb.StatResponse.FromString(raw)


def _gauges(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("tracestore_degraded{"):
            out[line.split('reason="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.slow
def test_health_follows_the_engine(tmp_path: Path) -> None:
    cfg = ServerConfig(storage=f"file://{tmp_path / 'data'}", wal_dir=str(tmp_path / "wal"), port=0, metrics_port=0,
                       flush_interval_s=0.05, storage_unhealthy_s=1.0, grace_s=2)  # fmt: skip
    sc = Sidecar(cfg).start()
    stopped = False
    try:
        Store(cfg.storage).put_run(SPEC)
        assert sc.metrics_port is not None
        with grpc.insecure_channel(f"127.0.0.1:{sc.port}") as ch:
            assert _statuses(ch) == {SERVING}
            assert list(_stat(ch).degraded) == []
            assert _gauges(sc.metrics_port) == dict.fromkeys(DEGRADED_REASONS, 0.0)
            # storage refuses every shard of version 1: a file where its directory goes
            blocker = tmp_path / "data" / SPEC.run / "v1"
            blocker.write_text("storage is refusing")
            req = write_request(1, [make_chunk("h", 0, 4, version=1)], writer="health").SerializeToString()
            acks = list(ch.stream_stream("/tracestore.v1.TraceStore/Write")(iter([req]), timeout=20))
            assert acks, "the write was not acknowledged (the WAL takes it while storage refuses)"
            wait_for("health NOT_SERVING", lambda: _statuses(ch) == {NOT_SERVING}, timeout=15)
            assert list(_stat(ch).degraded) == ["storage_refusing"]
            # a restart does not mend storage: the liveness name (what pod probes watch) stays SERVING
            live = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=LIVENESS), timeout=5)
            assert live.status == SERVING
            gauges = _gauges(sc.metrics_port)
            assert gauges["storage_refusing"] == 1.0
            assert {r: v for r, v in gauges.items() if r != "storage_refusing"} == dict.fromkeys(
                set(DEGRADED_REASONS) - {"storage_refusing"}, 0.0
            )
            blocker.unlink()  # storage recovers: the next commit goes through
            wait_for("health SERVING again", lambda: _statuses(ch) == {SERVING}, timeout=15)
            assert list(_stat(ch).degraded) == []
            assert _gauges(sc.metrics_port)["storage_refusing"] == 0.0
        sc.stop(2)
        stopped = True
        time.sleep(2 * HEALTH_PERIOD_S)  # the health loop would have run again by now
        for name in ("", SERVICE, LIVENESS):
            assert sc.health.Check(health_pb2.HealthCheckRequest(service=name), None).status == NOT_SERVING
    finally:
        if not stopped:
            sc.stop(2)
