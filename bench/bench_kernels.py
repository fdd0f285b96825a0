"""GPU kernel bandwidth: record capture and guided rounding vs the device-to-device copy ceiling.

Run on a GPU machine: ``python bench/bench_kernels.py`` (prints a table, appends rows to
``bench/results/bench_kernels.jsonl``). Providers side by side: ours (CuPy CUDA kernels), the
torch reference under ``torch.compile``, torchao's ``nvfp4_quantize`` eager and compiled (if
importable). GB/s counts bytes read plus written once each; ``%copy`` is against the copy
ceiling measured in the same process. Each time is the median of ``--reps`` runs of a CUDA graph
holding ``--per-graph`` back-to-back calls (launch overhead excluded) unless marked ``loop``
(CUDA events around back-to-back eager calls). Last: the share of a CUDA-graph-replayed decode
step of a synthetic MoE layer stack spent in record kernels.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/common.py; `bench` is no package name of ours

import torch  # noqa: E402
from common import append_results, print_table  # noqa: E402

import tracestore.kernels as K  # noqa: E402
import tracestore.kernels.guided as KG  # noqa: E402
import tracestore.kernels.record as KR  # noqa: E402
from tracestore.formats import MXFP4, NVFP4  # noqa: E402
from tracestore.fp4 import quantize  # noqa: E402
from tracestore.guidance import Guidance  # noqa: E402
from tracestore.guided import guided_round  # noqa: E402
from tracestore.kernels.testing import capture_graph  # noqa: E402
from tracestore.layouts import swizzle_scales  # noqa: E402
from tracestore.packing import pack_bits, pack_fp4  # noqa: E402
from tracestore.records import SiteSpec  # noqa: E402


def events_ms(fn: Callable[[], Any], reps: int, inner: int) -> list[float]:
    """Per-call ms of ``inner`` back-to-back calls between two CUDA events, ``reps`` times."""
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / inner)
    return out


def graph_ms(fn: Callable[[], Any], reps: int, inner: int) -> list[float]:
    """Per-call ms of a CUDA graph holding ``inner`` calls of ``fn`` (warmed up on a side stream)."""
    g = capture_graph(fn, warmup=2, inner=inner)
    g.replay()
    torch.cuda.synchronize()
    return [t / inner for t in events_ms(g.replay, reps, 1)]


def row(name: str, provider: str, times: list[float], nbytes: float, ceiling: float | None, **extra: Any) -> dict:
    med = statistics.median(times)
    gbs = nbytes / (med * 1e-3) / 1e9
    r = {
        "kernel": name,
        "provider": provider,
        "median_ms": med,
        "min_ms": min(times),
        "max_ms": max(times),
        "GB/s": gbs,
        "%copy": 100 * gbs / ceiling if ceiling else None,
        "bytes": nbytes,
        **extra,
    }
    print(
        f"  {name:34s} {provider:28s} {med:9.4f} ms  {gbs:8.0f} GB/s" + (f"  {r['%copy']:.1f}%" if ceiling else ""),
        flush=True,
    )
    return r


def safe(label: str, fn: Callable[[], dict | None], rows: list[dict]) -> None:
    try:
        r = fn()
        if r is not None:
            rows.append(r)
    except Exception as exc:  # noqa: BLE001 - a peer that fails is reported, not fatal
        traceback.print_exc(limit=3)
        rows.append({"kernel": label, "provider": "error", "error": f"{type(exc).__name__}: {exc}"[:300]})


def moe_step_share(args: argparse.Namespace, rows: list[dict]) -> None:
    """Decode step of a synthetic MoE stack (balanced routing: every expert gets batch*topk/experts
    tokens), records on the MoE input of the last ``recorded`` layers, replayed as one CUDA graph."""
    layers, recorded, hidden, experts, inter, topk, batch = 40, 20, 2048, 64, 768, 8, args.moe_batch
    per_e = batch * topk // experts
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    w_qkv = [torch.randn(hidden, hidden + 1024, device=dev, dtype=dt) * 0.02 for _ in range(layers)]
    w_o = [torch.randn(hidden, hidden, device=dev, dtype=dt) * 0.02 for _ in range(layers)]
    w_up = [torch.randn(experts, hidden, 2 * inter, device=dev, dtype=dt) * 0.02 for _ in range(layers)]
    w_dn = [torch.randn(experts, inter, hidden, device=dev, dtype=dt) * 0.02 for _ in range(layers)]
    x0 = torch.randn(batch, hidden, device=dev, dtype=dt)
    site = SiteSpec("layers.moe.input", "moe_input", 0, hidden, "nvfp4", 1)
    slabs = [K.RecordBuffer.allocate(site, 4 * batch, dev) for _ in range(recorded)]
    g = torch.full((1,), 0.01, device=dev)

    def step(record: bool) -> None:
        h = x0
        for i in range(layers):
            h = h + (h @ w_qkv[i])[:, :hidden] @ w_o[i]  # attention stand-in (weights streamed like decode)
            if record and i >= layers - recorded:
                K.record_from_activations(h, site, slabs[i - (layers - recorded)], row_offset=batch, global_scale=g)
            t = h.repeat(topk, 1).view(experts, per_e, hidden)  # balanced routing: per_e tokens per expert
            u = torch.bmm(t, w_up[i])
            y = torch.bmm(torch.nn.functional.silu(u[..., :inter]) * u[..., inter:], w_dn[i])
            h = h + y.view(topk, batch, hidden).sum(0)

    t_with = graph_ms(lambda: step(True), args.reps, 1)
    t_without = graph_ms(lambda: step(False), args.reps, 1)
    h = torch.randn(batch, hidden, device=dev, dtype=dt)

    def rec_only() -> None:
        for j in range(recorded):
            K.record_from_activations(h, site, slabs[j], row_offset=batch, global_scale=g)

    t_rec = graph_ms(rec_only, args.reps, 1)
    mw, mo, mr = statistics.median(t_with), statistics.median(t_without), statistics.median(t_rec)
    r = {
        "kernel": f"moe_decode_step b={batch} {layers}L/{recorded}rec E={experts} top{topk}",
        "provider": "cuda-graph",
        "step_ms_with_records": mw,
        "step_ms_without": mo,
        "records_only_ms": mr,
        "share_records_only_%": 100 * mr / mw,
        "share_step_delta_%": 100 * (mw - mo) / mw,
        "median_ms": mw,
    }
    print(
        f"  MoE decode step: {mw:.3f} ms with records, {mo:.3f} ms without; the {recorded} record kernels "
        f"alone {mr * 1000:.1f} us = {r['share_records_only_%']:.2f}% of the step "
        f"(step delta {r['share_step_delta_%']:.2f}%)",
        flush=True,
    )
    rows.append(r)


def copy_ceiling(reps: int, rows: list[dict]) -> float:
    """Device-to-device copy of 1 GiB, GB/s counting bytes read + written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    tc = events_ms(lambda: dst.copy_(src), reps, 10)
    ceiling = 2 * src.numel() / (statistics.median(tc) * 1e-3) / 1e9
    rows.append(row("d2d copy 1 GiB", "torch copy_", tc, 2 * src.numel(), None))
    print(f"  copy ceiling {ceiling:.0f} GB/s", flush=True)
    return ceiling


