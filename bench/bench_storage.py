"""Storage throughput and footprint against baselines measured in the same run, on one disk (CPU).

Data: the paper configuration (width 2048, 20 sites, b = 1, NVFP4: 384 B per token per site,
7,680 B per token). Code bits are uniformly random (the compression table shows real b = 1 bits
from ``tracestore.quantize`` do not compress); scale bytes follow a model of real NVFP4 block
scales (:class:`ScaleModel`), and a second footprint row uses uniformly random scale bytes (the
incompressible worst case). The compression table quantizes distinct heavy-tailed activations
with the torch reference.

Rows (ratio = baseline time / our time on the same bytes, higher is better; ``ratio_vs_ours`` from
the medians, ``ratio_min`` from the fastest runs, which suffer least from other load on a shared
machine; providers run interleaved in every repeat):

- ``write``: ``Store.write_shard`` (validation, checksums, sort, Parquet with codes uncompressed
  and scales zstd, page checksums, temp file + fsync + create-only link + directory fsync, manifest)
  vs raw ``pyarrow.parquet.write_table`` of the same Arrow table (default options, no fsync), and vs
  ``torch.save`` of one file per trajectory (what a user would write without tracestore);
- ``read-plan``: ``StoreReader.read`` of a microbatch plan (2 of the step's trajectories, all sites,
  page and chunk checksums verified, aligned arrays; a fresh reader and a long-lived one with cached
  manifests and footers) vs a raw pyarrow read of the same row groups (without and with page
  checksum verification), vs ``torch.load``
  of those trajectories' files; plus a pipeline-stage + tensor-parallel read (half the sites, half the
  columns) with the bytes it fetched;
- ``footprint``: bytes on storage per token (shard + manifest) vs the 7,680 B target (+1%);
- ``compression``: per-column codec alternatives (size ratio, encode and decode throughput).

Run: ``python bench/bench_storage.py [--trajectories 8] [--tokens 2048] [--repeat 5]``; prints
tables and appends rows to ``bench/results/bench_storage.jsonl``.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_results, print_table  # noqa: E402

from tracestore.arrow import chunks_to_table  # noqa: E402
from tracestore.plan import MicrobatchPlan  # noqa: E402
from tracestore.reader import StoreReader  # noqa: E402
from tracestore.records import RecordChunk, RunSpec, SiteSpec  # noqa: E402
from tracestore.shards import COMPRESSION, DICTIONARY_COLUMNS, ZSTD_LEVEL, encode_shard  # noqa: E402
from tracestore.store import Store  # noqa: E402

WIDTH, N_SITES, BITS = 2048, 20, 1
TARGET_BYTES_PER_TOKEN = 7680
SPEC = RunSpec(
    "bench", tuple(SiteSpec(f"layers.{20 + i}.mlp.input", "moe_input", 20 + i, WIDTH) for i in range(N_SITES))
)


def token_pool(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Real records of ``n`` distinct token rows (``tracestore.quantize``, the torch reference):
    packed b=1 codes, E4M3 scale bytes, global scale. Used for the compression table."""
    import torch

    from tracestore import pack_bits, quantize

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, WIDTH, generator=g)
    x *= torch.exp(0.5 * torch.randn(n, 1, generator=g))  # per-token magnitude spread
    x[:, torch.randperm(WIDTH, generator=g)[:16]] *= 20.0  # a few outlier channels, as in LLM activations
    q = quantize(x, "nvfp4")
    return pack_bits(q.codes, BITS).numpy(), q.scales.numpy(), float(q.global_scale)


class ScaleModel:
    """E4M3 block-scale bytes with the statistics of real NVFP4 quantization, generated fast.

    Block amax = per-token sigma (lognormal) x max|N(0,1)| over 16 values (drawn from 2^20 real
    samples) x 20 on the blocks holding a site's 16 outlier channels; bytes per numerics.md §3
    (``sf = E4M3(amax / (6 g))``, g = amax / 2688 of the chunk, nearest E4M3 value).
    """

    def __init__(self, rng: np.random.Generator) -> None:
        from tracestore.formats import E4M3_TO_FLOAT

        self.rng = rng
        self.m16 = np.abs(rng.standard_normal((1 << 20, 16), dtype=np.float32)).max(axis=1)
        self.values = E4M3_TO_FLOAT[:0x7F].astype(np.float64)  # bytes 0x00..0x7E, increasing
        self.mid = (self.values[1:] + self.values[:-1]) / 2

    def scales(self, n: int, outlier_blocks: np.ndarray) -> tuple[np.ndarray, float]:
        blocks = WIDTH // 16
        sigma = np.exp(0.5 * self.rng.standard_normal((n, 1)))
        amax = sigma * self.m16[self.rng.integers(0, len(self.m16), (n, blocks))]
        amax[:, outlier_blocks] *= 20.0
        g = float(np.float32(amax.max() / 2688.0))
        sf = np.minimum(amax / (6.0 * g), 448.0)
        return np.searchsorted(self.mid, sf).astype(np.uint8), g


