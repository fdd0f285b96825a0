"""One caller cannot take the Write-stream slots (``--max-streams``) from another.

Before, a Write stream took its slot (and its window's share of the memory budget) before any
scope was checked, and an idle stream was ended only while another stream waited for a turn to
read: a caller with only ``read:*`` that opened ``--max-streams`` streams and sent nothing made
every other team's write RESOURCE_EXHAUSTED for as long as it kept them open; so could any one
identity allowed to write, and so did streams that never sent their first message whenever no
stream waited for a turn. Each case is real gRPC against a sidecar with tokens and a WAL.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import numpy as np
from tracestore.client import RolloutRecorder, SiteOutput
from tracestore.server.config import ServerConfig
from tracestore.server.service import Sidecar
from tracestore.server.testing import SPEC, make_chunk, write_request
from tracestore.server.write_stream import READ_TURN_IDLE_S

from tracestore.records import RunSpec
from tracestore.v1 import tracestore_pb2 as pb

WRITE = "/tracestore.v1.TraceStore/Write"
SCOPES = {
    "reader": "read:*",
    "team-a": "write:team-a-*,read:team-a-*",
    "team-b": "write:team-b-*,read:team-b-*",
    "ops": "admin",
}
TOKENS = {name: secrets.token_urlsafe(24) for name in SCOPES}


def spec(run: str) -> RunSpec:
    return RunSpec(run, SPEC.sites)


def _start(tmp: Path, **config: object) -> Sidecar:
    lines = [f"sha256:{hashlib.sha256(TOKENS[n].encode()).hexdigest()} {s} {n}" for n, s in SCOPES.items()]
    (tmp / "tokens").write_text("\n".join(lines) + "\n")
    cfg = ServerConfig(storage=f"file://{tmp / 'data'}", wal_dir=str(tmp / "wal"), port=0, metrics_port=None,
                       auth_tokens=str(tmp / "tokens"), flush_interval_s=0.05, grace_s=2,
                       **config)  # type: ignore[arg-type]  # fmt: skip
    return Sidecar(cfg).start()


def _meta(who: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[who]}"),)


class IdleStream:
    """A Write stream opened as ``who`` (None: no token) that sends ``first`` (if any), then nothing
    until closed."""

    def __init__(self, ch: grpc.Channel, who: str | None, first: bytes | None = None) -> None:
        self.release = threading.Event()
        self.first = first
        meta = _meta(who) if who is not None else ()
        self.call = ch.stream_stream(WRITE)(self._requests(), metadata=meta, timeout=60)
        self.acks = 0
        self.error: grpc.RpcError | None = None
        self.ended = threading.Event()
        threading.Thread(target=self._collect, daemon=True).start()

    def _requests(self) -> Iterator[bytes]:
        if self.first is not None:
            yield self.first
        self.release.wait()

    def _collect(self) -> None:
        try:
            for _ in self.call:
                self.acks += 1
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.ended.set()

    def code(self) -> str:
        return "OK" if self.error is None else self.error.code().name

    def close(self) -> None:
        self.release.set()
        self.call.cancel()


def _open(sc: Sidecar, ch: grpc.Channel, who: str, n: int, settle_s: float = 1.0) -> list[IdleStream]:
    """``n`` idle streams as ``who``; returns once each was refused or holds a slot (or after settle_s)."""
    assert sc.service is not None
    before = sc.service.streams.used
    streams = [IdleStream(ch, who) for _ in range(n)]
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        if sum(s.ended.is_set() for s in streams) + sc.service.streams.used - before >= n:
            break
        time.sleep(0.02)
    return streams


def _write(port: int, who: str, reqs: Sequence[pb.WriteRequest]) -> grpc.RpcError | None:
    """Stream ``reqs`` as ``who`` until the last one is acknowledged; the error that ended the stream."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = ch.stream_stream(WRITE)
        try:
            for raw in call(iter([r.SerializeToString() for r in reqs]), metadata=_meta(who), timeout=20):
                ack = pb.WriteResponse.FromString(raw)
                if ack.epoch == reqs[-1].epoch and ack.durable_sequence >= reqs[-1].sequence:
                    return None
        except grpc.RpcError as exc:
            return exc
    raise AssertionError("the stream ended without acknowledging the last message")


