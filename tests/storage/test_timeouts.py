"""Every storage call is bounded: a black-holed endpoint or a stopped S3 server surfaces as
StorageError within the timeout (never a hang), retries are counted and reported to the hook."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from tracestore import StorageError
from tracestore.storage.reader import StoreReader
from tracestore.storage.store import Store

from .conftest import RUN, SITES, SPEC, make_chunk, s3_options

pytestmark = pytest.mark.s3


@pytest.fixture
def black_hole():
    """A TCP endpoint that accepts connections and never answers."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    conns: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conns.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    t.join()
    for c in conns:
        c.close()
    srv.close()


def test_black_holed_endpoint_times_out(black_hole):
    events = []
    store = Store(
        "s3://bucket/root",
        s3_options(black_hole, timeout=30.0),  # botocore itself would wait far longer than our bound
        timeout=0.5,
        retries=1,
        on_event=lambda kind, op, detail: events.append((kind, op)),
    )
    t0 = time.monotonic()
    with pytest.raises(StorageError, match=r"write run-1/run\.json .*failed after 2 attempt"):
        store.put_run(SPEC)
    assert time.monotonic() - t0 < 5.0
    assert store.stats["timeouts"] == 2 and store.stats["retries"] == 1 and store.stats["errors"] == 1
    assert [k for k, _ in events] == ["timeout", "retry", "timeout", "error"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_s3_outage_then_recovery():
    from moto.server import ThreadedMotoServer

    from .conftest import s3_bucket  # noqa: F401  (fixture name documented; a private server here)

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        import s3fs

        endpoint = f"http://127.0.0.1:{port}"
        s3fs.S3FileSystem(**s3_options(endpoint)).mkdir("outage")
        store = Store("s3://outage/root", s3_options(endpoint, timeout=1.0), timeout=2.0, retries=1)
        store.put_run(SPEC)
        rng = np.random.default_rng(30)
        first = make_chunk(SITES[0], "t0", 0, 8, rng=rng)
        store.write_shard(RUN, 0, "w0", 0, [first])
        server.stop()
        second = make_chunk(SITES[0], "t1", 0, 8, rng=rng)
        t0 = time.monotonic()
        with pytest.raises(StorageError):
            store.write_shard(RUN, 0, "w0", 1, [second])
        assert time.monotonic() - t0 < 20.0
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()  # moto keeps its state across restarts in one process (ThreadedMotoServer does)
        store.write_shard(RUN, 0, "w0", 1, [second])  # the retried flush goes through
        res = StoreReader(store, RUN).read([("t0", 0, 8), ("t1", 0, 8)], sites=[SITES[0].name])
        np.testing.assert_array_equal(res[SITES[0].name].codes, np.concatenate([first.codes, second.codes]))
    finally:
        server.stop()
