"""Sidecar gauges that must move on their own (shared-memory staging in use, backlog age during a
storage outage) and a shutdown that keeps to its grace period while storage hangs."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tracestore.client import RolloutRecorder, SiteOutput
from tracestore.server.config import ServerConfig
from tracestore.server.rpc.service import Sidecar
from tracestore.server.testing import SPEC, wait_for

from tracestore.plan import MicrobatchPlan
from tracestore.storage.reader import StoreReader
from tracestore.storage.store import Store

SITE = SPEC.site("layers.1.mlp.input")


def _gauge(sc: Sidecar, name: str) -> float:
    value = sc.metrics.registry.get_sample_value(name)
    return 0.0 if value is None else float(value)


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
        held = wait_for("the descriptor to arrive", lambda: _gauge(sc, "tracestore_shm_in_use_bytes"))
        assert held == codes.nbytes + scales.nbytes  # one single-piece chunk travels as a descriptor
        assert _gauge(sc, "tracestore_shm_capacity_bytes") >= rec.pool.capacity
        assert sc.engine is not None and sc.engine.flush(30)  # committed = durable (no WAL)
        assert rec.flush(30), rec.stats
        assert _gauge(sc, "tracestore_shm_in_use_bytes") == 0
    finally:
        rec.close(timeout=5)
        sc.stop(5)


class _Relay:
    """A TCP relay to moto on loopback that can turn into a black hole: connections it holds are
    cut, new ones are accepted and never answered (what a hung S3 endpoint looks like)."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.open = True
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            if not self.open:
                continue  # held, never answered
            try:
                u = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                c.close()
                continue
            self.conns.append(u)
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(1 << 16):
                b.sendall(data)
        for s in (a, b):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def blackhole(self) -> None:
        self.open = False
        for s in self.conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.sock.close()
        for s in self.conns:
            s.close()


@pytest.fixture
def hung_s3(tmp_path: Path) -> Any:
    """A sidecar (WAL on, grace 1.5 s, storage timeout 1 s) whose S3 hangs after a first commit,
    holding one acknowledged, uncommitted trajectory. Afterwards storage comes back and a new
    sidecar on the same WAL must commit everything that was acknowledged."""
    moto = pytest.importorskip("moto.server", reason="needs moto[server]>=5.2.5")
    s3fs = pytest.importorskip("s3fs", reason="needs the [s3] extra")
    server = moto.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    relay = _Relay(server.get_host_and_port()[1])
    options = {"endpoint_url": f"http://127.0.0.1:{relay.port}", "key": "testing", "secret": "testing",
               "client_kwargs": {"region_name": "us-west-2"},
               "config_kwargs": {"connect_timeout": 1.0, "read_timeout": 1.0,
                                 "retries": {"max_attempts": 1}}}  # fmt: skip
    bucket = f"ts-{uuid.uuid4().hex[:10]}"
    s3fs.S3FileSystem(**options, skip_instance_cache=True).mkdir(bucket)
    url = f"s3://{bucket}/root"
    cfg = ServerConfig(storage=url, storage_options=options, wal_dir=str(tmp_path / "wal"), port=0, metrics_port=None,
                       flush_interval_s=0.2, storage_timeout_s=1.0, grace_s=1.5)  # fmt: skip
    sc = Sidecar(cfg).start()
    rng = np.random.default_rng(1)
    sent: dict[str, np.ndarray] = {}
    rec = RolloutRecorder(f"127.0.0.1:{sc.port}", SPEC, "outage-writer", give_up_s=120, linger_s=0.0)
    try:

        def forward(t: str) -> None:
            codes, scales = _rows(rng, 8)
            assert rec.record_forward([(t, 0, 8)], {SITE.name: SiteOutput(codes, scales, 0.5)})
            rec.finish(t, 9)
            sent[t] = np.concatenate([codes, scales], axis=1)

        forward("before")
        assert rec.flush(30) and sc.engine is not None and sc.engine.flush(30)
        relay.blackhole()  # S3 hangs from here on
        forward("during")
        assert rec.flush(30), rec.stats  # acknowledged from the fsynced WAL
        rec.close(timeout=5)
        yield sc
    finally:
        rec.close(timeout=5)
        sc.stop(1)
    relay.open = True  # storage is back: a new sidecar replays the WAL and commits the rest
    sc2 = Sidecar(cfg).start()
    try:
        assert sc2.engine is not None and sc2.engine.flush(60), sc2.engine.stat()
        store = Store(url, options)
        rows = StoreReader(store, SPEC.run).read(MicrobatchPlan([(t, 0, 8) for t in sorted(sent)]), sites=[SITE.name])
        got = np.concatenate([rows[SITE.name].codes, rows[SITE.name].scales], axis=1)
        assert np.array_equal(got, np.concatenate([sent[t] for t in sorted(sent)]))
    finally:
        sc2.stop(5)
        relay.close()
        server.stop()


@pytest.mark.s3
@pytest.mark.slow
def test_backlog_age_grows_during_an_outage(hung_s3: Sidecar) -> None:
    """The flusher sits in storage retries; the age gauge must still grow (TraceStoreBacklogAgeHigh)."""
    sc = hung_s3
    time.sleep(0.5)
    age0 = _gauge(sc, "tracestore_backlog_oldest_age_seconds")
    time.sleep(1.5)
    age1 = _gauge(sc, "tracestore_backlog_oldest_age_seconds")
    assert age1 >= age0 + 1.0, f"backlog age froze during the outage: {age0:.2f} -> {age1:.2f} s"
    assert sc.engine is not None and sc.engine.stat()["backlog_bytes"] > 0


@pytest.mark.s3
@pytest.mark.slow
def test_shutdown_keeps_grace_while_storage_hangs(hung_s3: Sidecar) -> None:
    """--grace bounds the drain even when a shard write is stuck in retries x storage timeout;
    the acknowledged records stay in the WAL (the fixture's replay checks them)."""
    sc = hung_s3
    time.sleep(0.5)  # a shard write is in flight by now
    assert sc.engine is not None and sc.engine.stat()["backlog_bytes"] > 0
    t0 = time.monotonic()
    sc.stop()
    took = time.monotonic() - t0
    assert took < sc.config.grace_s + 1.0, f"shutdown took {took:.1f} s with --grace {sc.config.grace_s}"


def test_stop_with_an_empty_stream_is_prompt_and_logs_no_shard_write(
    tmp_path: Path, memory_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: a Write stream that admitted nothing held the stop for the whole grace period, and the
    log then blamed 'a shard write still in progress' (none was)."""
    import grpc
    from tracestore.server.testing import IdleWriteStream

    sc = Sidecar(ServerConfig(storage=memory_url, wal_dir=str(tmp_path / "wal"), port=0, metrics_port=None,
                              grace_s=6.0)).start()  # fmt: skip
    ch = grpc.insecure_channel(f"127.0.0.1:{sc.port}")
    stream = IdleWriteStream(ch)
    wait_for("the stream is open", lambda: _gauge(sc, "tracestore_active_write_streams") == 1, 10)
    t0 = time.monotonic()
    with caplog.at_level("INFO", logger="tracestore"):
        assert sc.stop()
    elapsed = time.monotonic() - t0
    stream.close()
    ch.close()
    assert elapsed < 2.0, f"stop took {elapsed:.1f} s of its 6 s grace with only an empty stream open"
    assert "waiting up to" in caplog.text and "1 open Write stream" in caplog.text
    assert "shard write" not in caplog.text and "grace period ended" not in caplog.text
