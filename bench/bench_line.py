"""The recording line under load, everything connected: engine processes -> ``tracestore serve``
(unix socket + shared memory, WAL acks) -> local Parquet storage, sustained; then stored rows
checked against an independent quantization of the activations the engines fed.

Run: ``python bench/bench_line.py [--procs K] [--config paper|dsv3] [--quick]`` (prints a table,
appends rows to ``bench/results/bench_line.jsonl``; ``--out DIR`` writes them there instead).

What one run does (K engine processes, one per simulated GPU, one sidecar):

- Each engine process runs a decode loop of ``--batch`` sequences. Its engine thread is busy in
  Python between steps: a stand-in scheduler (:class:`Scheduler`) builds per-sequence dicts, sorts
  them, appends each sampled token, retires sequences that reach their length (``finish``) and
  admits new ones, calibrated to ``--sched-us`` microseconds per step (measured and reported).
- The forward. ``--model moe40`` (GPU, one process): bench_production's synthetic 40-layer MoE
  decode step replayed as one CUDA graph, records on the MoE input of its last 20 layers
  (``dense-light``: its 24-layer dense step of hidden 2048, records on the last 20 MLP inputs).
  ``--model standin``: the graph holds the input gather, one activation per site and the record
  kernels; the rest of the forward is a wait of ``--forward-ms`` (the engine thread blocked on
  its GPU, GIL released), so K processes on one GPU each offer one GPU's load. On the GPU the
  recorded step is ``graph.replay()`` + ``stage.commit(Segments.decode(...), token_ids=...)``
  (:meth:`RolloutRecorder.slab_stage`, record kernels and staging inside the graph); then the
  engine reads a [batch] result back and synchronizes, as an engine reads its sampled tokens.
  Without a GPU the record kernels (CPU reference, far slower than the GPU's) run once before the
  loop into a ring of ``RING`` slabs, and each step hands one to ``record_slab`` (``--record
  stage``: copies it into the slab of a ``slab_stage`` and commits, the graph form's calls on the CPU).
- Phase 1, overhead (``--overhead-s``): blocks of ``--block-s`` alternate the same loop with and
  without recording (order swapped every pair), connected the whole time; each block has its own
  scheduler state, so unrecorded steps leave no gaps in recorded trajectories.
- Phase 2, sustained: recording only, one stage per ``--forward-ms`` value (``--stage-s`` each,
  or ``--duration`` for one value): the offered load rises stage by stage. A stage is sustained
  when no row went unguided, it ran to its end, and the backlog (sidecar ``backlog_bytes`` from
  the Stat RPC + the recorders' staging in use) either stayed under half of the sidecars' budget
  and half of each pool, or grew from the stage's first half to its second at a rate that would
  not fill the room left (budgets + pools) within 60 s (it saw-tooths with shard commits, so
  short stages read growth loosely). An engine that sees an unguided row ends the run for all
  (the later stages would only drop more).
- ``--sidecars N``: N sidecar processes (engine i records to sidecar i mod N; 0: one per
  engine), all on one storage. Meanwhile the parent samples every 0.5 s: each sidecar's Stat
  (backlog, WAL bytes, shards), RSS with its anonymous and shared-memory parts apart (a sidecar
  maps the recorders' staging pools it reads: their pages count in its RSS as RssShmem, not in
  its memory budget) and CPU seconds (/proc); rows sum them over the sidecars, the ``_max`` RSS
  figures are one sidecar's.
- The disk: the parent also reads /proc/diskstats for the block devices holding the WALs and the
  shards (``disk_write_GBps`` per stage: all that was written to them). ``--disk-probe S`` first
  measures that disk alone, as WALs load it (one writer, then one per sidecar; O_DIRECT writes and
  an fdatasync per 16 MiB): the ceiling in the same run (``disk_of_probe``: a stage's disk rate
  over the probe's with one writer per sidecar; near 1, the disk is what the line waits on). The
  shards' storage is beside the WALs unless ``--storage-dir`` puts it on another file system
  (``/dev/shm``: off the disk, as a node's shards go to object storage while only the WAL stays on
  its disk; it holds the whole run's shards in memory, so keep such runs short).
- After the last stage each engine seals its live sequences and flushes (until durable); the
  sidecar stops (SIGTERM: shards committed); ``GuidanceReader`` reads the sampled steps' rows
  from storage and each site is compared bit for bit with ``tracestore.fp4.quantize`` (the CPU
  reference) of the activations the engine fed, saved at those steps (on the GPU: copies of the
  tensors the record kernels read; on the CPU the records were made by that same reference, so
  the check there covers the line, not the kernels).

Rows: ``line`` (per-step overhead, engine-thread time of the record calls p50/p99, scheduler
time; ``overhead_quotable`` once each engine ran :data:`MIN_PAIRS` alternating pairs), ``stage``
(offered GB/s, backlog, sidecar CPU/RSS, unguided, verdict), ``run`` (durable GB/s: all bytes over
the time until the last flush returned, sidecar CPU, peak RSS), ``verify``, ``disk`` (``--disk-probe``) and, with
``--prometheus BIN``, ``dashboard``: the Grafana dashboard's panels (Backlog, throughput, CPU, ...)
over the sustained phase, from a Prometheus scraping the sidecars (``line_dashboard.py``). GB/s
count record payload (codes + scale bytes, as the recorder counts).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/common.py; `bench` is no package name of ours

import numpy as np  # noqa: E402
from common import append_results, git_commit, machine, print_table  # noqa: E402
from line_dashboard import LineDashboard  # noqa: E402

from tracestore.records import RunSpec, SiteSpec  # noqa: E402

RING = 4  # CPU: recorded slabs the loop cycles through
VOCAB = 4096  # rows of the input embedding table
MIN_PAIRS = 5  # alternating rec/norec block pairs per engine before a line row's overhead is quoted

CONFIGS: dict[str, dict[str, Any]] = {
    # the paper's: the MoE input of the last 20 of 40 layers, width 2048, NVFP4 b = 1
    "paper": dict(sites=20, width=2048, first=20),
    # DeepSeek-V3-like: hidden 7168, the MoE input (post-attention norm output) of its 58 MoE
    # layers (layers 3..60; layers 0-2 are dense), NVFP4 b = 1
    "dsv3": dict(sites=58, width=7168, first=3),
}


def run_spec(config: str) -> RunSpec:
    c = CONFIGS[config]
    sites = tuple(
        SiteSpec(f"layers.{c['first'] + i}.mlp.input", "moe_input", c["first"] + i, c["width"], bits=1)
        for i in range(c["sites"])
    )
    return RunSpec(f"line-{config}", sites)


def step_payload(spec: RunSpec, batch: int) -> int:
    """Record payload bytes of one decode step (codes + scales, as the recorder counts them)."""
    return batch * sum(s.code_bytes + s.scale_bytes for s in spec.sites)


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss(pid: int) -> dict[str, int]:
    """The process's resident bytes: ``rss`` (VmRSS) and its parts ``anon`` (RssAnon: its own
    heap), ``shmem`` (RssShmem: mapped shared memory, e.g. the recorders' staging pools the sidecar
    reads) and ``file`` (RssFile: mapped files and libraries)."""
    keys = {"VmRSS:": "rss", "RssAnon:": "anon", "RssShmem:": "shmem", "RssFile:": "file"}
    got = dict.fromkeys(keys.values(), 0)
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key = keys.get(line.split(maxsplit=1)[0]) if line else None
        if key is not None:
            got[key] = int(line.split()[1]) << 10
    return got


def _proc_table(path: str) -> list[list[str]]:
    """The whitespace-split lines of a /proc table (none when it cannot be read)."""
    try:
        return [line.split() for line in Path(path).read_text().splitlines()]
    except OSError:
        return []


def _diskstats(major: int, minor: int) -> list[str] | None:
    """The /proc/diskstats fields of device ``major:minor`` (None: no such device, or no file)."""
    return next(
        (f for f in _proc_table("/proc/diskstats") if len(f) > 9 and (int(f[0]), int(f[1])) == (major, minor)), None
    )


def block_device(path: Path) -> tuple[str, int, int] | None:
    """(name, major, minor) of the block device holding ``path``, from /proc/diskstats; None for
    a file system on no block device (tmpfs) or a path that cannot be read."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    f = _diskstats(os.major(dev), os.minor(dev))
    return None if f is None else (f[2], os.major(dev), os.minor(dev))


