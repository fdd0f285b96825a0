"""A recorder the sidecar will not take messages from must stop or back off, never spin: its
sender thread shares the rollout engine's GIL. Real sidecar, real recorders, a raw gRPC client
as the hostile writer; reconnects counted over 2 s (they ran at hundreds per second)."""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from tracestore.client import RolloutRecorder, SiteOutput
from tracestore.client.record.recorder import WriterFencedError
from tracestore.server.config import ServerConfig
from tracestore.server.rpc.service import Sidecar
from tracestore.server.testing import SPEC, make_chunk, wait_for, write_request

from tracestore.errors import PermissionDeniedError
from tracestore.v1 import tracestore_pb2 as pb

SITE = SPEC.site("layers.1.mlp.input")
WINDOW_S = 2.0
HANDFUL = 15  # reconnects in WINDOW_S with the backoff: ~6-9; without it: 400-700


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[Sidecar]:
    cfg = ServerConfig(storage=f"memory://fence-{uuid.uuid4().hex}", wal_dir=None, port=0, metrics_port=None,
                       unix_socket=str(tmp_path / "s.sock"), shm_dir=str(tmp_path), flush_interval_s=0.05)  # fmt: skip
    sc = Sidecar(cfg).start()
    try:
        yield sc
    finally:
        sc.stop(2)


def _forward(rec: RolloutRecorder, traj: str, start: int = 0, n: int = 4) -> bool:
    rows = n * SITE.rows_per_token
    codes = np.full((rows, SITE.code_bytes), start & 0xFF, np.uint8)
    scales = np.full((rows, SITE.scale_bytes), 7, np.uint8)
    return rec.record_forward([(traj, start, start + n)], {SITE.name: SiteOutput(codes, scales, 0.5)})


def _recorder(address: str, writer: str, **kw: object) -> RolloutRecorder:
    return RolloutRecorder(address, SPEC, writer, staging_bytes=1 << 20, linger_s=0.0, **kw)  # type: ignore[arg-type]


def _raw_write(sc: Sidecar, req: pb.WriteRequest) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{sc.port}") as ch:
        for raw in ch.stream_stream("/tracestore.v1.TraceStore/Write")(iter([req.SerializeToString()]), timeout=10):
            if pb.WriteResponse.FromString(raw).durable_sequence >= req.sequence:
                return
    raise AssertionError("not acknowledged")


def _window(rec: RolloutRecorder) -> tuple[int, int]:
    """(reconnects, resends) of ``rec`` over the next WINDOW_S seconds."""
    r0, s0 = rec.stats["reconnects"], rec.stats["resent"]
    time.sleep(WINDOW_S)
    return rec.stats["reconnects"] - r0, rec.stats["resent"] - s0


def test_hostile_max_epoch_fences_the_recorder_which_stops(sidecar: Sidecar) -> None:
    """Someone writes under the recorder's writer id with epoch 2**64-1: no epoch of the
    recorder can pass it. Before: it started a new epoch on every refusal, forever."""
    victim = _recorder(f"127.0.0.1:{sidecar.port}", "victim")
    try:
        assert _forward(victim, "v-t0") and victim.flush(10)
        hostile = write_request(1, [make_chunk("hostile-t0", 0, 4)], writer="victim", epoch=2**64 - 1, declare=True)
        _raw_write(sidecar, hostile)
        assert _forward(victim, "v-t1")
        t0 = time.monotonic()
        wait_for("the recorder to report it is fenced", lambda: victim.error is not None, timeout=10)
        reconnects, resent = _window(victim)
        assert isinstance(victim.error, WriterFencedError), victim.error
        assert "18446744073709551615" in str(victim.error) and "victim" in str(victim.error)
        assert victim.stats["reconnects"] <= 2 and reconnects == 0 and resent == 0, victim.stats
        assert time.monotonic() - t0 < 10
        # its open trajectories are unguided and nothing more is recorded or sealed
        assert {"v-t0", "v-t1"} <= victim.unguided
        assert not _forward(victim, "v-t2") and "v-t2" in victim.unguided
        assert not victim.finish("v-t1", 5)
        t1 = time.monotonic()
        assert not victim.flush(10) and time.monotonic() - t1 < 1
    finally:
        victim.close(timeout=2)


def test_a_stopped_recorder_logs_its_refusals_once(sidecar: Sidecar, caplog: pytest.LogCaptureFixture) -> None:
    """Once fenced, every refused forward marks its trajectories unguided (fenced). Before: one
    WARNING per refused record_forward, flooding the engine's log for the rest of the rollout."""
    caplog.set_level(logging.WARNING, logger="tracestore.client")
    victim = _recorder(f"127.0.0.1:{sidecar.port}", "loud")
    try:
        assert _forward(victim, "l-t0") and victim.flush(10)
        _raw_write(sidecar, write_request(1, [make_chunk("h-t0", 0, 4)], writer="loud", epoch=2**64 - 1, declare=True))
        assert _forward(victim, "l-t1")
        wait_for("the recorder to report it is fenced", lambda: victim.error is not None, timeout=10)
        for i in range(20):
            assert not _forward(victim, f"l-refused-{i}")
        assert {f"l-refused-{i}" for i in range(20)} <= victim.unguided
        fenced = [r for r in caplog.records if r.levelno >= logging.WARNING and "unguided (fenced)" in r.getMessage()]
        assert len(fenced) == 1, [r.getMessage() for r in fenced]
    finally:
        victim.close(timeout=2)


