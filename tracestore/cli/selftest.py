"""``tracestore selftest``: the numerics round trip on random activations, with a short report.

Quantize "rollout" activations, record the low bits, perturb them as a trainer would see them,
and compare TRACE rounding with plain RTN. Runs on the CPU reference (needs torch).

The default (64 tokens x 2048) takes a few seconds; every one of the 12 rows (format x b x rule) is
printed as soon as it is computed, numbered. ``--tokens 4096`` is the full-size run (about a
minute and a half of CPU). Settings: flag, else ``TRACESTORE_<FLAG>``, else the ``[selftest]``
table of a ``--config`` file.
"""

from __future__ import annotations

import argparse
import sys
import time

from tracestore.cli import Kind, Setting, add_settings, integer, number


def _width(raw: object) -> int:
    v = integer(32).parse(raw)
    if v % 32:
        raise ValueError
    return int(v)


SETTINGS = (
    Setting("--tokens", integer(1), 64, "rows of random activations (4096: the former full-size run, ~85 s)"),
    Setting(
        "--width",
        Kind("a multiple of 32, at least 32", _width, "N"),
        2048,
        "values per row (a multiple of the 32-value MXFP4 block)",
    ),
    Setting("--noise", number(ge=0), 1e-3, "relative train-vs-rollout perturbation", metavar="X"),
    Setting("--seed", integer(0), 0, "random seed"),
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "selftest",
        help="check the FP4/TRACE numerics on random data and print a report (a few seconds)",
        description="Quantize random activations (NVFP4, MXFP4), record b = 1, 2, 4 low bits, perturb them and "
        "check that TRACE rounding reproduces the rollout exactly, against plain RTN; one line per case as it "
        "is computed. Exit 1 on any identity mismatch. Settings: flag, else TRACESTORE_<FLAG>, else the "
        "[selftest] table of a --config file.",
    )
    add_settings(p, "selftest", SETTINGS)
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from tracestore.cli import resolve

    resolve(ns)
    t0 = time.monotonic()
    print(
        f"selftest: {ns.tokens} tokens x {ns.width} values, noise {ns.noise:g}, seed {ns.seed}; 12 cases "
        "(loading torch...)",
        flush=True,
    )
    try:
        import torch
    except ImportError:
        print("selftest needs torch: pip install 'tracestore[torch]'", file=sys.stderr)
        return 2
    from tracestore import MXFP4, NVFP4, dequantize, guided_round, pack_bits, quantize, rtn_fake_quant

    gen = torch.Generator().manual_seed(ns.seed)
    x_roll = torch.randn(ns.tokens, ns.width, generator=gen)
    x_train = x_roll * (1 + ns.noise * torch.randn(x_roll.shape, generator=gen))
    print(
        f"{'case':>5} {'format':8} {'b':>2} {'rule':8} {'identity':>9} {'RTN mismatch':>13} {'TRACE mismatch':>15}",
        flush=True,
    )
    failures = 0
    case = 0
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
                case += 1
                print(
                    f"{f'{case}/12':>5} {fmt.name:8} {bits:>2} {rule:8} {'exact' if ok else 'FAIL':>9} "
                    f"{rtn_mis:>13.3e} {tr_mis:>15.3e}",
                    flush=True,
                )
    verdict = "passed" if not failures else f"FAILED ({failures} identity mismatches)"
    print(f"selftest {verdict} in {time.monotonic() - t0:.1f} s")
    return 1 if failures else 0