def _first_write(port: int, who: str, run: str, writer: str = "w0") -> grpc.RpcError | None:
    req = write_request(1, [make_chunk(f"{writer}-t", 0, 4, spec=spec(run))], writer=writer, declare=True,
                        spec=spec(run))  # fmt: skip
    return _write(port, who, [req])


def _code(err: grpc.RpcError | None) -> str:
    return "OK" if err is None else err.code().name


def test_a_caller_without_write_scope_takes_no_stream_slot(tmp_path: Path) -> None:
    """read:* (and admin only, which grants no writes either) open twice --max-streams Write streams
    and send nothing: each is PERMISSION_DENIED at once, naming the scope it lacks, and holds
    nothing; team-a still writes (before: the reader's idle streams held all 4 slots and team-a was
    RESOURCE_EXHAUSTED for as long as they stayed open)."""
    sc = _start(tmp_path, max_streams=4)
    assert sc.service is not None and sc.engine is not None
    ch = grpc.insecure_channel(f"127.0.0.1:{sc.port}")
    streams: list[IdleStream] = []
    try:
        in_use = sc.engine.budget.in_use
        for who in ("reader", "ops"):
            opened = _open(sc, ch, who, 8)
            streams += opened
            assert [s.code() if s.ended.wait(5) else "open" for s in opened] == ["PERMISSION_DENIED"] * 8, who
            details = opened[0].error.details() if opened[0].error is not None else ""
            assert "write:<run glob>" in (details or "") and repr(who) in (details or ""), details
        assert sc.service.streams.used == 0
        assert sc.engine.budget.in_use == in_use  # no stream's window was reserved
        assert _code(_first_write(sc.port, "team-a", "team-a-1")) == "OK"
    finally:
        for s in streams:
            s.close()
        ch.close()
        sc.stop(5)


def test_one_identity_holds_at_most_its_share_of_streams(tmp_path: Path) -> None:
    """team-b opens --max-streams idle streams: those beyond its share (unset: a quarter of 16, at
    least 8) are RESOURCE_EXHAUSTED at once with a retry hint and a message naming the setting,
    and team-a still writes; its slots come back as its streams close (before: team-b took all 16
    and team-a was refused)."""
    sc = _start(tmp_path, max_streams=16)
    assert sc.service is not None and sc.config.streams_per_identity == 8
    ch = grpc.insecure_channel(f"127.0.0.1:{sc.port}")
    streams: list[IdleStream] = []
    try:
        streams = _open(sc, ch, "team-b", 16)
        deadline = time.monotonic() + 1.0  # the refused ones end at once (well before READ_TURN_IDLE_S)
        while sum(s.ended.is_set() for s in streams) < 8 and time.monotonic() < deadline:
            time.sleep(0.02)
        refused = [s for s in streams if s.ended.is_set()]
        assert len(refused) == 8, [s.code() for s in streams]
        assert {s.code() for s in refused} == {"RESOURCE_EXHAUSTED"}
        err = refused[0].error
        assert err is not None and "max_streams_per_identity" in (err.details() or ""), err
        assert "--max-streams-per-identity" in (err.details() or "")
        assert "retry-after-ms" in dict(err.trailing_metadata() or ())
        assert sc.service.streams.held == {"team-b": 8}
        assert _code(_first_write(sc.port, "team-a", "team-a-1")) == "OK"
        for s in streams:
            s.close()
        deadline = time.monotonic() + 10
        while sc.service.streams.used:
            assert time.monotonic() < deadline, sc.service.streams.held
            time.sleep(0.05)
        assert sc.service.streams.held == {}
        assert _code(_first_write(sc.port, "team-b", "team-b-1")) == "OK"
    finally:
        for s in streams:
            s.close()
        ch.close()
        sc.stop(5)


