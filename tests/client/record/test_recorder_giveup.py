"""The recorder gives up on a sidecar that acknowledges nothing, whatever the way it does so, and
never reports records as recorded that it dropped.

A small real gRPC server in the test gives the hostile answers (a stream held open without
acknowledgements, streams ended with OK, refusals with bogus trailers, acknowledgements of
sequences never sent); a real in-process sidecar where the answers are honest. ``give_up_s`` is
1 s, so each test takes a few seconds."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import numpy as np
import pytest
from tracestore.client import RolloutRecorder, SiteOutput
from tracestore.server.config import ServerConfig
from tracestore.server.rpc.service import Sidecar
from tracestore.server.testing import SPEC, wait_for

from tracestore.errors import ValidationError
from tracestore.storage.reader import StoreReader
from tracestore.storage.store import Store
from tracestore.v1 import tracestore_pb2 as pb

SITE = SPEC.site("layers.1.mlp.input")
GIVE_UP = 1.0

Handler = Callable[[Iterator[bytes], grpc.ServicerContext], Iterator[bytes]]


class Hostile:
    """A Write server whose every stream is answered by ``write``."""

    def __init__(self, write: Handler) -> None:
        handler = grpc.method_handlers_generic_handler(
            "tracestore.v1.TraceStore", {"Write": grpc.stream_stream_rpc_method_handler(write)}
        )
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        self.server.add_generic_rpc_handlers((handler,))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def stop(self) -> None:
        self.server.stop(0)


@pytest.fixture
def hostile() -> Iterator[Callable[[Handler], Hostile]]:
    made: list[Hostile] = []

    def make(write: Handler) -> Hostile:
        made.append(Hostile(write))
        return made[-1]

    yield make
    for h in made:
        h.stop()


@pytest.fixture
def sidecar() -> Iterator[Sidecar]:
    cfg = ServerConfig(storage=f"memory://giveup-{uuid.uuid4().hex}", wal_dir=None, port=0, metrics_port=None,
                       flush_interval_s=0.05)  # fmt: skip
    sc = Sidecar(cfg).start()
    try:
        yield sc
    finally:
        sc.stop(2)


def _recorder(address: str, writer: str = "w", **kw: Any) -> RolloutRecorder:
    kw.setdefault("give_up_s", GIVE_UP)
    kw.setdefault("reconnect_cap_s", 0.25)
    return RolloutRecorder(address, SPEC, writer, staging_bytes=1 << 20, linger_s=0.0, **kw)


def _forward(rec: RolloutRecorder, traj: str, start: int = 0, n: int = 4, **kw: Any) -> bool:
    rows = n * SITE.rows_per_token
    codes = np.full((rows, SITE.code_bytes), start & 0xFF, np.uint8)
    scales = np.full((rows, SITE.scale_bytes), 7, np.uint8)
    return rec.record_forward([(traj, start, start + n)], {SITE.name: SiteOutput(codes, scales, 0.5)}, **kw)


def _why(rec: RolloutRecorder, traj: str) -> str | None:
    return rec._unguided.why(traj) if traj in rec.unguided else None


# -- hostile answers ------------------------------------------------------------------------------


def _never_acks(it: Iterator[bytes], ctx: grpc.ServicerContext) -> Iterator[bytes]:
    """Reads every message and never answers, keeping the stream open (a frozen sidecar)."""

    def drain() -> None:
        try:
            for _ in it:
                pass
        except grpc.RpcError:  # the recorder cancelled the stream
            pass

    threading.Thread(target=drain, daemon=True).start()
    while ctx.is_active():
        time.sleep(0.05)
    return iter(())


def _refuse(code: grpc.StatusCode, *trailers: tuple[str, str], seq_trailer: bool = False) -> Handler:
    """Reads the first message, then ends the stream with ``code`` and ``trailers`` (with
    ``seq_trailer``: tracestore-failed-sequence naming that message)."""

    def write(it: Iterator[bytes], ctx: grpc.ServicerContext) -> Iterator[bytes]:
        raw = next(it, None)
        first = pb.WriteRequest.FromString(raw) if raw is not None else None
        md = list(trailers)
        if seq_trailer and first is not None:
            md.append(("tracestore-failed-sequence", str(first.sequence)))
        if md:
            ctx.set_trailing_metadata(tuple(md))
        ctx.abort(code, f"hostile {code.name}")
        yield b""  # pragma: no cover - a generator; abort raised

    return write


def _ack(r: pb.WriteRequest, durable: int) -> bytes:
    return pb.WriteResponse(epoch=r.epoch, durable_sequence=durable, received_sequence=durable).SerializeToString()


# -- give_up_s is enforced however the sidecar fails ----------------------------------------------


def test_gives_up_while_the_stream_stays_open_without_acks(hostile: Callable[[Handler], Hostile]) -> None:
    """Before: nothing was ever unguided (give-up ran only after a stream ended) and close(0.5)
    took 10 s and left the sender thread running."""
    h = hostile(_never_acks)
    rec = _recorder(h.address)
    try:
        assert _forward(rec, "t0")
        wait_for("t0 to be given up on", lambda: "t0" in rec.unguided, timeout=4 * GIVE_UP)
        assert _why(rec, "t0") == "sidecar_unreachable"
        assert rec.stats["reconnects"] <= 3, rec.stats  # one stalled stream, no spinning
        assert _forward(rec, "t1")
    finally:
        t0 = time.monotonic()
        ok = rec.close(timeout=0.5)
        took = time.monotonic() - t0
    assert not ok and took < 3, took
    assert not rec._thread.is_alive()
    assert _why(rec, "t1") == "closed_unacknowledged"


def test_gives_up_on_a_message_of_seals_only(hostile: Callable[[Handler], Hostile]) -> None:
    """A message with no records (a seal) has no age; the give-up waited for one forever."""
    h = hostile(_never_acks)
    rec = _recorder(h.address)
    try:
        assert rec.finish("s0", 5)
        wait_for("s0 to be given up on", lambda: "s0" in rec.unguided, timeout=4 * GIVE_UP)
        assert _why(rec, "s0") == "sidecar_unreachable"
    finally:
        rec.close(timeout=0.5)


def test_gives_up_when_streams_end_ok_without_acks(hostile: Callable[[Handler], Hostile]) -> None:
    """The sidecar acknowledged at first, then ends every stream with OK acknowledging nothing.
    Before: the first acknowledgement cleared the down time and OK ends never set it again."""
    acking = threading.Event()
    acking.set()

    def write(it: Iterator[bytes], ctx: grpc.ServicerContext) -> Iterator[bytes]:
        for raw in it:
            if not acking.is_set():
                return
            r = pb.WriteRequest.FromString(raw)
            yield _ack(r, r.sequence)

    h = hostile(write)
    rec = _recorder(h.address)
    try:
        assert _forward(rec, "first") and rec.flush(5)
        acking.clear()
        assert _forward(rec, "t0")
        wait_for("t0 to be given up on", lambda: "t0" in rec.unguided, timeout=4 * GIVE_UP)
        assert _why(rec, "t0") == "sidecar_unreachable"
        assert rec.stats["reconnects"] >= 1, rec.stats  # the OK ends counted as failed attempts
        assert "first" not in rec.unguided
    finally:
        rec.close(timeout=0.5)


# -- flush and close report what was dropped ------------------------------------------------------


def test_flush_is_false_when_records_were_dropped(hostile: Callable[[Handler], Hostile]) -> None:
    """Before: flush returned True once the give-up (or a content refusal) had emptied the queue."""
    h = hostile(_refuse(grpc.StatusCode.UNAVAILABLE))
    rec = _recorder(h.address)
    try:
        assert _forward(rec, "t0")
        t0 = time.monotonic()
        assert not rec.flush(timeout=10)
        assert time.monotonic() - t0 < 5  # not the timeout: the give-up ended it
        assert _why(rec, "t0") == "sidecar_unreachable" and rec.stats["dropped"] == 1
    finally:
        rec.close(timeout=0.5)
    h = hostile(_refuse(grpc.StatusCode.INVALID_ARGUMENT, seq_trailer=True))
    rec = _recorder(h.address)
    try:
        assert _forward(rec, "t1")
        assert not rec.flush(timeout=10)
        assert _why(rec, "t1") == "invalid_argument" and rec.stats["rejected_messages"] == 1
    finally:
        rec.close(timeout=0.5)


def test_flush_is_true_when_everything_was_acknowledged(sidecar: Sidecar) -> None:
    rec = _recorder(f"127.0.0.1:{sidecar.port}")
    try:
        for i in range(3):
            assert _forward(rec, f"ok-{i}")
        assert rec.flush(10) and not rec.unguided
        assert rec.finish("ok-0", 5) and rec.flush(10)
    finally:
        assert rec.close(timeout=5)
    assert not rec.unguided


def test_close_marks_what_was_not_acknowledged(hostile: Callable[[Handler], Hostile]) -> None:
    """Before: close dropped the record and nothing said so (rec.unguided empty)."""
    h = hostile(_refuse(grpc.StatusCode.UNAVAILABLE))
    rec = _recorder(h.address, give_up_s=30.0)
    assert _forward(rec, "t1")
    t0 = time.monotonic()
    assert not rec.close(timeout=0.5)
    assert time.monotonic() - t0 < 3
    assert _why(rec, "t1") == "closed_unacknowledged"
    assert rec.stats["unguided"] == 1 and rec.stats["dropped"] == 1


# -- refusals are logged and named ----------------------------------------------------------------


def test_refusals_are_logged_once_and_name_the_give_up(
    hostile: Callable[[Handler], Hostile], caplog: pytest.LogCaptureFixture
) -> None:
    """Before: every UNAUTHENTICATED was retried without a log line, and the give-up said
    'sidecar_unreachable' although the sidecar answered every time."""
    caplog.set_level(logging.WARNING, logger="tracestore.client")
    h = hostile(_refuse(grpc.StatusCode.UNAUTHENTICATED))
    rec = _recorder(h.address)
    try:
        assert _forward(rec, "t0")
        wait_for("a first refusal", lambda: rec.stats["reconnects"] > 0, timeout=5)
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert any("UNAUTHENTICATED" in m for m in warned), warned
        wait_for("t0 to be given up on", lambda: "t0" in rec.unguided, timeout=4 * GIVE_UP)
        assert _why(rec, "t0") == "unauthenticated"
        assert rec.stats["reconnects"] >= 2, rec.stats
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        retries = [m for m in warned if "Write stream" in m and "UNAUTHENTICATED" in m]
        assert len(retries) == 1, warned  # once per code between acknowledgements, not per attempt
        assert any("UNAUTHENTICATED" in m and "(unauthenticated)" in m for m in warned), warned
    finally:
        rec.close(timeout=0.5)


# -- acknowledgements and trailers are checked ----------------------------------------------------


def test_an_ack_beyond_what_was_sent_starts_a_new_epoch(sidecar: Sidecar) -> None:
    """A restarted engine reuses the writer id and an explicit epoch: the sidecar answers its
    messages as resends of its predecessor's. Before: flush True, records not stored."""
    address = f"127.0.0.1:{sidecar.port}"
    a = _recorder(address, "fixed", epoch=1)
    for i in range(5):
        assert _forward(a, f"a-{i}") and a.flush(10)
    assert a.close(timeout=5)
    b = _recorder(address, "fixed", epoch=1)
    try:
        assert _forward(b, "b-0")
        ok = b.flush(10)
        assert b.epoch != 1
    finally:
        b.close(timeout=2)
    rows = StoreReader(Store(sidecar.config.storage), SPEC.run).read([("b-0", 0, 4)], on_missing="mask")
    assert ok and bool(rows[SITE.name].valid.all()) and not b.unguided