def fs_type(path: Path) -> str:
    """The type of the file system holding ``path`` (ext4, xfs, tmpfs ...), from /proc/mounts."""
    real, best, kind = os.path.realpath(path), "", "unknown"
    for f in _proc_table("/proc/mounts"):
        if len(f) > 2 and (real == f[1] or real.startswith(f[1].rstrip("/") + "/")) and len(f[1]) >= len(best):
            best, kind = f[1], f[2]
    return kind


def disk_written(dev: tuple[str, int, int]) -> int:
    """Bytes written to ``dev`` since boot (/proc/diskstats counts 512-byte sectors, field 10)."""
    f = _diskstats(dev[1], dev[2])
    return 0 if f is None else int(f[9]) * 512


def disk_probe(directory: Path, writers: int, seconds: float) -> dict[str, Any]:
    """The disk's sustained write rate as ``writers`` WALs load it: each thread appends 4 MiB writes
    to its own file (O_DIRECT from an aligned buffer, as the sidecar's WAL writes where the file
    system takes it, else through the page cache) and fdatasyncs every 16 MiB (one WAL buffer), for
    ``seconds``. Returns the aggregate GB/s, and that rate as /proc/diskstats saw it."""
    import mmap

    block, sync_every = 4 << 20, 16 << 20
    flag = getattr(os, "O_DIRECT", 0)
    done = [0] * writers
    errors: list[str] = []
    stop = threading.Event()

    def write(i: int) -> None:
        buf = mmap.mmap(-1, block)
        buf[:] = os.urandom(block)
        path = directory / f"disk-probe-{i}.bin"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o600)
        except OSError as exc:
            errors.append(f"{path}: {exc.strerror}")
            return
        try:
            since = 0
            while not stop.is_set():
                done[i] += os.write(fd, buf)
                since += block
                if since >= sync_every:
                    os.fdatasync(fd)
                    since = 0
            os.fdatasync(fd)
        finally:
            os.close(fd)
            path.unlink()

    dev = block_device(directory)
    w0 = disk_written(dev) if dev else 0
    threads = [threading.Thread(target=write, args=(i,), daemon=True) for i in range(writers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    w1 = disk_written(dev) if dev else 0
    return {"writers": writers, "direct": bool(flag), "seconds": dt, "GBps": sum(done) / dt / 1e9,
            "disk_GBps": (w1 - w0) / dt / 1e9 if dev else None, "disk": dev[0] if dev else None,
            "error": errors[0] if errors else None}  # fmt: skip


# ------------------------------------------------------------------------------ the engine's Python


class Scheduler:
    """Stand-in for an engine's per-step Python: each step it appends the sampled tokens to their
    sequences, retires the ones at their target length and admits new ones, then ``passes`` times
    builds a dict per sequence (id, position, priority, sampling parameters, last tokens) and sorts
    them, as a scheduler ranks its batch. Row ``i`` of the batch stays sequence slot ``i``."""

    def __init__(self, batch: int, tag: str, seed: int, lengths: tuple[int, int]) -> None:
        self.rng = np.random.default_rng(seed)
        self.tag, self.lengths, self.n, self.passes = tag, lengths, 0, 1
        self.seqs = [self._new() for _ in range(batch)]
        self.trajs = tuple(s["id"] for s in self.seqs)

    def _new(self) -> dict[str, Any]:
        self.n += 1
        lo, hi = self.lengths
        return {"id": f"{self.tag}-{self.n}", "pos": 0, "target": int(self.rng.integers(lo, hi)),
                "tok": int(self.rng.integers(0, VOCAB)), "tokens": [], "prio": float(self.rng.random()),
                "temperature": 0.7, "top_p": 0.95}  # fmt: skip

    def step(self, sampled: np.ndarray | None) -> tuple[list[tuple[str, int]], np.ndarray, np.ndarray]:
        """Account the last forward's sampled tokens (None: no forward yet) and plan the next one:
        (sequences finished, as (trajectory, n_tokens); each slot's position; each slot's input token)."""
        finished = []
        seqs = self.seqs
        if sampled is not None:
            for i, tok in enumerate(sampled.tolist()):
                s = seqs[i]
                s["tokens"].append(s["tok"])
                s["tok"] = tok
                s["pos"] += 1
                if s["pos"] >= s["target"]:  # positions 0..pos-1 recorded; the last sampled token is not
                    finished.append((s["id"], s["pos"] + 1))
                    seqs[i] = self._new()
            if finished:
                self.trajs = tuple(s["id"] for s in seqs)
        for _ in range(self.passes):
            view = [{"id": s["id"], "pos": s["pos"], "prio": s["prio"] - 1e-4 * s["pos"], "t": s["temperature"],
                     "p": s["top_p"], "last": s["tokens"][-4:]} for s in seqs]  # fmt: skip
            view.sort(key=lambda d: (d["prio"], d["pos"]))
        return finished, np.array([s["pos"] for s in seqs], np.int64), np.array([s["tok"] for s in seqs], np.int64)


# ------------------------------------------------------------------------------ the forward


class _Eager:
    """A "graph" on the CPU (``--graph-on-cpu``: the GPU path's code run eagerly, for development)."""

    def __init__(self, fn: Any) -> None:
        self.replay = fn


class GpuForward:
    """The graphs of one engine on the GPU: ``norec``, ``rec`` (records + ``stage.capture()``) and
    ``keep`` (``rec`` that also copies each site's activation into ``acts``: the sampled steps).
    ``device="cpu"`` runs the same calls eagerly (no pinning, events or capture)."""

    def __init__(self, model: str, spec: RunSpec, batch: int, rec: Any, seed: int, device: str = "cuda") -> None:
        import torch

        import tracestore.kernels as K
        from tracestore.kernels.testing import capture_graph

        torch.manual_seed(seed)
        sites, w = spec.sites, spec.sites[0].width
        cuda = device == "cuda"
        self.torch, self.batch, self.device = torch, batch, device
        self.emb = torch.randn(VOCAB, w, device=device, dtype=torch.bfloat16)
        self.tok_pin = torch.zeros(batch, dtype=torch.int64)
        self.out_pin = torch.zeros(batch, dtype=torch.float32)
        if cuda:
            self.tok_pin, self.out_pin = self.tok_pin.pin_memory(), self.out_pin.pin_memory()
        self.tok = torch.zeros(batch, dtype=torch.int64, device=device)
        self.out = torch.zeros(batch, dtype=torch.float32, device=device)
        self.x = torch.zeros(batch, w, device=device, dtype=torch.bfloat16)
        self.acts = [torch.zeros(batch, w, device=device, dtype=torch.bfloat16) for _ in sites]
        self.g = torch.ones(len(sites), device=device)
        self.slab = K.RecordSlab.allocate(sites, batch, device)
        self.stage = rec.slab_stage(self.slab)
        self.done = torch.cuda.Event() if cuda else None
        self.sites = sites
        moe = None
        if model in ("moe40", "dense-light"):
            from bench_production import SITES, DenseStep, MoEStep

            if w != 2048 or len(sites) != SITES:
                raise SystemExit(f"--model {model} records the paper configuration only (--config paper)")
            moe = MoEStep(batch) if model == "moe40" else DenseStep(batch, light="light")
            moe.x0 = self.x  # the graph reads the gathered input

        def record(j: int, h: Any, keep: bool) -> None:
            if keep and h is not self.acts[j]:
                self.acts[j].copy_(h)
                h = self.acts[j]
            K.record_from_activations(h, sites[j], self.slab[sites[j].name], global_scale=self.g[j : j + 1])

        def fwd(recording: bool, keep: bool = False) -> None:
            torch.index_select(self.emb, 0, self.tok, out=self.x)
            if moe is not None:
                moe((lambda j, h: record(j, h, keep)) if recording else None)
            else:
                for j in range(len(sites)):
                    torch.mul(self.x, 1.0 + j / 8, out=self.acts[j])
                    if recording:
                        record(j, self.acts[j], keep)
            self.out.copy_(self.x[:, :8].float().sum(-1))  # read back after the whole step (stream order)
            if recording:
                self.stage.capture()

        capture = capture_graph if cuda else _Eager
        self.graphs = {
            "norec": capture(lambda: fwd(False)),
            "rec": capture(lambda: fwd(True)),
            "keep": capture(lambda: fwd(True, keep=True)),
        }
        # decode-side g per site, static (calibrated): amax of the site's activation / 2688
        self.tok.copy_(torch.randint(0, VOCAB, (batch,)))
        self.graphs["keep"].replay()
        self.g.copy_(torch.stack([a.float().abs().amax() for a in self.acts]) / 2688.0)
        self.g.clamp_(min=1e-12)
        if cuda:
            torch.cuda.synchronize()

    def launch(self, variant: str, tokens: np.ndarray) -> None:
        self.tok_pin.numpy()[:] = tokens
        self.tok.copy_(self.tok_pin, non_blocking=True)
        self.graphs[variant].replay()

    def commit(self, trajs: tuple[str, ...], positions: np.ndarray, tokens: np.ndarray) -> bool:
        from tracestore.client import Segments

        return bool(self.stage.commit(Segments.decode(trajs, positions), token_ids=tokens))

    def wait(self, forward_s: float) -> np.ndarray:
        """The rest of the forward (``forward_s``, stand-in) and the read-back of its result."""
        if forward_s > 0:
            time.sleep(forward_s)
        self.out_pin.copy_(self.out, non_blocking=True)
        if self.done is not None:
            self.done.record()
            self.done.synchronize()
        return self.out_pin.numpy()

    def kept(self, rows: list[int]) -> dict[str, Any]:
        """The activations each site's record kernel read at the last ``keep`` step, rows ``rows``."""
        idx = self.torch.tensor(rows, device=self.device)
        return {s.name: a.index_select(0, idx).cpu() for s, a in zip(self.sites, self.acts, strict=True)}

    def g_values(self) -> list[float]:
        return [float(v) for v in self.g.cpu()]


class CpuForward:
    """The CPU stand-in: ``RING`` slabs recorded before the loop (the CPU reference kernels), one
    handed to the recorder per step."""

    def __init__(self, spec: RunSpec, batch: int, rec: Any, seed: int, stage: bool) -> None:
        import torch

        import tracestore.kernels as K

        gen = torch.Generator().manual_seed(seed)
        self.sites, self.rec, self.p = spec.sites, rec, 0
        w = spec.sites[0].width
        self.acts, self.ring = [], []
        emb = torch.randn(VOCAB, w, generator=gen).to(torch.bfloat16)
        self.g = [float(emb.float().abs().amax()) * (1 + j / 8) / 2688.0 for j in range(len(spec.sites))]
        for _ in range(RING):
            x = emb[torch.randint(0, VOCAB, (batch,), generator=gen)]
            acts = [x * (1.0 + j / 8) for j in range(len(spec.sites))]
            slab = K.RecordSlab.allocate(spec.sites, batch, "cpu")
            for j, s in enumerate(spec.sites):
                K.record_from_activations(acts[j], s, slab[s.name], global_scale=self.g[j])
            self.acts.append(acts)
            self.ring.append(slab)
        self.slab = K.RecordSlab.allocate(spec.sites, batch, "cpu") if stage else None
        self.stage = rec.slab_stage(self.slab) if stage else None
        self.out = np.zeros(batch, np.float32)

    def launch(self, variant: str, tokens: np.ndarray) -> None:
        self.p = (self.p + 1) % RING
        if variant != "norec" and self.slab is not None:
            self.slab.data.copy_(self.ring[self.p].data)  # what the record kernels write on a GPU

    def commit(self, trajs: tuple[str, ...], positions: np.ndarray, tokens: np.ndarray) -> bool:
        from tracestore.client import Segments

        segs = Segments.decode(trajs, positions)
        if self.stage is not None:
            self.stage.capture()
            return bool(self.stage.commit(segs, token_ids=tokens))
        return bool(self.rec.record_slab(segs, self.ring[self.p], token_ids=tokens))

    def wait(self, forward_s: float) -> np.ndarray:
        if forward_s > 0:
            time.sleep(forward_s)
        return self.out

    def kept(self, rows: list[int]) -> dict[str, Any]:
        return {s.name: a[rows].clone() for s, a in zip(self.sites, self.acts[self.p], strict=True)}

    def g_values(self) -> list[float]:
        return list(self.g)


# ------------------------------------------------------------------------------ one engine process


def verify_times(start: float, span: float, n: int) -> list[float]:
    """When the engine keeps its ``n`` sampled steps of the sustained phase ``[start, start + span)``:
    the first 1 s in (a quarter of a shorter span), so a run stopped by its first unguided row
    still has stored rows checked, the others spread over the phase."""
    if n <= 0:
        return []
    rest = n - 1
    return [start + min(1.0, span / 4)] + [start + (q + 0.5) * span / rest for q in range(rest)]


def engine_process(a: dict[str, Any]) -> None:
    """One engine (``--child``): waits for the parent's go file, runs both phases, writes its result."""
    import torch
    from tracestore.client import RolloutRecorder

    work = Path(a["work"])
    i = a["index"]
    spec = run_spec(a["config"])
    gpu = a["device"] == "cuda" or a["graph_on_cpu"]  # the graph path (on the CPU: eagerly)
    if a["device"] == "cuda":
        torch.cuda.set_device(0)
    address = a["addresses"][i % len(a["addresses"])]  # engine i's sidecar (one per engine, or shared)
    rec = RolloutRecorder(
        address,
        spec,
        writer=f"engine-{i}",
        staging_bytes=a["staging_mib"] << 20,
        **({"linger_s": a["linger_s"]} if a["linger_s"] else {}),
    )
    fwd: Any = (
        GpuForward(a["model"], spec, a["batch"], rec, 1000 + i, a["device"])
        if gpu
        else CpuForward(spec, a["batch"], rec, 1000 + i, a["record"] == "stage")
    )
    lengths = (a["len_min"], a["len_max"])
    scheds = {"rec": Scheduler(a["batch"], f"e{i}", i, lengths), "norec": Scheduler(a["batch"], f"n{i}", i, lengths)}
    # calibrate the scheduler's passes to --sched-us (measured per step and reported)
    probe = Scheduler(a["batch"], "probe", 99, lengths)
    tok = np.zeros(a["batch"], np.int64)
    t0 = time.perf_counter()
    for _ in range(20):
        probe.step(tok)
    per_pass = (time.perf_counter() - t0) / 20
    passes = max(1, round(a["sched_us"] * 1e-6 / per_pass))
    for s in scheds.values():
        s.passes = passes
    (work / f"ready-{i}").write_text("")
    go = work / "go"
    while not go.exists():
        time.sleep(0.01)
    t_go = float(go.read_text())
    stop = work / "stop"
    payload = step_payload(spec, a["batch"])
    rng = np.random.default_rng(7 + i)
    blocks: list[dict[str, Any]] = []
    steps: dict[str, list[float]] = {"rec": [], "norec": []}
    sched_t: dict[str, list[float]] = {"rec": [], "norec": []}
    commit_t: list[float] = []
    calls_t: list[float] = []  # commit + the step's finish() calls
    stage_rows: list[dict[str, Any]] = []
    timeline: list[tuple[float, int, int, int]] = []  # (time, staging in use, payload queued, unguided)
    kept: list[dict[str, Any]] = []
    refused = 0
    outs: dict[str, Any] = {"rec": None, "norec": None}
    lost: set[str] = set()  # every trajectory seen unguided
    seen_unguided = [0]
    next_tl = 0.0

    def one_step(variant: str, forward_s: float, keep: bool) -> float:
        nonlocal refused, next_tl
        t0 = time.perf_counter()
        sched = scheds[variant]
        out = outs[variant]
        sampled = None  # the previous forward's read-back, as its sampled tokens
        if out is not None:
            sampled = (
                (np.abs(np.nan_to_num(out)) * 997).astype(np.int64) % VOCAB if gpu else rng.integers(0, VOCAB, len(out))
            )
        finished, positions, tokens = sched.step(sampled)
        t1 = time.perf_counter()
        fwd.launch("keep" if keep and gpu else variant, tokens)
        call = 0.0
        if variant == "rec":
            t2 = time.perf_counter()
            for traj, n in finished:
                rec.finish(traj, n)
            t3 = time.perf_counter()
            refused += not fwd.commit(sched.trajs, positions, tokens)
            t4 = time.perf_counter()
            call = t4 - t2
            if not keep:
                commit_t.append(t4 - t3)
                calls_t.append(call)
        outs[variant] = fwd.wait(forward_s).copy()
        if keep:
            rows = sorted(rng.choice(a["batch"], size=min(a["verify_rows"], a["batch"]), replace=False).tolist())
            name = work / f"kept-{i}-{len(kept)}.pt"
            torch.save({"trajs": [sched.trajs[r] for r in rows], "pos": positions[rows].tolist(),
                        "acts": fwd.kept(rows), "g": fwd.g_values()}, name)  # fmt: skip
            kept.append({"file": str(name)})
        elif variant in steps:
            sched_t[variant].append(t1 - t0)
        if rec.stats["unguided"] != seen_unguided[0]:  # kept: finish() forgets an unguided id
            seen_unguided[0] = rec.stats["unguided"]
            lost.update(rec.unguided)
        now = time.time()
        if now >= next_tl:
            next_tl = now + 0.25
            timeline.append((now, rec.pool.in_use, rec._outbox.in_bytes, rec.stats["unguided"]))  # noqa: SLF001
        return time.perf_counter() - t0

    # phase 1: alternating blocks, connected
    first_f = a["forward_ms"][0] / 1e3
    t_end1 = t_go + a["overhead_s"]
    k = 0
    while time.time() + 2 * a["block_s"] <= t_end1 + 0.05 and not stop.exists():  # whole pairs only
        order = ("rec", "norec") if k % 2 == 0 else ("norec", "rec")
        for variant in order:
            b_end = time.time() + a["block_s"]
            ts = []
            while time.time() < b_end:
                ts.append(one_step(variant, first_f, False))
            steps[variant].extend(ts)
            blocks.append({"variant": variant, "pair": k, "steps": len(ts), "mean_ms": 1e3 * statistics.fmean(ts)})
        k += 1
    # phase 2: recording only, one stage per forward time
    n_stages = len(a["forward_ms"])
    stage_s = a["stage_s"]
    t_start2 = t_go + a["overhead_s"]
    verify_at = verify_times(t_start2, stage_s * n_stages, a["verify_steps"])
    for si, f_ms in enumerate(a["forward_ms"]):
        s_end = t_start2 + (si + 1) * stage_s
        n0, b0, u0, c0, ts0 = len(commit_t), rec._outbox.in_bytes, rec.stats["unguided"], len(calls_t), time.time()  # noqa: SLF001
        cpu0 = time.process_time()  # this engine process, all its threads (engine, sender, gRPC)
        n_steps = 0
        while time.time() < s_end and not stop.exists():
            keep = bool(verify_at) and time.time() >= verify_at[0]
            if keep:
                verify_at.pop(0)
            one_step("rec", f_ms / 1e3, keep)
            n_steps += 1
            if rec.stats["unguided"] and not stop.exists():
                stop.write_text(f"engine {i}: {rec.stats['unguided']} unguided in stage {si}")
        stage_rows.append({"stage": si, "forward_ms": f_ms, "t0": ts0, "t1": time.time(), "steps": n_steps,
                           "cpu_s": time.process_time() - cpu0,
                           "complete": time.time() >= s_end,
                           "payload": rec._outbox.in_bytes - b0, "unguided": rec.stats["unguided"] - u0,  # noqa: SLF001
                           "commit_p50_ms": 1e3 * pct(commit_t[n0:], 50),
                           "commit_p99_ms": 1e3 * pct(commit_t[n0:], 99),
                           "calls_p50_ms": 1e3 * pct(calls_t[c0:], 50),
                           "calls_p99_ms": 1e3 * pct(calls_t[c0:], 99)})  # fmt: skip
        if stop.exists():
            break
    t_loop = time.time()
    lost.update(rec.unguided)
    if outs["rec"] is not None:  # each slot's last forward recorded its position pos: length pos + 2
        for seq in scheds["rec"].seqs:
            rec.finish(seq["id"], seq["pos"] + 2)
    lost.update(rec.unguided)
    flushed = rec.flush(timeout=a["flush_timeout"])
    t_flushed = time.time()
    stats = dict(rec.stats)
    unguided = sorted(rec.unguided)[:20]
    rec.close(timeout=10)
    result = {
        "index": i, "passes": passes, "blocks": blocks, "stages": stage_rows, "timeline": timeline, "kept": kept,
        "steps_ms": {v: [1e3 * t for t in ts] for v, ts in steps.items()},
        "sched_ms": {v: [1e3 * t for t in ts] for v, ts in sched_t.items()},
        "commit_ms": [1e3 * t for t in commit_t], "calls_ms": [1e3 * t for t in calls_t],
        "refused": refused, "flushed": flushed, "t_loop_end": t_loop, "t_flushed": t_flushed,
        "t_start2": t_start2, "payload_total": rec._outbox.in_bytes, "stats": stats,  # noqa: SLF001
        "unguided_ids": unguided, "unguided_all": sorted(lost | rec.unguided), "step_payload": payload,
        "batch_sites": a["batch"] * len(spec.sites),
    }  # fmt: skip
    (work / f"result-{i}.json").write_text(json.dumps(result))


# ------------------------------------------------------------------------------ the parent


class Sampler(threading.Thread):
    """Every ``period`` s: each sidecar's Stat (backlog, WAL, shards), RSS (anonymous and shared
    memory apart) and CPU seconds; a row sums them over the sidecars (``rss_max``, ``anon_max``,
    ``shmem_max``: the largest one sidecar's)."""

    def __init__(
        self, sidecars: list[tuple[str, int]], work: Path, min_free: int, period: float = 0.5, store: Path | None = None
    ) -> None:
        super().__init__(daemon=True)
        self.work, self.min_free = work, min_free
        # where a full file system would stop the line: the WAL's, and the shards' when elsewhere
        self.watch = [work] if store is None or os.stat(store).st_dev == os.stat(work).st_dev else [work, store]
        # block devices written (the WAL's, the shards'): their bytes written per sample
        self.disks = list(dict.fromkeys(d for d in (block_device(p) for p in self.watch) if d is not None))
        from tracestore.client.transport import channel

        from tracestore.v1 import tracestore_pb2 as pb

        self.pb, self.period = pb, period
        self.sidecars = [(channel(a).unary_unary("/tracestore.v1.TraceStore/Stat"), pid) for a, pid in sidecars]
        self.rows: list[dict[str, Any]] = []
        self.halt = threading.Event()

    def sample(self) -> None:
        try:
            row: dict[str, Any] = {"t": time.time(), "cpu_s": 0.0, "disk_w": sum(disk_written(d) for d in self.disks)}
            row.update(dict.fromkeys(("backlog", "wal", "shards", "budget", "rss", "anon", "shmem"), 0))
            row.update(dict.fromkeys(("rss_max", "anon_max", "shmem_max"), 0))
            for stat, pid in self.sidecars:
                st = self.pb.StatResponse.FromString(stat(self.pb.StatRequest().SerializeToString(), timeout=5))
                mem = proc_rss(pid)
                for key, value in (("backlog", st.backlog_bytes), ("wal", st.wal_bytes),
                                   ("shards", st.shards_committed), ("budget", st.memory_budget_bytes),
                                   ("rss", mem["rss"]), ("anon", mem["anon"]), ("shmem", mem["shmem"]),
                                   ("cpu_s", proc_cpu_s(pid))):  # fmt: skip
                    row[key] += value
                for key in ("rss", "anon", "shmem"):
                    row[key + "_max"] = max(row[key + "_max"], mem[key])
            self.rows.append(row)
            stop = self.work / "stop"
            for where in self.watch:
                vfs = os.statvfs(where)
                free = vfs.f_bavail * vfs.f_frsize
                if free < self.min_free and not stop.exists():  # a full disk would fail the line for another reason
                    stop.write_text(f"disk: {free >> 20} MiB free under {where}, stopped before it fills")
        except Exception as exc:  # noqa: BLE001 - a missed sample is reported, not fatal
            self.rows.append({"t": time.time(), "error": f"{type(exc).__name__}: {exc}"[:200]})

    def run(self) -> None:
        while not self.halt.wait(self.period):
            self.sample()


def _window(rows: list[dict[str, Any]], t0: float, t1: float) -> list[dict[str, Any]]:
    return [r for r in rows if t0 <= r["t"] <= t1 and "error" not in r]


def _staging_at(results: list[dict[str, Any]], t0: float, t1: float) -> tuple[float, float]:
    """Sum over engines of the mean staging in use in the first and the second half of [t0, t1]."""
    mid = (t0 + t1) / 2
    first = second = 0.0
    for r in results:
        a = [x[1] for x in r["timeline"] if t0 <= x[0] < mid]
        b = [x[1] for x in r["timeline"] if mid <= x[0] <= t1]
        first += statistics.fmean(a) if a else 0.0
        second += statistics.fmean(b) if b else 0.0
    return first, second


def verify(storage: str, spec: RunSpec, results: list[dict[str, Any]]) -> dict[str, Any]:
    """Stored rows of the sampled steps vs ``tracestore.fp4.quantize`` of the saved activations.
    Rows not stored (their trajectory dropped: unguided) are counted, not compared."""
    import torch
    from tracestore.client import GuidanceReader

    from tracestore.fp4 import quantize
    from tracestore.packing import pack_bits
    from tracestore.plan import MicrobatchPlan

    checked = bad = absent = absent_guided = 0
    first_bad = None
    with GuidanceReader(storage, spec.run, prefetch=False, on_missing="mask") as reader:
        for r in results:
            lost = set(r["unguided_all"])
            for k in r["kept"]:
                d = torch.load(k["file"])
                plan = MicrobatchPlan([(t, p, p + 1) for t, p in zip(d["trajs"], d["pos"], strict=True)])
                got = reader.read(plan)
                for j, s in enumerate(spec.sites):
                    gd = got[s.name]
                    valid = torch.as_tensor(gd.valid).bool()
                    n = int(valid.sum())
                    absent += len(d["trajs"]) - n
                    absent_guided += sum(
                        1 for t, v in zip(d["trajs"], valid.tolist(), strict=True) if not v and t not in lost
                    )
                    q = quantize(d["acts"][s.name][valid], "nvfp4", d["g"][j])
                    gs = torch.as_tensor(gd.global_scale, dtype=torch.float32).expand(len(d["trajs"]))[valid]
                    ts = torch.as_tensor(gd.token_scales)[valid] if gd.token_scales is not None else 1.0
                    fails = [what for what, same in (
                        ("codes", torch.equal(torch.as_tensor(gd.codes)[valid], pack_bits(q.codes, s.bits))),
                        ("scales", torch.equal(torch.as_tensor(gd.scales)[valid], q.scales)),
                        ("g", bool((gs * ts == torch.tensor(q.global_scale, dtype=torch.float32)).all())),
                    ) if not same]  # fmt: skip
                    checked += n
                    if fails:
                        bad += n
                        first_bad = first_bad or f"engine {r['index']} {Path(k['file']).name} {s.name}: {fails}"
    return {"site_rows_checked": checked, "site_rows_mismatched": bad, "first_mismatch": first_bad,
            "site_rows_not_stored": absent, "site_rows_not_stored_not_unguided": absent_guided}  # fmt: skip


def dashboard_rows(dash: LineDashboard, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The dashboard's panels over the sustained phase (first stage's start to last stage's end);
    a failure is one row with ``error``, so the run's other rows are kept."""
    st = [r["stages"] for r in results if r["stages"]]
    if dash.binary is None or not st:
        return []
    t0, t1 = min(s[0]["t0"] for s in st), max(s[-1]["t1"] for s in st)
    try:
        return dash.evaluate(t0, t1)
    except Exception as exc:  # noqa: BLE001 - reported as a row and printed
        print(f"# dashboard: {type(exc).__name__}: {exc}", flush=True)
        return [{"panel": None, "error": f"{type(exc).__name__}: {exc}"[:500]}]


def run_once(ns: argparse.Namespace, device: str) -> list[dict[str, Any]]:
    from tracestore.server.testing import ServeProcess

    spec = run_spec(ns.config)
    payload = step_payload(spec, ns.batch)
    k = ns.procs
    shm_free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    staging_mib = ns.staging_mib
    if k * (staging_mib << 20) > 0.8 * shm_free:
        staging_mib = int(0.8 * shm_free / k) >> 20
        print(f"# /dev/shm has {shm_free >> 20} MiB free: staging cut to {staging_mib} MiB per engine")
    stages = ns.forward_ms
    stage_s = ns.stage_s if len(stages) > 1 else ns.duration
    n_side = k if ns.sidecars == 0 else min(ns.sidecars, k)
    with (
        tempfile.TemporaryDirectory(prefix="bench-line-", dir=ns.workdir) as tmp,
        tempfile.TemporaryDirectory(prefix="bench-line-store-", dir=ns.storage_dir) as store_tmp,
        LineDashboard(ns.prometheus, Path(tmp) / "prometheus") as dash,
    ):
        work = Path(tmp)
        # one storage for all sidecars (each writer's shards go under its own prefix): beside the
        # WALs, or (--storage-dir) on another file system, as shards leave a node for object storage
        store_dir = Path(store_tmp) / "data" if ns.storage_dir else work / "data"
        storage = f"file://{store_dir}"
        probes = [disk_probe(work, w, ns.disk_probe) for w in sorted({1, n_side})] if ns.disk_probe > 0 else []
        for pr in probes:
            print(f"# disk probe under {work}: {pr['writers']} writer(s), O_DIRECT {pr['direct']}: "
                  f"{pr['GBps']:.3f} GB/s written + fdatasync ({pr['disk']}: {pr['disk_GBps'] or 0:.3f} GB/s)",
                  flush=True)  # fmt: skip
        sps = [
            ServeProcess(work / f"sidecar-{j}", storage=storage, unix_socket=True, flags=list(ns.serve_flag)).start()
            for j in range(n_side)
        ]
        store_dir.mkdir(parents=True, exist_ok=True)
        sampler = Sampler([(sp.unix_address, sp.proc.pid) for sp in sps if sp.proc], work, int(ns.min_free_gb * 2**30),
                          store=store_dir)  # fmt: skip
        where = {"wal_fs": fs_type(work), "store_fs": fs_type(store_dir), "store_beside_wal": not ns.storage_dir,
                 "disks": [d[0] for d in sampler.disks]}  # fmt: skip
        dash.start([sp.metrics_port for sp in sps if sp.metrics_port is not None])  # every target up
        args = {"work": str(work), "config": ns.config, "device": device, "model": ns.model, "batch": ns.batch,
                "addresses": [sp.unix_address for sp in sps], "staging_mib": staging_mib, "linger_s": ns.linger_s,
                "record": ns.record,
                "sched_us": ns.sched_us, "len_min": ns.len_min, "len_max": ns.len_max,
                "forward_ms": stages, "stage_s": stage_s, "overhead_s": ns.overhead_s, "block_s": ns.block_s,
                "verify_steps": ns.verify_steps, "verify_rows": ns.verify_rows,
                "flush_timeout": ns.flush_timeout, "graph_on_cpu": ns.graph_on_cpu}  # fmt: skip
        procs = []
        for i in range(k):
            cmd = [sys.executable, __file__, "--child", json.dumps({**args, "index": i})]
            procs.append(subprocess.Popen(cmd, cwd=Path(__file__).resolve().parent.parent))
        deadline = time.time() + ns.start_timeout
        while not all((work / f"ready-{i}").exists() for i in range(k)):
            if any(p.poll() not in (None, 0) for p in procs) or time.time() > deadline:
                for p in procs:
                    p.kill()
                for sp in sps:
                    sp.kill()
                raise SystemExit(f"an engine process failed to start; sidecar log:\n{sps[0].log_tail()}")
            time.sleep(0.05)
        sampler.start()
        t_go = time.time() + 0.5
        (work / "go").write_text(repr(t_go))
        rcs = [p.wait() for p in procs]
        ru_engines = resource.getrusage(resource.RUSAGE_CHILDREN)  # the engines waited for, not the sidecar
        sampler.sample()
        sampler.halt.set()
        results = [json.loads((work / f"result-{i}.json").read_text()) for i in range(k) if rcs[i] == 0]
        dash_rows = dashboard_rows(dash, results)  # the sidecars still up: their last scrapes count
        t_stop = time.time()
        rcs_side = [sp.terminate(timeout=300) for sp in sps]  # shards committed before each exits
        rc = next((x for x in rcs_side if x), 0)
        t_stopped = time.time()
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)  # now with the sidecar's whole life
        cpu_total = ru.ru_utime + ru.ru_stime - ru_engines.ru_utime - ru_engines.ru_stime
        stopped = (work / "stop").read_text() if (work / "stop").exists() else None
        try:
            ver = verify(storage, spec, results) if results and ns.verify_steps else {}
        except Exception as exc:  # noqa: BLE001 - reported as the verify row
            ver = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    if len(results) != k:
        raise SystemExit(f"{k - len(results)} engine process(es) failed (exit codes {rcs})")
    rows: list[dict[str, Any]] = []
    graph = device == "cuda" or ns.graph_on_cpu
    base = {"config": ns.config, "sites": len(spec.sites), "width": spec.sites[0].width, "bits": 1,
            "batch": ns.batch, "procs": k, "model": ns.model if graph else "cpu-ring", "device": device,
            "graph_on_cpu": ns.graph_on_cpu,
            "record_path": "slab_stage" if graph or ns.record == "stage" else "record_slab",
            "sched_us_target": ns.sched_us, "step_payload_bytes": payload, "staging_mib": staging_mib,
            "linger_s": ns.linger_s,
            "serve_flags": " ".join(ns.serve_flag), "sidecars": n_side, "code_commit": ns.commit,
            **where}  # fmt: skip
    # -- line: overhead and engine-thread time (median over engines)
    per = []
    for r in results:
        rb = [b["mean_ms"] for b in r["blocks"] if b["variant"] == "rec"]
        nb = [b["mean_ms"] for b in r["blocks"] if b["variant"] == "norec"]
        pairs: dict[int, dict[str, float]] = {}
        for b in r["blocks"]:
            pairs.setdefault(b["pair"], {})[b["variant"]] = b["mean_ms"]
        ratios = [p["rec"] / p["norec"] - 1 for p in pairs.values() if len(p) == 2]
        per.append({"rec_ms": statistics.median(rb) if rb else float("nan"),
                    "norec_ms": statistics.median(nb) if nb else float("nan"),
                    "overhead_pct": 100 * statistics.median(ratios) if ratios else float("nan"),
                    "pairs": len(ratios), "passes": r["passes"],
                    "sched_rec_ms": pct(r["sched_ms"]["rec"], 50), "sched_norec_ms": pct(r["sched_ms"]["norec"], 50),
                    "commit_p50_ms": pct(r["commit_ms"], 50), "commit_p99_ms": pct(r["commit_ms"], 99),
                    "commit_max_ms": max(r["commit_ms"], default=float("nan")),
                    "calls_p50_ms": pct(r["calls_ms"], 50), "calls_p99_ms": pct(r["calls_ms"], 99)})  # fmt: skip
    line = {key: statistics.median(p[key] for p in per) for key in per[0]}
    rows.append({**base, "kind": "line", "forward_ms": stages[0], "overhead_s": ns.overhead_s,
                 "block_s": ns.block_s, **line,
                 # fewer alternating pairs than this per engine: the overhead is noise, not a figure
                 "overhead_quotable": line["pairs"] >= MIN_PAIRS,
                 "overhead_pct_per_engine": [round(p["overhead_pct"], 3) for p in per]})  # fmt: skip
    # -- stages: offered load, backlog, verdict
    srows = sampler.rows
    # the disk's ceiling from this run's probe with as many writers as sidecars
    ceiling = next((p["GBps"] for p in probes if p["writers"] == n_side and p["error"] is None), None)
    for si in range(max(len(r["stages"]) for r in results)):
        st = [r["stages"][si] for r in results if si < len(r["stages"])]
        t0, t1 = min(s["t0"] for s in st), max(s["t1"] for s in st)
        w = _window(srows, t0, t1)
        half = (t0 + t1) / 2
        bl1 = [x["backlog"] for x in w if x["t"] < half]
        bl2 = [x["backlog"] for x in w if x["t"] >= half]
        sg1, sg2 = _staging_at(results, t0, t1)
        room = (w[0]["budget"] if w else 0) + k * (staging_mib << 20)
        growth = (statistics.fmean(bl2) if bl2 else 0) - (statistics.fmean(bl1) if bl1 else 0) + sg2 - sg1
        unguided = sum(s["unguided"] for s in st)
        budget = w[0]["budget"] if w else 1 << 30
        st_max = max((x[1] for r in results for x in r["timeline"] if t0 <= x[0] <= t1), default=0)
        # bounded: not growing, or far from both limits (the sidecar's budget, a recorder's pool)
        far = bool(bl1 + bl2) and max(bl1 + bl2) < budget / 2 and st_max < (staging_mib << 20) / 2
        growth_rate = growth / max((t1 - t0) / 2, 1e-9)  # bytes/s, first half to second
        left = room - max(bl1 + bl2, default=0) - sg2  # room not yet taken at the stage's end
        cpu = (w[-1]["cpu_s"] - w[0]["cpu_s"]) if len(w) > 1 else float("nan")
        span = (w[-1]["t"] - w[0]["t"]) if len(w) > 1 else float("nan")
        disk_w = (w[-1]["disk_w"] - w[0]["disk_w"]) if len(w) > 1 else float("nan")
        disk_rate = disk_w / span / 1e9 if where["disks"] and span == span and span > 0 else None
        offered = sum(s["payload"] for s in st) / (t1 - t0)
        rows.append({**base, "kind": "stage", "stage": si, "forward_ms": st[0]["forward_ms"], "seconds": t1 - t0,
                     "steps_per_engine": statistics.median(s["steps"] for s in st),
                     "offered_GBps": offered / 1e9, "unguided": unguided,
                     "backlog_mean_MiB": statistics.fmean(bl1 + bl2) / 2**20 if w else None,
                     "backlog_max_MiB": max(bl1 + bl2) / 2**20 if w else None,
                     "staging_mean_MiB": (sg1 + sg2) / 2 / 2**20, "backlog_growth_MiB": growth / 2**20,
                     "sidecar_cpu_cores": cpu / span if span == span and span > 0 else None,
                     # all that the disks holding the WALs and the shards took, the line's and anyone's
                     "disk_write_GBps": disk_rate,
                     "disk_of_probe": disk_rate / ceiling if disk_rate is not None and ceiling else None,
                     "engines_cpu_cores": sum(s["cpu_s"] for s in st) / (t1 - t0),
                     "sidecar_rss_max_MiB": max(x["rss_max"] for x in w) / 2**20 if w else None,
                     "sidecar_anon_max_MiB": max(x["anon_max"] for x in w) / 2**20 if w else None,
                     "sidecar_shmem_max_MiB": max(x["shmem_max"] for x in w) / 2**20 if w else None,
                     "commit_p50_ms": statistics.median(s["commit_p50_ms"] for s in st),
                     "commit_p99_ms": max(s["commit_p99_ms"] for s in st),
                     "calls_p99_ms": max(s["calls_p99_ms"] for s in st),
                     "complete": all(s["complete"] for s in st) and len(st) == k,
                     "staging_max_MiB": st_max / 2**20, "far_from_limits": far,
                     "backlog_growth_MiBps": growth_rate / 2**20, "room_left_MiB": left / 2**20,
                     "sustained": unguided == 0 and (far or growth_rate * 60 < left) and all(s["complete"] for s in st)
                     and len(st) == k})  # fmt: skip
    # -- the run: durable rate over all recorded bytes
    t_start2 = min(r["stages"][0]["t0"] for r in results if r["stages"])
    t_flushed = max(r["t_flushed"] for r in results)
    total = sum(r["payload_total"] for r in results)
    rec_bytes = sum(sum(s["payload"] for s in r["stages"]) for r in results)
    rows.append({**base, "kind": "run", "forward_ms_stages": stages, "stage_s": stage_s,
                 "payload_GB": total / 1e9, "sustained_payload_GB": rec_bytes / 1e9,
                 "durable_GBps": rec_bytes / (t_flushed - t_start2) / 1e9 if rec_bytes else 0.0,
                 "flush_lag_s": t_flushed - max(r["t_loop_end"] for r in results),
                 "all_flushed": all(r["flushed"] for r in results), "refused_steps": sum(r["refused"] for r in results),
                 "unguided": sum(r["stats"]["unguided"] for r in results),
                 "unguided_ids": [u for r in results for u in r["unguided_ids"]][:10], "stopped": stopped,
                 "sidecar_cpu_s_total": cpu_total, "sidecar_cpu_s_per_GB": cpu_total / (total / 1e9) if total else None,
                 "sidecar_exit": rc, "sidecar_stop_s": t_stopped - t_stop,
                 "sidecar_rss_max_MiB": max((x["rss_max"] for x in srows if "rss" in x), default=0) / 2**20,
                 "sidecar_anon_max_MiB": max((x["anon_max"] for x in srows if "rss" in x), default=0) / 2**20,
                 "sidecar_shmem_max_MiB": max((x["shmem_max"] for x in srows if "rss" in x), default=0) / 2**20,
                 "sidecars_rss_sum_max_MiB": max((x["rss"] for x in srows if "rss" in x), default=0) / 2**20,
                 "stat_errors": sum(1 for x in srows if "error" in x),
                 # (s, backlog MiB, RSS MiB, of it anonymous MiB, of it shared memory MiB, CPU s), summed over sidecars
                 "sidecar_samples": [(round(x["t"] - t_start2, 2), x["backlog"] >> 20, x["rss"] >> 20,
                                      x["anon"] >> 20, x["shmem"] >> 20, round(x["cpu_s"], 2))
                                     for x in srows if "error" not in x]
                 [:: max(1, len(srows) // 40)],
                 "stager_behind": sum(r["stats"].get("stager_behind", 0) for r in results),
                 "resent": sum(r["stats"]["resent"] for r in results),
                 "chunks": sum(r["stats"]["chunks"] for r in results),
                 "messages": sum(r["stats"]["messages"] for r in results),
                 "tokens_per_chunk": sum(r["payload_total"] // r["step_payload"] * r["batch_sites"]
                                         for r in results) / max(1, sum(r["stats"]["chunks"] for r in results)),
                 "reconnects": sum(r["stats"]["reconnects"] for r in results)})  # fmt: skip
    rows += [{**base, "kind": "disk", **pr} for pr in probes]
    rows += [{**base, "kind": "dashboard", **d} for d in dash_rows]
    if ver:
        rows.append(
            {**base, "kind": "verify", **ver, "reference": "tracestore.fp4.quantize (CPU) of the saved activations"}
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--procs", type=int, nargs="+", default=[1], help="engine processes per run (one run per value)")
    ap.add_argument("--config", choices=sorted(CONFIGS), default="paper")
    ap.add_argument("--model", choices=["moe40", "dense-light", "standin"], default=None,
                    help="GPU forward (default: moe40 for one process on a GPU, else standin)")  # fmt: skip
    ap.add_argument("--record", choices=["slab", "stage"], default="slab", help="CPU only: record_slab or slab_stage")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--sched-us", type=float, default=1000.0, help="the scheduler's Python work per step (target)")
    ap.add_argument("--forward-ms", type=float, nargs="+", default=[8.0],
                    help="stand-in forward time per stage (the first also in phase 1); moe40: ignored (0)")  # fmt: skip
    ap.add_argument("--duration", type=float, default=60.0, help="sustained seconds (one --forward-ms value)")
    ap.add_argument("--stage-s", type=float, default=20.0, help="seconds per stage (several --forward-ms values)")
    ap.add_argument("--overhead-s", type=float, default=20.0, help="phase 1: alternating blocks, seconds")
    ap.add_argument("--block-s", type=float, default=1.0)
    ap.add_argument("--len-min", type=int, default=256, help="sequence lengths (tokens), uniform")
    ap.add_argument("--len-max", type=int, default=2048)
    ap.add_argument("--staging-mib", type=int, default=256, help="each recorder's staging pool")
    ap.add_argument("--linger-s", type=float, default=0.0, help="recorders' linger_s (0: the recorder's default)")
    ap.add_argument("--sidecars", type=int, default=1,
                    help="sidecar processes (engine i records to sidecar i mod N); 0: one per engine")  # fmt: skip
    ap.add_argument("--verify-steps", type=int, default=3, help="sampled steps per engine checked from storage")
    ap.add_argument("--verify-rows", type=int, default=32, help="sequences per sampled step")
    ap.add_argument("--flush-timeout", type=float, default=300.0)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--serve-flag", action="append", default=[], help="extra `tracestore serve` flag (repeat)")
    ap.add_argument("--min-free-gb", type=float, default=8.0, help="stop the engines when the disk gets this full")
    ap.add_argument("--workdir", default=None, help="where the WAL, shards and sockets go (default: a temp dir)")
    ap.add_argument("--storage-dir", default=None,
                    help="put the shards' storage under this directory instead of beside the WALs (e.g. "
                         "/dev/shm: off the WALs' disk, as shards leave a node for object storage)")  # fmt: skip
    ap.add_argument("--disk-probe", type=float, default=0.0, metavar="S",
                    help="first measure the WALs' disk for S seconds each with 1 and with one writer per "
                         "sidecar (O_DIRECT + fdatasync): `disk` rows, the ceiling the line's disk rate is "
                         "compared with")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="~10 s: overhead 4 s, sustained 6 s (CPU development)")
    ap.add_argument("--cpu", action="store_true", help="CPU path even with a GPU")
    ap.add_argument("--graph-on-cpu", action="store_true",
                    help="development: without a GPU, run the GPU path's calls eagerly on the CPU (slow)")  # fmt: skip
    ap.add_argument("--prometheus", default=None, metavar="BIN",
                    help="Prometheus binary ('auto': from PATH): scrape the sidecars and add the Grafana "
                         "dashboard's panels over the sustained window as `dashboard` rows")  # fmt: skip
    ap.add_argument("--label", default="", help="free text stored in every row (e.g. the machine's name)")
    ap.add_argument("--out", default=None, help="append rows to DIR/bench_line.jsonl instead of bench/results/")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--commit", default=os.environ.get("TRACESTORE_BENCH_COMMIT") or git_commit(),
                    help="the code's commit in the rows (default: $TRACESTORE_BENCH_COMMIT, else git)")  # fmt: skip
    ns = ap.parse_args()
    if ns.child:
        engine_process(json.loads(ns.child))
        return 0
    import torch

    device = "cuda" if torch.cuda.is_available() and not ns.cpu else "cpu"
    if ns.quick:
        ns.overhead_s, ns.block_s, ns.duration, ns.stage_s = 4.0, 0.5, 6.0, 6.0 / len(ns.forward_ms)
    if ns.prometheus == "auto":
        ns.prometheus = shutil.which("prometheus") or ap.error("--prometheus auto: no prometheus on PATH")
    LineDashboard(ns.prometheus, Path(tempfile.gettempdir()))  # a missing binary or panel fails now, not after a run
    m = machine()
    if ns.graph_on_cpu and device == "cuda":
        raise SystemExit("--graph-on-cpu is for machines without a GPU")
    print(f"# {m.get('gpu', 'no GPU')} | {m.get('cpu')} ({m.get('cores')} cores) | torch {m.get('torch')} | "
          f"commit {ns.commit} | device {device}", flush=True)  # fmt: skip
    if ns.out:
        import common

        common.RESULTS = Path(ns.out)
    for k in ns.procs:
        ns_k = argparse.Namespace(**vars(ns))
        ns_k.procs = k
        if ns_k.model is None:
            ns_k.model = "moe40" if device == "cuda" and k == 1 and ns.config == "paper" else "standin"
        if device == "cuda" and ns_k.model != "standin":
            ns_k.forward_ms = [0.0]
        print(f"# run: K={k} {ns.config} model={ns_k.model if device == 'cuda' or ns.graph_on_cpu else 'cpu-ring'} "
              f"forward_ms={ns_k.forward_ms}", flush=True)  # fmt: skip
        try:
            got = run_once(ns_k, device)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - one failed K is a row, the others still run
            got = [{"config": ns.config, "procs": k, "kind": "error", "error": f"{type(exc).__name__}: {exc}"[:500]}]
            print(got[0]["error"], flush=True)
        for r in got:
            r["label"] = ns.label
        print_table([r for r in got if r["kind"] == "line"], ["procs", "model", "forward_ms", "rec_ms", "norec_ms",
              "overhead_pct", "pairs", "overhead_quotable", "sched_norec_ms", "commit_p50_ms", "commit_p99_ms",
              "calls_p99_ms"])  # fmt: skip
        print_table([r for r in got if r["kind"] == "stage"], ["procs", "stage", "forward_ms", "offered_GBps",
              "unguided", "backlog_max_MiB", "staging_mean_MiB", "backlog_growth_MiB", "sidecar_cpu_cores",
              "engines_cpu_cores", "disk_write_GBps", "sidecar_rss_max_MiB", "sidecar_anon_max_MiB",
              "sidecar_shmem_max_MiB", "sustained"])  # fmt: skip
        print_table([r for r in got if r["kind"] in ("run", "verify")], ["procs", "kind", "durable_GBps",
              "flush_lag_s", "unguided", "sidecar_cpu_s_total", "sidecar_cpu_s_per_GB", "tokens_per_chunk",
              "site_rows_checked",
              "site_rows_mismatched"])  # fmt: skip
        print_table([r for r in got if r["kind"] == "dashboard"], ["procs", "panel", "unit", "series",
              "node_samples", "node_first_third_mean", "node_last_third_mean", "node_max", "node_slope_per_s",
              "flat", "error"])  # fmt: skip
        if not ns.no_save:  # after each run: a later run that is cut off loses only its own rows
            print(f"appended {len(got)} rows to {append_results('bench_line', got)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
