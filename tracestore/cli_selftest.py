"""``tracestore selftest``: the numerics round trip on random activations, with a short report.

Quantize "rollout" activations, record the low bits, perturb them as a trainer would see them,
and compare TRACE rounding with plain RTN. Runs on the CPU reference (needs torch).
"""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("selftest", help="check the FP4/TRACE numerics on random data and print a report")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--noise", type=float, default=1e-3, help="relative train-vs-rollout perturbation")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    try:
        import torch
    except ImportError:
        print("selftest needs torch: pip install 'tracestore[torch]'", file=sys.stderr)
        return 2
    from tracestore import MXFP4, NVFP4, dequantize, guided_round, pack_bits, quantize, rtn_fake_quant

    gen = torch.Generator().manual_seed(ns.seed)
    x_roll = torch.randn(ns.tokens, ns.width, generator=gen)
    x_train = x_roll * (1 + ns.noise * torch.randn(x_roll.shape, generator=gen))
    print(f"{'format':8} {'b':>2} {'rule':8} {'identity':>9} {'RTN mismatch':>13} {'TRACE mismatch':>15}")
    failures = 0
    for fmt in (NVFP4, MXFP4):
        q = quantize(x_roll, fmt)
        ref = dequantize(q)
        g = q.global_scale if fmt is NVFP4 else None
        rtn = rtn_fake_quant(x_train, fmt, g)
        for bits in (1, 2, 4):
            p = pack_bits(q.codes, bits)
            for rule in ("bracket", "paper"):
                ident = guided_round(x_roll, p, q.scales, q.global_scale, bits, fmt, rule)
                y = guided_round(x_train, p, q.scales, q.global_scale, bits, fmt, rule)
                ok = torch.equal(ident, ref)
                failures += not ok
                rtn_mis = (rtn != ref).float().mean().item()
                tr_mis = (y != ref).float().mean().item()
                print(
                    f"{fmt.name:8} {bits:>2} {rule:8} {'exact' if ok else 'FAIL':>9} {rtn_mis:>13.3e} {tr_mis:>15.3e}"
                )
    print("selftest", "passed" if not failures else f"FAILED ({failures} identity mismatches)")
    return 1 if failures else 0
