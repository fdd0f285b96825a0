"""Engine: writer sessions (epoch, sequence), dedupe and conflicts, durable acks, budget backpressure.

Real Store on memory:// or file:// (no mocks); messages are parsed from real wire bytes.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from tracestore.server.config import ServerConfig
from tracestore.server.engine.core import Engine
from tracestore.server.engine.memory import OverBudgetError
from tracestore.server.engine.sessions import SequenceError
from tracestore.server.metrics import Metrics
from tracestore.server.rpc.ingest import parse_write, wal_parser
from tracestore.server.testing import SPEC, make_chunk, start_engine, submit_request, write_request

from tracestore.errors import ConflictError, MissingRecordsError, ValidationError
from tracestore.plan import MicrobatchPlan
from tracestore.records import TrajectorySeal
from tracestore.storage.reader import StoreReader
from tracestore.storage.store import Store


def _engine(url: str, wal: Path | None, **kw: object) -> Engine:
    return start_engine(url, wal, **kw)  # type: ignore[no-any-return]


def _submit(eng: Engine, req: object) -> tuple[object, bool]:
    return submit_request(eng, req)  # type: ignore[arg-type]


def _wait_durable(eng: Engine, st: object, seq: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while eng.durable(st)[1] < seq:  # type: ignore[arg-type]
        assert time.monotonic() < deadline, "not durable in time"
        time.sleep(0.005)


def test_sequence_rules(memory_url: str, tmp_path: Path) -> None:
    eng = _engine(memory_url, tmp_path / "wal")
    try:
        st, dup = _submit(eng, write_request(1, [make_chunk("t1", 0, 4)]))
        assert not dup
        _, dup = _submit(eng, write_request(1, [make_chunk("t1", 0, 4)]))
        assert dup  # resend: success, no second write
        with pytest.raises(SequenceError, match="expected sequence 2, got 4"):
            _submit(eng, write_request(4, [make_chunk("t1", 4, 4)]))
        with pytest.raises(SequenceError, match="must start at sequence 1"):
            _submit(eng, write_request(3, [make_chunk("t1", 4, 4)], epoch=2))
        _submit(eng, write_request(1, [make_chunk("t1", 4, 4)], epoch=2))
        with pytest.raises(SequenceError, match="older than"):
            _submit(eng, write_request(2, [make_chunk("t1", 8, 4)], epoch=1))
        _wait_durable(eng, st, 1)
        assert eng.durable(st)[0] == 2  # type: ignore[arg-type]
    finally:
        eng.close()


def test_conflicting_bytes_are_refused_identical_chunks_dropped(memory_url: str) -> None:
    eng = _engine(memory_url, None, flush_interval_s=0.05)
    try:
        _submit(eng, write_request(1, [make_chunk("t1", 0, 4, seed=1)]))
        with pytest.raises(ConflictError, match="different bytes"):
            _submit(eng, write_request(2, [make_chunk("t1", 2, 4, seed=2)]))
        # the same chunk again under a new sequence (another writer's retry): accepted, stored once
        _submit(eng, write_request(2, [make_chunk("t1", 0, 4, seed=1), make_chunk("t1", 4, 2, seed=1)]))
        assert eng.flush(10)
        rows = StoreReader(eng.store, SPEC.run).read(MicrobatchPlan([("t1", 0, 6)]), sites=["layers.1.mlp.input"])
        got = rows["layers.1.mlp.input"]
        want = [make_chunk("t1", 0, 4, seed=1), make_chunk("t1", 4, 2, seed=1)]
        assert got.codes.tobytes() == b"".join(c.codes.tobytes() for c in want)
        manifests = eng.store.manifests(SPEC.run, 0)
        assert sum(len(m.chunks) for m in manifests) == 2
    finally:
        eng.close()


def test_conflicting_seal_is_refused(memory_url: str) -> None:
    eng = _engine(memory_url, None)
    try:
        seal = TrajectorySeal(SPEC.run, 0, "t1", 9, ("layers.1.mlp.input",))
        _submit(eng, write_request(1, seals=[seal]))
        with pytest.raises(ConflictError, match="already sealed"):
            _submit(eng, write_request(2, seals=[TrajectorySeal(SPEC.run, 0, "t1", 10, ("layers.1.mlp.input",))]))
    finally:
        eng.close()


def test_wal_replay_after_restart_commits_everything_once(memory_url: str, tmp_path: Path) -> None:
    # flush interval far away: everything stays in the WAL until the "crash"
    eng = _engine(memory_url, tmp_path / "wal", flush_interval_s=3600)
    for i in range(1, 6):
        st, _ = _submit(eng, write_request(i, [make_chunk(f"t{i}", 0, 3)]))
    _wait_durable(eng, st, 5)
    eng._stopped = True  # simulate a crash: no drain, no flush
    eng.wal.close()  # type: ignore[union-attr]
    eng2 = _engine(memory_url, tmp_path / "wal", flush_interval_s=3600)
    try:
        st2 = eng2.writers[(SPEC.run, "w0")]
        assert eng2.durable(st2)[1:] == (5, 5)
        _, dup = _submit(eng2, write_request(5, [make_chunk("t5", 0, 3)]))
        assert dup
        assert eng2.flush(10)
        entries = [e for m in eng2.store.manifests(SPEC.run, 0) for e in m.chunks]
        assert sorted(e.trajectory for e in entries) == [f"t{i}" for i in range(1, 6)]
        # retired after the commit's DONE entry is durable (the WAL's next fdatasync, milliseconds)
        deadline = time.monotonic() + 10
        while list((tmp_path / "wal").glob("wal-000000000001.log")) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not list((tmp_path / "wal").glob("wal-000000000001.log"))
    finally:
        eng2.close()


@pytest.mark.parametrize("wal", [True, False])
def test_flush_waits_for_an_older_epochs_messages(memory_url: str, tmp_path: Path, wal: bool) -> None:
    # A writer's queue can hold messages of an older epoch behind a new epoch's first message (a
    # recorder restarted before its last messages were committed). flush() compared sequence
    # numbers alone: with (epoch 1, seq 2) queued and (epoch 2, seq 1) received, 2 <= 1 said
    # "done" at once and the older message stayed uncommitted — an acknowledged record missing
    # from storage after a flush that returned True (found by the fault suite's state machine).
    eng = _engine(memory_url, tmp_path / "wal" if wal else None, flush_interval_s=3600)
    try:
        _submit(eng, write_request(1, [make_chunk("t1", 0, 3)]))
        assert eng.flush(10)
        _submit(eng, write_request(2, [make_chunk("t2", 0, 3)]))
        _submit(eng, write_request(1, [make_chunk("t3", 0, 3)], epoch=2))
        assert eng.flush(10)
        assert not eng.writers[(SPEC.run, "w0")].pending, "flush returned with messages still queued"
        entries = [e for m in eng.store.manifests(SPEC.run, 0) for e in m.chunks]
        assert sorted(e.trajectory for e in entries) == ["t1", "t2", "t3"]
    finally:
        eng.close()


def test_runs_with_records_replayed_keep_their_slots_after_a_restart(tmp_path: Path) -> None:
    # The WAL replay looks runs up without taking a slot, so a restarted engine started with an
    # empty table of runs while the replayed records kept runs busy: --max-runs(-per-identity) no
    # longer bounded them (team-a had records queued in 3 runs, its share 2), and the writer of a
    # run whose records were replayed was refused (RESOURCE_EXHAUSTED) once other runs had taken
    # the slots, although its run had records queued (found by the fault suite's auth state machine).
    from tracestore.errors import LimitError
    from tracestore.records import RunSpec

    (tmp_path / "tokens").write_text("")
    url, wal = f"file://{tmp_path / 'data'}", tmp_path / "wal"
    limits = dict(auth_tokens=str(tmp_path / "tokens"), max_runs=3, max_runs_per_identity=2, flush_interval_s=3600)
    specs = {run: RunSpec(run, SPEC.sites) for run in ("ra", "rb", "rc")}
    for spec in specs.values():
        Store(url).put_run(spec)

    def submit(eng: Engine, run: str, seq: int, traj: str) -> tuple[object, bool]:
        req = write_request(seq, [make_chunk(traj, 0, 3, spec=specs[run])], spec=specs[run])
        _, msg, parts = parse_write(req.SerializeToString(), lambda r: eng.write_spec(r, "team-a"), None)
        return eng.submit(msg, parts, identity="team-a")

    eng = _engine(url, wal, **limits)
    try:
        submit(eng, "rc", 1, "t1")
    finally:
        eng.close()  # without a flush: rc's record is replayed and queued again
    eng = _engine(url, wal, **limits)
    try:
        submit(eng, "ra", 1, "t2")  # records queued in 2 runs: team-a's share
        with pytest.raises(LimitError, match="max_runs_per_identity"):
            submit(eng, "rb", 1, "t3")
        submit(eng, "rc", 2, "t4")  # rc has records queued: never refused a slot
        assert eng.flush(10)
        submit(eng, "rb", 1, "t3")  # committed runs give their slots back
    finally:
        eng.close()


def test_budget_pushes_back_and_never_drops(tmp_path: Path) -> None:
    blocker = tmp_path / "data"
    blocker.write_text("a file where the store needs a directory: every shard write fails")
    url = f"file://{tmp_path / 'data' / 'root'}"
    cfg = ServerConfig(storage=url, wal_dir=None, port=0, metrics_port=None, memory_budget_bytes=8192,
                       max_message_bytes=2048, backpressure_timeout_s=0.3, flush_interval_s=0.01)  # fmt: skip
    store = Store(url, timeout=5, retries=0)
    eng = Engine(cfg, store, Metrics())
    eng.runs[SPEC.run] = SPEC  # storage is down, so the run is known from the writer's declaration
    eng.start(wal_parser(eng.run_spec))
    try:
        accepted = 0
        with pytest.raises(OverBudgetError, match="memory budget"):
            for i in range(1, 100):
                _submit(eng, write_request(i, [make_chunk(f"t{i}", 0, 8)]))
                accepted = i
        assert 0 < accepted < 99
        assert eng.in_use <= cfg.memory_budget_bytes
        assert eng.metrics.backpressure._value.get() >= 1
        blocker.unlink()  # storage comes back
        store.put_run(SPEC)
        assert eng.flush(20)
        got = sorted(e.trajectory for m in store.manifests(SPEC.run, 0) for e in m.chunks)
        assert got == sorted(f"t{i}" for i in range(1, accepted + 1))
    finally:
        eng.close()


def test_validation_errors_name_what_was_expected(memory_url: str) -> None:
    eng = _engine(memory_url, None)
    try:
        req = write_request(1, [make_chunk("t1", 0, 4)])
        req.chunks[0].codes = req.chunks[0].codes[:-1]
        with pytest.raises(ValidationError, match="expected codes/scales/token_scales of 32/"):
            _submit(eng, req)
        big = write_request(1, [make_chunk("t1", 0, 4096)])  # > 16 KiB: the zero-copy scanner path
        big.chunks[0].scales = big.chunks[0].scales[:-3]
        with pytest.raises(ValidationError, match="expected codes/scales/token_scales of 32768/16384/0"):
            _submit(eng, big)
        raw = write_request(1, [make_chunk("t1", 0, 4096)]).SerializeToString()
        with pytest.raises(ValidationError, match="not a valid"):
            parse_write(raw[:-7], eng.run_spec, None)  # truncated inside a large payload field
        req = write_request(1, [make_chunk("t1", 0, 4)])
        req.chunks[0].site = "layers.9.nope"
        with pytest.raises(ValidationError, match="declares no site"):
            _submit(eng, req)
        req = write_request(1, [make_chunk("t1", 0, 4)])
        req.chunks[0].trajectory = "../../etc"
        with pytest.raises(ValidationError, match="invalid trajectory id"):
            _submit(eng, req)
    finally:
        eng.close()


def test_concurrent_writers(memory_url: str, tmp_path: Path) -> None:
    eng = _engine(memory_url, tmp_path / "wal", flush_interval_s=0.05)
    try:

        def writer(k: int) -> None:
            for i in range(1, 21):
                _submit(eng, write_request(i, [make_chunk(f"w{k}-t{i}", 0, 2)], writer=f"w{k}"))

        threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert eng.flush(20)
        got = [e.trajectory for m in eng.store.manifests(SPEC.run, 0) for e in m.chunks]
        assert sorted(got) == sorted(f"w{k}-t{i}" for k in range(4) for i in range(1, 21))
    finally:
        eng.close()


def test_replay_does_not_store_deduplicated_chunks_twice(memory_url: str, tmp_path: Path) -> None:
    eng = _engine(memory_url, tmp_path / "wal", flush_interval_s=3600)
    st, _ = _submit(eng, write_request(1, [make_chunk("t1", 0, 4, seed=1)]))
    assert eng.flush(10)  # t1 committed in its own shard; its WAL segment is still the active one
    # the same chunk again inside a later message (a resend after an epoch change): dropped
    st, _ = _submit(eng, write_request(1, [make_chunk("t1", 0, 4, seed=1), make_chunk("t2", 0, 4)], epoch=2))
    _wait_durable(eng, st, 1)
    eng._stopped = True  # crash before the second shard is written
    eng.wal.close()  # type: ignore[union-attr]
    eng2 = _engine(memory_url, tmp_path / "wal", flush_interval_s=3600)
    try:
        assert eng2.flush(10)
        entries = sorted(e.trajectory for m in eng2.store.manifests(SPEC.run, 0) for e in m.chunks)
        assert entries == ["t1", "t2"]
    finally:
        eng2.close()


def test_dedupe_state_is_bounded_to_the_newest_versions(memory_url: str) -> None:
    eng = _engine(memory_url, None, flush_interval_s=0.05, dedupe_versions=2)
    try:
        for v in range(6):
            seal = TrajectorySeal(SPEC.run, v, f"t{v}", 5, ("layers.1.mlp.input",))
            _submit(eng, write_request(v + 1, [make_chunk(f"t{v}", 0, 4, version=v)], seals=[seal]))
        assert {k[1] for k in eng._dedupe._index} == {4, 5}
        assert {k[1] for k in eng._dedupe._seals} == {4, 5}
        assert eng.stat()["open_trajectories"] == 0
        # within the window a conflicting chunk is still refused
        with pytest.raises(ConflictError):
            _submit(eng, write_request(7, [make_chunk("t5", 0, 4, seed=9, version=5)]))
    finally:
        eng.close()


def test_a_message_waiting_for_room_keeps_its_streams_reservation(tmp_path: Path) -> None:
    """While a received message waits for room it is in memory: its stream's reservation must stay
    counted until the message is admitted or refused (it was given back before the wait, so other
    streams could read more messages into memory meanwhile)."""
    blocker = tmp_path / "data"
    blocker.write_text("a file where the store needs a directory: every shard write fails")
    url = f"file://{tmp_path / 'data' / 'root'}"
    cfg = ServerConfig(storage=url, wal_dir=None, port=0, metrics_port=None, memory_budget_bytes=16384,
                       max_message_bytes=4096, backpressure_timeout_s=2.0, flush_interval_s=0.01)  # fmt: skip
    store = Store(url, timeout=5, retries=0)
    eng = Engine(cfg, store, Metrics())
    eng.runs[SPEC.run] = SPEC
    eng.start(wal_parser(eng.run_spec))
    try:
        seq = 0
        probe = parse_write(write_request(1, [make_chunk("t0", 0, 8)]).SerializeToString(), eng.run_spec, None)[1]
        while eng.budget.fits(probe.nbytes, msg=probe):  # fill the budget (storage is down)
            seq += 1
            _submit(eng, write_request(seq, [make_chunk(f"t{seq}", 0, 8)]))
        raw = write_request(seq + 1, [make_chunk("waiting", 0, 8)]).SerializeToString()
        _, msg, parts = parse_write(raw, eng.run_spec, None)
        reserved = msg.nbytes
        with eng._lock:  # what a stream holds once reserve() let it read this message
            eng.budget.reserved += reserved
        result: list[object] = []
        t = threading.Thread(target=lambda: result.append(_try(lambda: eng.submit(msg, parts, reserved))))
        t.start()
        time.sleep(0.5)  # the message waits for room
        assert t.is_alive(), result
        assert eng.budget.reserved == reserved  # still counted while it waits
        t.join()
        assert isinstance(result[0], OverBudgetError)  # storage never came back: refused ...
        assert eng.budget.reserved == 0  # ... and only then given back
    finally:
        eng.close()


def _try(fn: object) -> object:
    try:
        return fn()  # type: ignore[operator]
    except Exception as exc:  # noqa: BLE001
        return exc


def test_open_streams_count_against_the_budget(memory_url: str) -> None:
    """Each open Write stream's own memory (its HTTP/2 window and threads) is held against the
    budget while it is open: the stream after the budget is full is refused with a clear error."""
    from tracestore.errors import LimitError

    eng = _engine(memory_url, None, memory_budget_bytes=4 << 20, max_message_bytes=1 << 20)
    try:
        held = []
        with pytest.raises(LimitError, match="cannot hold another Write stream"):
            for _ in range(1000):
                held.append(eng.reserve_stream())
        # (a memory:// store publishes from memory: streams leave a shard's file and upload copy free)
        assert len(held) == ((4 << 20) - eng.budget.headroom) // eng.budget.stream_bytes
        eng.unreserve(held.pop())
        held.append(eng.reserve_stream())  # room again once one ends
        for h in held:
            eng.unreserve(h)
        assert eng.budget.reserved == 0
    finally:
        eng.close()


def test_the_engine_parts_do_not_import_the_engine() -> None:
    """The writer sessions, the memory accounting, the WAL bookkeeping, the flusher, the dedupe
    index and the message format are the engine's parts, reached through narrow interfaces: none
    imports ``engine/core.py`` (no import cycle)."""
    import ast
    import importlib

    names = ("sessions", "memory", "journal", "runs", "dedupe", "flusher", "message", "owners")
    for name in names:
        mod = importlib.import_module(f"tracestore.server.engine.{name}")
        assert mod.__file__ is not None
        tree = ast.parse(Path(mod.__file__).read_text())
        imported = [f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names]
        imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in imported if m.startswith("tracestore.server.engine.core")], (mod.__name__, imported)


def test_records_past_a_seal_are_refused_and_those_before_it_never_read_as_valid(memory_url: str) -> None:
    """Before: rows past finish(n_tokens) were stored and read back as valid (a rollout that ran on
    after its sequence ended), and records arriving after the seal past it were accepted."""
    eng = _engine(memory_url, None, flush_interval_s=0.05)
    site = "layers.1.mlp.input"
    try:
        _submit(eng, write_request(1, [make_chunk("t1", 0, 10, seed=1)]))  # forwards ran 10 positions
        _submit(eng, write_request(2, seals=[TrajectorySeal(SPEC.run, 0, "t1", 6, (site,))]))  # 6 tokens
        assert eng.metrics.tokens_past_seals._value.get() == 4
        past = r"t1.*tokens \[6, 8\) reach past the trajectory's seal \(n_tokens=6\)"
        with pytest.raises(ValidationError, match=past):
            _submit(eng, write_request(3, [make_chunk("t1", 6, 2, seed=2)]))
        with pytest.raises(ValidationError, match=r"reach past the trajectory's seal \(n_tokens=3\)"):
            # a chunk and its trajectory's seal in one message: the seal holds for the chunk too
            seal = TrajectorySeal(SPEC.run, 0, "t2", 3, (site,))
            _submit(eng, write_request(3, [make_chunk("t2", 0, 4)], seals=[seal]))
        _submit(eng, write_request(3, [make_chunk("t3", 0, 3)], seals=[TrajectorySeal(SPEC.run, 0, "t3", 3, (site,))]))
        assert eng.flush(10)
        reader = StoreReader(eng.store, SPEC.run)
        got = reader.read(MicrobatchPlan([("t1", 0, 10)]), sites=[site], on_missing="mask")[site]
        assert got.valid.tolist() == [True] * 6 + [False] * 4
        want = make_chunk("t1", 0, 10, seed=1)
        assert got.codes[:6].tobytes() == want.codes[:6].tobytes()
        missing = r"t1 site layers.1.mlp.input tokens \[6, 10\) \(at or past its seal's n_tokens=6\)"
        with pytest.raises(MissingRecordsError, match=missing):
            reader.read(MicrobatchPlan([("t1", 0, 10)]), sites=[site])
        assert reader.read(MicrobatchPlan([("t3", 0, 3)]), sites=[site])[site].valid.all()
    finally:
        eng.close()


def test_streams_leave_a_commit_its_room(tmp_path: Path) -> None:
    """Committing is what gives memory back, so a commit never waits for memory: the streams'
    reservations leave free what encoding the backlog's largest chunk takes (ENCODE_COPIES of it),
    and a commit holds that room while it runs. Before, reservations and the backlog filled the
    budget, and the encoding of a 57 MiB message's 12 MiB chunks (3 x 12 MiB, counted nowhere)
    went on top of it."""
    from tracestore.server.engine.memory import ENCODE_COPIES

    url = f"file://{tmp_path / 'data'}"
    mib = 1 << 20
    eng = _engine(url, None, memory_budget_bytes=4 * mib, max_message_bytes=mib, backpressure_timeout_s=30.0,
                  flush_interval_s=60.0)  # fmt: skip
    held = []
    try:
        chunk = make_chunk("big", 0, 49152)  # 576 KiB
        _submit(eng, write_request(1, [chunk]))
        assert eng.budget.kept_free() == ENCODE_COPIES * chunk.nbytes
        with eng._lock:  # the streams' reservations: as many as leave the commit's room free
            while eng.budget.fits(mib):
                eng.budget.reserved += mib
                held.append(mib)
        assert len(held) == (4 * mib - eng.in_use - ENCODE_COPIES * chunk.nbytes) // mib == 1
        t0 = time.monotonic()
        assert eng.flush(timeout=10)  # the commit finds its room at once
        assert time.monotonic() - t0 < 5
        assert eng.in_use == 0 and eng.budget.kept_free() == 0 and eng.budget.commit_held == 0
    finally:
        for n in held:
            eng.unreserve(n)
        eng.close()


def test_a_message_keeps_its_commits_room_from_arrival(memory_url: str, tmp_path: Path) -> None:
    """A received message's commit room is kept free before it is parsed (as one chunk of its
    size), then as what its largest chunk takes, and given back when it is refused: before, the
    next stream could reserve that room between the message's arrival and its admission, and with
    57 MiB messages two of them then waited for each other's room until the backpressure timeout."""
    from tracestore.server.engine.memory import ENCODE_COPIES

    url = f"file://{tmp_path / 'data'}"
    eng = _engine(url, None, memory_budget_bytes=8 << 20, max_message_bytes=1 << 20)
    try:
        raw = write_request(1, [make_chunk("a", 0, 4096), make_chunk("b", 0, 8192)]).SerializeToString()
        eng.arrived(len(raw))
        assert eng.budget.kept_free() == ENCODE_COPIES * len(raw)
        _, msg, _ = parse_write(raw, eng.run_spec, None)
        eng.expect(msg, len(raw))
        assert eng.budget.kept_free() == ENCODE_COPIES * max(c.nbytes for c in msg.chunks)
        eng.forget(msg)  # refused (or a resend): no commit of it to come
        assert eng.budget.kept_free() == 0
    finally:
        eng.close()
