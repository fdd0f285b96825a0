"""A loop of tiny Reads does not make the sidecar cut a shard per read.

Before, every Read committed everything the sidecar held before reading storage (read-your-writes):
a caller with only ``read:`` scope looping tiny Reads beside a writer forced a shard per writer per
read (721-1,008 shards in 20 s instead of 3), a storage cost and object count no reader should
control, and took ingest CPU. Now reads together force at most one commit per ``--flush-interval``
(a Read waits for the next one instead), and a Read still sees every record acknowledged before it
began. A real ``tracestore serve`` process with tokens and a WAL, over real gRPC.
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
from tracestore.server.testing import ServeProcess, make_chunk, write_request

from tracestore.v1 import tracestore_pb2 as pb

from .tenants import SCOPES, TOKENS, meta, spec

READ = "/tracestore.v1.TraceStore/Read"
WRITE = "/tracestore.v1.TraceStore/Write"
RUN = "team-a-1"
FLUSH_S = 1.0
PHASE_S = 6.0


def _shards(sp: ServeProcess) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{sp.metrics_port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("tracestore_shards_total "):
                return float(line.split()[1])
    raise AssertionError("no tracestore_shards_total")


class _Writer:
    """team-a writes a 16-token trajectory every 10 ms on one Write stream; ``acked`` is the highest
    sequence acknowledged (each message i writes trajectory ``t-<i>``)."""

    def __init__(self, address: str) -> None:
        self.acked = 0
        self.stop = threading.Event()
        self.error: str | None = None
        self._ch = grpc.insecure_channel(address)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _requests(self) -> Any:
        seq = 1
        while not self.stop.is_set():
            req = write_request(seq, [make_chunk(f"t-{seq}", 0, 16, spec=spec(RUN))], writer="w0",
                                declare=seq == 1, spec=spec(RUN))  # fmt: skip
            yield req.SerializeToString()
            seq += 1
            time.sleep(0.01)

    def _run(self) -> None:
        try:
            for raw in self._ch.stream_stream(WRITE)(self._requests(), metadata=meta("team-a"), timeout=120):
                self.acked = max(self.acked, pb.WriteResponse.FromString(raw).durable_sequence)
        except grpc.RpcError as exc:
            if not self.stop.is_set():
                self.error = exc.code().name

    def close(self) -> None:
        self.stop.set()
        self._thread.join(10)
        self._ch.close()


def _reader(address: str, writer: _Writer, until: float, out: list[str]) -> None:
    """read:* reads one token of the trajectory acknowledged last, again and again until ``until``:
    the status of each read (a missing record is NOT_FOUND: read-your-writes broken)."""
    with grpc.insecure_channel(address) as ch:
        while time.monotonic() < until:
            seq = writer.acked
            req = pb.ReadRequest(run=RUN, plan=[pb.Segment(trajectory=f"t-{seq}", token_start=0, token_end=1)],
                                 sites=[spec(RUN).sites[0].name], on_missing=pb.ON_MISSING_ERROR)  # fmt: skip
            try:
                for _ in ch.unary_stream(READ)(req.SerializeToString(), metadata=meta("reader"), timeout=30):
                    pass
                out.append("OK")
            except grpc.RpcError as exc:
                out.append(f"{exc.code().name}: {(exc.details() or '')[:200]}")


@pytest.mark.timeout(120)
def test_a_loop_of_tiny_reads_forces_at_most_one_commit_per_flush_interval(tmp_path: Path) -> None:
    """Beside a writer, 6 s of back-to-back tiny reads (two reader threads) force at most one commit
    per --flush-interval (1 s): a few shards per second more than 6 s without reads; every read sees
    what was acknowledged before it (before: a shard per read, hundreds)."""
    lines = [f"sha256:{hashlib.sha256(TOKENS[n].encode()).hexdigest()} {s} {n}" for n, s in SCOPES.items()]
    (tmp_path / "tokens").write_text("\n".join(lines) + "\n")
    (tmp_path / "tokens").chmod(0o600)
    sp = ServeProcess(tmp_path, flags=["--auth-tokens", str(tmp_path / "tokens"), "--flush-interval", str(FLUSH_S)])
    sp.start()
    writer = _Writer(sp.address)
    try:
        time.sleep(1.0)
        s0, a0 = _shards(sp), writer.acked
        time.sleep(PHASE_S)
        s1, a1 = _shards(sp), writer.acked
        results: list[str] = []
        until = time.monotonic() + PHASE_S
        readers = [threading.Thread(target=_reader, args=(sp.address, writer, until, results)) for _ in range(2)]
        for t in readers:
            t.start()
        for t in readers:
            t.join(60)
        s2, a2 = _shards(sp), writer.acked
        quiet, busy = s1 - s0, s2 - s1
        print(f"{PHASE_S:.0f} s without reads: {quiet:.0f} shards, {a1 - a0} messages acked; with "
              f"{len(results)} tiny reads: {busy:.0f} shards, {a2 - a1} messages acked")  # fmt: skip
        assert writer.error is None, writer.error
        assert results and set(results) == {"OK"}, sorted(set(results))[:3]
        # one read-forced commit per interval cuts a shard per writer, at times a second one of what
        # arrived while the first was written
        assert busy <= quiet + 3 * (PHASE_S / FLUSH_S + 1), (quiet, busy, len(results))
    finally:
        writer.close()
        sp.kill()
