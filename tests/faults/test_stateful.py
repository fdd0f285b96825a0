"""11. A stateful property test (hypothesis RuleBasedStateMachine) of the engine + a real
WriteAheadLog (64 KiB segments: they rotate and retire) + a Store on local disk, against a trivially
correct model (a dict of acknowledged records), under interleavings of writes (waited for or left in
flight), resends, new epochs, flushes, crashes (the engine closed without a flush, then a new engine
replays the same WAL, and the writers resend what was in flight, as the recorder does) and reads.

Invariants at every step: storage never holds a chunk key twice, nor a record that was not sent
with those exact bytes; a restarted engine knows every acknowledged sequence. After a flush every
acknowledged record reads back bit-identical. In-process (server.engine.Engine): no sidecar process.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as hs
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test
from tracestore.server.config import ServerConfig
from tracestore.server.rpc.ingest import parse_write

from tracestore.storage.reader import StoreReader
from tracestore.storage.store import Store
from tracestore.v1 import tracestore_pb2 as pb

from .harness import SPEC, EngineOnDisk, Rec, make_recs, read_back, row

WRITERS = ("sm-a", "sm-b")
DURABLE_S = 10.0
# 250 examples: ~25 s on 2 cores. At 15, CI missed a lost acknowledged record (an older epoch's
# message left queued by a flush) that 300-700 examples found; tests/server/engine/test_core.py now
# pins that case, and nightly-sized runs (TRACESTORE_STATEFUL_EXAMPLES=4000) find nothing more.
EXAMPLES = int(os.environ.get("TRACESTORE_STATEFUL_EXAMPLES", "250"))
STATS: Counter[str] = Counter()


class Sent:
    def __init__(self, writer: str, epoch: int, seq: int, recs: list[Rec], raw: bytes) -> None:
        self.writer, self.epoch, self.seq, self.recs, self.raw = writer, epoch, seq, recs, raw


class EngineWalStore(EngineOnDisk, RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="ts-stateful-"))
        self.url = f"file://{self.dir / 'data'}"
        Store(self.url).put_run(SPEC)
        self.cfg = ServerConfig(
            storage=self.url, wal_dir=str(self.dir / "wal"), port=0, metrics_port=None,
            wal_segment_bytes=64 << 10, shard_target_bytes=96 << 10, flush_interval_s=0.05, grace_s=5.0,
        )  # fmt: skip
        self.eng = self._engine()
        self.epoch = dict.fromkeys(WRITERS, 1)
        self.seq = dict.fromkeys(WRITERS, 0)
        self.acked_seq = dict.fromkeys(WRITERS, 0)  # highest acknowledged sequence of the current epoch
        self.history: dict[str, list[Sent]] = {w: [] for w in WRITERS}  # this epoch's messages
        self.in_flight: list[Sent] = []
        self.acked: dict[tuple[int, str, str, int], Rec] = {}
        self.sent: dict[tuple[int, str, str, int], Rec] = {}
        self.payload = 0
        STATS["examples"] += 1

    # -- helpers

    def _submit(self, raw: bytes) -> tuple[object, bool]:
        _, msg, parts = parse_write(raw, self.eng.run_spec, None)
        return self.eng.submit(msg, parts)

    def _wait_durable(self, writer: str, seq: int) -> None:
        st = self.eng.writers[(SPEC.run, writer)]
        deadline = time.monotonic() + DURABLE_S
        while True:
            epoch, durable, _ = self.eng.durable(st)
            if epoch == self.epoch[writer] and durable >= seq:
                return
            assert time.monotonic() < deadline, f"{writer} seq {seq} not durable in {DURABLE_S} s"
            time.sleep(0.002)

    def _ack(self, s: Sent) -> None:
        for r in s.recs:
            self.acked[r.key] = r
        self.acked_seq[s.writer] = max(self.acked_seq[s.writer], s.seq)
        STATS["acked"] += len(s.recs)

    def _stored(self) -> Counter[tuple[int, str, str, int]]:
        store = Store(self.url)
        keys: Counter[tuple[int, str, str, int]] = Counter()
        for v in store.list_versions(SPEC.run) if (self.dir / "data" / SPEC.run).exists() else []:
            for m in store.manifests(SPEC.run, v):
                for e in m.chunks:
                    keys[(v, e.trajectory, e.site, e.token_start)] += 1
        return keys

    def _read_back(self, recs: list[Rec], must_exist: bool) -> None:
        read_back(StoreReader(Store(self.url), SPEC.run), recs, must_exist, STATS)

    # -- rules

    @rule(
        writer=hs.sampled_from(WRITERS), trajs=hs.integers(1, 3), tokens=hs.sampled_from([1, 7, 64, 200]),
        version=hs.sampled_from([0, 0, 1]), wait=hs.booleans(),
    )  # fmt: skip
    def write(self, writer: str, trajs: int, tokens: int, version: int, wait: bool) -> None:
        self.seq[writer] += 1
        seq = self.seq[writer]
        recs = make_recs(writer, self.payload, trajs=trajs, tokens=tokens, version=version)
        self.payload += 1
        req = pb.WriteRequest(run=SPEC.run, writer=writer, epoch=self.epoch[writer], sequence=seq,
                              chunks=[r.to_pb() for r in recs])  # fmt: skip
        s = Sent(writer, self.epoch[writer], seq, recs, req.SerializeToString())
        for r in recs:
            self.sent[r.key] = r
        _, dup = self._submit(s.raw)
        assert not dup, f"a new message {writer} seq {seq} was taken for a resend"
        self.history[writer].append(s)
        STATS["writes"] += 1
        if wait:
            self._wait_durable(writer, seq)
            self._ack(s)
        else:
            self.in_flight.append(s)

    @rule(writer=hs.sampled_from(WRITERS), trajs=hs.integers(1, 3), wait=hs.booleans())
    def write_more(self, writer: str, trajs: int, wait: bool) -> None:
        """(writes are the common step: a second rule makes them about as likely as the others together)"""
        self.write(writer, trajs, 32, 0, wait)

    @precondition(lambda self: self.in_flight)
    @rule()
    def settle(self) -> None:
        for s in self.in_flight:
            self._wait_durable(s.writer, s.seq)
            self._ack(s)
        self.in_flight = []

    @precondition(lambda self: any(self.history.values()))
    @rule(data=hs.data())
    def resend(self, data: hs.DataObject) -> None:
        writer = data.draw(hs.sampled_from([w for w in WRITERS if self.history[w]]))
        s = data.draw(hs.sampled_from(self.history[writer]))
        _, dup = self._submit(s.raw)
        assert dup, f"a resend of {writer} seq {s.seq} was taken as new"
        STATS["resends"] += 1

    @precondition(lambda self: not self.in_flight)
    @rule(writer=hs.sampled_from(WRITERS))
    def new_epoch(self, writer: str) -> None:
        self.epoch[writer] += 1
        self.seq[writer] = 0
        self.acked_seq[writer] = 0
        self.history[writer] = []

    @rule()
    def flush(self) -> None:
        assert self.eng.flush(15), f"flush did not finish: {self.eng.stat()}"
        for s in self.in_flight:  # committed implies durable
            self._ack(s)
        self.in_flight = []
        self._read_back(list(self.acked.values()), must_exist=True)
        STATS["flushes"] += 1

    @rule()
    def crash(self) -> None:
        """The engine goes away without a flush; a new one replays the WAL; writers resend in flight."""
        self.eng.close(timeout=5)
        self.eng = self._engine()
        STATS["crashes"] += 1
        for w in WRITERS:
            st = self.eng.writers.get((SPEC.run, w))
            if self.acked_seq[w]:
                assert st is not None, f"the restarted engine forgot writer {w}"
                epoch, durable, _ = self.eng.durable(st)
                assert (epoch, durable) >= (self.epoch[w], self.acked_seq[w]), (
                    f"{w}: restarted at epoch {epoch} durable {durable}, "
                    f"acknowledged epoch {self.epoch[w]} seq {self.acked_seq[w]}"
                )
        for s in self.in_flight:  # the recorder resends what was not acknowledged, same epoch
            self._submit(s.raw)
            self._wait_durable(s.writer, s.seq)
            self._ack(s)
        self.in_flight = []

    @precondition(lambda self: self.acked)
    @rule(data=hs.data())
    def read(self, data: hs.DataObject) -> None:
        """Whatever is readable now is exactly what was written (some may still be pending)."""
        keys = data.draw(hs.lists(hs.sampled_from(sorted(self.acked)), min_size=1, max_size=8, unique=True))
        self._read_back([self.acked[k] for k in keys], must_exist=False)

    # -- invariants

    @invariant()
    def storage_holds_each_key_once_and_only_sent_records(self) -> None:
        stored = self._stored()
        dups = {k: n for k, n in stored.items() if n > 1}
        STATS["duplicated"] += sum(n - 1 for n in dups.values())
        assert not dups, f"chunk keys stored more than once: {list(dups.items())[:3]}"
        phantom = [k for k in stored if k not in self.sent]
        assert not phantom, f"records on storage that were never sent: {phantom[:3]}"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_engine_wal_store_state_machine() -> None:
    r = row(f"11 stateful engine+WAL+store ({EXAMPLES} examples)")
    STATS.clear()
    # No shrinking in CI by default (a failing run would spend the time budget shrinking);
    # TRACESTORE_STATEFUL_SHRINK=1 shrinks a failure to its shortest interleaving.
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if os.environ.get("TRACESTORE_STATEFUL_SHRINK") else [])
    opts = settings(
        max_examples=EXAMPLES, stateful_step_count=25, deadline=None, database=None, phases=phases,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )  # fmt: skip
    try:
        run_state_machine_as_test(EngineWalStore, settings=opts)
    finally:
        r.trials = STATS["examples"]
        r.acked, r.lost, r.duplicated = STATS["acked"], STATS["lost"], STATS["duplicated"]
        r.add_note(
            f"writes {STATS['writes']}, resends {STATS['resends']}, crashes {STATS['crashes']}, "
            f"flushes {STATS['flushes']}"
        )
