"""One caller cannot take the Write-stream slots (``--max-streams``) from another.

Before, a Write stream took its slot (and its window's share of the memory budget) before any
scope was checked, and an idle stream was ended only while another stream waited for a turn to
read: a caller with only ``read:*`` that opened ``--max-streams`` streams and sent nothing made
every other team's write RESOURCE_EXHAUSTED for as long as it kept them open; so could any one
identity allowed to write, and so did streams that never sent their first message whenever no
stream waited for a turn. Each case is real gRPC against a sidecar with tokens and a WAL.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import numpy as np
from tracestore.client import RolloutRecorder, SiteOutput
from tracestore.server.rpc.service import Sidecar
from tracestore.server.rpc.write_stream import READ_TURN_IDLE_S
from tracestore.server.testing import SPEC, IdleWriteStream, make_chunk, write_request

from .tenants import TOKENS, code, first_write, meta, spec, start_sidecar


def _idle(ch: grpc.Channel, who: str | None, first: bytes | None = None) -> IdleWriteStream:
    """A Write stream opened as ``who`` (None: no token) that sends ``first`` (if any), then nothing."""
    return IdleWriteStream(ch, first, meta(who) if who is not None else (), timeout=60)


def _open(sc: Sidecar, ch: grpc.Channel, who: str, n: int, settle_s: float = 1.0) -> list[IdleWriteStream]:
    """``n`` idle streams as ``who``; returns once each was refused or holds a slot (or after settle_s)."""
    assert sc.service is not None
    before = sc.service.streams.used
    streams = [_idle(ch, who) for _ in range(n)]
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        if sum(s.ended.is_set() for s in streams) + sc.service.streams.used - before >= n:
            break
        time.sleep(0.02)
    return streams


def test_a_caller_without_write_scope_takes_no_stream_slot(tmp_path: Path) -> None:
    """read:* (and admin only, which grants no writes either) open twice --max-streams Write streams
    and send nothing: each is PERMISSION_DENIED at once, naming the scope it lacks, and holds
    nothing; team-a still writes (before: the reader's idle streams held all 4 slots and team-a was
    RESOURCE_EXHAUSTED for as long as they stayed open)."""
    sc = start_sidecar(tmp_path, max_streams=4)
    assert sc.service is not None and sc.engine is not None
    ch = grpc.insecure_channel(f"127.0.0.1:{sc.port}")
    streams: list[IdleWriteStream] = []
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
        assert code(first_write(sc.port, "team-a", "team-a-1")) == "OK"
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
    sc = start_sidecar(tmp_path, max_streams=16)
    assert sc.service is not None and sc.config.streams_per_identity == 8
    ch = grpc.insecure_channel(f"127.0.0.1:{sc.port}")
    streams: list[IdleWriteStream] = []
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
        assert code(first_write(sc.port, "team-a", "team-a-1")) == "OK"
        for s in streams:
            s.close()
        deadline = time.monotonic() + 10
        while sc.service.streams.used:
            assert time.monotonic() < deadline, sc.service.streams.held
            time.sleep(0.05)
        assert sc.service.streams.held == {}
        assert code(first_write(sc.port, "team-b", "team-b-1")) == "OK"
    finally:
        for s in streams:
            s.close()
        ch.close()
        sc.stop(5)


def test_unix_socket_callers_share_enough_for_one_engine(tmp_path: Path) -> None:
    """Every unix-socket caller without a token is one identity ('unix-socket'): the default share
    still admits a tensor-parallel engine's 8 recorder processes, one stream each, when
    --max-streams is lowered to 16 (a plain quarter would be 4). (Messages of at most 16 MiB, so
    that all 8 also hold a read turn at once: with the default 64 MiB the budget gives 7, and an
    idle eighth stream may be ended to pass its turn on, which is the read-turn rule, not this one.)"""
    sc = start_sidecar(tmp_path, max_streams=16, unix_socket=str(tmp_path / "s.sock"), max_message_bytes=16 << 20)
    assert sc.service is not None
    ch = grpc.insecure_channel(f"unix://{tmp_path / 's.sock'}")
    streams: list[IdleWriteStream] = []
    try:
        for i in range(8):  # each recorder process has written its first message, and waits
            first = write_request(1, [make_chunk(f"tp{i}", 0, 4)], writer=f"tp-{i}", declare=True).SerializeToString()
            streams.append(_idle(ch, None, first))
        deadline = time.monotonic() + 10
        while not all(s.responses for s in streams):
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
    sc = start_sidecar(tmp_path, max_streams=2)
    assert sc.service is not None and sc.config.streams_per_identity == 2
    run = spec("team-b-1")
    rec = RolloutRecorder(f"127.0.0.1:{sc.port}", run, "b-rec", staging_bytes=4 << 20, batch_bytes=16 << 10,
                          token=TOKENS["team-b"], linger_s=0.0, reconnect_cap_s=0.5)  # fmt: skip
    ch = grpc.insecure_channel(f"127.0.0.1:{sc.port}")
    silent: list[IdleWriteStream] = []
    try:
        _record(rec, "b-step-0")
        assert rec.flush(20), rec.stats
        silent = _open(sc, ch, "team-b", 1)
        deadline = time.monotonic() + 10
        while sc.service.streams.used < 2:
            assert time.monotonic() < deadline, sc.service.streams.held
            time.sleep(0.02)
        t0 = time.monotonic()
        first = first_write(sc.port, "team-a", "team-a-1")
        assert code(first) == "RESOURCE_EXHAUSTED" and "max_streams" in (first.details() or ""), first
        while (err := first_write(sc.port, "team-a", "team-a-1")) is not None:
            assert code(err) == "RESOURCE_EXHAUSTED", err
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
