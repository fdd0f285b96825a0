"""A storage call stuck past its timeout is abandoned, and it must not keep the process alive:
ThreadPoolExecutor workers are joined at interpreter exit, so a black-holed PUT used to hold a
finished sidecar or test run for minutes (seen twice in full-suite runs)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

SCRIPT = textwrap.dedent(
    """
    import threading, time
    from tracestore.errors import StorageError
    from tracestore.storage.fs import Storage

    st = Storage("memory://stuck-call", timeout=0.2, retries=0)
    never = threading.Event()
    try:
        st.call("put part-0", never.wait)  # a call that never returns, like a black-holed PUT
    except StorageError as exc:
        print("timed out:", exc)
    assert any(t.name.startswith("tracestore-io") and t.is_alive() for t in threading.enumerate())
    """
)


def test_stuck_call_does_not_block_exit() -> None:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    assert "timed out: put part-0 on memory://stuck-call failed" in proc.stdout, proc.stdout
    assert took < 20, f"the process took {took:.1f} s to exit with a stuck storage call"


def test_workers_of_a_dropped_storage_exit() -> None:
    """Idle workers belong to their pool: a Storage dropped without close() leaves no threads
    behind (as ThreadPoolExecutor's workers exit when it is collected)."""
    import gc
    import threading

    from tracestore.storage.fs import Storage

    def io_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("tracestore-io")}

    before = io_threads()
    st = Storage("memory://dropped-storage", timeout=5.0)
    for _ in range(3):
        st.call("noop", lambda: None)
    assert io_threads() - before, "the calls ran on no worker thread"
    del st
    gc.collect()
    deadline = time.monotonic() + 5
    while io_threads() - before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not io_threads() - before, f"workers left behind: {io_threads() - before}"


class _Body:
    """Stands for a request body (weakly referable)."""


def _fail_in_a_cycle(body: _Body, wait: object = None) -> None:
    """Fail as an async client's request does: the error sits in a reference cycle with the frame
    that holds the body (its future holds it, the frame holds the future)."""
    if wait is not None:
        wait.wait(10)  # type: ignore[attr-defined]
    held: list[object] = [body]
    err = ConnectionRefusedError("connection refused")
    held.append(err)
    raise err


def test_failed_and_abandoned_attempts_free_their_request_at_once() -> None:
    """A retried attempt's failure, and the failure of an attempt abandoned at its timeout once it
    ends, hold their request's body only until then, not until the garbage collector runs: a PUT
    against a black-holed S3 endpoint kept a shard and aiohttp's copy of it per timed-out attempt
    (the sidecar runs the collector rarely)."""
    import gc
    import threading
    import weakref

    from tracestore.errors import StorageError
    from tracestore.storage.fs import Storage

    st = Storage("memory://garbage", timeout=0.3, retries=1, backoff=0.01)
    bodies: list[weakref.ref[_Body]] = []

    def put(wait: object = None) -> None:
        body = _Body()
        bodies.append(weakref.ref(body))
        _fail_in_a_cycle(body, wait)

    gc.disable()
    try:
        with pytest.raises(StorageError, match="put refused"):
            st.call("put refused", put)
        assert len(bodies) == 2 and bodies[0]() is None  # the retried attempt's
        bodies.clear()
        release = threading.Event()
        with pytest.raises(StorageError, match="timed out"):
            st.call("put black-holed", put, release, retry=False)
        release.set()
        deadline = time.monotonic() + 5
        while bodies[0]() is not None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert bodies[0]() is None  # the abandoned attempt's, once it failed
    finally:
        gc.enable()
        st.close()