def make_step(n_traj: int, n_tokens: int, chunk_tokens: int, random_scales: bool, seed: int = 0) -> list[RecordChunk]:
    """One step's chunks: uniformly random code bits (real b=1 mantissa bits are incompressible; the
    compression table measures that on real quantized tokens) and modelled or random scale bytes."""
    rng = np.random.default_rng(seed)
    model = ScaleModel(rng)
    outliers = {s.name: np.unique(rng.integers(0, WIDTH // 16, 16)) for s in SPEC.sites}
    chunks = []
    for t in range(n_traj):
        for s in SPEC.sites:
            for a in range(0, n_tokens, chunk_tokens):
                n = min(chunk_tokens, n_tokens - a)
                codes = rng.integers(0, 256, (n, s.code_bytes), dtype=np.uint8)
                if random_scales:
                    scales, g = rng.integers(0, 256, (n, s.scale_bytes), dtype=np.uint8), 1.0
                else:
                    scales, g = model.scales(n, outliers[s.name])
                chunks.append(RecordChunk(SPEC.run, 0, f"traj-{t:04d}", s.name, a, n, codes, scales, g))
    return chunks


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def _spread(xs: list[float]) -> str:
    return f"{min(xs) * 1e3:.0f}-{max(xs) * 1e3:.0f} ms"


def bench_write_read(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    import torch

    chunks = make_step(args.trajectories, args.tokens, args.chunk_tokens, random_scales=False)
    payload = sum(c.nbytes for c in chunks)
    table = chunks_to_table(chunks)
    rows: list[dict[str, Any]] = []
    t_ours, t_encode, t_raw, t_raw_fmt, t_raw_sync, t_torch = [], [], [], [], [], []
    url = f"file://{workdir}/store"
    store = Store(url)
    store.put_run(SPEC)
    by_traj: dict[str, list[RecordChunk]] = {}
    for c in chunks:
        by_traj.setdefault(c.trajectory, []).append(c)
    torch_dir = workdir / "torch"
    info = None
    for i in range(args.repeat):
        # interleaved so drift from other load on the machine hits all providers alike
        raw_path = workdir / f"raw-{i}.parquet"
        t0 = time.perf_counter()
        pq.write_table(table, raw_path)
        t_raw.append(time.perf_counter() - t0)
        raw_path.unlink()

        fmt_path = workdir / f"raw-fmt-{i}.parquet"
        t0 = time.perf_counter()
        pq.write_table(
            table,
            fmt_path,
            compression=COMPRESSION,
            compression_level={n: ZSTD_LEVEL for n, c in COMPRESSION.items() if c == "ZSTD"},
            use_dictionary=DICTIONARY_COLUMNS,
            write_page_checksum=True,
            data_page_size=1 << 20,
        )
        t_raw_fmt.append(time.perf_counter() - t0)
        fmt_path.unlink()

        sync_path = workdir / f"raw-sync-{i}.parquet"
        t0 = time.perf_counter()
        with open(sync_path, "wb") as fh:
            pq.write_table(table, fh)
            fh.flush()
            os.fsync(fh.fileno())
        t_raw_sync.append(time.perf_counter() - t0)
        sync_path.unlink()

        t0 = time.perf_counter()
        info = store.write_shard(SPEC.run, 0, f"w{i}", 0, chunks)
        t_ours.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        encode_shard(SPEC.run, 0, "enc", i, "unused", chunks)
        t_encode.append(time.perf_counter() - t0)
        if i < args.repeat - 1:
            store.storage.rm(f"{SPEC.run}/v0/w{i}", recursive=True)

        shutil.rmtree(torch_dir, ignore_errors=True)
        torch_dir.mkdir()
        t0 = time.perf_counter()
        for traj, cs in by_traj.items():
            obj = {
                f"{c.site}@{c.token_start}": {
                    "codes": torch.from_numpy(c.codes),
                    "scales": torch.from_numpy(c.scales),
                    "global_scale": c.global_scale,
                }
                for c in cs
            }
            torch.save(obj, torch_dir / f"{traj}.pt")
        t_torch.append(time.perf_counter() - t0)
    assert info is not None
    mib = payload / 2**20
    for name, ts in (
        ("ours write_shard (durable)", t_ours),
        ("ours encode_shard only (no I/O)", t_encode),
        ("raw pq.write_table (page cache only)", t_raw),
        ("raw pq.write_table, our codecs + page crc", t_raw_fmt),
        ("raw pq.write_table + fsync", t_raw_sync),
        ("torch.save per traj (no fsync)", t_torch),
    ):
        rows.append(
            {
                "case": "write",
                "provider": name,
                "payload_MiB": round(mib, 1),
                "median_ms": round(_median(ts) * 1e3, 1),
                "spread": _spread(ts),
                "MiB_per_s": round(mib / _median(ts), 1),
                "ratio_vs_ours": round(_median(ts) / _median(t_ours), 3),
                "ratio_min": round(min(ts) / min(t_ours), 3),
            }
        )

    # ---- reads: a microbatch of two trajectories, all sites
    trajs = sorted(by_traj)
    pick = [trajs[len(trajs) // 3], trajs[(2 * len(trajs)) // 3]]
    plan = MicrobatchPlan([(t, 0, args.tokens) for t in pick])
    m = store.read_manifest(info.manifest_path)
    groups = sorted({e.row_group for e in m.chunks if e.trajectory in pick})
    shard_file = workdir / "store" / info.path
    r_ours, r_warm, r_raw, r_raw_crc, r_torch, r_full = [], [], [], [], [], []
    res = None
    warm = StoreReader(store, SPEC.run)
    warm.read(plan)
    for _ in range(args.repeat):
        reader = StoreReader(store, SPEC.run)  # a fresh reader each time: footer and manifest reads count
        t0 = time.perf_counter()
        res = reader.read(plan)
        r_ours.append(time.perf_counter() - t0)

        t0 = time.perf_counter()  # a trainer's long-lived reader: manifests and footers cached
        warm.read(plan)
        r_warm.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        raw_tbl = pq.ParquetFile(shard_file).read_row_groups(groups)
        r_raw.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        pq.ParquetFile(shard_file, page_checksum_verification=True).read_row_groups(groups)
        r_raw_crc.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        loaded = [torch.load(torch_dir / f"{t}.pt") for t in pick]
        r_torch.append(time.perf_counter() - t0)
        del loaded

        t0 = time.perf_counter()
        pq.read_table(shard_file)
        r_full.append(time.perf_counter() - t0)
    assert res is not None
    read_bytes = sum(r.codes.nbytes + r.scales.nbytes for r in res.values())
    rmib = read_bytes / 2**20
    for name, ts, fetched in (
        ("ours StoreReader.read (cold reader)", r_ours, res.stats.bytes_read),
        ("ours StoreReader.read (warm reader)", r_warm, warm.read(plan).stats.bytes_read),
        ("raw pq read_row_groups (same groups)", r_raw, raw_tbl.nbytes),
        ("raw pq read_row_groups + page crc", r_raw_crc, raw_tbl.nbytes),
        ("torch.load per traj", r_torch, sum(os.path.getsize(torch_dir / f"{t}.pt") for t in pick)),
        ("raw pq.read_table (whole step)", r_full, shard_file.stat().st_size),
    ):
        rows.append(
            {
                "case": "read-plan",
                "provider": name,
                "payload_MiB": round(rmib, 1),
                "fetched_MiB": round(fetched / 2**20, 1),
                "median_ms": round(_median(ts) * 1e3, 1),
                "spread": _spread(ts),
                "MiB_per_s": round(rmib / _median(ts), 1),
                "ratio_vs_ours": round(_median(ts) / _median(r_ours), 3),
                "ratio_min": round(min(ts) / min(r_ours), 3),
            }
        )

    # ---- a pipeline stage (half the sites) of a tensor-parallel rank (half the columns)
    stage = [s.name for s in SPEC.sites[: N_SITES // 2]]
    r_stage = []
    for _ in range(args.repeat):
        reader = StoreReader(store, SPEC.run)
        t0 = time.perf_counter()
        sres = reader.read(plan, sites=stage, columns=(0, WIDTH // 2))
        r_stage.append(time.perf_counter() - t0)
    rows.append(
        {
            "case": "read-plan",
            "provider": "ours PP half sites + TP half columns",
            "payload_MiB": round(sum(r.codes.nbytes + r.scales.nbytes for r in sres.values()) / 2**20, 1),
            "fetched_MiB": round(sres.stats.bytes_read / 2**20, 1),
            "median_ms": round(_median(r_stage) * 1e3, 1),
            "spread": _spread(r_stage),
            "shard_MiB": round(info.nbytes / 2**20, 1),
        }
    )

    # ---- footprint at the paper configuration
    tokens = args.trajectories * args.tokens
    manifest_bytes = len(store.storage.cat(info.manifest_path))
    torch_bytes = sum(os.path.getsize(torch_dir / f"{t}.pt") for t in trajs)
    rows.append(_footprint("ours (real scales)", info.nbytes + manifest_bytes, tokens))
    rows.append(_footprint("torch.save per traj (real scales)", torch_bytes, tokens))
    rnd = make_step(args.trajectories, args.tokens, args.chunk_tokens, random_scales=True, seed=1)
    rinfo = store.write_shard(SPEC.run, 0, "rand", 0, rnd)
    rman = len(store.storage.cat(rinfo.manifest_path))
    rows.append(_footprint("ours (random scales, worst case)", rinfo.nbytes + rman, tokens))
    return rows


def _footprint(name: str, nbytes: int, tokens: int) -> dict[str, Any]:
    per = nbytes / tokens
    return {
        "case": "footprint",
        "provider": name,
        "bytes": nbytes,
        "tokens": tokens,
        "bytes_per_token": round(per, 1),
        "target": f"<= {TARGET_BYTES_PER_TOKEN * 1.01:.0f}",
        "ok": per <= TARGET_BYTES_PER_TOKEN * 1.01,
    }


def bench_compression(args: argparse.Namespace) -> list[dict[str, Any]]:
    codes, scales, g = token_pool(args.pool_tokens, seed=2)  # distinct real tokens: no repeats to exploit
    site = SPEC.sites[0]
    step = args.chunk_tokens
    real = [
        RecordChunk(
            SPEC.run, 0, "real", site.name, a, min(step, len(codes) - a), codes[a : a + step], scales[a : a + step], g
        )
        for a in range(0, len(codes), step)
    ]
    table = chunks_to_table(real)
    rows = []
    for column in ("codes", "scales"):
        sub = table.select([column])
        raw = sum(len(v) for v in sub.column(0).to_pylist())
        for codec, level in (("NONE", None), ("SNAPPY", None), ("LZ4", None), ("ZSTD", 1), ("ZSTD", 3), ("ZSTD", 9)):
            enc, dec = [], []
            size = 0
            for _ in range(max(2, args.repeat // 2)):
                buf = io.BytesIO()
                t0 = time.perf_counter()
                pq.write_table(sub, buf, compression=codec, compression_level=level, use_dictionary=False)
                enc.append(time.perf_counter() - t0)
                size = buf.tell()
                data = pa.py_buffer(buf.getvalue())
                t0 = time.perf_counter()
                pq.read_table(pa.BufferReader(data))
                dec.append(time.perf_counter() - t0)
            rows.append(
                {
                    "case": "compression",
                    "column": f"{column} (real quantized tokens)",
                    "codec": codec + (f"-{level}" if level else ""),
                    "raw_MiB": round(raw / 2**20, 1),
                    "size_ratio": round(size / raw, 4),
                    "encode_MiB_per_s": round(raw / 2**20 / _median(enc), 0),
                    "decode_MiB_per_s": round(raw / 2**20 / _median(dec), 0),
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trajectories", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per trajectory")
    ap.add_argument("--chunk-tokens", type=int, default=512, help="tokens per record chunk")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--pool-tokens", type=int, default=8192, help="real quantized tokens for the compression table")
    ap.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--no-save", action="store_true", help="do not append to bench/results")
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-storage-", dir=args.dir))
    try:
        rows = bench_write_read(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    comp = bench_compression(args)
    config = {"trajectories": args.trajectories, "tokens": args.tokens, "chunk_tokens": args.chunk_tokens}
    for case, cols in (
        ("write", ["provider", "payload_MiB", "median_ms", "spread", "MiB_per_s", "ratio_vs_ours", "ratio_min"]),
        (
            "read-plan",
            ["provider", "payload_MiB", "fetched_MiB", "median_ms", "spread", "MiB_per_s"]
            + ["ratio_vs_ours", "ratio_min"],
        ),
        ("footprint", ["provider", "bytes", "tokens", "bytes_per_token", "target", "ok"]),
    ):
        print(f"\n== {case} ({config})")
        print_table([r for r in rows if r["case"] == case], cols)
    print("\n== compression alternatives per column")
    print_table(comp, ["column", "codec", "raw_MiB", "size_ratio", "encode_MiB_per_s", "decode_MiB_per_s"])
    if not args.no_save:
        path = append_results("bench_storage", [{**r, **config} for r in rows + comp])
        print(f"\nappended {len(rows) + len(comp)} rows to {path}")


if __name__ == "__main__":
    main()
