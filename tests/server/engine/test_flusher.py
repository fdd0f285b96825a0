"""The flusher on its own: a source that is not the engine (the FlushSource protocol is all it needs)
and a store that refuses the first writes."""

from __future__ import annotations

import threading
import time
import weakref

import numpy as np
from tracestore.server.engine.flusher import Batch, Flusher, Round
from tracestore.server.engine.message import Message
from tracestore.server.metrics import Metrics
from tracestore.server.testing import SPEC, make_chunk


class OneBatch:
    """Gives one batch until it is committed, then idle rounds."""

    def __init__(self, batch: Batch) -> None:
        self.batch = batch
        self.committed_batches: list[Batch] = []
        self.rounds_finished = 0
        self.lock = threading.Lock()

    def next_round(self) -> Round | None:
        with self.lock:
            if self.committed_batches:
                return Round(wait_s=0.01)
            return Round([self.batch])

    def wait_planned(self, ticket: int, timeout: float) -> bool:
        raise AssertionError("a round without a plan ticket waits for no WAL entry")

    def committed(self, batch: Batch) -> None:
        with self.lock:
            self.committed_batches.append(batch)

    def round_finished(self) -> None:
        with self.lock:
            self.rounds_finished += 1

    def hold_commit(self, chunks: object) -> int:
        return 0  # (no memory budget here)

    def release_commit(self, held: int) -> None:
        pass


class RefusingStore:
    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.calls: list[tuple[str, int, str, int]] = []

    def write_shard(self, run: str, version: int, writer: str, shard: int, chunks: object, **kw: object) -> None:
        self.calls.append((run, version, writer, shard))
        if len(self.calls) <= self.refusals:
            raise OSError("storage is down")


