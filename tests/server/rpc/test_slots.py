"""Admission of calls to a real sidecar over TCP: idle Write streams never take the threads that
health checks, Stat, Seal and new writers need; streams over the cap are refused at once, naming
the limit; streams that wait for a turn to read get one even when the turn holders are idle."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tracestore.server.config import ServerConfig
from tracestore.server.rpc.service import Sidecar
from tracestore.server.rpc.write_stream import READ_TURN_IDLE_S
from tracestore.server.testing import SPEC, IdleWriteStream, make_chunk, write_request

from tracestore.records import TrajectorySeal
from tracestore.storage.store import Store
from tracestore.v1 import tracestore_pb2 as pb
from tracestore.wire import seal_to_pb

WRITE = "/tracestore.v1.TraceStore/Write"


def _sidecar(tmp_path: Path, **kw: Any) -> Sidecar:
    cfg = ServerConfig(storage=f"file://{tmp_path / 'data'}", wal_dir=str(tmp_path / "wal"), port=0, metrics_port=None,
                       flush_interval_s=0.05, grace_s=5, **kw)  # fmt: skip
    sc = Sidecar(cfg).start()
    Store(cfg.storage).put_run(SPEC)
    return sc


def _health(ch: grpc.Channel, timeout: float) -> int:
    return int(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout).status)


def _stat(ch: grpc.Channel, timeout: float) -> pb.StatResponse:
    raw = ch.unary_unary("/tracestore.v1.TraceStore/Stat")(pb.StatRequest().SerializeToString(), timeout=timeout)
    return pb.StatResponse.FromString(raw)


@pytest.mark.slow
def test_idle_streams_leave_threads_for_health_stat_and_writers(tmp_path: Path) -> None:
    """100 idle recorders: health and Stat still answer within 1 s, a writer still gets acks, and
    the 101st stream over a cap of 100 is refused at once with RESOURCE_EXHAUSTED naming the
    limit. (Before: each stream held one of 64 worker threads for good, and above
    maximum_concurrent_rpcs gRPC refused the health check itself.)"""
    # a budget that covers every stream's read at once: no stream here waits for a turn
    sc = _sidecar(tmp_path, max_streams=100, memory_budget_bytes=1 << 30, max_message_bytes=4 << 20)
    ch = grpc.insecure_channel(f"127.0.0.1:{sc.port}")
    idle: list[IdleWriteStream] = []
    try:
        writer = IdleWriteStream(ch, write_request(1, [make_chunk("busy", 0, 4)], writer="busy").SerializeToString())
        idle.append(writer)
        for _ in range(99):
            idle.append(IdleWriteStream(ch))
        deadline = time.monotonic() + 30
        while sc.metrics.active_streams._value.get() < 100:  # noqa: SLF001 - the gauge's value
            assert time.monotonic() < deadline, "the 100 streams did not all open"
            time.sleep(0.05)
        t0 = time.monotonic()
        assert _health(ch, timeout=1.0) == health_pb2.HealthCheckResponse.SERVING
        assert _stat(ch, timeout=1.0).state == pb.SERVING_STATE_SERVING
        assert time.monotonic() - t0 < 2.0
        deadline = time.monotonic() + 10
        while not writer.responses:
            assert time.monotonic() < deadline, "the writer among the idle streams got no ack"
            time.sleep(0.02)
        assert writer.responses[-1].durable_sequence == 1
        extra = IdleWriteStream(ch)
        assert extra.ended.wait(5), "the stream over the cap was not refused at once"
        assert extra.error is not None and extra.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_streams" in (extra.error.details() or ""), extra.error.details()
        assert "100" in (extra.error.details() or "")
        assert "retry-after-ms" in dict(extra.error.trailing_metadata() or ())
        # a stream that ends frees its place for a new one
        idle.pop().close()
        deadline = time.monotonic() + 10
        while sc.metrics.active_streams._value.get() >= 100:  # noqa: SLF001
            assert time.monotonic() < deadline
            time.sleep(0.05)
        again = IdleWriteStream(ch, write_request(1, [make_chunk("again", 0, 4)], writer="again").SerializeToString())
        idle.append(again)
        deadline = time.monotonic() + 10
        while not again.responses:
            assert again.error is None, again.error
            assert time.monotonic() < deadline, "no ack on the stream opened after one closed"
            time.sleep(0.02)
    finally:
        for s in idle:
            s.close()
        ch.close()
        sc.stop(5)


@pytest.mark.slow
def test_idle_turn_holders_yield_to_a_waiting_writer(tmp_path: Path) -> None:
    """Only (budget - gRPC's two copies) / 2 / max_message_bytes streams read at once (here 2). Two
    idle streams hold both turns; a third stream with a message to send gets its turn once they have
    been idle for their idle limit (at most READ_TURN_IDLE_S): they are ended with OK (all they sent
    is durable) and the writer is acked."""
    sc = _sidecar(tmp_path, memory_budget_bytes=28 << 20, max_message_bytes=4 << 20)
    assert sc.config.reading_streams == 2
    ch = grpc.insecure_channel(f"127.0.0.1:{sc.port}")
    holders = [
        IdleWriteStream(ch, write_request(1, [make_chunk(f"h{i}", 0, 4)], writer=f"holder-{i}").SerializeToString())
        for i in range(2)
    ]
    try:
        for h in holders:  # each has sent one message, is acked, and waits for its next one
            deadline = time.monotonic() + 10
            while not h.responses:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        t0 = time.monotonic()
        waiting = IdleWriteStream(ch, write_request(1, [make_chunk("late", 0, 4)], writer="late").SerializeToString())
        holders.append(waiting)
        deadline = t0 + READ_TURN_IDLE_S + 10
        while not waiting.responses:
            assert waiting.error is None, waiting.error
            assert time.monotonic() < deadline, "the waiting writer never got a turn to read"
            time.sleep(0.02)
        assert waiting.responses[-1].durable_sequence == 1
        ended = [h for h in holders[:2] if h.ended.is_set()]
        assert ended, "no idle turn holder was ended"
        for h in ended:
            assert h.error is None, h.error  # ended with OK, everything it sent acknowledged
            assert h.responses[-1].durable_sequence == 1
    finally:
        for h in holders:
            h.close()
        ch.close()
        sc.stop(5)


def _seal(ch: grpc.Channel, i: int, out: dict[int, Any]) -> None:
    seal = TrajectorySeal(SPEC.run, 1, f"sealed-{i}", 4, ("layers.1.mlp.input",))
    req = pb.SealRequest(run=SPEC.run, writer=f"sealer-{i}", epoch=1, sequence=1, seals=[seal_to_pb(seal)])
    try:
        out[i] = ch.unary_unary("/tracestore.v1.TraceStore/Seal")(req.SerializeToString(), timeout=6)
    except grpc.RpcError as exc:
        out[i] = exc


@pytest.mark.slow
def test_long_calls_leave_threads_for_health(tmp_path: Path) -> None:
    """Seals that cannot become durable (no WAL, storage refusing: they wait for a commit) take at
    most workers - 4 threads; the rest are refused at once with RESOURCE_EXHAUSTED, and health
    still answers within 1 s. (Before: 8 such Seals took all 8 threads and health timed out.)"""
    sc = Sidecar(ServerConfig(storage=f"file://{tmp_path / 'data'}", wal_dir=None, port=0, metrics_port=None,
                              flush_interval_s=0.05, workers=8, grace_s=2)).start()  # fmt: skip
    ch = grpc.insecure_channel(f"127.0.0.1:{sc.port}")
    try:
        Store(sc.config.storage).put_run(SPEC)
        (tmp_path / "data" / SPEC.run / "v1").write_text("storage refuses shards of version 1")
        out: dict[int, Any] = {}
        threads = [threading.Thread(target=_seal, args=(ch, i, out)) for i in range(8)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        assert _health(ch, timeout=1.0) == health_pb2.HealthCheckResponse.SERVING
        for t in threads:
            t.join()
        refused = [e for e in out.values() if isinstance(e, grpc.RpcError) and e.code().name == "RESOURCE_EXHAUSTED"]
        assert len(refused) >= 4, {i: e.code() if isinstance(e, grpc.RpcError) else e for i, e in out.items()}
        assert all("--workers" in (e.details() or "") for e in refused)
    finally:
        ch.close()
        sc.stop(2)
