"""Shared bench plumbing: timing, machine description, a printed table and JSON rows in results/."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def git_commit() -> str:
    """The code's commit for result rows: ``$TRACESTORE_BENCH_COMMIT`` when set (a copy of the tree
    whose git metadata is not its own, e.g. on a lent GPU machine), else ``git rev-parse`` of the
    working tree, with ``-dirty`` for uncommitted changes to tracked files."""
    pinned = os.environ.get("TRACESTORE_BENCH_COMMIT")
    if pinned:
        return pinned
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> dict[str, Any]:
    """CPU/GPU, core count and library versions of this run."""
    info: dict[str, Any] = {
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    for mod in ("torch", "pyarrow", "grpc", "numpy", "cupy", "triton"):
        try:
            m = __import__(mod)
            info[mod] = getattr(m, "__version__", "?")
        except Exception:  # noqa: BLE001 - optional
            continue
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    except Exception:  # noqa: BLE001
        pass
    return info


def time_it(fn: Callable[[], Any], *, repeat: int = 7, warmup: int = 1, min_time: float = 0.0) -> dict[str, float]:
    """Wall-clock seconds of ``fn()``: median, min, max over ``repeat`` runs after ``warmup``."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    t_end = time.perf_counter() + min_time
    while len(times) < repeat or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "n": len(times)}


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def append_results(bench: str, rows: Sequence[dict[str, Any]]) -> Path:
    """Append rows (with machine, commit and time) to ``bench/results/<bench>.jsonl``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{bench}.jsonl"
    stamp = {
        "bench": bench,
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "machine": machine(),
    }
    with path.open("a") as f:
        for r in rows:
            f.write(json.dumps({**stamp, **r}, default=str) + "\n")
    return path