def _until(what: str, fn: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not fn():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_a_refused_shard_is_retried_until_committed_once_and_health_follows() -> None:
    chunks = [make_chunk("t0", 0, 4, version=3), make_chunk("t1", 0, 4, version=5)]
    msg = Message(SPEC.run, "w0", 1, 1, chunks, [], [], nbytes=100, crcs=[c.checksum for c in chunks])
    source = OneBatch(Batch(SPEC.run, "w0", 42, [msg]))
    store = RefusingStore(refusals=3)
    metrics = Metrics()
    flusher = Flusher(source, store, metrics)
    assert flusher.health(0.0) == []
    flusher.start()
    try:
        # refused for 0.05 + 0.1 + 0.2 s of backoff
        _until("storage reported refusing", lambda: "storage_refusing" in flusher.health(0.0))
        _until("the commit", lambda: source.committed_batches)
        # each policy version is its own shard write; the refused ones were written again
        assert store.calls[-2:] == [(SPEC.run, 3, "w0", 42), (SPEC.run, 5, "w0", 42)]
        assert store.calls[:3] == [(SPEC.run, 3, "w0", 42)] * 3
        assert len(store.calls) == 5
        assert source.committed_batches == [source.batch]
        # every round that named shards ends, failed or not
        _until("the last round to end", lambda: source.rounds_finished == 4)
        assert flusher.health(0.0) == []
        assert flusher.is_alive()
    finally:
        assert flusher.stop(5.0)
    assert not flusher.is_alive()
    assert flusher.health(0.0) == []  # stopped, not dead
    assert source.committed_batches == [source.batch]


def test_a_two_file_shard_is_committed_only_once_both_files_and_manifests_are_durable(tmp_path) -> None:
    """A batch written as two files side by side (Store splitting every shard): while the second
    file's publish is held, the first file is on disk but nothing is visible and nothing is
    committed (no DONE, no acknowledgement); released, the batch commits once and every record
    reads back from either file."""
    from tracestore.storage.reader import StoreReader
    from tracestore.storage.store import PART_SEQ_STRIDE, Store

    store = Store(f"file://{tmp_path}/data", shard_files=2, split_min_bytes=0, split_min_chunk_bytes=0)
    store.put_run(SPEC)
    trajs = [f"t{i}" for i in range(4)]
    chunks = [make_chunk(t, 0, 8, site, seed=i) for i, t in enumerate(trajs) for site in (s.name for s in SPEC.sites)]
    msg = Message(SPEC.run, "w0", 1, 1, chunks, [], [], nbytes=100, crcs=[c.checksum for c in chunks])
    source = OneBatch(Batch(SPEC.run, "w0", 42, [msg]))
    real = store.storage.publish_stream
    held, entered = threading.Event(), threading.Event()

    def publish_stream(rel: str, produce: object) -> object:
        if f"part-{42 + PART_SEQ_STRIDE}" in rel:
            entered.set()
            assert held.wait(10)
        return real(rel, produce)  # type: ignore[arg-type]

    store.storage.publish_stream = publish_stream  # type: ignore[method-assign, assignment]
    flusher = Flusher(source, store, Metrics())
    flusher.start()
    try:
        _until("the second file's publish", entered.is_set)
        _until(
            "the first file", lambda: (tmp_path / "data" / SPEC.run / "v0" / "w0" / "part-00000042.parquet").exists()
        )
        time.sleep(0.1)
        assert store.manifest_paths(SPEC.run, 0) == [] and source.committed_batches == []
        held.set()
        _until("the commit", lambda: source.committed_batches)
        assert source.committed_batches == [source.batch]
        paths = Store(store.url).manifest_paths(SPEC.run, 0)
        assert [p.rsplit("/", 1)[1] for p in paths] == [
            "part-00000042.manifest.json",
            f"part-{42 + PART_SEQ_STRIDE}.manifest.json",
        ]
        res = StoreReader(Store(store.url), SPEC.run).read([(t, 0, 8) for t in trajs])
        for site in SPEC.sites:
            assert res[site.name].valid.all()
            want = np.concatenate([c.codes for t in trajs for c in chunks if c.trajectory == t and c.site == site.name])
            np.testing.assert_array_equal(res[site.name].codes, want)
    finally:
        held.set()
        assert flusher.stop(5.0)


class Shard:
    """Stands for a shard's bytes (weakly referable)."""


class ChainingStore:
    """Refuses every write as a storage client does through a thread pool's future: the error it
    raises chains the client's error, whose traceback's frame holds the shard and, through what
    it is waiting for, the error itself (a reference cycle)."""

    def __init__(self) -> None:
        self.shards: list[weakref.ref[Shard]] = []

    def write_shard(self, *args: object, **kw: object) -> None:
        from tracestore.errors import StorageError

        shard = Shard()
        self.shards.append(weakref.ref(shard))
        try:
            self._put(shard)
        except OSError as exc:
            raise StorageError("write failed after 1 attempt(s)") from exc

    @staticmethod
    def _put(shard: Shard) -> None:
        pending: list[object] = [shard]
        err = ConnectionRefusedError("connection refused")
        pending.append(err)  # (a future holding its exception, as the client's frame holds the future)
        raise err


def test_a_failed_commit_leaves_no_shard_for_the_garbage_collector() -> None:
    """Each failed commit's shard is freed when the commit fails, not when the cyclic garbage
    collector runs (the sidecar runs it rarely: cli.tune_gc). Before, only the top exception's
    frames were cleared: the chained client error kept every refused attempt's shard and its upload
    copy (8 MiB each against a refusing S3 endpoint, 64 MiB budget: peak RSS - idle up to 158 MiB)."""
    import gc

    chunks = [make_chunk("t0", 0, 4)]
    msg = Message(SPEC.run, "w0", 1, 1, chunks, [], [], nbytes=100, crcs=[c.checksum for c in chunks])
    store = ChainingStore()
    flusher = Flusher(OneBatch(Batch(SPEC.run, "w0", 7, [msg])), store, Metrics())
    gc.disable()
    try:
        flusher.start()
        _until("three refused commits", lambda: len(store.shards) >= 3)
        assert flusher.stop(5.0)
        assert [ref() for ref in store.shards[:2]] == [None, None]
    finally:
        gc.enable()