def test_acks_of_never_sent_sequences_release_nothing(hostile: Callable[[Handler], Hostile]) -> None:
    def write(it: Iterator[bytes], ctx: grpc.ServicerContext) -> Iterator[bytes]:
        for raw in it:
            r = pb.WriteRequest.FromString(raw)
            yield _ack(r, r.sequence + 1000)

    h = hostile(write)
    rec = _recorder(h.address)
    try:
        assert _forward(rec, "t0")
        assert not rec.flush(timeout=10)
        assert rec.stats["acked_messages"] == 0 and _why(rec, "t0") == "failed_precondition"
        assert rec.stats["reconnects"] >= 2, rec.stats  # a new epoch each time, answered the same way
    finally:
        rec.close(timeout=0.5)


def test_a_failed_sequence_naming_no_pending_message_is_ignored(
    hostile: Callable[[Handler], Hostile], caplog: pytest.LogCaptureFixture
) -> None:
    """Before: each refusal decremented the next sequence anyway; at 0 numbering raised in the
    sender, the message was lost without being unguided and the give-up never ran."""
    caplog.set_level(logging.WARNING, logger="tracestore.client")
    h = hostile(_refuse(grpc.StatusCode.INVALID_ARGUMENT, ("tracestore-failed-sequence", "99999")))
    rec = _recorder(h.address)
    try:
        for i in range(4):
            assert _forward(rec, f"t{i}")
            time.sleep(0.1)
        wait_for("t0..t3 to be given up on", lambda: {"t0", "t1", "t2", "t3"} <= rec.unguided, timeout=4 * GIVE_UP)
        assert _why(rec, "t3") == "invalid_argument" and rec.stats["rejected_messages"] == 0
        assert rec._session._next_seq >= 1
        assert not [r for r in caplog.records if "sender error" in r.getMessage()]
    finally:
        rec.close(timeout=0.5)


