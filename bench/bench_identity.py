"""What token identity costs (``ids_crc`` on every chunk), against the same records without it, in
the same run, at the paper configuration (width 2048, 20 sites, b = 1, NVFP4: 7,680 B per token).

Cases:

- ``bytes``: bytes per token on storage (shard + manifest, ``Store.write_shard`` to local disk) and
  on the wire (the serialized ``WriteRequest`` chunks), for a prefill step (8 trajectories x 2048
  tokens in 512-token chunks) and a decode shard (256 sequences x 16 steps of one-token chunks at
  every site: the most chunks per token a recorder makes). Deterministic sizes; ``overhead_pct`` is
  (with - without) / 7,680 B.
- ``line``: the recorder line as an engine runs it: ``RolloutRecorder.record_forward`` of decode
  steps (``--seqs`` sequences x 20 sites, one token each) into a real ``tracestore serve`` on its
  unix socket (shared memory, WAL with fsync, local storage), the engine thread busy in Python for
  ``--step-ms`` between steps (not sleeping), with and without ``token_ids``, interleaved over
  ``--repeat`` rounds: the caller's time per step (median, p99), the sender thread's and the
  sidecar's CPU per step, and the time until every step is durable. A CPU box: the GPU copy path
  is not exercised here (bench_ingest measures it on the device).

Run: ``python bench/bench_identity.py [--cases bytes,line] [--repeat 5] [--steps 200] [--seqs 64]``;
prints the machine and tables and appends rows to ``bench/results/bench_identity.jsonl``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_storage import SPEC, TARGET_BYTES_PER_TOKEN, decode_shard, make_step  # noqa: E402
from common import append_results, git_commit, machine, print_table  # noqa: E402

from tracestore.identity import PrefixCrcs  # noqa: E402
from tracestore.records import RecordChunk  # noqa: E402
from tracestore.storage.store import Store  # noqa: E402
from tracestore.v1 import tracestore_pb2 as pb  # noqa: E402
from tracestore.wire import chunk_to_pb  # noqa: E402


def with_identity(chunks: list[RecordChunk], seed: int = 0) -> list[RecordChunk]:
    """The same chunks, each carrying the identity of random token ids of its trajectory."""
    rng = np.random.default_rng(seed)
    ends: dict[str, int] = {}
    for c in chunks:
        ends[c.trajectory] = max(ends.get(c.trajectory, 0), c.token_end)
    seqs = {t: PrefixCrcs(rng.integers(0, 150_000, n)) for t, n in ends.items()}
    return [dataclasses.replace(c, ids_crc=seqs[c.trajectory].at(c.token_end)) for c in chunks]


def bench_bytes(workdir: Path) -> list[dict[str, Any]]:
    shapes = {
        "prefill: 8 traj x 2048 tok, 512-tok chunks": make_step(8, 2048, 512, random_scales=False),
        "decode: 256 seqs x 16 steps, 1-tok chunks": decode_shard(SPEC.run, 256, 16, 0, 7),
    }
    rows = []
    for shape, plain in shapes.items():
        tokens = len({(c.trajectory, t) for c in plain for t in range(c.token_start, c.token_end)})
        for name, chunks in (("without identity", plain), ("with identity", with_identity(plain))):
            store = Store(f"file://{workdir}/bytes-{len(rows)}", shard_files=1)
            store.put_run(SPEC)
            info = store.write_shard(SPEC.run, 0, "w", 0, chunks)
            stored = info.nbytes + len(store.storage.cat(info.manifest_path))
            wire = sum(len(pb.WriteRequest(chunks=[chunk_to_pb(c)]).SerializeToString()) for c in chunks)
            rows.append({"case": "bytes", "shape": shape, "provider": name, "tokens": tokens,
                         "storage_bytes_per_token": round(stored / tokens, 2),
                         "wire_bytes_per_token": round(wire / tokens, 2)})  # fmt: skip
        base, ours = rows[-2], rows[-1]
        for k in ("storage", "wire"):
            extra = ours[f"{k}_bytes_per_token"] - base[f"{k}_bytes_per_token"]
            ours[f"{k}_overhead_pct"] = round(100 * extra / TARGET_BYTES_PER_TOKEN, 3)
    return rows


def _busy(seconds: float) -> None:
    """The engine's own Python between steps (scheduling, sampling bookkeeping): holds the GIL."""
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        for i in range(200):
            x += i & 7


