"""The production line's costs on a GPU: the engine-thread time of recording a decode step, the
overhead of recording inside a CUDA-graph-replayed decode loop, and a training step with guided FP4.

Run on a GPU machine: ``python bench/bench_production.py`` (prints a table, appends rows to
``bench/results/bench_production.jsonl``). Every number has its baseline from the same run:

1. ``host``: engine-thread time per decode step (256 sequences x 20 sites of width 2048, NVFP4
   b = 1) of ``RolloutRecorder.record_slab`` (one slab), of ``SlabStage.commit`` (the graph form's
   bookkeeping; by default its copies deferred to the stage's stager thread, and ``not deferred``:
   all of it on the engine thread), each with its copies through the CUDA driver (the default,
   client/record/_cuda.py) and
   through torch, with the segments as a list of tuples or as ``Segments`` (column form, built
   inside the timed call from the engine's positions array), with and without the sender thread
   beside it (``connect=False``: nothing drains the recorder), and, as the baseline, of
   ``record_forward`` with the same rows as 20 ``SiteOutput`` slab slices; a real sidecar over
   the unix socket drains the recorder meanwhile (its sender thread shares the GIL), each call
   timed with ``perf_counter`` after the step's kernels; between calls the engine thread sleeps
   ``--step-ms`` (8 ms: the MoE decode step) as it would wait on the GPU.
2. ``decode``: a decode loop replaying one CUDA graph per step (the 40-layer MoE step of
   bench_kernels, a 24-layer dense step: hidden 4096, FFN 14336, GQA 32/8 heads, a light one:
   hidden 2048, FFN 8192, 16/4 heads, and a lighter one: hidden 1536, FFN 6144, 12/4 heads), without
   records, with the 20 record kernels only, and with record kernels + ``SlabStage.capture()`` in
   the graph and ``commit`` after each replay (staging copies on the side stream); both again with
   the record kernels forked onto a ``kernels.RecordBranch`` (a parallel branch of the graph beside
   the engine's next kernels, joined before the slab is staged). Overhead =
   (loop time per step with recording - without) / without, CUDA events around the loop. Before
   timing, 8 steps check that the pinned staging holds each step's slab rows bit for bit.
3. ``train``: one training step (forward, backward, AdamW step) of a transformers MoE model with
   the public hook, guided FP4 (``kernels.guided_fp4``) at 20 sites vs RTN (``kernels.rtn_fp4``)
   at the same sites, and the same step with the hooks off; blocks of ``--train-block`` steps per
   variant with CUDA events, the variants' order alternating between rounds, median per step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/common.py; `bench` is no package name of ours

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import append_results, print_table  # noqa: E402
from tracestore.client import GuidedFP4Hooks, RolloutRecorder, Segments, SiteOutput  # noqa: E402

import tracestore.kernels as K  # noqa: E402
from tracestore.guidance import Guidance  # noqa: E402
from tracestore.kernels.testing import capture_graph  # noqa: E402
from tracestore.records import RunSpec, SiteSpec  # noqa: E402

SITES = 20


def decode_spec(width: int) -> RunSpec:
    return RunSpec("bench", tuple(SiteSpec(f"layers.{i}.mlp.input", "moe_input", i, width) for i in range(SITES)))


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


# ------------------------------------------------------------------------------------ 1. host time


def host_time(args: argparse.Namespace, rows: list[dict]) -> None:
    from tracestore.server.testing import ServeProcess

    batch, width = 256, 2048
    spec = decode_spec(width)
    slab = K.RecordSlab.allocate(spec.sites, batch, "cuda")
    x = torch.randn(batch, width, device="cuda", dtype=torch.bfloat16)
    g = torch.full((1,), 0.01, device="cuda")

    def kernels() -> None:
        for s in spec.sites:
            K.record_from_activations(x, s, slab[s.name], global_scale=g)

    kernels()
    torch.cuda.synchronize()
    outputs = {
        s.name: SiteOutput(slab[s.name].codes, slab[s.name].scales, slab[s.name].global_scale[:1]) for s in spec.sites
    }
    flags = ["--flush-interval", "0.2"]
    with tempfile.TemporaryDirectory() as tmp, ServeProcess(tmp, wal=False, unix_socket=True, flags=flags) as sp:
        from tracestore.client.record import _cuda

        variants = (
            "record_forward (baseline, 20 SiteOutputs)",
            "record_slab, torch copies",
            "record_slab",
            "record_slab, no sender thread (the call alone)",
            "record_slab, Segments (column form)",
            "record_slab, Segments, no sender thread",
            "SlabStage.commit, torch copies",
            "SlabStage.commit, not deferred",
            "SlabStage.commit, Segments, not deferred",
            "SlabStage.commit",
            "SlabStage.commit, Segments (column form)",
            "SlabStage.commit, Segments, no sender thread",
        )
        for v, label in enumerate(variants):
            # each variant its own writer and trajectories (a trajectory belongs to the writer that wrote it)
            # 1 GiB of staging: the sidecar's ingest (~16 ms CPU per 256 x 20 step) need not keep up
            _cuda._DRIVER[:] = [None] if "torch copies" in label else []  # the copy path (default: the driver's)
            alone = "no sender" in label  # nothing drains it: what the call costs without a thread beside it
            rec = RolloutRecorder(sp.unix_address, spec, writer=f"bench-{v}", staging_bytes=1 << 30, connect=not alone)
            trajs = [f"v{v}-t{i}" for i in range(batch)]
            columns = "Segments" in label  # built inside the timed call from the engine's positions array
            ids = tuple(trajs)
            deferred = "not deferred" not in label
            stage = rec.slab_stage(slab, deferred=deferred) if label.startswith("SlabStage") else None
            times: list[float] = []
            refused = 0
            for step in range(args.host_steps):
                time.sleep(args.step_ms / 1e3)  # the engine waits on its decode step's GPU work
                kernels()
                if stage is not None:
                    stage.capture()
                torch.cuda.current_stream().synchronize()  # the engine thread comes back after its step
                segs: Any = [(t, step, step + 1) for t in trajs]
                positions = np.full(batch, step, np.int64)
                t0 = time.perf_counter()
                if columns:
                    segs = Segments.decode(ids, positions)
                if stage is not None:
                    ok = stage.commit(segs)
                elif label.startswith("record_slab"):
                    ok = rec.record_slab(segs, slab)
                else:
                    ok = rec.record_forward(segs, outputs)
                times.append((time.perf_counter() - t0) * 1e3)
                refused += not ok
            flushed = rec.flush(timeout=120) if not alone else None
            rec.close()
            t = times[args.host_steps // 10 :]  # first steps: pinning, CUDA stream set-up
            r = {
                "kernel": f"host time per decode step {batch}x{SITES} sites w={width}",
                "provider": label,
                "median_ms": statistics.median(t),
                "p90_ms": pct(t, 90),
                "p99_ms": pct(t, 99),
                "steps": len(t),
                "refused_steps": refused,
                "flushed": flushed,
                "driver_copies": rec.stats["driver_copies"],
                "stager_behind": rec.stats["stager_behind"],
                "refused_forwards": rec.stats["refused_forwards"],  # deferred commits are refused after the call
            }
            print(
                f"  {label:44s} median {r['median_ms']:.4f} ms  p90 {r['p90_ms']:.4f}  p99 {r['p99_ms']:.4f}"
                f"  refused {refused}"
            )
            rows.append(r)


# ------------------------------------------------------------------------------------ 2. decode loop


class MoEStep:
    """bench_kernels' synthetic 40-layer MoE decode step (records on the MoE input of the last 20)."""

    layers, hidden, experts, inter, topk = 40, 2048, 64, 768, 8

    def __init__(self, batch: int) -> None:
        dev, dt = "cuda", torch.bfloat16
        torch.manual_seed(0)
        L, H, E, Fi = self.layers, self.hidden, self.experts, self.inter
        self.batch, self.per_e = batch, batch * self.topk // E
        self.w_qkv = [torch.randn(H, H + 1024, device=dev, dtype=dt) * 0.02 for _ in range(L)]
        self.w_o = [torch.randn(H, H, device=dev, dtype=dt) * 0.02 for _ in range(L)]
        self.w_up = [torch.randn(E, H, 2 * Fi, device=dev, dtype=dt) * 0.02 for _ in range(L)]
        self.w_dn = [torch.randn(E, Fi, H, device=dev, dtype=dt) * 0.02 for _ in range(L)]
        self.x0 = torch.randn(batch, H, device=dev, dtype=dt)
        self.width = H

    def __call__(self, record: Any) -> None:
        h = self.x0
        H, Fi = self.hidden, self.inter
        for i in range(self.layers):
            h = h + (h @ self.w_qkv[i])[:, :H] @ self.w_o[i]
            if record is not None and i >= self.layers - SITES:
                record(i - (self.layers - SITES), h)
            t = h.repeat(self.topk, 1).view(self.experts, self.per_e, H)
            u = torch.bmm(t, self.w_up[i])
            y = torch.bmm(torch.nn.functional.silu(u[..., :Fi]) * u[..., Fi:], self.w_dn[i])
            h = h + y.view(self.topk, self.batch, H).sum(0)


