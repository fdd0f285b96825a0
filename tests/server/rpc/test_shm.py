"""Shared-memory staging held past durability: a WAL sidecar reads a writer's regions until the
shard is committed (released_sequence trails durable_sequence) instead of copying them out, for
writers that set keeps_staging; copies them out for writers that do not, when a writer's pool is
half held, and when a writer starts a new epoch. Real sidecar, real gRPC over the unix socket,
real staging pools in shared memory, records read back from the store."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from tracestore.client import GuidanceReader, RolloutRecorder, SiteOutput
from tracestore.client.record.staging import StagingPool
from tracestore.server.config import ServerConfig
from tracestore.server.engine.memory import SHM_HOLD_FRACTION
from tracestore.server.rpc.service import Sidecar
from tracestore.server.testing import SPEC, wait_for

from tracestore.checksum import ChunkKey, chunk_checksum
from tracestore.v1 import tracestore_pb2 as pb

SITE = SPEC.site("layers.1.mlp.input")


def _sidecar(tmp_path: Path, url: str, **kw: Any) -> Sidecar:
    cfg = ServerConfig(storage=url, wal_dir=str(tmp_path / "wal"), port=0, metrics_port=None,
                       unix_socket=str(tmp_path / "s.sock"), flush_interval_s=600.0, **kw)  # fmt: skip
    return Sidecar(cfg).start()


def _rows(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (n, SITE.code_bytes), dtype=np.uint8),
            rng.integers(0, 256, (n, SITE.scale_bytes), dtype=np.uint8))  # fmt: skip


def _read(url: str, trajs: list[str], n: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    reader = GuidanceReader(url, SPEC.run, sites=[SITE.name], prefetch=False)
    try:
        out = {}
        for t in trajs:
            r = reader.read_host([(t, 0, n)])[SITE.name]
            assert r.valid.all(), t
            out[t] = (r.codes.copy(), r.scales.copy())
        return out
    finally:
        reader.close()


def _held(sc: Sidecar) -> int:
    assert sc.engine is not None
    with sc.engine._lock:  # noqa: SLF001 - the engine's own accounting, read under its lock
        return sum(sc.engine.holds.held.values())


def test_held_until_commit_then_released(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    sc = _sidecar(tmp_path, url)
    rec = RolloutRecorder(f"unix://{tmp_path / 's.sock'}", SPEC, "hold", linger_s=0.0)
    try:
        codes, scales = _rows(0, 64)
        assert rec.record_forward([("hold-t0", 0, 64)], {SITE.name: SiteOutput(codes, scales, 0.5)})
        assert rec.flush(30), rec.stats  # durable: the WAL is fsynced
        # ... but the shard is not written (flush interval 600 s): the sidecar still reads the
        # region, so the recorder keeps it
        assert _held(sc) == codes.nbytes + scales.nbytes
        assert rec.pool.in_use > 0
        assert sc.engine is not None and sc.engine.flush(30)
        wait_for("the region to be released", lambda: rec.pool.in_use == 0)
        assert _held(sc) == 0
        got = _read(url, ["hold-t0"], 64)["hold-t0"]
        assert np.array_equal(got[0], codes) and np.array_equal(got[1], scales)
    finally:
        rec.close(timeout=5)
        sc.stop(5)


def _descriptor_request(pool: StagingPool, seq: int, traj: str, codes: np.ndarray, scales: np.ndarray,
                        keeps: bool) -> bytes:  # fmt: skip
    a = pool.reserve(codes.nbytes)
    b = pool.reserve(scales.nbytes)
    assert a is not None and b is not None
    pool.view[a : a + codes.nbytes] = codes.tobytes()
    pool.view[b : b + scales.nbytes] = scales.tobytes()
    n = codes.shape[0]
    key = ChunkKey(SPEC.run, 0, traj, SITE.name, 0, n, n, SITE.code_bytes, SITE.scale_bytes, 0.5)
    crc = chunk_checksum(key, [codes], [scales], None)
    req = pb.WriteRequest(run=SPEC.run, writer="raw", epoch=1, sequence=seq, shm_pool=pool.name or "",
                          keeps_staging=keeps)  # fmt: skip
    if seq == 1:
        from tracestore.wire import run_spec_to_pb

        req.run_spec.CopyFrom(run_spec_to_pb(SPEC))
    c = req.chunks.add(trajectory=traj, site=SITE.name, token_start=0, n_tokens=n, global_scale=0.5, checksum=crc)
    c.shm.codes_offset, c.shm.scales_offset = a, b
    return req.SerializeToString()


def test_writer_without_keeps_staging_gets_a_copy(tmp_path: Path) -> None:
    """An older writer (no keeps_staging) reuses its regions at the durable ack: the sidecar
    copies them out first. Scribbling over the whole pool after the ack changes nothing stored."""
    url = f"file://{tmp_path / 'store'}"
    sc = _sidecar(tmp_path, url)
    pool = StagingPool(1 << 20, shared=True)
    try:
        codes, scales = _rows(1, 128)
        with grpc.insecure_channel(f"unix://{tmp_path / 's.sock'}") as ch:
            call = ch.stream_stream("/tracestore.v1.TraceStore/Write")
            acks = call(iter([_descriptor_request(pool, 1, "old-t0", codes, scales, keeps=False)]))
            last = None
            for raw in acks:
                last = pb.WriteResponse.FromString(raw)
                if last.durable_sequence >= 1:
                    break
            assert last is not None and last.durable_sequence == 1
            assert last.HasField("released_sequence") and last.released_sequence == 1  # nothing held
            acks.cancel()
        assert _held(sc) == 0
        pool.view[:] = b"\xa5" * len(pool.view)  # the writer reuses everything
        assert sc.engine is not None and sc.engine.flush(30)
        got = _read(url, ["old-t0"], 128)["old-t0"]
        assert np.array_equal(got[0], codes) and np.array_equal(got[1], scales)
    finally:
        pool.close()
        sc.stop(5)


def test_half_held_pool_copies_oldest_out(tmp_path: Path) -> None:
    """With shards deferred (flush interval 600 s) a writer streams 8 pools' worth: the sidecar never
    holds more than half its pool, copies the oldest held regions out so that the staging ring
    keeps turning, and every forward is taken and stored intact."""
    url = f"file://{tmp_path / 'store'}"
    sc = _sidecar(tmp_path, url, memory_budget_bytes=256 << 20, shard_target_bytes=256 << 20)
    staging = 1 << 20
    rec = RolloutRecorder(f"unix://{tmp_path / 's.sock'}", SPEC, "ring", staging_bytes=staging,
                          batch_bytes=64 << 10, linger_s=0.0)  # fmt: skip
    n = 4096
    per_fwd = n * (SITE.code_bytes + SITE.scale_bytes)
    sent: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    peak = 0
    try:
        for f in range(8 * staging // per_fwd):
            deadline = time.monotonic() + 20
            # one forward at a time (each then travels as descriptors, not gathered into a copy),
            # and an engine pacing on its ring
            while rec.stats["chunks"] < f or rec.pool.capacity - rec.pool.in_use < 2 * per_fwd:
                assert time.monotonic() < deadline, f"staging never freed: {rec.stats}, held {_held(sc)}"
                time.sleep(0.001)
            codes, scales = _rows(100 + f, n)
            sent[f"ring-{f}"] = (codes, scales)
            assert rec.record_forward([(f"ring-{f}", 0, n)], {SITE.name: SiteOutput(codes, scales, 0.5)}), rec.stats
            peak = max(peak, _held(sc))
        assert rec.flush(60), rec.stats
        assert 0 < peak <= SHM_HOLD_FRACTION * rec.pool.capacity
        assert rec.stats["refused_forwards"] == 0 and rec.stats["unguided"] == 0
        assert sc.engine is not None and sc.engine.flush(60)
        wait_for("every region to be released", lambda: rec.pool.in_use == 0)
        got = _read(url, sorted(sent), n)
        for t, (codes, scales) in sent.items():
            assert np.array_equal(got[t][0], codes) and np.array_equal(got[t][1], scales), t
    finally:
        rec.close(timeout=5)
        sc.stop(5)


def test_new_epoch_copies_held_regions_out(tmp_path: Path) -> None:
    """A writer restarted under the same id (newer epoch) fences its predecessor: the sidecar copies
    the predecessor's held regions out before it accepts the new epoch, so that pool may be reused
    (here: scribbled over) and the predecessor's durable records are still stored intact."""
    url = f"file://{tmp_path / 'store'}"
    sc = _sidecar(tmp_path, url)
    addr = f"unix://{tmp_path / 's.sock'}"
    old = RolloutRecorder(addr, SPEC, "same", linger_s=0.0, epoch=1)
    new = RolloutRecorder(addr, SPEC, "same", linger_s=0.0, epoch=2)
    try:
        codes, scales = _rows(7, 96)
        assert old.record_forward([("ep-old", 0, 96)], {SITE.name: SiteOutput(codes, scales, 0.5)})
        assert old.flush(30), old.stats
        assert _held(sc) == codes.nbytes + scales.nbytes
        c2, s2 = _rows(8, 32)
        assert new.record_forward([("ep-new", 0, 32)], {SITE.name: SiteOutput(c2, s2, 0.5)})
        assert new.flush(30), new.stats
        assert _held(sc) == c2.nbytes + s2.nbytes  # only the new epoch's message is held now
        old.pool.view[:] = b"\x5a" * len(old.pool.view)
        assert sc.engine is not None and sc.engine.flush(30)
        got = _read(url, ["ep-new", "ep-old"], 32)
        assert np.array_equal(got["ep-new"][0], c2) and np.array_equal(got["ep-new"][1], s2)
        full = _read(url, ["ep-old"], 96)["ep-old"]
        assert np.array_equal(full[0], codes) and np.array_equal(full[1], scales)
    finally:
        old.close(timeout=2)
        new.close(timeout=5)
        sc.stop(5)