def test_retry_after_is_capped(hostile: Callable[[Handler], Hostile]) -> None:
    """A retry-after-ms of 27 hours parked the sender: nothing delivered, nothing given up."""
    h = hostile(_refuse(grpc.StatusCode.RESOURCE_EXHAUSTED, ("retry-after-ms", "100000000")))
    rec = _recorder(h.address)
    try:
        assert _forward(rec, "t0")
        wait_for("t0 to be given up on", lambda: "t0" in rec.unguided, timeout=4 * GIVE_UP)
        assert _why(rec, "t0") == "resource_exhausted"
    finally:
        t0 = time.monotonic()
        rec.close(timeout=0.5)
        assert time.monotonic() - t0 < 3


def test_a_message_that_cannot_be_built_unguides_its_trajectories(sidecar: Sidecar) -> None:
    """A message the sender cannot build (here a policy version beyond int64, put past the call's
    own check, which refuses it now) marks its trajectories unguided. Before: the forward was lost
    silently (flush True, nothing unguided)."""
    rec = _recorder(f"127.0.0.1:{sidecar.port}")
    try:
        rec._outbox.policy_version = 2**63  # noqa: SLF001 - past record_forward's check, on purpose
        assert _forward(rec, "huge")
        rec._outbox.policy_version = 0  # noqa: SLF001
        assert not rec.flush(10)
        assert _why(rec, "huge") == "sender_error"
        assert _forward(rec, "fine") and rec.flush(10) and "fine" not in rec.unguided
    finally:
        rec.close(timeout=2)


