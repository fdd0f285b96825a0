"""A token revoked by a reload of the token file (SIGHUP) reaches the Write streams already open
with it: busy or idle, they end UNAUTHENTICATED within a second, and what they had acknowledged
stays stored. Before, a revoked writer's open stream kept being acknowledged (~2,900 messages over
30 s)."""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import grpc
from tracestore.server.testing import make_chunk, wait_for, write_request

from tracestore.plan import MicrobatchPlan
from tracestore.storage.reader import StoreReader
from tracestore.storage.store import Store
from tracestore.v1 import tracestore_pb2 as pb

from .tenants import SCOPES, TOKENS, WRITE, meta, spec, start_sidecar


class Stream:
    """A Write stream as ``who`` on ``run`` that sends a message whenever ``go`` is set (``busy``:
    one after another) and records every acknowledgement and how it ended."""

    def __init__(self, port: int, who: str, run: str, busy: bool) -> None:
        self.run, self.busy = run, busy
        self.go = threading.Event()
        self.stop = threading.Event()
        self.acked = 0
        self.error: grpc.RpcError | None = None
        self.ended_at: float | None = None
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.call = self.channel.stream_stream(WRITE)(self._requests(), metadata=meta(who), timeout=60)
        self.thread = threading.Thread(target=self._collect, daemon=True)
        self.thread.start()

    def _requests(self):  # noqa: ANN202
        seq = 0
        while not self.stop.is_set():
            if not self.busy and seq >= 1:
                self.stop.wait(0.05)
                continue
            seq += 1
            yield write_request(seq, [make_chunk(f"t{seq}", 0, 2, spec=spec(self.run))], writer=f"w-{self.run}",
                                declare=seq == 1, spec=spec(self.run)).SerializeToString()  # fmt: skip
            time.sleep(0.005)

    def _collect(self) -> None:
        try:
            for raw in self.call:
                self.acked = max(self.acked, pb.WriteResponse.FromString(raw).durable_sequence)
        except grpc.RpcError as exc:
            self.error = exc
        self.ended_at = time.monotonic()

    def close(self) -> None:
        self.stop.set()
        self.call.cancel()
        self.channel.close()


def test_a_revoked_token_ends_its_open_streams_within_a_second(tmp_path: Path) -> None:
    sc = start_sidecar(tmp_path)
    busy = Stream(sc.port, "team-a", "team-a-busy", busy=True)
    idle = Stream(sc.port, "team-a", "team-a-idle", busy=False)
    other = Stream(sc.port, "team-b", "team-b-run", busy=False)
    try:
        wait_for("the streams are acknowledged", lambda: busy.acked >= 5 and idle.acked >= 1 and other.acked >= 1)
        kept = [n for n in SCOPES if n != "team-a"]
        lines = [f"sha256:{hashlib.sha256(TOKENS[n].encode()).hexdigest()} {SCOPES[n]} {n}" for n in kept]
        (tmp_path / "tokens").write_text("\n".join(lines) + "\n")
        t0 = time.monotonic()
        sc.reload()
        wait_for("team-a's streams ended", lambda: busy.ended_at is not None and idle.ended_at is not None, 10)
        for s in (busy, idle):
            assert s.error is not None and s.error.code() == grpc.StatusCode.UNAUTHENTICATED, s.error
            assert "revoked" in (s.error.details() or "")
            assert s.ended_at is not None and s.ended_at - t0 <= 1.0, f"ended {s.ended_at - t0:.2f} s after the reload"
        assert other.ended_at is None  # another identity's stream stays open
        acked = busy.acked
    finally:
        for s in (busy, idle, other):
            s.close()
        sc.stop(5)
    # everything acknowledged before the revocation is stored
    reader = StoreReader(Store(f"file://{tmp_path / 'data'}"), "team-a-busy")
    plan = MicrobatchPlan([(f"t{i}", 0, 2) for i in range(1, acked + 1)])
    rows = reader.read(plan, sites=[spec("team-a-busy").sites[0].name])
    assert next(iter(rows.values())).valid.all()
