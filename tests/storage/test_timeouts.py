"""Every storage call is bounded: a black-holed endpoint or a stopped S3 server surfaces as
StorageError within the timeout (never a hang), retries are counted and reported to the hook. An
endpoint that resets every connection fails the calls without "Task exception was never retrieved"
errors from the S3 client's event loop."""

from __future__ import annotations

import gc
import logging
import socket
import struct
import threading
import time

import numpy as np
import pytest

from tracestore import StorageError
from tracestore.storage.fs import Storage
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


def reset(conn: socket.socket) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close() sends RST
    conn.close()


@pytest.fixture
def resetting_endpoint():
    """A TCP endpoint that accepts every connection and resets it a moment later (what a proxy or
    load balancer in front of a stopped S3 does). The reset comes from a thread of its own: that
    lands it, often, after the client's connect completed and before its request went out."""
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def accept():
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conn = srv.accept()[0]
            except OSError:
                continue
            threading.Thread(target=reset, args=(conn,), daemon=True).start()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    t.join()
    srv.close()


def test_reset_connections_leave_no_unretrieved_task_exception(resetting_endpoint, caplog):
    """Before: aiohttp's request-body writer task failed on the reset transport ("Cannot write to
    closing transport") while the request itself failed and was reported; nobody read the task's
    exception, so the event loop logged "Task exception was never retrieved" with a traceback for
    every such PUT."""
    caplog.set_level(logging.DEBUG, logger="tracestore.storage")
    options = s3_options(resetting_endpoint, timeout=2.0)
    options["config_kwargs"]["retries"] = {"max_attempts": 0}  # one request per call: no backoff to wait out
    storage = Storage("s3://bucket/root", options, timeout=5.0, retries=0)
    for i in range(200):  # ~2 s; before the fix 10-20% of them logged it
        with pytest.raises(StorageError):
            storage.publish(f"part-{i}", b"x" * 100_000)
    for _ in range(3):  # the failed tasks are collected, and reported if unread, on the loop's thread
        gc.collect()
        time.sleep(0.2)
    unread = [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert not unread, unread[0].getMessage()
    assert any("request body" in r.getMessage() for r in caplog.records), "the dropped errors are logged at DEBUG"


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
