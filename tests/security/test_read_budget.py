"""Reads a caller does not take hold no budget ingest needs, and one reader cannot take every read.

Before, a Read reserved its whole output in the memory budget the Write streams use and held it
until its response stream ended: a caller with only ``read:`` scope that opened a few Reads and
never took the responses left every Write RESOURCE_EXHAUSTED (the message blaming storage) for as
long as it kept them open, and 60 such calls also took every thread Seal and other readers need.
Now reads reserve from their own read budget (``--read-budget-mib``), a read whose client takes no
response for ``--read-stall-timeout`` seconds is cancelled and its reservation freed, and with
tokens one identity holds at most half of the read budget (unless no other identity reads) and at
most half of the Read/Seal threads. Each case is a real ``tracestore serve`` process over real gRPC.
"""

from __future__ import annotations

import hashlib
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from tracestore.server.testing import ServeProcess, make_chunk, wait_for, write_request

from tracestore.v1 import tracestore_pb2 as pb

from .tenants import SCOPES, TOKENS, meta, spec

READ = "/tracestore.v1.TraceStore/Read"
WRITE = "/tracestore.v1.TraceStore/Write"
SEAL = "/tracestore.v1.TraceStore/Seal"
RUN = "team-a-1"
SITE = spec(RUN).sites[0].name
STALL_S = 3.0  # TRACESTORE_READ_STALL_TIMEOUT of these sidecars
# Each not-taken read asks for ~6.2 MiB of masked rows (108 bytes per token over both sites) and
# reserves ~18 MiB with the slices being sent: more than gRPC's client buffers take in unasked, so its
# responses wait for the caller.
GHOST_TOKENS = 60_000


def _serve(tmp: Path, *flags: str, read_budget_mib: int = 32) -> ServeProcess:
    lines = [f"sha256:{hashlib.sha256(TOKENS[n].encode()).hexdigest()} {s} {n}" for n, s in SCOPES.items()]
    (tmp / "tokens").write_text("\n".join(lines) + "\n")
    (tmp / "tokens").chmod(0o600)
    flags = ("--auth-tokens", str(tmp / "tokens"), "--memory-budget-mib", "64", "--max-message-mib", "8",
             "--backpressure-timeout", "2", "--flush-interval", "0.2", *flags)  # fmt: skip
    env = {"TRACESTORE_READ_STALL_TIMEOUT": str(STALL_S), "TRACESTORE_READ_BUDGET_MIB": str(read_budget_mib)}
    return ServeProcess(tmp, flags=list(flags), env=env).start()


def _read_req(traj: str, tokens: int) -> bytes:
    return pb.ReadRequest(run=RUN, plan=[pb.Segment(trajectory=traj, token_start=0, token_end=tokens)],
                          on_missing=pb.ON_MISSING_MASK).SerializeToString()  # fmt: skip


def _slow_channel(sp: ServeProcess) -> grpc.Channel:
    """A channel whose HTTP/2 windows stay at 64 KiB (BDP probing off): responses not taken wait at
    the sidecar (with probing on, gRPC's client buffers a few MiB per call unasked)."""
    return grpc.insecure_channel(sp.address, options=[("grpc.max_receive_message_length", 64 << 20),
                                                      ("grpc.http2.bdp_probe", 0)])  # fmt: skip


def _untaken(ch: grpc.Channel, who: str, n: int, tokens: int = GHOST_TOKENS) -> list[Any]:
    """``n`` Reads as ``who`` on ``ch`` (a :func:`_slow_channel`) whose responses are never taken
    (the calls are kept open, not iterated)."""
    return [ch.unary_stream(READ)(_read_req(f"ghost-{who}-{i}", tokens), metadata=meta(who), timeout=120)
            for i in range(n)]  # fmt: skip


def _read(ch: grpc.Channel, who: str, traj: str, tokens: int, timeout: float = 60) -> tuple[str, float]:
    """A Read as ``who`` taken to the end: its status code and how long it took."""
    t0 = time.monotonic()
    try:
        for _ in ch.unary_stream(READ)(_read_req(traj, tokens), metadata=meta(who), timeout=timeout):
            pass
    except grpc.RpcError as exc:
        return exc.code().name, time.monotonic() - t0
    return "OK", time.monotonic() - t0