class DenseStep:
    """A 24-layer dense decode step: hidden 4096, FFN 14336 (SwiGLU), GQA 32 query / 8 K/V heads of
    128 (weights streamed as in decode); records on the MLP input of the last 20 layers. The light
    step (``light="light"``): hidden 2048, FFN 8192, 16 / 4 heads of 128 (a ~1.5B model; about 1.9 ms
    per step at batch 256 on an H200), where the recording's fixed costs weigh most; the lighter one
    (``light="lighter"``): hidden 1536, FFN 6144, 12 / 4 heads (a ~1B model, the
    lightest step whose recording overhead we report)."""

    layers, hidden, inter, kv = 24, 4096, 14336, 1024

    SHAPES = {"light": (2048, 8192, 512), "lighter": (1536, 6144, 512)}

    def __init__(self, batch: int, light: str | None = None) -> None:
        dev, dt = "cuda", torch.bfloat16
        torch.manual_seed(0)
        if light:
            self.hidden, self.inter, self.kv = self.SHAPES[light]
        L, H, Fi = self.layers, self.hidden, self.inter
        self.w_qkv = [torch.randn(H, H + 2 * self.kv, device=dev, dtype=dt) * 0.02 for _ in range(L)]
        self.w_o = [torch.randn(H, H, device=dev, dtype=dt) * 0.02 for _ in range(L)]
        self.w_up = [torch.randn(H, 2 * Fi, device=dev, dtype=dt) * 0.01 for _ in range(L)]
        self.w_dn = [torch.randn(Fi, H, device=dev, dtype=dt) * 0.01 for _ in range(L)]
        self.x0 = torch.randn(batch, H, device=dev, dtype=dt)
        self.width = H

    def __call__(self, record: Any) -> None:
        h = self.x0
        H, Fi = self.hidden, self.inter
        for i in range(self.layers):
            h = h + (h @ self.w_qkv[i])[:, :H] @ self.w_o[i]
            if record is not None and i >= self.layers - SITES:
                record(i - (self.layers - SITES), h)
            u = h @ self.w_up[i]
            h = h + (torch.nn.functional.silu(u[:, :Fi]) * u[:, Fi:]) @ self.w_dn[i]


