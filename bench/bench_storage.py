"""Storage throughput and footprint against baselines measured in the same run, on one disk (CPU).

Data: the paper configuration (width 2048, 20 sites, b = 1, NVFP4: 384 B per token per site,
7,680 B per token). Code bits are uniformly random (the compression table shows real b = 1 bits
from ``tracestore.quantize`` do not compress); scale bytes follow a model of real NVFP4 block
scales (:class:`ScaleModel`), and a second footprint row uses uniformly random scale bytes (the
incompressible worst case). The compression table quantizes distinct heavy-tailed activations
with the torch reference.

The restated storage targets, against baselines that do the same work (printed first, as
``target`` rows; ratio = baseline median / our median, >= 0.8 passes):

- ``write_shard`` >= 0.8x raw ``pq.write_table`` of the same Arrow table with our codecs, page
  checksums (``write_page_checksum=True``) and an ``fsync``;
- a plan read (``StoreReader.read``, fresh reader) >= 0.8x raw ``ParquetFile.read_row_groups`` of
  the same row groups with ``page_checksum_verification=True``.

Rows (ratio = baseline time / our time on the same bytes, higher is better; ``ratio_vs_ours`` from
the medians, ``ratio_min`` from the fastest runs, which suffer least from other load on a shared
machine; providers run interleaved in every repeat, in a new random order each repeat; ``cpu_ms`` is
the process CPU time (all threads), so work moved to background threads still shows; every row
carries the machine's 1-minute load average and CPU pressure measured before its case):

- ``write``: ``Store.write_shard`` (validation, checksums, sort, one Parquet writer with codes
  uncompressed and scales zstd, page checksums, into the temp file with writeback behind it,
  fsync, create-only link, directory fsync, manifest likewise) vs raw
  ``pyarrow.parquet.write_table`` of the same Arrow table: with default options and no fsync,
  with our codecs and page checksums, with defaults + fsync, and with our codecs, page checksums
  and fsync (the equal-work baseline); also our encoder into a null sink, ``torch.save`` of one
  file per trajectory (what a user would write without tracestore), and the shard published from
  memory (``write_shard`` on ``memory://``, the path S3 takes) vs raw ``write_table`` into a
  ``BufferOutputStream`` and its bytes (what an upload needs). ``ours`` rows are the default
  ``Store``, which writes this shard as two files side by side on a machine with 2+ cores (column
  ``files``); the ``one file`` rows are ``Store(shard_files=1)`` in the same run;
- ``read-plan``: ``StoreReader.read`` of a microbatch plan (2 of the step's trajectories, all sites,
  page and chunk checksums verified, aligned arrays; a fresh reader and a long-lived one with cached
  manifests and footers) vs the original baseline, a raw pyarrow ``read_row_groups`` of the same row
  groups (defaults); also raw with Arrow's page checksum verification (the equal-work baseline),
  raw tuned like our reader (memory map, data columns, page checksums; no chunk checksums, no
  aligned output), ``torch.load`` of those trajectories' files; plus a pipeline-stage +
  tensor-parallel read (half the sites, half the columns) with the bytes it fetched; the reads use
  a one-file shard, and a cold ``StoreReader.read`` of the same chunks written as two files has a
  row of its own;
- ``split``: one file vs two files side by side (``Store(shard_files=1|2)``, split whatever the
  size), on local disk and ``memory://``, interleaved, per shard shape: 8 trajectories of 256 to
  2048 tokens in 512-token chunks (15-120 MiB), 60 MiB in 64- and 128-token chunks, and a decode
  shard of one-token chunks; ``one_file_over_this`` = one-file median / this median (where the
  default thresholds of ``Store`` come from);
- ``footprint``: bytes on storage per token (shard + manifest) vs the 7,680 B target (+1%);
- ``compression``: per-column codec alternatives (size ratio, encode and decode throughput), and
  the per-chunk (key and checksum) columns' codec on a decode shard of small row groups (process
  CPU per GB of payload to encode and read, size over payload);
- ``validate``: ``validate_version`` (what ``tracestore inspect --validate`` runs per version:
  every manifest checksum, every page, key column, byte length and chunk checksum, and every
  sealed trajectory's completeness) in MB/s of shard bytes, in one process and with ``jobs`` = the
  core count (this process and a worker process per further core), vs raw
  ``pyarrow.parquet.read_table`` of the same files with page checksum verification (Arrow's
  threads, and one thread), on two stores: decode shards (one-token chunks of 256 sequences x 20
  sites per step, ~300k chunks per 120 MB shard) and prefill shards (the write case's 512-token
  chunks). ``cpu_ms`` there adds the worker processes' CPU.

Run: ``python bench/bench_storage.py [--trajectories 8] [--tokens 2048] [--repeat 5] [--cases write,split]``
(``--quick``: a small write/read case only, a check that the bench runs); prints the machine and
tables and appends rows to ``bench/results/bench_storage.jsonl``. The bench imports the storage
modules of whichever tracestore is importable, so the same file measures an older tree too
(``PYTHONPATH=<old checkout> python bench/bench_storage.py ...``).
"""

