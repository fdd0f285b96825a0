"""The sender's vectorized decode path (ChunkBuilder.gather) sends exactly the chunks the
per-piece path (Outbox.expand -> ChunkBuilder.build) sends: same keys, bytes, scales and checksums, across
rows_per_token > 1, token scales, a global-scale change, unguided trajectories, a changed batch
and a gap in the tokens. No sidecar: both recorders build their messages from the same forwards."""

from __future__ import annotations

from typing import Any

import numpy as np
from tracestore.client import RolloutRecorder, SiteOutput

from tracestore.records import RunSpec, SiteSpec
from tracestore.v1 import tracestore_pb2 as pb

SPEC = RunSpec(
    "gather",
    (
        SiteSpec("layers.20.mlp.input", "moe_input", layer=20, width=128),
        SiteSpec("layers.20.mlp.experts", "moe_input", layer=20, width=64, rows_per_token=2, bits=2),
        SiteSpec("layers.20.attn.k", "key", layer=20, width=64, format="mxfp4"),
    ),
)


def _forwards() -> list[tuple[list[tuple[str, int, int]], dict[str, SiteOutput]]]:
    rng = np.random.default_rng(7)
    fwds = []
    trajs = [f"t{i}" for i in range(6)]
    for step in range(12):
        if step == 7:
            trajs = trajs[1:] + ["t9"]  # one sequence finished, another joined: a new group
        start = step + (3 if step >= 10 else 0)  # a gap in the tokens at step 10: a new group
        segs = [(t, start, start + 1) for t in trajs]
        out = {}
        for s in SPEC.sites:
            rows = len(segs) * s.rows_per_token
            g = (0.5 if step < 4 else 0.25) if s.fmt.has_global_scale else 1.0  # a scale change mid-group
            ts = rng.uniform(0.5, 2, rows).astype(np.float32) if s.rows_per_token == 2 else None
            out[s.name] = SiteOutput(
                rng.integers(0, 256, (rows, s.code_bytes), dtype=np.uint8),
                rng.integers(0, 256, (rows, s.scale_bytes), dtype=np.uint8),
                g,
                ts,
            )
        fwds.append((segs, out))
    return fwds


def _chunks(outs: list[Any]) -> list[tuple[Any, ...]]:
    got = []
    for out in outs:
        req = pb.WriteRequest.FromString(out.serialize())
        for c in req.chunks:
            got.append((c.trajectory, c.site, c.policy_version, c.token_start, c.n_tokens, c.codes, c.scales,
                        c.global_scale, c.has_token_scales, c.token_scales, c.checksum))  # fmt: skip
    return sorted(got)


def _sent(fast: bool) -> tuple[list[tuple[Any, ...]], list[Any], dict[str, int]]:
    rec = RolloutRecorder("127.0.0.1:1", SPEC, "w", staging_bytes=4 << 20, batch_bytes=8 << 10, connect=False)
    try:
        for segs, out in _forwards():
            assert rec.record_forward(segs, out)
        rec._unguided.mark(["t3"], "test")  # noqa: SLF001 - dropped by the sender, never sent
        for t in ("t0", "t1", "t3"):
            rec.finish(t, 14)
        fwds: list[Any] | None = [] if fast else None
        pieces, extras = rec._outbox.take(1 << 30, fwds)  # noqa: SLF001 - the sender's view
        outs = rec._chunks.gather(fwds) if fwds else []  # noqa: SLF001
        outs += list(rec._chunks.build(pieces, extras, False))  # noqa: SLF001
        if fast:
            assert not pieces and fwds and rec.pool.in_use == 0  # all gathered, staging released
        seals = [s for o in outs for s in pb.WriteRequest.FromString(o.serialize()).seals]
        return _chunks(outs), seals, {"messages": len(outs), "chunks": sum(o.chunks for o in outs)}
    finally:
        rec.close(timeout=0.1)


def test_gather_sends_the_chunks_the_piece_path_sends() -> None:
    slow, slow_seals, slow_n = _sent(fast=False)
    fast, fast_seals, fast_n = _sent(fast=True)
    assert len(fast) == len(slow) == fast_n["chunks"] == slow_n["chunks"]
    assert fast == slow
    assert not any(c[0] == "t3" for c in fast)
    # groups [0,7) minus the NVFP4 scale change at 4, [7,10), [10,12): per site and trajectory
    runs = {(c[0], c[1]): 0 for c in fast}
    for c in fast:
        runs[(c[0], c[1])] += 1
    assert runs[("t1", "layers.20.mlp.input")] == 3 and runs[("t1", "layers.20.attn.k")] == 2
    assert runs[("t0", "layers.20.mlp.input")] == 2  # t0 left the batch at step 7
    assert [s.trajectory for s in fast_seals] == [s.trajectory for s in slow_seals] == ["t0", "t1"]
    assert fast_n["messages"] > 1  # batch_bytes cut the gathered chunks into several messages