def capture(fn: Any) -> torch.cuda.CUDAGraph:
    return capture_graph(fn, warmup=2)


def decode_loop(name: str, model: Any, args: argparse.Namespace, rows: list[dict]) -> None:
    batch = args.batch
    spec = decode_spec(model.width)
    slab = K.RecordSlab.allocate(spec.sites, batch, "cuda")
    g = torch.full((1,), 0.01, device="cuda")
    sites = spec.sites

    def record(j: int, h: torch.Tensor) -> None:
        K.record_from_activations(h, sites[j], slab[sites[j].name], global_scale=g)

    branch = K.RecordBranch("cuda")

    def record_on_branch(j: int, h: torch.Tensor) -> None:
        with branch.fork(h):  # beside the engine's next kernels: a parallel branch of the graph
            record(j, h)

    # connect=False: no sender, so the staged raw rows stay in the pool for the bit-for-bit check
    rec = RolloutRecorder("127.0.0.1:1", spec, writer="bench", connect=False, staging_bytes=1 << 30)
    stage = rec.slab_stage(slab)

    def with_stage(rec_fn: Any) -> None:
        model(rec_fn)
        stage.capture()  # joins the branch first (a no-op without one)

    def branch_only() -> None:
        model(record_on_branch)
        branch.join()

    graphs = {
        "no records": capture(lambda: model(None)),
        "record kernels only": capture(lambda: model(record)),
        "record kernels + staging (graph) + commit": capture(lambda: with_stage(record)),
        "record kernels on a branch only": capture(branch_only),
        "record kernels on a branch + staging (graph) + commit": capture(lambda: with_stage(record_on_branch)),
    }
    ids = tuple(f"t{i}" for i in range(batch))
    positions = np.zeros(batch, np.int64)  # the engine's positions, advanced in place each step
    exact: dict[str, bool] = {}
    row_bytes = slab.row_bytes
    for label, graph in graphs.items():
        if not label.endswith("commit"):
            continue
        # bit-for-bit: each step's staged bytes against a snapshot of the slab taken after its replay
        snaps = []
        for _step in range(8):
            model.x0.normal_()
            graph.replay()
            stage.commit(Segments.decode(ids, positions))
            positions += 1
            snaps.append(slab.data[:batch].clone())
        rec._drain_stages()  # the stager's pending copies queued (what finish() and flush() do)
        offs = [fwd.staged[0][1] for fwd in list(rec._queue)[-8:]]
        torch.cuda.synchronize()
        exact[label] = all(
            bytes(rec._np[o : o + batch * row_bytes]) == s.cpu().numpy().tobytes()
            for o, s in zip(offs, snaps, strict=True)
        )
        print(f"  {name}: {label}: staged bytes equal the slab bit for bit over 8 steps: {exact[label]}")
        for fwd in list(rec._queue):
            rec.pool.release(fwd.region.offset)
        rec._queue.clear()
    per_step: dict[str, list[float]] = {k: [] for k in graphs}
    for _rep in range(args.reps):
        for label, graph in graphs.items():
            commit = label.endswith("commit")
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _step in range(args.steps):
                graph.replay()
                if commit:
                    stage.commit(Segments.decode(ids, positions))
                    positions += 1
            b.record()
            b.synchronize()
            per_step[label].append(a.elapsed_time(b) / args.steps)
            if commit:
                rec._drain_stages()
                for fwd in list(rec._queue):
                    rec.pool.release(fwd.region.offset)
                rec._queue.clear()
    base = statistics.median(per_step["no records"])
    for label, ts in per_step.items():
        med = statistics.median(ts)
        r = {
            "kernel": f"{name} decode loop b={batch} {SITES} sites",
            "provider": label,
            "median_ms": med,
            "min_ms": min(ts),
            "max_ms": max(ts),
            "baseline_ms": base,
            "overhead_%": 100 * (med - base) / base,
            "staged_bytes_exact": exact.get(label),
            "slab_bytes_per_step": batch * row_bytes,
            "stager_behind": rec.stats["stager_behind"] if label.endswith("commit") else None,
            "refused_forwards": rec.stats["refused_forwards"] if label.endswith("commit") else None,
        }
        print(f"  {name:6s} {label:54s} {med:8.4f} ms/step  overhead {r['overhead_%']:6.3f}%")
        rows.append(r)
    rec.close(timeout=0)