def _thread_cpu_s(native_id: int) -> float:
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_line_run(address: str, sidecar_pid: int, tag: str, ns: argparse.Namespace, ids: bool) -> dict[str, Any]:
    from tracestore.client import RolloutRecorder, SiteOutput

    rng = np.random.default_rng(1)
    outs = {
        s.name: SiteOutput(rng.integers(0, 256, (ns.seqs, s.code_bytes), dtype=np.uint8),
                           rng.integers(0, 256, (ns.seqs, s.scale_bytes), dtype=np.uint8), 0.02)
        for s in SPEC.sites
    }  # fmt: skip
    trajs = [f"{tag}-{k}" for k in range(ns.seqs)]
    tokens = rng.integers(0, 150_000, (ns.steps, ns.seqs))
    rec = RolloutRecorder(address, SPEC, f"bench-{tag}", staging_bytes=256 << 20)
    times = []
    c0 = _proc_cpu_s(sidecar_pid)
    t_start = time.perf_counter()
    try:
        for i in range(ns.steps):
            segs = [(t, i, i + 1) for t in trajs]
            t0 = time.perf_counter()
            ok = rec.record_forward(segs, outs, token_ids=tokens[i] if ids else None)
            times.append(time.perf_counter() - t0)
            if not ok:
                raise RuntimeError(f"step refused: {rec.stats}")
            _busy(ns.step_ms / 1000)
        if not rec.flush(300):
            raise RuntimeError(f"steps not acknowledged: {rec.stats}")
        durable_s = time.perf_counter() - t_start
        sender = _thread_cpu_s(rec._thread.native_id)  # noqa: SLF001 - bench only
    finally:
        rec.close(timeout=60)
    v = times[5:]  # the first steps open the stream
    return {"caller_ms": statistics.median(v) * 1e3, "caller_p99_ms": statistics.quantiles(v, n=100)[98] * 1e3,
            "sender_cpu_ms_per_step": sender / ns.steps * 1e3,
            "sidecar_cpu_ms_per_step": (_proc_cpu_s(sidecar_pid) - c0) / ns.steps * 1e3,
            "durable_s": durable_s}  # fmt: skip


def bench_line(ns: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    from tracestore.server.testing import ServeProcess

    got: dict[str, list[dict[str, Any]]] = {"without token ids": [], "with token ids": []}
    sp = ServeProcess(workdir / "sidecar", unix_socket=True, flags=["--metrics-port", "off"]).start()
    try:
        assert sp.proc is not None
        for r in range(ns.repeat):
            order = list(got) if r % 2 == 0 else list(reversed(got))
            for name in order:
                ids = name.startswith("with ")
                tag = f"r{r}-{'ids' if ids else 'plain'}"
                got[name].append(one_line_run(sp.unix_address, sp.proc.pid, tag, ns, ids))
    finally:
        sp.kill()
    rows = []
    for name, runs in got.items():
        step = f"{ns.seqs} seqs x {len(SPEC.sites)} sites, 1 token"
        row: dict[str, Any] = {"case": "line", "provider": name, "step": step, "repeats": len(runs)}
        for k in runs[0]:
            row[k] = round(statistics.median(x[k] for x in runs), 4)
        rows.append(row)
    base, ours = rows
    ours["caller_ratio"] = round(ours["caller_ms"] / base["caller_ms"], 3)
    ours["durable_ratio"] = round(ours["durable_s"] / base["durable_s"], 3)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="bytes,line")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--no-save", action="store_true")
    ns = ap.parse_args()
    cases = ns.cases.split(",")
    m = machine()
    print(f"# bench_identity on {m.get('cpu')} ({m.get('cores')} cores), commit {git_commit()}")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-identity-", dir=os.environ.get("BENCH_DIR")) as tmp:
        if "bytes" in cases:
            b = bench_bytes(Path(tmp))
            print_table(b, ["shape", "provider", "tokens", "storage_bytes_per_token", "storage_overhead_pct",
                            "wire_bytes_per_token", "wire_overhead_pct"])  # fmt: skip
            rows += b
        if "line" in cases:
            threading.current_thread().name = "engine"
            line = bench_line(ns, Path(tmp))
            print(f"\n# the line: {ns.repeat} interleaved rounds of {ns.steps} decode steps, engine busy "
                  f"{ns.step_ms} ms in Python between steps; load average {os.getloadavg()[0]:.1f}")  # fmt: skip
            print_table(line, ["provider", "step", "caller_ms", "caller_p99_ms", "sender_cpu_ms_per_step",
                               "sidecar_cpu_ms_per_step", "durable_s", "caller_ratio", "durable_ratio"])  # fmt: skip
            rows += line
    if not ns.no_save:
        print(f"\nappended to {append_results('bench_identity', rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