from __future__ import annotations

import argparse
import io
import os
import random
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
from common import append_results, git_commit, machine, print_table  # noqa: E402

from tracestore.plan import MicrobatchPlan  # noqa: E402
from tracestore.records import RecordChunk, RunSpec, SiteSpec  # noqa: E402
from tracestore.storage.arrow import chunks_to_table  # noqa: E402
from tracestore.storage.reader import StoreReader  # noqa: E402
from tracestore.storage.store import Store  # noqa: E402

try:
    from tracestore.storage.shard_read import DATA_COLUMNS
    from tracestore.storage.shard_write import COMPRESSION, DICTIONARY_COLUMNS, ZSTD_LEVEL, encode_shard
except ImportError:  # a tree from before the shard modules were split (measured before/after)
    from tracestore.storage.shards import (  # type: ignore[no-redef]
        COMPRESSION,
        DATA_COLUMNS,
        DICTIONARY_COLUMNS,
        ZSTD_LEVEL,
        encode_shard,
    )

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
    samples) x 20 on the blocks holding a site's 16 outlier channels; bytes per docs/numerics.md §3
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


def machine_load() -> dict[str, Any]:
    """What else the machine was doing: 1-minute load average and Linux CPU pressure (avg10, %)."""
    out: dict[str, Any] = {"loadavg_1m": round(os.getloadavg()[0], 2)}
    try:
        with open("/proc/pressure/cpu") as f:
            out["cpu_pressure_avg10"] = float(f.readline().split()[1].split("=")[1])
    except (OSError, IndexError, ValueError):
        pass
    return out


def interleaved(
    providers: dict[str, Any], repeat: int, cleanup: Any = None
) -> dict[str, tuple[list[float], list[float]]]:
    """Run every provider once per repetition, in a new random order each repetition (fixed seed),
    so drift in other load on the machine and what ran just before hit all providers alike;
    returns {name: (wall seconds, process CPU seconds)}. ``cleanup()`` runs untimed after each
    repetition.

    Not a rotation: rotating keeps the cyclic order, so every provider always follows the same
    one. Measured on the read-plan case: any reader took 2.5-4 ms (of ~20) longer right after the
    whole-step ``pq.read_table`` (106 MB of cache and freed memory) than after a plan read, and
    with rotation the fresh StoreReader always came right after it while the raw read always came
    after the warm reader's read of the same groups."""
    names = list(providers)
    out: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in names}
    rng = random.Random(20261201)
    for _ in range(repeat):
        order = names[:]
        rng.shuffle(order)
        for name in order:
            c0, t0 = time.process_time(), time.perf_counter()
            providers[name]()
            out[name][0].append(time.perf_counter() - t0)
            out[name][1].append(time.process_time() - c0)
        if cleanup is not None:
            cleanup()
    return out


class NullSink(io.RawIOBase):
    """A sink for :func:`encode_shard` that drops the bytes (encoding cost without any I/O)."""

    size = 0
    crc32 = 0

    def write(self, b: Any) -> int:
        n = memoryview(b).nbytes
        self.size += n
        return n

    def writable(self) -> bool:
        return True

    def finish(self) -> None:
        pass


def _rows(case: str, times: dict[str, tuple[list[float], list[float]]], ours: str, mib: float) -> list[dict[str, Any]]:
    ref_w = times[ours][0]
    rows = []
    for name, (ws, cs) in times.items():
        rows.append(
            {
                "case": case,
                "provider": name,
                "payload_MiB": round(mib, 1),
                "median_ms": round(_median(ws) * 1e3, 1),
                "min_ms": round(min(ws) * 1e3, 1),
                "spread": _spread(ws),
                "cpu_ms": round(_median(cs) * 1e3, 1),
                "MiB_per_s": round(mib / _median(ws), 1),
                "ratio_vs_ours": round(_median(ws) / _median(ref_w), 3),
                "ratio_min": round(min(ws) / min(ref_w), 3),
            }
        )
    return rows


WRITE_OURS, READ_OURS = "ours write_shard (durable)", "ours StoreReader.read (cold reader)"
WRITE_ONE_FILE = "ours write_shard (durable), one file"
READ_SPLIT = "ours StoreReader.read (cold reader), two-file shard"