def test_finish_refuses_a_length_no_seal_can_have(sidecar: Sidecar) -> None:
    """Before: finish(t, 0) was queued, and the sender failed on it, losing what it had taken."""
    rec = _recorder(f"127.0.0.1:{sidecar.port}")
    try:
        assert _forward(rec, "t0")
        with pytest.raises(ValidationError, match="n_tokens"):
            rec.finish("t0", 0)
        assert rec.flush(10) and not rec.unguided
    finally:
        rec.close(timeout=2)


@pytest.mark.parametrize("bad", [-1, 1 << 63, 2.0, True])
def test_a_policy_version_the_wire_cannot_carry_raises_at_the_call(sidecar: Sidecar, bad: object) -> None:
    """Before: 2**63 was queued and failed on the sender thread (protobuf's int64), which marked
    the forwards it had taken with it unguided (sender_error); -1 went out and the sidecar refused
    the whole message. Now each raises at the call and what was queued before stays guided."""
    with pytest.raises(ValidationError, match="policy_version"):
        _recorder(f"127.0.0.1:{sidecar.port}", policy_version=bad)
    rec = _recorder(f"127.0.0.1:{sidecar.port}")
    try:
        assert _forward(rec, "t0")
        with pytest.raises(ValidationError, match="policy_version"):
            _forward(rec, "t1", policy_version=bad)
        with pytest.raises(ValidationError, match="policy_version"):
            rec.link_prefix("t2", "t0", 4, policy_version=bad)
        with pytest.raises(ValidationError, match="policy_version"):
            rec.set_policy_version(bad)  # type: ignore[arg-type]
        assert rec.policy_version == 0
        assert _forward(rec, "t3", policy_version=np.int64(3))  # NumPy integers are integers
        assert rec.flush(10) and not rec.unguided, rec.unguided
    finally:
        rec.close(timeout=2)
