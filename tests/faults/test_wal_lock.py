"""3. Two sidecars on one WAL directory: the second refuses to start with a message naming the
directory; the first's segments (its live one included) are untouched and it keeps serving; after a
crash of the first, everything it acknowledged is replayed and committed."""

from __future__ import annotations

from pathlib import Path

import pytest

from .harness import Sidecar, Writer, row, verify

FLAGS = ["--wal-segment-mib", "1", "--flush-interval", "3600", "--shard-target-mib", "64", "--grace", "10"]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_second_sidecar_on_same_wal_dir_refuses(tmp_path: Path) -> None:
    r = row("3 two sidecars, one WAL dir")
    wal = tmp_path / "wal"
    storage = f"file://{tmp_path / 'data'}"
    first = Sidecar(tmp_path / "first", wal_dir=wal, storage=storage, flags=FLAGS)
    second = Sidecar(tmp_path / "second", wal_dir=wal, storage=storage, flags=FLAGS)
    w = Writer("lock-w", trajs=4, tokens=256)
    problems: list[str] = []
    try:
        first.start()
        res = w.session(first.address, max_new=24, timeout=30)  # acknowledged, in the WAL only
        assert res.code is None and not w.unacked, res
        before = first.wal_files()
        rc, log = second.start_expect_exit(timeout=20)
        r.trials = 1
        if rc is None:
            problems.append("the second sidecar started on a WAL directory in use")
            second.terminate(10)
        elif rc == 0:
            problems.append("the second sidecar exited 0")
        elif str(wal) not in log or not any(k in log.lower() for k in ("lock", "in use", "another", "already")):
            problems.append(f"the refusal does not say the WAL directory {wal} is in use: {log.strip()[-300:]}")
        second.kill()
        after = first.wal_files()
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        if changed:
            problems.append(f"the first sidecar's WAL files changed: {changed}")
        # the first goes on acknowledging, then crashes: all it acknowledged comes back from its WAL
        res = w.session(first.address, max_new=8, timeout=30)
        if res.code is not None or w.unacked:
            problems.append(f"the first sidecar stopped acknowledging: {res}")
        first.kill()
        first.start()
        w.drain(first.address, timeout=20)
        if first.terminate(30) != 0:
            problems.append("SIGTERM of the restarted first sidecar did not exit 0")
    finally:
        first.kill()
        second.kill()
    chk = verify(storage, w.acked_recs)
    r.acked, r.lost, r.duplicated = chk.acked, chk.lost_total, chk.duplicated
    for p in problems:
        r.add_note(p[:150])
    assert chk.ok(), chk
    assert not problems, "\n".join(problems)