def run_kernels(args: argparse.Namespace, ceiling: float, rows: list[dict]) -> None:
    n, d, reps, inner = args.rows, args.width, args.reps, args.per_graph
    dev = "cuda"
    x = (torch.randn(n, d, device=dev) * 2).to(torch.bfloat16)
    g = torch.full((1,), 0.002, device=dev)
    site1 = SiteSpec("s", "moe_input", 0, d, "nvfp4", 1)
    msite1 = SiteSpec("s", "moe_input", 0, d, "mxfp4", 1)
    out = K.RecordBuffer.allocate(site1, n, dev, with_fp4=True)
    out_nofp4 = K.RecordBuffer(out.codes, out.scales, out.global_scale)
    mout = K.RecordBuffer.allocate(msite1, n, dev)
    site4 = SiteSpec("s", "moe_input", 0, d, "nvfp4", 4)  # the paper's full-information records
    out4 = K.RecordBuffer.allocate(site4, n, dev)
    rec_bytes = n * d * 2 + n * d // 8 + n * d // 16 + 4 * n

    def ours(fn: Callable[[], Any], name: str, nbytes: float, provider: str = "ours (CuPy CUDA)") -> None:
        safe(name, lambda: row(name, provider + " graph", graph_ms(fn, reps, inner), nbytes, ceiling), rows)
        safe(name, lambda: row(name, provider + " loop", events_ms(fn, reps, inner), nbytes, ceiling), rows)

    ours(
        lambda: K.record_from_activations(x, site1, out_nofp4, global_scale=g),
        "record_from_activations nvfp4 b=1",
        rec_bytes,
    )
    default_rg, default_gg = KR.BLOCKS_PER_THREAD, KG.BLOCKS_PER_THREAD
    default_rv = KR.RECORD_VARIANT
    for variant in KR.RECORD_VARIANTS:  # per-element formulations (V in kernels/_source_record.py)
        KR.RECORD_VARIANT = variant
        for group in (1, 2, 4):  # scale blocks per thread
            KR.BLOCKS_PER_THREAD = group
            ours(
                lambda: K.record_from_activations(x, site1, out_nofp4, global_scale=g),
                f"record_from_activations nvfp4 b=1 [V{variant} {group} blk/thr]",
                rec_bytes,
            )
        KR.BLOCKS_PER_THREAD = default_rg
        ours(
            lambda: K.record_from_activations(x, site4, out4, global_scale=g),
            f"record_from_activations nvfp4 b=4 [V{variant}]",
            n * d * 2 + n * d // 2 + n * d // 16 + 4 * n,
        )
        ours(
            lambda: K.record_from_activations(x, site1, out, global_scale=g),
            f"record_from_activations nvfp4 b=1 +fp4 [V{variant}]",
            rec_bytes + n * d // 2,
        )
        ours(
            lambda: K.record_from_activations(x, msite1, mout),
            f"record_from_activations mxfp4 b=1 [V{variant}]",
            n * d * 2 + n * d // 8 + n * d // 32 + 4 * n,
        )
    KR.RECORD_VARIANT = default_rv  # (the default's rows are the [V{default}] ones above)
    gbuf = torch.zeros(1, device=dev)
    ours(lambda: K.compute_global_scale(x, gbuf), "compute_global_scale (amax)", n * d * 2)

    q = quantize(x, NVFP4, g.reshape(()))
    packed, scales = pack_fp4(q.codes), q.scales.contiguous()
    swz = swizzle_scales(scales)
    del q
    codes_bytes = n * d // 2 + n * d // 16 + n * d // 8 + n * d // 16 + 4 * n
    ours(
        lambda: K.record_from_codes(packed, scales, site1, out_nofp4, global_scale=g),
        "record_from_codes nvfp4 b=1 rowmajor",
        codes_bytes,
    )
    ours(
        lambda: K.record_from_codes(packed, swz, site1, out_nofp4, global_scale=g, scale_layout="swizzled128x4"),
        "record_from_codes nvfp4 b=1 swizzled",
        codes_bytes,
    )

    # guided rounding: training x = rollout x with 2% relative noise
    xt = (x.float() * (1 + 0.02 * torch.randn(n, d, device=dev))).to(torch.bfloat16)
    K.record_from_activations(x, site1, out_nofp4, global_scale=g)
    gd = Guidance(out.codes, out.scales, out.global_scale, 1, NVFP4)
    g_bytes = 2 * n * d * 2 + n * d // 8 + n * d // 16 + 4 * n
    for table in (False, True):
        KG._TABLE_B1 = table
        label = "table kernel" if table else "b1 kernel"
        ours(lambda: K.guided_fp4(xt, gd), f"guided_fp4 fwd nvfp4 b=1 ({label})", g_bytes)
    KG._TABLE_B1 = False
    for group in (1, 2, 4):
        KG.BLOCKS_PER_THREAD = group
        ours(lambda: K.guided_fp4(xt, gd), f"guided_fp4 fwd nvfp4 b=1 [{group} blk/thr]", g_bytes)
    KG.BLOCKS_PER_THREAD = default_gg
    gd2 = Guidance(out.codes, out.scales, out.global_scale, 1, NVFP4, "paper")
    ours(lambda: K.guided_fp4(xt, gd2), "guided_fp4 fwd nvfp4 b=1 paper (table)", g_bytes)
    ours(lambda: K.rtn_fp4(xt, "nvfp4", g), "rtn_fp4 fwd nvfp4", 2 * n * d * 2)
    mgd = Guidance(mout.codes, mout.scales, 1.0, 1, MXFP4)
    K.record_from_activations(x, msite1, mout)
    ours(lambda: K.guided_fp4(xt, mgd), "guided_fp4 fwd mxfp4 b=1", 2 * n * d * 2 + n * d // 8 + n * d // 32)

    # peers
    if not args.no_compile:

        def ref_record(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            qq = quantize(a, NVFP4, g.reshape(()))
            return pack_bits(qq.codes, 1), qq.scales

        cref = torch.compile(ref_record)
        safe(
            "record_from_activations nvfp4 b=1",
            lambda: row(
                "record_from_activations nvfp4 b=1",
                "torch.compile(reference) loop",
                events_ms(lambda: cref(x), reps, 5),
                rec_bytes,
                ceiling,
            ),
            rows,
        )

        def ref_guided(a: torch.Tensor) -> torch.Tensor:
            return guided_round(a, out.codes, out.scales, out.global_scale, 1, NVFP4, "bracket")

        cg = torch.compile(ref_guided)
        safe(
            "guided_fp4 fwd nvfp4 b=1",
            lambda: row(
                "guided_fp4 fwd nvfp4 b=1",
                "torch.compile(reference) loop",
                events_ms(lambda: cg(xt), reps, 5),
                g_bytes,
                ceiling,
            ),
            rows,
        )
    try:
        from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize

        pts = torch.tensor(0.002, device=dev)
        q_bytes = n * d * 2 + n * d // 2 + n * d // 16
        safe(
            "nvfp4 quantize (codes + scales)",
            lambda: row(
                "nvfp4 quantize (codes + scales)",
                "torchao eager loop",
                events_ms(lambda: nvfp4_quantize(x, 16, pts), reps, 5),
                q_bytes,
                ceiling,
            ),
            rows,
        )
        if not args.no_compile:
            ctao = torch.compile(nvfp4_quantize)
            safe(
                "nvfp4 quantize (codes + scales)",
                lambda: row(
                    "nvfp4 quantize (codes + scales)",
                    "torchao torch.compile loop",
                    events_ms(lambda: ctao(x, 16, pts), reps, 5),
                    q_bytes,
                    ceiling,
                ),
                rows,
            )
    except ImportError as exc:
        print(f"  torchao not importable here ({exc}); peers are torch.compile of our reference", flush=True)
        rows.append({"kernel": "nvfp4 quantize", "provider": "torchao", "error": f"not importable: {exc}"})


def kernel_resources() -> None:
    """Registers and local memory (spills) per compiled kernel: occupancy and spills explain speed."""
    from cupy.cuda import driver

    from tracestore.kernels import _launch

    for (name, _dev), (_mod, fn) in sorted(_launch._modules.items()):
        try:
            regs = driver.funcGetAttribute(4, fn.ptr)  # CU_FUNC_ATTRIBUTE_NUM_REGS
            local = driver.funcGetAttribute(3, fn.ptr)  # CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES
            print(f"  {name:40s} {regs:4d} registers, {local:5d} B local", flush=True)
        except Exception as exc:  # noqa: BLE001 - diagnostics only
            print(f"  {name}: attributes unavailable ({exc})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=65536)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--per-graph", type=int, default=20)
    ap.add_argument("--moe-batch", type=int, default=256)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile peers")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels needs a CUDA GPU")
    n, d, reps = args.rows, args.width, args.reps
    rows: list[dict] = []
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  [{n} x {d}] bf16", flush=True)

    ceiling = copy_ceiling(reps, rows)
    run_kernels(args, ceiling, rows)
    kernel_resources()
    torch.cuda.empty_cache()
    safe("moe_decode_step", lambda: moe_step_share(args, rows), rows)

    print()
    print_table(
        [r for r in rows if "error" not in r and "GB/s" in r],
        ["kernel", "provider", "median_ms", "min_ms", "max_ms", "GB/s", "%copy"],
    )
    if not args.no_save:
        # the device copy of the tree has no .git: the caller passes the commit that ran
        extra = {"ceiling_GBps": ceiling, "shape": [n, d], "code_commit": os.environ.get("TRACESTORE_BENCH_COMMIT")}
        path = append_results("bench_kernels", [{**r, **extra} for r in rows])
        print(f"appended {len(rows)} rows to {path}")


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"bench_kernels done in {time.time() - t0:.0f} s")
