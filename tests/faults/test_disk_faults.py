"""4. WAL and storage disk-full (ENOSPC) and I/O errors (EIO).

The LD_PRELOAD shim (faultshim.c) fails write-family calls and/or fsyncs on the WAL's or the
storage's paths while a trigger file exists; a real tmpfs with ``size=`` gives a true ENOSPC where
mounting is allowed. While the WAL is failed the sidecar reports health NOT_SERVING and clients get
UNAVAILABLE (never INTERNAL); once space is back it recovers by itself (no restart) and acknowledges
again. While storage fails, acknowledgements go on from the WAL until the memory budget is full
(then RESOURCE_EXHAUSTED), the backlog rises and drains afterwards. Nothing acknowledged is lost:
a final crash + restart replays and commits everything.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from .harness import Background, Row, Sidecar, Writer, converged, row, verify, wait_until

BASE_FLAGS = [
    "--wal-segment-mib", "1", "--flush-interval", "0.2", "--memory-budget-mib", "32", "--max-message-mib", "4",
    "--backpressure-timeout", "1", "--storage-timeout", "5", "--wal-retry", "0.5", "--grace", "10",
]  # fmt: skip
FAIL_WINDOW_S = 1.5  # how long the fault lasts once the sidecar noticed it
NOTICE_S = 10.0  # bound for NOT_SERVING after the fault starts (storage: --storage-unhealthy + this)
RECOVER_S = 20.0  # bound for SERVING and acknowledgements again once the fault is gone
OK_FAULT_CODES = {"UNAVAILABLE", "RESOURCE_EXHAUSTED", "CLIENT_TIMEOUT"}


def _acked_after(w: Writer, n0: int, timeout: float) -> bool:
    return bool(wait_until(lambda: len(w.acked) > n0, timeout, 0.05))


def _fault_flow(
    r: Row, sc: Sidecar, w: Writer, fail: Callable[[], None], heal: Callable[[], None], *, wal: bool
) -> list[str]:
    """Healthy ingest, fault, heal; returns the contract breaches seen (the caller verifies data)."""
    problems: list[str] = []
    with Background(w, sc.address) as bg:
        if not _acked_after(w, 0, 10):
            return [f"no acknowledgement before the fault: {sc.log()[-500:]}"]
        if not wal:  # let the first shards commit
            wait_until(lambda: sc.stat().shards_committed > 0, 10)
        bg.phase = "fault"
        t_fail = time.monotonic()
        fail()
        backlog_peak = 0

        def noticed() -> bool:
            nonlocal backlog_peak
            with contextlib.suppress(Exception):
                backlog_peak = max(backlog_peak, sc.stat(timeout=2).backlog_bytes)
            return sc.health(timeout=1) == "NOT_SERVING"

        not_serving = wait_until(noticed, NOTICE_S, 0.1)
        t_notice = time.monotonic() - t_fail
        health_during = sc.health(timeout=1)
        acked_in_fault = len(w.acked)
        end = time.monotonic() + FAIL_WINDOW_S
        while time.monotonic() < end:  # the fault lasts a while: writes go on meeting it
            with contextlib.suppress(Exception):
                backlog_peak = max(backlog_peak, sc.stat(timeout=2).backlog_bytes)
            time.sleep(0.2)
        if not not_serving:
            what = "WAL" if wal else "storage"
            problems.append(f"health stayed {health_during} for {NOTICE_S:.0f} s of a failed {what}")
        else:
            r.add_note(f"NOT_SERVING after {t_notice:.1f} s")
        bg.phase = "healed"
        acked_at_heal = len(w.acked)
        heal()
        t_heal = time.monotonic()
        if not wait_until(lambda: sc.health(timeout=1) == "SERVING", RECOVER_S, 0.1):
            problems.append(f"health not SERVING {RECOVER_S:.0f} s after the fault ended: {sc.health()}")
        if not _acked_after(w, acked_at_heal, RECOVER_S):
            problems.append(f"no acknowledgement {RECOVER_S:.0f} s after the fault ended: {sc.log()[-600:]}")
        else:
            r.add_note(f"acks again {time.monotonic() - t_heal:.1f} s after heal")
        if not wal:
            if backlog_peak == 0:
                problems.append("no backlog during the storage fault")
            r.add_note(f"backlog peak {backlog_peak >> 20} MiB")
        if wal and len(w.acked) > acked_in_fault and acked_at_heal > acked_in_fault:
            r.add_note(f"{acked_at_heal - acked_in_fault} messages acked while the WAL was failed")
    fault_codes = bg.codes.get("fault", Counter())
    bad = {c: n for c, n in fault_codes.items() if c not in OK_FAULT_CODES}
    if bad:
        problems.append(f"clients got {bad} during the fault (expected UNAVAILABLE / RESOURCE_EXHAUSTED)")
    if wal and not fault_codes.get("UNAVAILABLE"):
        problems.append(f"no UNAVAILABLE while the WAL was failed (codes {dict(fault_codes)})")
    r.add_note(f"codes in fault {dict(fault_codes)}")
    late_bad = {c: n for c, n in bg.codes.get("healed", Counter()).items() if c not in OK_FAULT_CODES}
    if late_bad:
        problems.append(f"clients got {late_bad} after the fault ended")
    return problems


def _finish(r: Row, sc: Sidecar, w: Writer, problems: list[str], env_clean: dict[str, str]) -> None:
    """Converge, crash, restart clean, drain; then every acknowledged record must be on storage."""
    try:
        w.drain(sc.address, timeout=20)
        if not wait_until(lambda: converged(sc, w.writer), 20.0, 0.1):
            r.wedged += 1
            problems.append(f"did not converge after the fault: {sc.stat()}")
        sc.kill()
        sc.env = env_clean
        sc.start()
        w.drain(sc.address, timeout=20)
        if sc.terminate(30) != 0:
            problems.append("SIGTERM exit code not 0 after restart")
    finally:
        sc.kill()
    r.trials += 1
    chk = verify(sc.storage, w.acked_recs)
    r.acked, r.lost, r.duplicated = chk.acked, chk.lost_total, chk.duplicated
    if not chk.ok():
        problems.insert(0, str(chk))
    for p in problems[:2]:
        r.add_note(p[:150])


SHIM_CASES = [
    ("wal", "ENOSPC", "write"),
    ("wal", "EIO", "sync"),
    ("storage", "ENOSPC", "write"),
    ("storage", "EIO", "write,sync"),
]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("target", "err", "ops"), SHIM_CASES, ids=[f"{t}-{e}" for t, e, _ in SHIM_CASES])
def test_disk_fault(target: str, err: str, ops: str, tmp_path: Path, shim: Path) -> None:
    r = row(f"4 {target} {err} ({ops} fail)")
    trigger = tmp_path / "fault-on"
    sc = Sidecar(tmp_path, flags=[*BASE_FLAGS, "--storage-unhealthy", "1"])
    pattern = f"{sc.wal_dir}/" if target == "wal" else f"{sc.data_dir}/"
    sc.env = {
        "LD_PRELOAD": str(shim), "FAULTSHIM_PATTERN": pattern, "FAULTSHIM_TRIGGER": str(trigger),
        "FAULTSHIM_ERRNO": err, "FAULTSHIM_OPS": ops,
    }  # fmt: skip
    w = Writer(f"disk-{target}", trajs=4, tokens=256, window=4)
    try:
        sc.start()
        problems = _fault_flow(r, sc, w, trigger.touch, lambda: trigger.unlink(missing_ok=True), wal=target == "wal")
    except BaseException:
        sc.kill()
        raise
    _finish(r, sc, w, problems, {})
    assert not problems, "\n".join(problems)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_wal_on_full_tmpfs(tmp_path: Path) -> None:
    """A real ENOSPC: the WAL on a 6 MiB tmpfs that a filler file leaves ~1.5 MiB of; deleting the
    filler is space coming back. (tmpfs takes no O_DIRECT: the page-cache append path.)"""
    mnt = tmp_path / "walfs"
    mnt.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)], check=True, capture_output=True)
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {exc}")
    r = row("4 wal ENOSPC (real tmpfs)")
    filler = mnt / "filler"
    sc = Sidecar(tmp_path, wal_dir=mnt / "wal", flags=[*BASE_FLAGS, "--storage-unhealthy", "1"])
    w = Writer("disk-tmpfs", trajs=4, tokens=256, window=4)

    def fill() -> None:
        with open(filler, "wb") as f, contextlib.suppress(OSError):
            f.write(bytes(int(4.5 * (1 << 20))))

    try:
        sc.start()
        # storage down too, so the WAL cannot shrink by committing: it must fill the disk
        problems = _fault_flow(r, sc, w, lambda: (fill(), _block_storage(sc)), lambda: (filler.unlink(),
                               _unblock_storage(sc)), wal=True)  # fmt: skip
        _finish(r, sc, w, problems, {})
    finally:
        sc.kill()
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)
    assert not problems, "\n".join(problems)


def _block_storage(sc: Sidecar) -> None:
    """Storage refuses every shard: a file where the run's v0 directory of this writer goes."""
    d = sc.data_dir / "faults" / "v0"
    if d.is_dir():
        d.rename(sc.data_dir / "faults" / "v0.moved")
    d.write_text("storage is down")


def _unblock_storage(sc: Sidecar) -> None:
    d = sc.data_dir / "faults" / "v0"
    d.unlink(missing_ok=True)
    moved = sc.data_dir / "faults" / "v0.moved"
    if moved.is_dir():
        moved.rename(d)
