"""1. SIGKILL at every crash point of a shard commit and of the WAL's life (TRACESTORE_FAULT=<point>:<n>,
tracestore/faults.py), for several n each, with 1 MiB WAL segments so segments rotate and retire;
restart, resend what was not acknowledged (as the recorder does) and keep writing with the same
writer; at the end every acknowledged record reads back bit-identical with no duplicates, and the
sidecar converges (committed == durable == received, no backlog, the WAL shrinks to its live
segment) within a bound. A crash point that is never reached fails its test (not instrumented).

Beside the product's own points, the LD_PRELOAD shim kills the sidecar right after it unlinks a
WAL segment (the retire step), the known wedge: segments deleted before the DONE entry was durable.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from tracestore.faults import POINTS

from .harness import MiB, Sidecar, StartError, Writer, converged, row, verify, wait_until

SEGMENT_MIB = 1
FLAGS = [
    "--wal-segment-mib", str(SEGMENT_MIB), "--flush-interval", "0.1", "--shard-target-mib", "1",
    "--memory-budget-mib", "16", "--max-message-mib", "4", "--grace", "5", "--storage-timeout", "10",
]  # fmt: skip
NS = (1, 2, 3)  # the n-th time the point is reached
REACH_S = 6.0  # a point not reached after this long of steady ingest is not instrumented
CONVERGE_S = 20.0


def _state(sc: Sidecar) -> str:
    try:
        st = sc.stat()
    except Exception as exc:  # noqa: BLE001
        return f"Stat failed ({exc}); log: {sc.log()[-600:]}"
    ws = [(x.epoch, x.received_sequence, x.durable_sequence, x.committed_sequence) for x in st.writers]
    return f"backlog {st.backlog_bytes} B, writers (epoch, received, durable, committed) {ws}; log: {sc.log()[-600:]}"


def _crash_trials(point_id: str, tmp_path: Path, env_for: dict[int, dict[str, str]], *, tokens: int = 256) -> None:
    r = row(f"1 crash {point_id}")
    sc = Sidecar(tmp_path, flags=FLAGS)
    w = Writer("crash-w", trajs=4, tokens=tokens, window=4)  # 256 tokens: ~62 KiB messages, 16 per segment
    not_reached: list[int] = []
    problems: list[str] = []
    try:
        for n, env in env_for.items():
            try:
                sc.start(env_extra=env)
            except StartError as exc:
                if exc.rc == -9:  # killed at the point while replaying / opening the WAL: a trial too
                    r.trials += 1
                    continue
                raise
            try:  # (the sidecar may already have died at the point, committing what it replayed)
                with_state = sc.writer_state(w.writer) if w.acked else None
            except grpc.RpcError:
                with_state = None
            if with_state is not None and with_state.epoch == w.epoch and with_state.durable_sequence < w.acked_seq:
                problems.append(
                    f"after restart {n}: durable_sequence {with_state.durable_sequence} < acknowledged {w.acked_seq}"
                )
            w.write_until(sc.address, lambda: not sc.alive(), timeout=REACH_S, pace_s=0.004)
            rc = sc.wait_exit(5.0) if not sc.alive() else None
            if rc is None:
                # Not reached: after an earlier crash of this test, a sidecar that stopped committing
                # (the point lies on the commit path) is the likelier cause; else not instrumented.
                if r.trials and not wait_until(lambda: converged(sc, w.writer), 5.0, 0.1):
                    r.wedged += 1
                    problems.append(f"wedged after crash {r.trials}: point not reached again, {_state(sc)}")
                else:
                    not_reached.append(n)
                sc.kill()
                break  # the next n would not be reached either
            if rc != -9:
                problems.append(f"n={n}: exit code {rc}, expected -9 (SIGKILL)\n{sc.log()[-1500:]}")
            r.trials += 1
        # recovery: no fault; resend, keep writing, converge, drain
        try:
            sc.start()
        except StartError as exc:
            r.wedged += 1
            problems.append(f"the restart without a fault failed: {exc}")
        else:
            if not w.drain(sc.address, timeout=20):
                r.wedged = 1
                problems.append(f"{len(w.unacked)} messages never acknowledged after the last restart: {_state(sc)}")
            else:
                w.session(sc.address, max_new=24, timeout=30)
            if not wait_until(lambda: converged(sc, w.writer), CONVERGE_S, 0.1):
                r.wedged = 1
                problems.append(f"did not converge in {CONVERGE_S:.0f} s: {_state(sc)}")
            if not wait_until(lambda: sc.wal_bytes() <= 2 * SEGMENT_MIB * MiB, 0.0 if r.wedged else 10.0, 0.1):
                segs = sorted(p.name for p in sc.wal_dir.iterdir())
                problems.append(f"WAL did not shrink: {sc.wal_bytes()} B in {segs}")
            rc = sc.terminate(20)
            if rc != 0:
                problems.append(f"SIGTERM exit code {rc}")
    finally:
        sc.kill()
    chk = verify(sc.storage, w.acked_recs)
    r.acked, r.lost, r.duplicated = chk.acked, chk.lost_total, chk.duplicated
    if not_reached:
        r.add_note(f"point not reached at n={not_reached[0]} within {REACH_S:.0f} s (not instrumented?)")
    if w.anomalies:
        r.add_note(w.anomalies[0][:120])
    if problems:
        r.add_note(problems[0][:160])
    if not chk.ok():
        r.add_note(str(chk)[:160] + (" (wedged: acked records left in the WAL only)" if r.wedged else ""))
    assert not not_reached, f"{point_id}: crash point never reached at n={not_reached} in {REACH_S} s of ingest"
    assert chk.ok(), f"{point_id}: {chk}"
    assert not w.anomalies, w.anomalies
    assert not problems, "\n".join(problems)


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("point", POINTS)
def test_sigkill_at_crash_point(point: str, tmp_path: Path) -> None:
    _crash_trials(point, tmp_path, {n: {"TRACESTORE_FAULT": f"{point}:{n}"} for n in NS})


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_sigkill_after_wal_segment_unlink(tmp_path: Path, shim: Path) -> None:
    """SIGKILL right after the sidecar deletes a WAL segment (the shim's unlink crash point)."""
    wal = tmp_path / "wal"
    env = {n: {"LD_PRELOAD": str(shim), "FAULTSHIM_KILL": f"unlink:{wal}/wal-:{n}"} for n in NS}
    _crash_trials("shim.wal_unlink", tmp_path, env)
