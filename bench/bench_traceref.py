"""TraceRefs -> a trainer rank's guidance tensors, against raw pyarrow reading the same bytes; and
the host memory a rank holds.

Data: the paper's configuration, 20 sites x width 2048, NVFP4, b = 1 (384 B per token per site;
here 10 layers x {MoE input, K}, so tensor parallelism has columns to split), one step of
``--trajectories`` x ``--tokens`` written with ``Store.write_shard`` (``--shards`` writers, one
chunk per trajectory and site, a seal each), handed to trainers as TraceRefs.

Per layout (DP 1/2/4/8, DP 2 x CP 2 zig-zag, DP 2 x PP 2 x TP 2) and rank, timed (median of
``--repeat``, one StoreReader per rank made beforehand, as a trainer keeps it):
- ours: ``rank_plan(refs, layout, coord)`` + ``RankPlan.read`` (refs checked against their seals,
  checksum-verified, plan-aligned reads of only the rank's row groups and columns) + torch tensors;
- raw: ``pyarrow.parquet.ParquetFile(shard).read_row_groups(groups)`` of the row groups holding the
  rank's chunks (the same bytes from storage, no checks, no alignment, whole rows).
Memory: ``held``, the Arrow memory the rank keeps while it holds its rows (its output buffer;
decode buffers are gone), and ``peak``, the rise of the process's peak RSS during the read
(``/proc/self/clear_refs``), against the rank's slice and the whole step.

Run: ``python bench/bench_traceref.py [--trajectories 16] [--tokens 1024] [--repeat 5]``; rows go
to ``bench/results/bench_traceref.jsonl``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_results, print_table, time_it  # noqa: E402
from tracestore.client.record.traceref import TraceRef, attempt_id, site_digest  # noqa: E402

from tracestore.rank_plan import RankCoord, TrainerLayout, rank_plan  # noqa: E402
from tracestore.records import RecordChunk, RunSpec, SiteSpec, TrajectorySeal  # noqa: E402
from tracestore.storage.reader import StoreReader  # noqa: E402
from tracestore.storage.store import Store  # noqa: E402

WIDTH, LAYERS = 2048, 10
SPEC = RunSpec(
    "bench-refs",
    tuple(SiteSpec(f"layers.{i}.{k}", kind, i, WIDTH) for i in range(LAYERS)
          for k, kind in (("mlp.input", "moe_input"), ("attn.k", "key"))),
)  # fmt: skip


def write_step(url: str, n_traj: int, n_tokens: int, shards: int) -> list[TraceRef]:
    store = Store(url)
    store.put_run(SPEC)
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, (n_tokens, WIDTH // 8), dtype=np.uint8)
    scales = rng.integers(0, 127, (n_tokens, WIDTH // 16), dtype=np.uint8)
    ids = [attempt_id(f"p{t:04d}", 0) for t in range(n_traj)]
    per = -(-n_traj // shards)
    for w in range(shards):
        mine = ids[w * per : (w + 1) * per]
        chunks = [
            RecordChunk(SPEC.run, 0, t, s.name, 0, n_tokens - 1, np.roll(codes[:-1], i, 0), scales[:-1], 0.25)
            for i, t in enumerate(mine)
            for s in SPEC.sites
        ]
        seals = [TrajectorySeal(SPEC.run, 0, t, n_tokens, SPEC.site_names) for t in mine]
        store.write_shard(SPEC.run, 0, f"w{w}", 1, chunks, seals)
    d = site_digest(SPEC)
    return [TraceRef(SPEC.run, 0, t.split("::")[0], 0, n_tokens, d) for t in ids]


def _rss_peak_reset() -> None:
    with contextlib.suppress(OSError):  # resets VmHWM (Linux)
        Path("/proc/self/clear_refs").write_text("5")


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


LAYOUTS = {
    "dp1": TrainerLayout(),
    "dp2": TrainerLayout(dp_size=2),
    "dp4": TrainerLayout(dp_size=4),
    "dp8": TrainerLayout(dp_size=8),
    "dp2-cp2-zigzag": TrainerLayout(dp_size=2, cp_size=2),
    "dp2-pp2-tp2": TrainerLayout(dp_size=2, pp_size=2, tp_size=2),
}


def _child_memory(url: str, refs: list[TraceRef], layout: str, coord: RankCoord) -> dict[str, int]:
    """A fresh trainer-rank process (refs from a JSON-lines file, one StoreReader): the memory it
    holds once it has read its rows, against before the read."""
    import json
    import subprocess

    from tracestore.client.record.traceref import write_jsonl

    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        write_jsonl(refs, f)
    cmd = [sys.executable, __file__, "--child", url, f.name, layout, str(coord.dp), str(coord.cp), str(coord.pp),
           str(coord.tp)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout
    Path(f.name).unlink()
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def child(url: str, refs_file: str, layout: str, dp: int, cp: int, pp: int, tp: int) -> dict[str, int]:
    import gc

    import torch  # noqa: F401 - a trainer has it loaded before it reads
    from tracestore.client.record.traceref import read_jsonl

    refs = read_jsonl(refs_file)
    reader = StoreReader(Store(url), SPEC.run)
    rp = rank_plan(refs, LAYOUTS[layout], RankCoord(dp, cp, pp, tp), run_spec=SPEC)
    gc.collect()
    base_arrow = pa.total_allocated_bytes()
    rss0 = _status("VmRSS")
    _rss_peak_reset()
    got = rp.read(reader)
    gc.collect()
    held = pa.total_allocated_bytes() - base_arrow
    slice_bytes = sum(int(got[n].codes.nbytes + got[n].scales.nbytes) for n in got.rows)
    return dict(held_bytes=held, slice_bytes=slice_bytes, rss_rise=_status("VmRSS") - rss0,
                hwm_rise=_status("VmHWM") - rss0)  # fmt: skip


def bench(url: str, refs: list[TraceRef], repeat: int) -> list[dict[str, Any]]:
    import torch

    store = Store(url)
    step_bytes = sum(r.n_tokens for r in refs) * sum(s.code_bytes + s.scale_bytes for s in SPEC.sites)
    rows = []
    for name, layout in LAYOUTS.items():
        coords = [RankCoord(dp=0), RankCoord(dp=layout.dp_size - 1)] if layout.dp_size > 1 else [RankCoord()]
        if layout.cp_size > 1:
            coords = [RankCoord(dp=0, cp=1)]
        if layout.pp_size > 1:
            coords = [RankCoord(dp=0, pp=1, tp=1)]
        for coord in coords:
            reader = StoreReader(store, SPEC.run)
            reader.refresh(reader.versions())
            rp0 = rank_plan(refs, layout, coord, run_spec=SPEC)
            # the same bytes with raw pyarrow: the row groups holding the rank's chunks
            # (the reader's index is private; a bench may look)
            groups: dict[str, set[int]] = {}
            for traj in rp0.plan.trajectories:
                for site in rp0.sites:
                    for m, e in reader._by_traj[(traj, site)]:
                        groups.setdefault(m.shard or "", set()).add(e.row_group)
            full = {p: str(Path(store.storage.full(p))) for p in groups}

            def ours(layout: TrainerLayout = layout, coord: RankCoord = coord, reader: StoreReader = reader) -> Any:
                rp = rank_plan(refs, layout, coord, run_spec=SPEC)
                got = rp.read(reader)
                return {n: (torch.from_numpy(got[n].codes), torch.from_numpy(got[n].scales),
                            torch.from_numpy(got[n].valid)) for n in got.rows}  # fmt: skip

            def raw(groups: dict[str, set[int]] = groups, full: dict[str, str] = full) -> Any:
                return [pq.ParquetFile(full[p]).read_row_groups(sorted(g)) for p, g in groups.items()]

            t_ours = time_it(ours, repeat=repeat)
            t_raw = time_it(raw, repeat=repeat)
            raw_bytes = sum(t.nbytes for t in raw())
            mem = _child_memory(url, refs, name, coord)
            slice_bytes = mem["slice_bytes"]
            reader.close()
            rows.append(
                dict(
                    case="refs_to_guidance",
                    layout=name,
                    rank=f"dp{coord.dp} cp{coord.cp} pp{coord.pp} tp{coord.tp}",
                    trajectories=len(refs),
                    tokens=refs[0].n_tokens,
                    sites=len(rp0.sites),
                    width=WIDTH,
                    bits=1,
                    rank_tokens=rp0.n_tokens,
                    slice_MiB=round(slice_bytes / 2**20, 2),
                    step_MiB=round(step_bytes / 2**20, 2),
                    ours_ms=round(1e3 * t_ours["median_s"], 2),
                    raw_ms=round(1e3 * t_raw["median_s"], 2),
                    ours_over_raw=round(t_ours["median_s"] / t_raw["median_s"], 2),
                    ours_GBps=round(slice_bytes / t_ours["median_s"] / 1e9, 3),
                    raw_MiB=round(raw_bytes / 2**20, 2),
                    ours_min_ms=round(1e3 * t_ours["min_s"], 2),
                    raw_min_ms=round(1e3 * t_raw["min_s"], 2),
                    held_MiB=round(mem["held_bytes"] / 2**20, 2),
                    held_over_slice=round(mem["held_bytes"] / slice_bytes, 3) if slice_bytes else None,
                    rss_rise_MiB=round(mem["rss_rise"] / 2**20, 1),
                    peak_rss_rise_MiB=round(mem["hwm_rise"] / 2**20, 1),
                )
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trajectories", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--shards", type=int, default=4, help="writers (shards) the step is spread over")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-save", action="store_true", help="do not append rows to bench/results/")
    ap.add_argument("--child", nargs=7, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        import json

        u, f, lay, *c = args.child
        print(json.dumps(child(u, f, lay, *map(int, c))))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-traceref-") as d:
        url = f"file://{d}/store"
        t0 = time.perf_counter()
        refs = write_step(url, args.trajectories, args.tokens, args.shards)
        print(
            f"wrote {args.trajectories} x {args.tokens} tokens x {len(SPEC.sites)} sites "
            f"in {time.perf_counter() - t0:.1f} s"
        )
        rows = bench(url, refs, args.repeat)
    print_table(
        rows,
        ["layout", "rank", "rank_tokens", "sites", "slice_MiB", "step_MiB", "ours_ms", "raw_ms", "ours_over_raw",
         "ours_min_ms", "raw_min_ms", "held_MiB", "rss_rise_MiB", "peak_rss_rise_MiB"],
    )  # fmt: skip
    if not args.no_save:
        print("appended to", append_results("bench_traceref", rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
