"""10. SIGTERM: health NOT_SERVING (or the listener gone) within a second, the process exits 0
within its grace period, and everything it acknowledged is durable: after a restart it is all on
storage. Once while ingesting with storage healthy, once with storage refusing every shard (the
drain cannot commit: the WAL keeps it)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from .harness import Background, Sidecar, Writer, row, verify, wait_until

GRACE_S = 4.0
NOT_SERVING_S = 1.0


def _watch_health(sc: Sidecar, stop: threading.Event, seen: list[tuple[float, str]]) -> None:
    while not stop.is_set():
        status = sc.health(timeout=0.5)
        seen.append((time.monotonic(), status))
        if status != "SERVING":
            return
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("storage", ["healthy", "down"])
def test_sigterm_drains_within_grace(storage: str, tmp_path: Path) -> None:
    r = row(f"10 SIGTERM while ingesting, storage {storage}")
    sc = Sidecar(tmp_path, flags=["--flush-interval", "0.5", "--grace", str(GRACE_S), "--storage-timeout", "2",
                                  "--wal-segment-mib", "4"])  # fmt: skip
    w = Writer("term-w", trajs=4, tokens=256, window=4)
    problems: list[str] = []
    try:
        sc.start()
        with Background(w, sc.address, session_s=5.0, pace_s=0.01) as bg:
            if not wait_until(lambda: len(w.acked) >= 10, 20):
                problems.append("no acknowledgements before the SIGTERM")
            if storage == "down":
                blocker = sc.data_dir / "faults" / "v0"
                if blocker.is_dir():
                    blocker.rename(sc.data_dir / "faults" / "v0.moved")
                blocker.write_text("storage is down")
                time.sleep(1.0)
            seen: list[tuple[float, str]] = []
            stop = threading.Event()
            watcher = threading.Thread(target=_watch_health, args=(sc, stop, seen), daemon=True)
            watcher.start()
            time.sleep(0.1)
            assert sc.proc is not None
            t0 = time.monotonic()
            sc.proc.send_signal(15)
            bg.phase = "term"
            rc = sc.wait_exit(GRACE_S + 10)
            took = time.monotonic() - t0
            stop.set()
            watcher.join(timeout=5)
        first_down = next((t - t0 for t, s in seen if s != "SERVING" and t >= t0), None)
        r.trials = 1
        r.add_note(f"exit {rc} after {took:.1f} s (grace {GRACE_S:.0f})")
        if first_down is None:
            problems.append(f"health never left SERVING before exit: {seen[-3:]}")
        else:
            r.add_note(f"not serving after {first_down * 1000:.0f} ms")
            if first_down > NOT_SERVING_S:
                problems.append(f"health still SERVING {first_down:.2f} s after SIGTERM")
        if rc is None:
            problems.append(f"did not exit within grace {GRACE_S} s + 10 s")
        elif rc != 0:
            problems.append(f"exit code {rc}: {sc.log()[-600:]}")
        elif took > GRACE_S + 2.0:
            problems.append(f"exit took {took:.1f} s, grace is {GRACE_S} s")
        if storage == "down":
            (sc.data_dir / "faults" / "v0").unlink()
            moved = sc.data_dir / "faults" / "v0.moved"
            if moved.is_dir():
                moved.rename(sc.data_dir / "faults" / "v0")
        sc.kill()
        sc.start()  # replays what the drain could not commit
        w.drain(sc.address, timeout=20)
        if sc.terminate(30) != 0:
            problems.append("the restarted sidecar's SIGTERM exit code is not 0")
    finally:
        sc.kill()
    chk = verify(sc.storage, w.acked_recs)
    r.acked, r.lost, r.duplicated = chk.acked, chk.lost_total, chk.duplicated
    for p in ([str(chk)] if not chk.ok() else []) + problems:
        r.add_note(p[:150])
    assert chk.ok(), chk
    assert not problems, "\n".join(problems)
