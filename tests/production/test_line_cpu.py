"""The production line on the CPU, end to end through a sidecar process, and its refusals."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("grpc")

from tracestore.client import RolloutRecorder, Segments, SiteOutput  # noqa: E402

from tests.hf_compat import checkpointing_on  # noqa: E402
from tests.production import line  # noqa: E402
from tracestore.errors import ConfigError, DTypeError, ShapeError, ValidationError  # noqa: E402
from tracestore.kernels import RecordSlab, record_from_activations  # noqa: E402
from tracestore.records import RunSpec, SiteSpec  # noqa: E402


@pytest.mark.parametrize(
    ("fmt", "g_mode", "unix", "columns"),
    [
        ("nvfp4", "forward", False, False),
        ("nvfp4", "token", True, False),
        ("nvfp4", "static", False, True),
        ("mxfp4", "forward", True, True),
    ],
)
def test_line_cpu_records_bytes_and_trains_on_them(tmp_path, fmt: str, g_mode: str, unix: bool, columns: bool) -> None:  # noqa: ANN001
    roll = line.rollout("cpu", fmt, g_mode)
    got = line.record_and_read(roll, tmp_path, unix=unix, columns=columns)
    line.check_records(roll, got)
    if g_mode == "token":  # per-row g arrives as token scales under a chunk g of 1.0
        g = got["layers.0.mlp.input"]
        assert g.token_scales is not None and bool((torch.as_tensor(g.global_scale) == 1.0).all())
    line.train_identity(roll, got, fmt)


def test_line_cpu_with_activation_checkpointing(tmp_path) -> None:  # noqa: ANN001
    roll = line.rollout("cpu", "nvfp4", "token")
    got = line.record_and_read(roll, tmp_path)
    ref = line.train_identity(roll, got)
    grads = {n: p.grad.clone() for n, p in roll.model.named_parameters() if p.grad is not None}
    roll.model.zero_grad(set_to_none=True)
    checkpointing_on(roll.model, {"use_reentrant": False})
    again = line.train_identity(roll, got)
    for name in ref.seen:
        assert torch.equal(again.seen[name], ref.seen[name]), name
    for n, p in roll.model.named_parameters():
        if n in grads:
            assert torch.equal(p.grad, grads[n]), n


def _spec(*widths: int) -> RunSpec:
    return RunSpec("bad", tuple(SiteSpec(f"layers.{i}.mlp.input", "moe_input", i, w) for i, w in enumerate(widths)))


def test_record_slab_refuses_bad_input() -> None:
    spec = _spec(64, 32)
    rec = RolloutRecorder("127.0.0.1:1", spec, writer="w", connect=False, staging_bytes=1 << 20)
    try:
        slab = RecordSlab.allocate(spec.sites, 8, "cpu")
        segs = [("a", 0, 2), ("b", 5, 6)]
        with pytest.raises(ShapeError, match="wrote 4 rows but the segments hold 3 tokens"):
            rec.record_slab(segs, slab, n_rows=4)
        with pytest.raises(ShapeError, match="more than the 8"):
            rec.record_slab([("a", 0, 9)], slab)
        other = RecordSlab.allocate((*spec.sites, SiteSpec("layers.9.mlp.input", "moe_input", 9, 32)), 8, "cpu")
        with pytest.raises(ValidationError, match="declares no site 'layers.9.mlp.input'"):
            rec.record_slab(segs, other)
        wrong = RecordSlab.allocate((spec.sites[0], SiteSpec("layers.1.mlp.input", "moe_input", 1, 48)), 8, "cpu")
        with pytest.raises(ShapeError, match="slab site layers.1.mlp.input"):
            rec.record_slab(segs, wrong)
        with pytest.raises(ShapeError, match="rows_per_token"):
            RecordSlab.allocate(
                (spec.sites[0], SiteSpec("layers.1.mlp.input", "moe_input", 1, 32, rows_per_token=2)), 8, "cpu"
            )
        assert rec.record_slab(segs, slab, n_rows=3)
        # record_forward: a per-row g of the wrong length, of the wrong dtype, or beside token scales
        codes, scales = np.zeros((3, 8), np.uint8), np.zeros((3, 4), np.uint8)
        with pytest.raises(ShapeError, match=r"layers.0.mlp.input.global_scale has 2 values.*one per row \(3\)"):
            rec.record_forward(segs, {"layers.0.mlp.input": SiteOutput(codes, scales, torch.ones(2))})
        with pytest.raises(DTypeError, match="float32"):
            rec.record_forward(
                segs, {"layers.0.mlp.input": SiteOutput(codes, scales, torch.ones(3, dtype=torch.float64))}
            )
        with pytest.raises(ConfigError, match="token_scales together"):
            rec.record_forward(segs, {"layers.0.mlp.input": SiteOutput(codes, scales, torch.ones(3), torch.ones(3))})
        assert rec.record_forward(segs, {"layers.0.mlp.input": SiteOutput(codes, scales, torch.rand(3))})
    finally:
        rec.close(timeout=0)


def test_segments_in_column_form_are_checked_like_the_list() -> None:
    """Segments (column form): the same staged rows and sender-side segments as the list form; a
    malformed one is refused with what was expected, and a new trajectories tuple is checked again
    (the check is cached by the tuple's identity, never by its contents)."""
    spec = _spec(64, 32)
    rec = RolloutRecorder("127.0.0.1:1", spec, writer="w", connect=False, staging_bytes=1 << 20)
    try:
        slab = RecordSlab.allocate(spec.sites, 8, "cpu")
        record_from_activations(torch.randn(3, 64), spec.sites[0], slab["layers.0.mlp.input"], global_scale=0.01)
        record_from_activations(torch.randn(3, 32), spec.sites[1], slab["layers.1.mlp.input"], global_scale=0.02)
        listed = [("a", 0, 2), ("b", 5, 6)]
        cols = Segments(("a", "b"), np.array([0, 5]), np.array([2, 6]))
        assert list(cols) == listed and len(cols) == 2 and ("b", 5, 6) in cols
        assert list(Segments.decode(("a", "b"), [7, 3])) == [("a", 7, 8), ("b", 3, 4)]
        assert rec.record_slab(listed, slab, n_rows=3) and rec.record_slab(cols, slab, n_rows=3)
        one, two = rec._unslab(rec._queue.popleft()), rec._unslab(rec._queue.popleft())
        assert list(one.segs) == list(two.segs) == listed
        for a, b in zip(one.sites, two.sites, strict=True):
            (_, _, o1, nc, ns, nt, g1), (_, _, o2, *_rest, g2) = a, b
            n = nc + ns + nt
            assert bytes(rec._np[o1 : o1 + n]) == bytes(rec._np[o2 : o2 + n])
            assert bytes(rec._np[g1 : g1 + 4]) == bytes(rec._np[g2 : g2 + 4])
        with pytest.raises(ShapeError, match="2 trajectories, 3 starts and 2 ends"):
            Segments(("a", "b"), [0, 1, 2], [1, 2])
        # decode takes a snapshot: the engine may advance its positions array in place at once
        pos = np.array([4, 9], dtype=np.int32)
        snap = Segments.decode(("a", "b"), pos)
        pos += 1
        assert list(snap) == [("a", 4, 5), ("b", 9, 10)] and snap.starts.dtype == np.int64
        with pytest.raises(ShapeError, match="2 trajectories, 3 positions; expected one position per trajectory"):
            rec.record_slab(Segments.decode(("a", "b"), np.arange(3)), slab)
        with pytest.raises(ShapeError, match="positions must be integers"):
            _ = Segments.decode(("a", "b"), np.array([0.5, 1.0])).starts
        with pytest.raises(ValidationError, match=r"segment of b: expected 0 <= token_start < token_end, got \[4, 4\)"):
            rec.record_slab(Segments(("a", "b"), [0, 4], [1, 4]), slab)
        with pytest.raises(ValidationError, match=r"segment of a: .*got \[-1, 1\)"):
            rec.record_slab(Segments(("a", "b"), [-1, 4], [1, 5]), slab)
        with pytest.raises(ValidationError, match="trajectory"):
            rec.record_slab(Segments(("a", "b/../x"), [0, 4], [1, 5]), slab)
        with pytest.raises(ShapeError, match="wrote 4 rows but the segments hold 3 tokens"):
            rec.record_slab(cols, slab, n_rows=4)
        assert not rec._queue  # nothing refused was queued
    finally:
        rec.close(timeout=0)


def test_record_slab_lays_out_sites_and_per_row_g_on_the_sender() -> None:
    """The sender's per-site layout of a staged slab: codes, scales, one g (uniform) or token scales."""
    spec = _spec(64, 32)
    rec = RolloutRecorder("127.0.0.1:1", spec, writer="w", connect=False, staging_bytes=1 << 20)
    try:
        slab = RecordSlab.allocate(spec.sites, 8, "cpu")
        x0, x1 = torch.randn(3, 64), torch.randn(3, 32)
        record_from_activations(x0, spec.sites[0], slab["layers.0.mlp.input"], global_scale=0.01)
        record_from_activations(x1, spec.sites[1], slab["layers.1.mlp.input"], global_scale=torch.rand(3) / 100)
        assert rec.record_slab([("a", 0, 2), ("b", 5, 6)], slab)
        fwd = rec._unslab(rec._queue.popleft())
        pool = rec._np
        (n0, _, o0, nc0, ns0, nt0, g0), (n1, _, o1, nc1, ns1, nt1, g1) = fwd.sites
        b0, b1 = slab["layers.0.mlp.input"], slab["layers.1.mlp.input"]
        assert bytes(pool[o0 : o0 + nc0]) == b0.codes[:3].numpy().tobytes() and nt0 == 0
        assert bytes(pool[o0 + nc0 : o0 + nc0 + ns0]) == b0.scales[:3].numpy().tobytes()
        assert np.frombuffer(bytes(pool[g0 : g0 + 4]), np.float32)[0] == np.float32(0.01)
        assert bytes(pool[o1 : o1 + nc1]) == b1.codes[:3].numpy().tobytes() and nt1 == 12
        ts = np.frombuffer(bytes(pool[o1 + nc1 + ns1 : o1 + nc1 + ns1 + nt1]), np.float32)
        assert (
            np.array_equal(ts, b1.global_scale[:3].numpy())
            and np.frombuffer(bytes(pool[g1 : g1 + 4]), np.float32)[0] == 1
        )
    finally:
        rec.close(timeout=0)


def test_slab_stage_on_the_cpu_stages_each_commit_from_its_slot() -> None:
    spec = _spec(64)
    rec = RolloutRecorder("127.0.0.1:1", spec, writer="w", connect=False, staging_bytes=1 << 20)
    try:
        slab = RecordSlab.allocate(spec.sites, 4, "cpu")
        stage = rec.slab_stage(slab)
        seen = []
        for step in range(3):
            record_from_activations(torch.randn(4, 64), spec.sites[0], slab["layers.0.mlp.input"], global_scale=0.02)
            stage.capture()
            seen.append(slab.data[:2].clone())
            assert stage.commit([("a", step, step + 1), ("b", step, step + 1)])
            assert int(stage.slot) == (step + 1) % stage.slots
        for step in range(3):
            fwd = rec._queue.popleft()
            plan, off, rows = fwd.staged[0]
            assert rows == 2 and bytes(rec._np[off : off + 2 * plan.row_bytes]) == seen[step].numpy().tobytes()
        with pytest.raises(ShapeError, match="more than the 4"):
            stage.commit([("a", 0, 5)])
    finally:
        rec.close(timeout=0)