def store_with(url: str, **kw: Any) -> Store | None:
    """A Store with two-file options (``shard_files``...), its run declared; None on a tree from
    before them (the bench measures older trees too)."""
    try:
        st = Store(url, **kw)
    except TypeError:
        return None
    st.put_run(SPEC)
    return st


def info_paths(info: Any) -> list[str]:
    """Every file a write_shard published: its Parquet file(s) and manifest(s)."""
    parts = getattr(info, "parts", ()) or (info,)
    return [p for part in parts for p in (part.path, part.manifest_path) if p]


def shard_files_of(store: Store, chunks: list[RecordChunk]) -> int:
    """How many files ``store`` writes ``chunks`` as (1 on a tree without two-file shards)."""
    if not hasattr(store, "shard_files"):
        return 1
    payload = sum(c.nbytes for c in chunks)
    big = payload >= store.split_min_bytes and payload >= store.split_min_chunk_bytes * len(chunks)
    return store.shard_files if big and len({c.trajectory for c in chunks}) > 1 else 1


WRITE_BASELINE = "raw pq.write_table, our codecs + page crc + fsync"
READ_BASELINE = "raw pq read_row_groups + page crc"
TARGET = 0.8


def target_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The restated targets (module docstring) from the write and read-plan rows of this run."""
    out = []
    for case, ours, base, what in (
        ("write", WRITE_OURS, WRITE_BASELINE, "write_shard vs raw write_table + page crc + fsync"),
        ("read-plan", READ_OURS, READ_BASELINE, "plan read vs raw read_row_groups + page crc"),
    ):
        by = {r["provider"]: r for r in rows if r["case"] == case}
        if ours not in by or base not in by:
            continue
        ratio = by[base]["median_ms"] / by[ours]["median_ms"]
        out.append(
            {
                "case": "target",
                "target": what,
                "ours_ms": by[ours]["median_ms"],
                "baseline_ms": by[base]["median_ms"],
                "ratio": round(ratio, 3),
                "ratio_min": round(by[base]["min_ms"] / by[ours]["min_ms"], 3),
                "needed": f">= {TARGET}",
                "ok": ratio >= TARGET,
            }
        )
    return out


def bench_write_read(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    import torch

    chunks = make_step(args.trajectories, args.tokens, args.chunk_tokens, random_scales=False)
    payload = sum(c.nbytes for c in chunks)
    table = chunks_to_table(chunks)
    rows: list[dict[str, Any]] = []
    url = f"file://{workdir}/store"
    store = Store(url)  # the default: two files side by side for this shard on 2+ cores (case split)
    store.put_run(SPEC)
    one_file = store_with(url, shard_files=1)  # None on a tree from before two-file shards
    (workdir / "store" / SPEC.run / "v0" / "w0").mkdir(parents=True)  # exists on a running sidecar
    by_traj: dict[str, list[RecordChunk]] = {}
    for c in chunks:
        by_traj.setdefault(c.trajectory, []).append(c)
    torch_dir = workdir / "torch"
    torch_dir.mkdir()
    seq = iter(range(1 << 30))
    written: list[Any] = []
    last: dict[str, Any] = {}

    def raw() -> None:  # the original baseline: pyarrow defaults, page cache only
        path = workdir / f"raw-{next(seq)}.parquet"
        pq.write_table(table, path)
        written.append(path)

    fmt: dict[str, Any] = {
        "compression": COMPRESSION,
        "compression_level": {n: ZSTD_LEVEL for n, c in COMPRESSION.items() if c == "ZSTD"},
        "use_dictionary": DICTIONARY_COLUMNS,
        "write_page_checksum": True,
        "data_page_size": 1 << 20,
    }

    def raw_fmt() -> None:
        path = workdir / f"raw-fmt-{next(seq)}.parquet"
        pq.write_table(table, path, **fmt)
        written.append(path)

    def raw_equal() -> None:  # the restated target's baseline: our format (page crc) and an fsync
        path = workdir / f"raw-equal-{next(seq)}.parquet"
        with open(path, "wb") as fh:
            pq.write_table(table, fh, **fmt)
            fh.flush()
            os.fsync(fh.fileno())
        written.append(path)

    def raw_sync() -> None:
        path = workdir / f"raw-sync-{next(seq)}.parquet"
        with open(path, "wb") as fh:
            pq.write_table(table, fh)
            fh.flush()
            os.fsync(fh.fileno())
        written.append(path)

    def ours(st: Store = store) -> None:  # a sidecar's successive shards land in its existing writer directory
        last["info"] = st.write_shard(SPEC.run, 0, "w0", next(seq), chunks)
        written.extend(workdir / "store" / p for p in info_paths(last["info"]))

    mem_url = f"memory://bench-storage-{os.getpid()}"
    mem_store = Store(mem_url)
    mem_store.put_run(SPEC)
    mem_one_file = store_with(mem_url, shard_files=1)
    mem_written: list[str] = []

    def raw_memory() -> None:  # what S3 gets without tracestore: encode into memory, bytes to upload
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        sink.getvalue().to_pybytes()

    def ours_memory(st: Store = mem_store) -> None:  # published from memory as on S3 (memory:// keeps the bytes)
        mem_written.extend(info_paths(st.write_shard(SPEC.run, 0, "w0", next(seq), chunks)))

    def encode_only() -> None:
        encode_shard(SPEC.run, 0, "enc", 0, "unused", chunks, sink=NullSink())

    def torch_save() -> None:
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

    def cleanup() -> None:  # untimed: deleting 100 MB files (with discard) stalls the disk for a while
        for path in written:
            path.unlink()
        written.clear()
        for rel in mem_written:
            mem_store.storage.rm(rel)
        mem_written.clear()

    providers = {
        "raw pq.write_table (page cache only)": raw,
        "raw pq.write_table, our codecs + page crc": raw_fmt,
        "raw pq.write_table + fsync": raw_sync,
        WRITE_BASELINE: raw_equal,
        WRITE_OURS: ours,
        "ours encode_shard to a null sink (no I/O)": encode_only,
        "raw pq.write_table to memory + bytes": raw_memory,
        "ours write_shard (memory://, as S3)": ours_memory,
        "torch.save per traj (no fsync)": torch_save,
    }
    if one_file is not None and mem_one_file is not None:
        providers[WRITE_ONE_FILE] = lambda: ours(one_file)
        providers["ours write_shard (memory://, as S3), one file"] = lambda: ours_memory(mem_one_file)
    load_before = machine_load()
    times = interleaved(providers, args.repeat, cleanup)
    n_files = shard_files_of(store, chunks)
    for r in _rows("write", times, WRITE_OURS, payload / 2**20):
        if r["provider"].startswith("ours write_shard"):  # how many files the shard was written as
            r["files"] = 1 if r["provider"].endswith("one file") else n_files
        rows.append({**r, **load_before})
    # the reads below use a one-file shard (comparable with the raw reads of that file and with
    # earlier runs) and, on their own row, the same chunks as two files
    ours(one_file or store)
    info = last["info"]
    split_info = None
    if one_file is not None:
        split_dir = workdir / "split"
        split_store = store_with(f"file://{split_dir}", shard_files=2, split_min_bytes=0, split_min_chunk_bytes=0)
        assert split_store is not None
        split_info = split_store.write_shard(SPEC.run, 0, "w0", 0, chunks)

    # ---- reads: a microbatch of two trajectories, all sites
    trajs = sorted(by_traj)
    pick = [trajs[len(trajs) // 3], trajs[(2 * len(trajs)) // 3]]
    plan = MicrobatchPlan([(t, 0, args.tokens) for t in pick])
    m = store.read_manifest(info.manifest_path)
    groups = sorted({e.row_group for e in m.chunks if e.trajectory in pick})
    shard_file = workdir / "store" / info.path
    warm = StoreReader(store, SPEC.run)
    warm.read(plan)
    out: dict[str, Any] = {}

    def cold() -> None:
        out["res"] = StoreReader(store, SPEC.run).read(plan)  # a fresh reader: footer and manifest reads count

    def cold_split() -> None:
        out["split"] = StoreReader(split_store, SPEC.run).read(plan)

    def raw_read() -> None:  # the original baseline: pyarrow defaults
        out["raw"] = pq.ParquetFile(shard_file).read_row_groups(groups)

    def raw_mmap() -> None:  # pyarrow tuned the way our reader reads (but no chunk checksums, no aligned arrays)
        pq.ParquetFile(pa.memory_map(str(shard_file)), page_checksum_verification=True).read_row_groups(
            groups, columns=DATA_COLUMNS
        )

    readers = {
        READ_OURS: cold,
        "ours StoreReader.read (warm reader)": lambda: warm.read(plan),
        "raw pq read_row_groups (same groups)": raw_read,
        READ_BASELINE: lambda: pq.ParquetFile(shard_file, page_checksum_verification=True).read_row_groups(groups),
        "raw pq mmap + page crc, data columns": raw_mmap,
        "torch.load per traj": lambda: [torch.load(torch_dir / f"{t}.pt") for t in pick],
        "raw pq.read_table (whole step)": lambda: pq.read_table(shard_file),
    }
    if split_info is not None:
        readers[READ_SPLIT] = cold_split
    load_before = machine_load()
    times = interleaved(readers, args.read_repeat)
    res = out["res"]
    read_bytes = sum(r.codes.nbytes + r.scales.nbytes for r in res.values())
    fetched = {
        READ_OURS: res.stats.bytes_read,
        "ours StoreReader.read (warm reader)": warm.read(plan).stats.bytes_read,
        "raw pq read_row_groups (same groups)": out["raw"].nbytes,
        READ_BASELINE: out["raw"].nbytes,
        "raw pq mmap + page crc, data columns": out["raw"].select(DATA_COLUMNS).nbytes,
        "torch.load per traj": sum(os.path.getsize(torch_dir / f"{t}.pt") for t in pick),
        "raw pq.read_table (whole step)": shard_file.stat().st_size,
    }
    if split_info is not None:
        fetched[READ_SPLIT] = out["split"].stats.bytes_read
        for name in res:
            np.testing.assert_array_equal(out["split"][name].codes, res[name].codes)  # same rows from two files
    for r in _rows("read-plan", times, READ_OURS, read_bytes / 2**20):
        rows.append({**r, "fetched_MiB": round(fetched[r["provider"]] / 2**20, 1), **load_before})

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
            "min_ms": round(min(r_stage) * 1e3, 1),
            "spread": _spread(r_stage),
            "shard_MiB": round(info.nbytes / 2**20, 1),
        }
    )

    # ---- footprint at the paper configuration
    tokens = args.trajectories * args.tokens
    manifest_bytes = len(store.storage.cat(info.manifest_path))
    torch_bytes = sum(os.path.getsize(torch_dir / f"{t}.pt") for t in trajs)
    rows.append(_footprint("ours (real scales)", info.nbytes + manifest_bytes, tokens))
    if split_info is not None:
        split_bytes = sum(p.nbytes + len(split_store.storage.cat(p.manifest_path)) for p in split_info.parts)
        rows.append(_footprint(f"ours, {len(split_info.parts)} files (real scales)", split_bytes, tokens))
    rows.append(_footprint("torch.save per traj (real scales)", torch_bytes, tokens))
    rnd = make_step(args.trajectories, args.tokens, args.chunk_tokens, random_scales=True, seed=1)
    rinfo = store.write_shard(SPEC.run, 0, "rand", 0, rnd)
    rman = len(store.storage.cat(rinfo.manifest_path))
    rows.append(_footprint("ours (random scales, worst case)", rinfo.nbytes + rman, tokens))
    return rows


def bench_split(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    """One file vs two files side by side (``Store(shard_files=2)``, split whatever the size) per
    shard shape, on local disk and memory://, interleaved: where the default threshold lies."""
    shapes: list[tuple[str, list[RecordChunk]]] = [
        (f"8 traj x {n} tok, {min(n, 512)}-tok chunks", make_step(8, n, min(n, 512), random_scales=False))
        for n in args.split_tokens
    ]
    shapes += [(f"8 traj x 1024 tok, {k}-tok chunks", make_step(8, 1024, k, random_scales=False)) for k in (64, 128)]
    shapes.append(
        (
            f"decode: 256 seqs x {args.split_decode_steps} steps",
            decode_shard(SPEC.run, 256, args.split_decode_steps, 0, 7),
        )
    )
    rows: list[dict[str, Any]] = []
    seq = iter(range(1 << 30))
    local_dir = workdir / "split-case"
    for shape, chunks in shapes:
        stores: dict[str, Any] = {}
        for where, url in (("local", f"file://{local_dir}"), ("memory://", f"memory://bench-split-{os.getpid()}")):
            for files in (1, 2):
                st = store_with(url, shard_files=files, split_min_bytes=0, split_min_chunk_bytes=0)
                if st is None:
                    return []  # a tree without two-file shards
                stores[f"{where} {'one file' if files == 1 else 'two files'}"] = st
        (local_dir / SPEC.run / "v0" / "w0").mkdir(parents=True, exist_ok=True)
        mem = stores["memory:// one file"].storage

        def cleanup(mem: Any = mem) -> None:
            for f in (local_dir / SPEC.run / "v0" / "w0").iterdir():
                f.unlink()
            for rel in mem.find(f"{SPEC.run}/v0"):
                mem.rm(rel)

        load_before = machine_load()
        providers = {
            name: (lambda st=st, chunks=chunks: st.write_shard(SPEC.run, 0, "w0", next(seq), chunks))
            for name, st in stores.items()
        }
        times = interleaved(providers, args.split_repeat, cleanup)
        payload = sum(c.nbytes for c in chunks)
        for name, (ws, cs) in times.items():
            one = times[name.replace("two files", "one file")][0]
            rows.append(
                {
                    "case": "split",
                    "shape": shape,
                    "provider": name,
                    "payload_MiB": round(payload / 2**20, 1),
                    "chunks": len(chunks),
                    "chunk_KiB": round(payload / len(chunks) / 1024, 1),
                    "median_ms": round(_median(ws) * 1e3, 1),
                    "min_ms": round(min(ws) * 1e3, 1),
                    "spread": _spread(ws),
                    "cpu_ms": round(_median(cs) * 1e3, 1),
                    "one_file_over_this": round(_median(one) / _median(ws), 3),
                    "one_file_over_this_min": round(min(one) / min(ws), 3),
                    **load_before,
                }
            )
        del chunks
    return rows