def test_unix_socket_callers_share_enough_for_one_engine(tmp_path: Path) -> None:
    """Every unix-socket caller without a token is one identity ('unix-socket'): the default share
    still admits a tensor-parallel engine's 8 recorder processes, one stream each, when
    --max-streams is lowered to 16 (a plain quarter would be 4)."""
    sc = _start(tmp_path, max_streams=16, unix_socket=str(tmp_path / "s.sock"))
    assert sc.service is not None
    ch = grpc.insecure_channel(f"unix://{tmp_path / 's.sock'}")
    streams: list[IdleStream] = []
    try:
        for i in range(8):  # each recorder process has written its first message, and waits
            first = write_request(1, [make_chunk(f"tp{i}", 0, 4)], writer=f"tp-{i}", declare=True).SerializeToString()
            streams.append(IdleStream(ch, None, first))
        deadline = time.monotonic() + 10
        while not all(s.acks for s in streams):
            assert not any(s.ended.is_set() for s in streams), [s.code() for s in streams]
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert sc.service.streams.held == {"unix-socket": 8}
    finally:
        for s in streams:
            s.close()
        ch.close()
        sc.stop(5)


def _record(rec: RolloutRecorder, trajectory: str) -> None:
    site = SPEC.site("layers.1.mlp.input")
    rng = np.random.default_rng(len(trajectory))
    codes = rng.integers(0, 256, (6, site.code_bytes), dtype=np.uint8)
    scales = rng.integers(0, 256, (6, site.scale_bytes), dtype=np.uint8)
    assert rec.record_forward([(trajectory, 0, 6)], {site.name: SiteOutput(codes, scales, 0.5)})
    rec.finish(trajectory, 7)


def test_idle_streams_make_room_for_a_refused_writer(tmp_path: Path) -> None:
    """--max-streams 2 (team-b's share is both): team-b's recorder, quiet after its first step, and
    a stream of team-b that never sends its first message hold both slots, and no stream waits for
    a turn. team-a's writer is refused, retries, and gets in: the idle streams are ended with OK
    once idle READ_TURN_IDLE_S after the refusal (before: they held the slots for as long as they
    stayed open, and team-a was refused for good). The quiet recorder loses nothing: it opens a
    new stream and its next step is acknowledged."""
    sc = _start(tmp_path, max_streams=2)
    assert sc.service is not None and sc.config.streams_per_identity == 2
    run = spec("team-b-1")
    rec = RolloutRecorder(f"127.0.0.1:{sc.port}", run, "b-rec", staging_bytes=4 << 20, batch_bytes=16 << 10,
                          token=TOKENS["team-b"], linger_s=0.0, reconnect_cap_s=0.5)  # fmt: skip
    ch = grpc.insecure_channel(f"127.0.0.1:{sc.port}")
    silent: list[IdleStream] = []
    try:
        _record(rec, "b-step-0")
        assert rec.flush(20), rec.stats
        silent = _open(sc, ch, "team-b", 1)
        deadline = time.monotonic() + 10
        while sc.service.streams.used < 2:
            assert time.monotonic() < deadline, sc.service.streams.held
            time.sleep(0.02)
        t0 = time.monotonic()
        first = _first_write(sc.port, "team-a", "team-a-1")
        assert _code(first) == "RESOURCE_EXHAUSTED" and "max_streams" in (first.details() or ""), first
        while (err := _first_write(sc.port, "team-a", "team-a-1")) is not None:
            assert _code(err) == "RESOURCE_EXHAUSTED", err
            assert time.monotonic() - t0 < READ_TURN_IDLE_S + 10, "team-a was never let in"
            time.sleep(0.2)
        assert silent[0].ended.wait(10) and silent[0].code() == "OK"
        _record(rec, "b-step-1")  # the quiet recorder goes on
        assert rec.flush(20), rec.stats
        assert rec.error is None and rec.stats["dropped"] == 0, rec.stats
    finally:
        rec.close()
        for s in silent:
            s.close()
        ch.close()
        sc.stop(5)
