"""9. Oversized reads through the sidecar (the Read RPC): tokens [0, 2^24) and [0, 2^40) of a
100-token trajectory, and a plan that repeats it 2^16 times, are refused (RESOURCE_EXHAUSTED for a
read past the sidecar's read limit, INVALID_ARGUMENT for impossible token positions) quickly and
without the sidecar's RSS growing with the asked size; a normal read still returns the exact bytes.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from tracestore.v1 import tracestore_pb2 as pb

from .harness import READ, SPEC, PeakSampler, Sidecar, Writer, row

RSS_BOUND_MIB = 64
REFUSE_S = 10.0


def _read(sc: Sidecar, req: pb.ReadRequest, timeout: float = 30.0) -> tuple[str, list[pb.ReadResponse]]:
    out = []
    with grpc.insecure_channel(sc.address, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        try:
            for raw in ch.unary_stream(READ)(req.SerializeToString(), timeout=timeout):
                out.append(pb.ReadResponse.FromString(raw))
        except grpc.RpcError as exc:
            return exc.code().name, out
    return "OK", out


CASES = [
    ("tokens [0, 2^24) mask", [(0, 1 << 24)], pb.ON_MISSING_MASK, {"RESOURCE_EXHAUSTED"}),
    ("tokens [0, 2^24) error", [(0, 1 << 24)], pb.ON_MISSING_ERROR, {"RESOURCE_EXHAUSTED"}),
    ("tokens [0, 2^40) mask", [(0, 1 << 40)], pb.ON_MISSING_MASK, {"RESOURCE_EXHAUSTED", "INVALID_ARGUMENT"}),
    ("tokens [0, 2^40) error", [(0, 1 << 40)], pb.ON_MISSING_ERROR, {"RESOURCE_EXHAUSTED", "INVALID_ARGUMENT"}),
    (
        "tokens [2^62, 2^63-1) mask",
        [(1 << 62, (1 << 63) - 1)],
        pb.ON_MISSING_MASK,
        {"RESOURCE_EXHAUSTED", "INVALID_ARGUMENT"},
    ),  # fmt: skip
    ("2^16 x tokens [0, 100)", [(0, 100)] * (1 << 16), pb.ON_MISSING_ERROR, {"RESOURCE_EXHAUSTED"}),
]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_oversized_reads_refused_rss_bounded(tmp_path: Path) -> None:
    r = row("9 oversized reads")
    sc = Sidecar(tmp_path, flags=["--flush-interval", "0.2", "--memory-budget-mib", "256", "--grace", "5"])
    w = Writer("read-w", trajs=1, tokens=100)
    problems: list[str] = []
    worst = 0.0
    try:
        sc.start()
        assert w.session(sc.address, max_new=1, timeout=20).code is None
        traj = w.acked[0].recs[0].trajectory
        # a normal read first: the exact bytes come back (and the read path is warm before measuring)
        code, resp = _read(sc, pb.ReadRequest(run=SPEC.run, plan=[pb.Segment(trajectory=traj, token_start=0,
                                                                             token_end=100)]))  # fmt: skip
        if code != "OK":
            problems.append(f"a normal 100-token read failed: {code}")
        else:
            for rec in w.acked[0].recs:
                parts = sorted((x for x in resp if x.site == rec.site), key=lambda x: x.row_start)
                codes = b"".join(x.codes for x in parts)
                scales = b"".join(x.scales for x in parts)
                valid = np.frombuffer(b"".join(x.valid for x in parts), np.uint8)
                if codes != rec.codes or scales != rec.scales or not valid.all():
                    problems.append(f"the normal read of {rec.site} differs from what was written")
        for name, segs, on_missing, want in CASES:
            req = pb.ReadRequest(
                run=SPEC.run, plan=[pb.Segment(trajectory=traj, token_start=a, token_end=b) for a, b in segs],
                on_missing=on_missing,
            )  # fmt: skip
            t0 = time.monotonic()
            with PeakSampler(sc.pid) as peak:
                code, _ = _read(sc, req)
            took = time.monotonic() - t0
            worst = max(worst, peak.grown_mib)
            r.trials += 1
            if not sc.alive():
                problems.append(f"{name}: the sidecar died: {sc.log()[-800:]}")
                break
            if code not in want:
                problems.append(f"{name}: {code} (want {' or '.join(sorted(want))})")
            if took > REFUSE_S:
                problems.append(f"{name}: answered after {took:.1f} s")
            if peak.grown_mib > RSS_BOUND_MIB:
                problems.append(f"{name}: RSS grew {peak.grown_mib:.0f} MiB")
        r.rss_mib = worst
        if sc.alive() and sc.health() != "SERVING":
            problems.append(f"health {sc.health()} after the reads")
    finally:
        sc.kill()
    r.add_note(f"{r.trials - sum(1 for p in problems if ':' in p)}/{r.trials} refused as documented")
    for p in problems[:3]:
        r.add_note(p[:150])
    assert not problems, "\n".join(problems)