def _writes(ch: grpc.Channel, who: str, reqs: list[pb.WriteRequest]) -> tuple[str, list[float]]:
    """Send ``reqs`` on one Write stream as ``who``, each once the one before is acknowledged: the
    stream's end status and the seconds each acknowledgement took."""
    acks: list[float] = []
    gate = threading.Semaphore(1)
    t_sent = [0.0]

    def requests() -> Any:
        for r in reqs:
            gate.acquire()
            t_sent[0] = time.monotonic()
            yield r.SerializeToString()

    try:
        for raw in ch.stream_stream(WRITE)(requests(), metadata=meta(who), timeout=60):
            ack = pb.WriteResponse.FromString(raw)
            if ack.durable_sequence >= reqs[len(acks)].sequence:
                acks.append(time.monotonic() - t_sent[0])
                if len(acks) == len(reqs):
                    return "OK", acks
                gate.release()
    except grpc.RpcError as exc:
        return exc.code().name, acks
    return "ENDED", acks


def _metric(sp: ServeProcess, name: str) -> float:
    """The value of metric ``name`` (with its labels, as the endpoint writes them; 0 if absent)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{sp.metrics_port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


def _reads_ended(sp: ServeProcess, code: str) -> float:
    return _metric(sp, f'tracestore_requests_total{{code="{code}",method="Read"}}')


def _drain(call: Any) -> str:
    """Take what a call still has and return how it ended (a call the sidecar cancelled ends once
    the caller has taken the responses gRPC holds for it)."""
    try:
        for _ in call:
            pass
    except grpc.RpcError as exc:
        return str(exc.code().name)
    return "OK"


def _declare(ch: grpc.Channel) -> None:
    first = write_request(1, [make_chunk("t-0", 0, 4, spec=spec(RUN))], writer="w0", declare=True, spec=spec(RUN))
    assert _writes(ch, "team-a", [first])[0] == "OK"


@pytest.mark.timeout(120)
def test_untaken_reads_of_a_reader_leave_writes_and_other_readers_served(tmp_path: Path) -> None:
    """read:* opens 16 Reads of ~6 MiB and never takes a response: team-a's 20 writes are each
    acknowledged within 2 s (before: RESOURCE_EXHAUSTED after the 2 s backpressure timeout, the
    budget held by the reads), team-a's own read is served once the stalled reads are cancelled
    (within the stall timeout), every stalled read ends, and the read budget is all free again."""
    sp = _serve(tmp_path)
    ch = grpc.insecure_channel(sp.address, options=[("grpc.max_receive_message_length", 64 << 20)])
    slow = _slow_channel(sp)
    calls: list[Any] = []
    try:
        _declare(ch)
        calls = _untaken(slow, "reader", 16)
        time.sleep(1.0)  # the reads have reserved what they could and wait in their first response
        reqs = [write_request(i, [make_chunk(f"t-{i}", 0, 1000, spec=spec(RUN))], writer="w0", spec=spec(RUN))
                for i in range(2, 22)]  # fmt: skip
        t0 = time.monotonic()
        status, acks = _writes(ch, "team-a", reqs)
        took = time.monotonic() - t0
        print(f"writes beside 16 untaken reads: {status}, {len(acks)}/20 acked in {took:.2f} s, "
              f"slowest ack {max(acks, default=0):.2f} s")  # fmt: skip
        assert status == "OK" and len(acks) == 20, (status, len(acks))
        assert max(acks) < 2.0, acks
        code, read_s = _read(ch, "team-a", "t-5", 1000)
        print(f"team-a's read beside them: {code} in {read_s:.2f} s")
        assert code == "OK" and read_s < STALL_S + 5, (code, read_s)
        # each stalled read is cancelled (CANCELLED) and each refused for the read budget
        # RESOURCE_EXHAUSTED, none served, and what they held is free
        wait_for(
            "the untaken reads ended at the sidecar",
            lambda: _reads_ended(sp, "CANCELLED") + _reads_ended(sp, "RESOURCE_EXHAUSTED") >= 16,
            2 * STALL_S + 10,
        )
        assert _metric(sp, "tracestore_read_in_use_bytes") == 0
        stalled = _metric(sp, "tracestore_reads_stalled_total")
        assert stalled >= 1 and _reads_ended(sp, "CANCELLED") == stalled, stalled
        ends = [_drain(c) for c in calls]
        print(f"the untaken reads: {stalled:.0f} cancelled, ended {sorted(set(ends))} at the caller")
        assert set(ends) <= {"CANCELLED", "RESOURCE_EXHAUSTED"} and "CANCELLED" in ends, ends
    finally:
        for c in calls:
            c.cancel()
        ch.close()
        slow.close()
        sp.kill()


@pytest.mark.timeout(120)
def test_one_reader_holds_at_most_half_while_another_reads(tmp_path: Path) -> None:
    """With a 64 MiB read budget, team-a has a ~1.5 MiB read open (6 MiB reserved); read:* then opens
    16 untaken ~6 MiB ones (18 MiB reserved each): it holds at most half the read budget (one read),
    so team-a's next ~6 MiB read is served at once, not after the stall timeout (before: the reader's
    reads filled the memory budget and team-a's read was RESOURCE_EXHAUSTED after the 2 s
    backpressure timeout)."""
    sp = _serve(tmp_path, read_budget_mib=64)
    ch = grpc.insecure_channel(sp.address, options=[("grpc.max_receive_message_length", 64 << 20)])
    slow = _slow_channel(sp)
    calls: list[Any] = []
    try:
        _declare(ch)
        calls = _untaken(slow, "team-a", 1, GHOST_TOKENS // 4)  # team-a reads (slowly): the reader is not alone
        time.sleep(0.3)
        calls += _untaken(slow, "reader", 16)
        time.sleep(0.7)
        code, read_s = _read(ch, "team-a", "t-0", GHOST_TOKENS)
        print(f"team-a's read beside the reader's 16 untaken reads: {code} in {read_s:.2f} s")
        assert code == "OK" and read_s < STALL_S / 2, (code, read_s)
    finally:
        for c in calls:
            c.cancel()
        ch.close()
        slow.close()
        sp.kill()


@pytest.mark.timeout(120)
def test_one_readers_calls_leave_threads_for_seal_and_other_readers(tmp_path: Path) -> None:
    """--workers 12 leaves 8 threads for Read and Seal: read:* opens 12 untaken reads (a read budget of
    256 MiB holds them all), of which it holds at most 4 (the rest RESOURCE_EXHAUSTED at once), and
    team-a's Seal and read are still served at once (before: the reader's reads took all 8 threads
    and both were RESOURCE_EXHAUSTED)."""
    sp = _serve(tmp_path, "--workers", "12", "--memory-budget-mib", "512", read_budget_mib=256)
    ch = grpc.insecure_channel(sp.address, options=[("grpc.max_receive_message_length", 64 << 20)])
    slow = _slow_channel(sp)
    calls: list[Any] = []
    try:
        _declare(ch)
        calls = _untaken(slow, "reader", 12)
        time.sleep(1.0)
        refused = [c.code().name for c in calls if c.done()]
        print(f"the reader's 12 untaken reads: {len(calls) - len(refused)} open, refused {refused}")
        sealed_t0 = pb.TrajectorySeal(trajectory="t-0", policy_version=0, n_tokens=5, sites=[SITE])
        seal = pb.SealRequest(run=RUN, writer="w0", epoch=1, sequence=2, seals=[sealed_t0])
        try:
            ch.unary_unary(SEAL)(seal.SerializeToString(), metadata=meta("team-a"), timeout=10)
            sealed = "OK"
        except grpc.RpcError as exc:
            sealed = f"{exc.code().name}: {exc.details()}"
        code, read_s = _read(ch, "team-a", "t-0", 4)
        print(f"team-a's seal: {sealed}; its read: {code} in {read_s:.2f} s")
        assert sealed == "OK" and code == "OK" and read_s < STALL_S / 2, (sealed, code, read_s)
        assert len(calls) - len(refused) <= 4 and set(refused) <= {"RESOURCE_EXHAUSTED"}, refused
    finally:
        for c in calls:
            c.cancel()
        ch.close()
        slow.close()
        sp.kill()