def test_a_second_instance_with_the_same_writer_id_fences_the_first(sidecar: Sidecar) -> None:
    """The restarted engine (newer epoch) keeps the writer id; the old one stops instead of
    taking it back with an even newer epoch (the two fenced each other in turn)."""
    address = f"127.0.0.1:{sidecar.port}"
    first = _recorder(address, "shared-id")
    second = None
    try:
        assert _forward(first, "a-t0") and first.flush(10)
        second = _recorder(address, "shared-id")
        assert second.epoch > first.epoch
        assert _forward(second, "b-t0") and second.flush(10)
        assert _forward(first, "a-t1")
        wait_for("the first recorder to report it is fenced", lambda: first.error is not None, timeout=10)
        reconnects, _ = _window(first)
        assert isinstance(first.error, WriterFencedError), first.error
        assert first.stats["reconnects"] <= 2 and reconnects == 0, first.stats
        assert "a-t1" in first.unguided
        # the second one was never fenced back: it goes on writing
        for i in range(1, 4):
            assert _forward(second, "b-t0", start=4 * i)
        assert second.flush(10) and second.error is None, second.stats
        assert second.stats["reconnects"] == 0
        assert second.finish("b-t0", 17) and second.flush(10)
    finally:
        first.close(timeout=2)
        if second is not None:
            second.close(timeout=2)


def test_a_refusal_without_a_failed_sequence_backs_off(sidecar: Sidecar, tmp_path: Path) -> None:
    """The recorder's pool is not in the sidecar's shm_dir: every stream is refused
    (INVALID_ARGUMENT) before a sequence is known, so no tracestore-failed-sequence trailer.
    Before: an immediate reconnect and resend each time (~330 per second)."""
    other = tmp_path / "elsewhere"
    other.mkdir()
    rec = _recorder(f"unix://{tmp_path / 's.sock'}", "misplaced", shm_dir=str(other))
    try:
        assert _forward(rec, "m-t0")
        wait_for("a first refusal", lambda: rec.stats["reconnects"] > 0, timeout=10)
        reconnects, resent = _window(rec)
        assert 1 <= reconnects <= HANDFUL, rec.stats
        assert resent <= HANDFUL, rec.stats
        assert rec.error is None  # not fatal: it keeps trying, ever more slowly, until give_up_s
    finally:
        rec.close(timeout=1)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a socket group the test process is not in")
def test_permission_denied_stops_the_recorder(tmp_path: Path) -> None:
    """The sidecar's socket admits group 54320, so it reads only pools of that group; a recorder
    that puts its pool in another group is refused (PERMISSION_DENIED) and stops, naming why."""
    cfg = ServerConfig(storage=f"memory://deny-{uuid.uuid4().hex}", wal_dir=None, port=0, metrics_port=None,
                       unix_socket=str(tmp_path / "s.sock"), shm_dir=str(tmp_path), socket_group="54320")  # fmt: skip
    sc = Sidecar(cfg).start()
    rec = _recorder(f"unix://{tmp_path / 's.sock'}", "denied", shm_dir=str(tmp_path), shm_group=54329)
    try:
        assert _forward(rec, "d-t0")
        wait_for("the recorder to stop", lambda: rec.error is not None, timeout=10)
        reconnects, _ = _window(rec)
        assert isinstance(rec.error, PermissionDeniedError), rec.error
        assert rec.pool.name is not None and rec.pool.name in str(rec.error) and "54320" in str(rec.error)
        assert rec.stats["reconnects"] == 1 and reconnects == 0, rec.stats
        assert "d-t0" in rec.unguided
    finally:
        rec.close(timeout=1)
        sc.stop(2)


def test_backoff_resets_once_the_sidecar_takes_messages_again(tmp_path: Path) -> None:
    """The wait grows only while nothing is acknowledged: after a sidecar outage the recorder
    delivers its records within the cap and its next hiccup starts from the shortest wait."""
    cfg = ServerConfig(storage=f"memory://back-{uuid.uuid4().hex}", wal_dir=None, port=0, metrics_port=None,
                       flush_interval_s=0.05)  # fmt: skip
    sc = Sidecar(cfg).start()
    port = sc.port
    rec = _recorder(f"127.0.0.1:{port}", "outage", reconnect_cap_s=1.0)
    try:
        assert _forward(rec, "o-t0") and rec.flush(10)
        sc.stop(1)
        assert _forward(rec, "o-t1")
        time.sleep(3)  # refused connections meanwhile: the wait reached the 1 s cap
        down = rec.stats["reconnects"]
        assert 2 <= down <= HANDFUL, rec.stats
        sc = Sidecar(ServerConfig(storage=cfg.storage, wal_dir=None, port=port, metrics_port=None,
                                  flush_interval_s=0.05)).start()  # fmt: skip
        t0 = time.monotonic()
        assert rec.flush(10), rec.stats
        assert time.monotonic() - t0 < 2.5  # at most one capped wait, plus the send
        assert rec.error is None and not rec.unguided
    finally:
        rec.close(timeout=2)
        sc.stop(1)
