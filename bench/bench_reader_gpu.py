"""What ``GuidanceReader.read`` costs the training thread on a GPU host, for a prefetched plan.

The trainer calls ``reader.prefetch(next_plan)`` and, a step later, ``reader.read(next_plan)``,
which returns ``Guidance`` tensors on the GPU. Measured on the training thread, with the prefetch
already finished:

- ``pin in read (baseline)``: the host rows were fetched in the background; ``read`` pins them
  (``pin_memory``, a copy) and queues the non-blocking copies to the GPU. This is what ``read`` did
  before the rows were staged in the prefetch thread;
- ``staged in prefetch``: the prefetch thread has pinned the rows too; ``read`` only queues the
  copies (the current ``GuidanceReader``), in this process and with ``process=2``.

Each is timed twice: the time ``read`` keeps the training thread (``caller_ms``), and that time
plus ``torch.cuda.synchronize()`` (``until_on_gpu_ms``, when the rows are usable). The records
are random, in the paper configuration (384 B per token per site).

Run (needs CUDA): ``python bench/bench_reader_gpu.py [--mib 192] [--repeat 7]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_results, machine, print_table  # noqa: E402

from tracestore.records import RecordChunk, RunSpec, SiteSpec  # noqa: E402

WIDTH, TOKENS = 2048, 512
SPEC = RunSpec(
    "bench-gpu-read", tuple(SiteSpec(f"layers.{20 + i}.mlp.input", "moe_input", 20 + i, WIDTH) for i in range(4))
)


def fill(url: str, mib: int) -> list[tuple[str, int, int]]:
    """Write ~``mib`` MiB of random records (trajectories of TOKENS tokens, every site)."""
    from tracestore.storage.store import Store

    store = Store(url)
    store.put_run(SPEC)
    rng = np.random.default_rng(0)
    per_traj = TOKENS * sum(s.code_bytes + s.scale_bytes for s in SPEC.sites)
    n = max(1, (mib << 20) // per_traj)
    for w in range(0, n, 32):
        chunks = [
            RecordChunk(SPEC.run, 0, f"t{k}", s.name, 0, TOKENS,
                        rng.integers(0, 256, (TOKENS, s.code_bytes), dtype=np.uint8),
                        rng.integers(0, 256, (TOKENS, s.scale_bytes), dtype=np.uint8), 0.01)
            for k in range(w, min(n, w + 32)) for s in SPEC.sites
        ]  # fmt: skip
        store.write_shard(SPEC.run, 0, f"w{w}", 0, chunks)
    return [(f"t{k}", 0, TOKENS) for k in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=192)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--no-save", action="store_true")
    ns = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from tracestore.client import GuidanceReader
    from tracestore.client.read.reader import _plan_key

    samples: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-gpu-read-") as tmp:
        url = f"file://{tmp}/store"
        plan = fill(url, ns.mib)
        nbytes = len(plan) * TOKENS * sum(s.code_bytes + s.scale_bytes for s in SPEC.sites)
        readers = {"": GuidanceReader(url, SPEC.run, device="cuda"),
                   ", process=2": GuidanceReader(url, SPEC.run, device="cuda", process=2)}  # fmt: skip
        try:

            def baseline(reader: Any) -> Any:
                host = reader.read_host(plan)  # (untimed below: the prefetch thread's part)

                def run() -> Any:  # what read() did with fetched rows: pin, then queue the copies
                    out = {}
                    for name, r in host.items():
                        ts = []
                        for a in (r.codes, r.scales, r.global_scale.astype(np.float32), r.valid.astype(bool)):
                            ts.append(
                                torch.from_numpy(np.ascontiguousarray(a)).pin_memory().to("cuda", non_blocking=True)
                            )
                        out[name] = ts
                    return out

                return run

            def staged(reader: Any) -> Any:
                reader.prefetch(plan)
                reader._pending[_plan_key(plan)].result()  # noqa: SLF001 - the prefetch has finished
                return lambda: reader.read(plan)

            for _ in range(2):  # warm-up: CUDA context, pinned-memory cache, page cache, children
                for reader in readers.values():
                    baseline(reader)()
                    staged(reader)()
                torch.cuda.synchronize()
            for _ in range(ns.repeat):
                for suffix, reader in readers.items():
                    for name, prepare in (("pin in read (baseline)", baseline), ("staged in prefetch", staged)):
                        fn = prepare(reader)
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        out = fn()
                        t1 = time.perf_counter()
                        torch.cuda.synchronize()
                        t2 = time.perf_counter()
                        samples.setdefault(name + suffix, []).append((t1 - t0, t2 - t0))
                        del out
        finally:
            for reader in readers.values():
                reader.close()
    rows: list[dict[str, Any]] = []
    for name, v in samples.items():
        caller = statistics.median(x[0] for x in v)
        total = statistics.median(x[1] for x in v)
        rows.append(dict(provider=f"read() of a prefetched plan, {name}", caller_ms=caller * 1e3,
                         until_on_gpu_ms=total * 1e3, GBps_to_gpu=nbytes / total / 1e9, n=len(v),
                         MiB=nbytes >> 20))  # fmt: skip
    base = {r["provider"].split(", ", 1)[1]: r for r in rows}
    checks = []
    for suffix in ("", ", process=2"):
        b, s = base[f"pin in read (baseline){suffix}"], base[f"staged in prefetch{suffix}"]
        checks.append(dict(check=f"training-thread time of read(): baseline / staged{suffix}",
                           median_ratio=b["caller_ms"] / s["caller_ms"], target=None, met="n/a"))  # fmt: skip
    m = machine()
    gpu = torch.cuda.get_device_name()
    print(f"# bench_reader_gpu on {m.get('cpu')} ({m.get('cores')} cores) + {gpu}, {nbytes >> 20} MiB per plan, "
          f"{ns.repeat} repetitions")  # fmt: skip
    print_table(rows, ["provider", "caller_ms", "until_on_gpu_ms", "GBps_to_gpu", "n", "MiB"])
    print()
    print_table(checks, ["check", "median_ratio"])
    if not ns.no_save:
        print(f"\nappended to {append_results('bench_reader_gpu', [dict(r, gpu=gpu) for r in rows + checks])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
