"""Slab forwards (record_slab) that the sender takes over several windows. A decode forward that
does not fit the rest of a window goes back to the queue for the next one; it was already laid
out per site (Outbox.unslab) and must not be laid out again: every stored row must still be the
row the engine wrote, for every (trajectory, position, site). No sidecar: the sender's messages
are read back."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tracestore.client import RolloutRecorder  # noqa: E402

from tracestore.kernels import RecordSlab  # noqa: E402
from tracestore.records import RunSpec, SiteSpec  # noqa: E402
from tracestore.v1 import tracestore_pb2 as pb  # noqa: E402

SPEC = RunSpec(
    "slab-window",
    (
        SiteSpec("layers.0.mlp.input", "moe_input", 0, 128),
        SiteSpec("layers.1.mlp.input", "moe_input", 1, 64),
    ),
)
TRAJS = [f"t{i}" for i in range(8)]
STEPS = 12
Row = tuple[bytes, bytes, float]


def _record(rec: RolloutRecorder, per_row_g: bool) -> dict[tuple[str, int, str], Row]:
    """Queue STEPS decode forwards (one token per trajectory each); the rows written, by key."""
    rng = np.random.default_rng(11)
    slab = RecordSlab.allocate(SPEC.sites, capacity=len(TRAJS), device="cpu")
    want: dict[tuple[str, int, str], Row] = {}
    for step in range(STEPS):
        for site in SPEC.sites:
            buf = slab[site.name]
            buf.codes.copy_(torch.from_numpy(rng.integers(0, 256, tuple(buf.codes.shape), dtype=np.uint8)))
            buf.scales.copy_(torch.from_numpy(rng.integers(0, 256, tuple(buf.scales.shape), dtype=np.uint8)))
            n = len(TRAJS)
            g = rng.uniform(0.5, 2.0, n).astype(np.float32) if per_row_g else np.full(n, 0.75, np.float32)
            buf.global_scale.copy_(torch.from_numpy(g))
            for r, t in enumerate(TRAJS):
                want[(t, step, site.name)] = (
                    buf.codes[r].numpy().tobytes(),
                    buf.scales[r].numpy().tobytes(),
                    float(g[r]),
                )
        assert rec.record_slab([(t, step, step + 1) for t in TRAJS], slab, n_rows=len(TRAJS))
    return want


def _sent_rows(rec: RolloutRecorder, limit: int) -> tuple[dict[tuple[str, int, str], Row], int]:
    """What the sender sends when it takes ``limit`` bytes per window: rows by key, and windows."""
    outbox, chunks = rec._outbox, rec._chunks  # noqa: SLF001 - the sender's view
    got: dict[tuple[str, int, str], Row] = {}
    windows = 0
    while outbox.queue:
        fwds: list[Any] = []
        pieces, extras = outbox.take(limit, fwds)
        assert not pieces, "decode forwards coalesce: no pieces"
        windows += 1
        for out in chunks.gather(fwds):
            for c in pb.WriteRequest.FromString(out.serialize()).chunks:
                site = SPEC.sites_by_name[c.site]
                n = c.n_tokens
                codes = np.frombuffer(c.codes, np.uint8).reshape(n, site.code_bytes)
                scales = np.frombuffer(c.scales, np.uint8).reshape(n, site.scale_bytes)
                ts = np.frombuffer(c.token_scales, np.float32) if c.has_token_scales else None
                for i in range(n):
                    g = float(ts[i]) * c.global_scale if ts is not None else c.global_scale
                    key = (c.trajectory, c.token_start + i, c.site)
                    assert key not in got, f"{key} sent twice"
                    got[key] = (codes[i].tobytes(), scales[i].tobytes(), g)
    return got, windows


@pytest.mark.parametrize("per_row_g", [True, False], ids=["token-scales", "one-g"])
def test_a_forward_put_back_is_laid_out_once(per_row_g: bool) -> None:
    rec = RolloutRecorder(
        "127.0.0.1:1", SPEC, "w", staging_bytes=8 << 20, batch_bytes=64 << 10, linger_s=60.0, connect=False
    )
    try:
        want = _record(rec, per_row_g)
        one_forward = len(TRAJS) * sum(s.code_bytes + s.scale_bytes for s in SPEC.sites)
        # a window of 2.5 forwards: the third forward of each window is taken, does not fit, goes back
        got, windows = _sent_rows(rec, int(2.5 * one_forward))
        assert windows >= STEPS // 2
        assert set(got) == set(want)
        bad = [k for k in want if got[k] != want[k]]
        assert not bad, f"{len(bad)} of {len(want)} rows differ from the rows written, e.g. {bad[0]}"
    finally:
        rec.close(timeout=0.1)