def decode_shard(run: str, seqs: int, steps: int, first_step: int, seed: int) -> list[RecordChunk]:
    """One-token chunks of ``steps`` decode steps of ``seqs`` sequences at every site (what a
    sidecar's shard of decode steps holds): views of two random arrays, so building them is cheap."""
    rng = np.random.default_rng(seed)
    n = steps * seqs * N_SITES
    codes = rng.integers(0, 256, (n, SPEC.sites[0].code_bytes), dtype=np.uint8)
    scales = rng.integers(0, 256, (n, SPEC.sites[0].scale_bytes), dtype=np.uint8)
    chunks = []
    k = 0
    for step in range(first_step, first_step + steps):
        for q in range(seqs):
            for s in SPEC.sites:
                chunks.append(
                    RecordChunk(run, 0, f"seq-{q:04d}", s.name, step, 1, codes[k : k + 1], scales[k : k + 1], 1.0)
                )
                k += 1
    return chunks


def bench_validate(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    import io as _io
    import resource

    from tracestore.cli.inspect import validate_version
    from tracestore.records import TrajectorySeal

    cores = len(os.sched_getaffinity(0))
    rows: list[dict[str, Any]] = []
    stores = {}
    # decode: args.validate_shards shards of args.decode_steps steps each
    url = f"file://{workdir}/validate-decode"
    store = Store(url)
    store.put_run(SPEC)
    seqs = 256
    for i in range(args.validate_shards):
        chunks = decode_shard(SPEC.run, seqs, args.decode_steps, i * args.decode_steps, seed=100 + i)
        store.write_shard(SPEC.run, 0, "w0", i, chunks)
        del chunks
    sites = tuple(s.name for s in SPEC.sites)
    n_tokens = args.validate_shards * args.decode_steps + 1
    seals = [TrajectorySeal(SPEC.run, 0, f"seq-{q:04d}", n_tokens, sites) for q in range(seqs)]
    store.write_shard(SPEC.run, 0, "w0", 1 << 20, [], seals=seals)
    stores["decode (1-token chunks)"] = store
    # prefill: the write case's step, in args.validate_shards shards of distinct trajectories
    url = f"file://{workdir}/validate-prefill"
    store = Store(url)
    store.put_run(SPEC)
    for i in range(args.validate_shards):
        chunks = [
            RecordChunk(
                c.run, 0, f"{c.trajectory}-{i}", c.site, c.token_start, c.n_tokens, c.codes, c.scales, c.global_scale
            )
            for c in make_step(args.trajectories, args.tokens, args.chunk_tokens, random_scales=False, seed=200 + i)
        ]
        store.write_shard(SPEC.run, 0, "w0", i, chunks)
        seals = [TrajectorySeal(SPEC.run, 0, t, args.tokens + 1, sites) for t in sorted({c.trajectory for c in chunks})]
        store.write_shard(SPEC.run, 0, "w1", i, [], seals=seals)
        del chunks
    stores[f"prefill ({args.chunk_tokens}-token chunks)"] = store

    for kind, store in stores.items():
        manifests = store.manifests(SPEC.run, 0)
        files = [store.storage.full(m.shard) for m in manifests if m.shard]
        shard_bytes = sum(m.shard_bytes for m in manifests)
        n_chunks = sum(len(m.chunks) for m in manifests)
        store._manifests.clear()  # every provider reads the manifests from disk

        def ours(jobs: int, st: Store = store) -> None:
            out = _io.StringIO()
            n = validate_version(Store(st.url), SPEC.run, 0, out, jobs=jobs, parallel_min_bytes=0)
            assert n == 0, out.getvalue()

        def raw(threads: bool, fs: list[str] = files) -> None:
            for f in fs:
                pq.read_table(f, page_checksum_verification=True, use_threads=threads)

        providers = {
            "ours validate_version, 1 process": lambda: ours(1),
            f"ours validate_version, jobs={cores} (+{cores - 1} worker)": lambda: ours(cores),
            "raw pq.read_table + page crc (Arrow threads)": lambda: raw(True),
            "raw pq.read_table + page crc, 1 thread": lambda: raw(False),
        }
        load_before = machine_load()
        times: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in providers}
        rng = random.Random(20261202)
        for _ in range(args.validate_repeat):
            order = list(providers)
            rng.shuffle(order)
            for name in order:
                ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                c0, t0 = time.process_time(), time.perf_counter()
                providers[name]()
                wall = time.perf_counter() - t0
                ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                child = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
                times[name][0].append(wall)
                times[name][1].append(time.process_time() - c0 + child)
        raw_w = times["raw pq.read_table + page crc (Arrow threads)"][0]
        for name, (ws, cs) in times.items():
            rows.append(
                {
                    "case": "validate",
                    "store": kind,
                    "provider": name,
                    "shards": len(files),
                    "chunks": n_chunks,
                    "shard_MiB": round(shard_bytes / 2**20, 1),
                    "median_ms": round(_median(ws) * 1e3, 1),
                    "min_ms": round(min(ws) * 1e3, 1),
                    "spread": _spread(ws),
                    "cpu_ms": round(_median(cs) * 1e3, 1),
                    "MB_per_s": round(shard_bytes / 1e6 / _median(ws), 1),
                    "MB_per_s_best": round(shard_bytes / 1e6 / min(ws), 1),
                    "ratio_vs_raw": round(_median(raw_w) / _median(ws), 3),
                    **load_before,
                }
            )
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
    rows += _metadata_codecs(args, codes, scales, g)
    return rows