# ------------------------------------------------------------------------------------ 3. training


def train_step(args: argparse.Namespace, rows: list[dict]) -> None:
    from tracestore.demo.model import ModelSpec, build_model
    from tracestore.formats import NVFP4, packed_row_bytes

    spec = ModelSpec("qwen3_moe", layers=7, hidden=2048, heads=16, kv_heads=4, experts=8, top_k=2,
                     expert_hidden=1024, vocab=32000)  # fmt: skip
    model = build_model(spec, dtype=torch.bfloat16, device="cuda", seed=0).train()
    b, t = args.train_batch, args.train_len
    ids = torch.randint(3, spec.vocab, (b, t), device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    hooks = GuidedFP4Hooks(model, "nvfp4")
    sites = hooks.sites[:SITES]
    n = b * t
    gen = torch.Generator(device="cuda").manual_seed(1)
    guidance = {
        s.name: Guidance(
            torch.randint(0, 256, (n, packed_row_bytes(s.width, 1)), dtype=torch.uint8, device="cuda", generator=gen),
            torch.randint(40, 90, (n, s.width // 16), dtype=torch.uint8, device="cuda", generator=gen),
            torch.full((n,), 0.01, device="cuda"),
            1,
            NVFP4,
            valid=torch.ones(n, dtype=torch.bool, device="cuda"),
        )
        for s in sites
    }
    names = [s.name for s in sites]
    hooks.remove()
    hooks = GuidedFP4Hooks(model, "nvfp4", sites=names)
    variants: dict[str, dict[str, Guidance] | None] = {
        "hooks attached, no FP4": None,
        "RTN at 20 sites (rtn_fp4)": {},
        "guided at 20 sites (guided_fp4)": guidance,
    }
    times: dict[str, list[float]] = {k: [] for k in variants}

    def step() -> None:
        logits = model(input_ids=ids, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    # blocks of --train-block steps per variant, the variants' order alternating between rounds; round 0 warms up
    for rnd in range(args.train_reps + 1):
        for label in list(variants) if rnd % 2 == 0 else list(reversed(variants)):
            gd = variants[label]
            hooks.rtn = gd is not None  # hooks attached either way; off: every site passes through
            hooks.set_guidance(gd or {})
            a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            for _ in range(args.train_block):
                step()
            e.record()
            e.synchronize()
            if rnd:
                times[label].append(a.elapsed_time(e) / args.train_block)
    hooks.remove()
    base = statistics.median(times["RTN at 20 sites (rtn_fp4)"])
    for label, ts in times.items():
        med = statistics.median(ts)
        r = {
            "kernel": f"train step qwen3_moe h=2048 7L E=8 top2, {b}x{t} tokens, AdamW",
            "provider": label,
            "median_ms": med,
            "min_ms": min(ts),
            "max_ms": max(ts),
            "baseline_ms": base,
            "ratio_vs_rtn": med / base,
        }
        print(f"  {label:36s} {med:8.3f} ms/step  x{r['ratio_vs_rtn']:.4f} of RTN")
        rows.append(r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--host-steps", type=int, default=300)
    ap.add_argument("--step-ms", type=float, default=8.0, help="decode step time the host bench waits per step")
    ap.add_argument("--steps", type=int, default=50, help="decode steps per timed loop")
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--train-batch", type=int, default=8)
    ap.add_argument("--train-len", type=int, default=1024)
    ap.add_argument("--train-reps", type=int, default=8)
    ap.add_argument("--train-block", type=int, default=3)
    ap.add_argument("--only", default="host,moe,dense,light,lighter,train")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_production needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    rows: list[dict] = []
    only = set(args.only.split(","))
    for part, fn in (
        ("host", lambda: host_time(args, rows)),
        ("moe", lambda: decode_loop("moe40", MoEStep(args.batch), args, rows)),
        ("dense", lambda: decode_loop("dense24", DenseStep(args.batch), args, rows)),
        ("light", lambda: decode_loop("dense24-light", DenseStep(args.batch, light="light"), args, rows)),
        ("lighter", lambda: decode_loop("dense24-lighter", DenseStep(args.batch, light="lighter"), args, rows)),
        ("train", lambda: train_step(args, rows)),
    ):
        if part in only:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - report and go on to the next part
                import traceback

                traceback.print_exc(limit=4)
                rows.append({"kernel": part, "provider": "error", "error": f"{type(exc).__name__}: {exc}"[:300]})
            torch.cuda.empty_cache()
    print()
    print_table(rows, ["kernel", "provider", "median_ms", "baseline_ms", "overhead_%", "ratio_vs_rtn", "p99_ms"])
    if not args.no_save:
        extra = {"code_commit": os.environ.get("TRACESTORE_BENCH_COMMIT")}
        path = append_results("bench_production", [{**r, **extra} for r in rows])
        print(f"appended {len(rows)} rows to {path}")


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"bench_production done in {time.time() - t0:.0f} s")