def _metadata_codecs(args: argparse.Namespace, codes: Any, scales: Any, g: float) -> list[dict[str, Any]]:
    """The per-chunk columns' codec on a decode shard: 100-token chunks of 20 sites, row groups as
    the shard writer cuts them (small groups, so every column chunk is a page of a few hundred
    bytes), codes uncompressed and scales zstd-1 as in production; process CPU per GB of payload
    to encode and to read back, and the file size over the payload."""
    from tracestore.storage.config import MIN_ROW_GROUP_BYTES, ROW_GROUP_BYTES
    from tracestore.storage.shard_write import _WRITER_OPTIONS, _row_groups

    tok = 100
    chunks = []
    for i in range(2000):
        a = (i * tok) % max(1, len(codes) - tok)
        chunks.append(
            RecordChunk(
                SPEC.run, 0, f"t{i // 20:05d}", f"site{i % 20:02d}", 0, tok, codes[a : a + tok], scales[a : a + tok], g
            )
        )
    groups = _row_groups(chunks, ROW_GROUP_BYTES, MIN_ROW_GROUP_BYTES)
    tables = [chunks_to_table(chunks[a : a + n]) for a, n in groups]
    payload = sum(c.nbytes for c in chunks)
    payload_cols = {"codes", "scales", "token_scales"}
    rows = []
    for codec, level in (("ZSTD", 1), ("SNAPPY", None), ("LZ4", None), ("NONE", None)):
        opts = dict(_WRITER_OPTIONS)
        opts["compression"] = {
            n: (c if n in payload_cols else codec) for n, c in _WRITER_OPTIONS["compression"].items()
        }
        opts["compression_level"] = {
            n: (1 if c == "ZSTD" and n in payload_cols else level)
            for n, c in opts["compression"].items()
            if c == "ZSTD"
        }
        enc, dec, size = [], [], 0
        for _ in range(max(3, args.repeat // 2)):
            out = pa.BufferOutputStream()
            t0 = time.process_time()
            with pq.ParquetWriter(out, tables[0].schema, **opts) as w:
                for t in tables:
                    w.write_table(t)
            enc.append(time.process_time() - t0)
            data = out.getvalue()
            size = len(data)
            t0 = time.process_time()
            pq.ParquetFile(pa.BufferReader(data), page_checksum_verification=True).read()
            dec.append(time.process_time() - t0)
        rows.append(
            {
                "case": "compression",
                "column": f"per-chunk columns, decode shard ({len(groups)} x {len(chunks) // len(groups)} chunks)",
                "codec": codec + (f"-{level}" if level else ""),
                "raw_MiB": round(payload / 2**20, 1),
                "size_ratio": round(size / payload, 5),
                "encode_cpu_s_per_GB": round(min(enc) / payload * 1e9, 3),
                "decode_cpu_s_per_GB": round(min(dec) / payload * 1e9, 3),
            }
        )
    return rows


def git_commit_of(tree: Path) -> str:
    """The commit (``-dirty`` with uncommitted changes) of the checkout at ``tree``."""
    cwd = os.getcwd()
    try:
        os.chdir(tree)
        return git_commit()
    finally:
        os.chdir(cwd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trajectories", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per trajectory")
    ap.add_argument("--chunk-tokens", type=int, default=512, help="tokens per record chunk")
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--read-repeat", type=int, default=25, help="repetitions of the plan reads (~20 ms each)")
    ap.add_argument("--pool-tokens", type=int, default=8192, help="real quantized tokens for the compression table")
    ap.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--no-save", action="store_true", help="do not append to bench/results")
    ap.add_argument(
        "--cases", default="write,split,compression,validate", help="comma list of write, split, compression, validate"
    )
    ap.add_argument("--split-repeat", type=int, default=7, help="repetitions of the split case")
    ap.add_argument(
        "--split-tokens",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[256, 512, 1024, 2048],
        help="tokens per trajectory of the split case's prefill shapes (8 trajectories; 2048: 120 MiB)",
    )
    ap.add_argument("--split-decode-steps", type=int, default=8, help="decode steps of the split case's decode shard")
    ap.add_argument("--validate-shards", type=int, default=4, help="shards per store in the validate case")
    ap.add_argument("--decode-steps", type=int, default=30, help="decode steps per shard (256 x 20 chunks each)")
    ap.add_argument("--validate-repeat", type=int, default=5)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a check that the bench runs: --cases write, 2 trajectories of 1024 tokens, 3 repeats (reads 7)",
    )
    args = ap.parse_args()
    if args.quick:
        args.cases, args.trajectories, args.tokens, args.repeat, args.read_repeat = "write", 2, 1024, 3, 7
    import tracestore

    where = Path(tracestore.__file__).resolve().parent.parent
    print(f"machine: {machine()}")
    print(f"tracestore: {where} (commit {git_commit_of(where)})")
    cases = set(args.cases.split(","))
    workdir = Path(tempfile.mkdtemp(prefix="bench-storage-", dir=args.dir))
    rows: list[dict[str, Any]] = []
    try:
        if "write" in cases:
            rows += bench_write_read(args, workdir)
        if "split" in cases:
            rows += bench_split(args, workdir)
        if "validate" in cases:
            rows += bench_validate(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    comp = bench_compression(args) if "compression" in cases else []
    config = {"trajectories": args.trajectories, "tokens": args.tokens, "chunk_tokens": args.chunk_tokens}
    if "validate" in cases:
        config = {**config, "validate_shards": args.validate_shards, "decode_steps": args.decode_steps}
    rows = target_rows(rows) + rows
    for case, cols in (
        ("target", ["target", "ours_ms", "baseline_ms", "ratio", "ratio_min", "needed", "ok"]),
        (
            "write",
            ["provider", "files", "payload_MiB", "median_ms", "min_ms", "cpu_ms", "MiB_per_s", "ratio_vs_ours"]
            + ["ratio_min", "spread"],
        ),
        (
            "read-plan",
            ["provider", "payload_MiB", "fetched_MiB", "median_ms", "min_ms", "cpu_ms", "MiB_per_s"]
            + ["ratio_vs_ours", "ratio_min"],
        ),
        (
            "split",
            ["shape", "provider", "payload_MiB", "chunk_KiB", "median_ms", "min_ms", "cpu_ms"]
            + ["one_file_over_this", "one_file_over_this_min"],
        ),
        ("footprint", ["provider", "bytes", "tokens", "bytes_per_token", "target", "ok"]),
        (
            "validate",
            ["store", "provider", "shards", "chunks", "shard_MiB", "median_ms", "min_ms", "cpu_ms", "MB_per_s"]
            + ["MB_per_s_best", "ratio_vs_raw"],
        ),
    ):
        if any(r["case"] == case for r in rows):
            print(f"\n== {case} ({config})")
            print_table([r for r in rows if r["case"] == case], cols)
    if comp:
        print("\n== compression alternatives per column")
        print_table(
            comp,
            ["column", "codec", "raw_MiB", "size_ratio", "encode_MiB_per_s", "decode_MiB_per_s"]
            + ["encode_cpu_s_per_GB", "decode_cpu_s_per_GB"],
        )
    if not args.no_save:
        path = append_results("bench_storage", [{**r, **config} for r in rows + comp])
        print(f"\nappended {len(rows) + len(comp)} rows to {path}")


if __name__ == "__main__":
    main()
