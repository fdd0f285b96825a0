"""RecordBranch: record kernels forked onto a side stream beside the engine's kernels and joined
before the slab is staged. CPU: the records run in place. GPU (marker gpu): eager and inside a
captured CUDA graph, the branch's slab rows equal the same records made on the engine's stream,
bit for bit, while the engine frees and reallocates its activations right after each fork."""

import threading

import numpy as np
import pytest
import torch

from tracestore.errors import ConfigError
from tracestore.kernels import RecordBranch, RecordSlab, record_from_activations, stage_rows
from tracestore.kernels.branch import join_pending
from tracestore.kernels.testing import assert_bits_equal, capture_graph
from tracestore.records import RunSpec, SiteSpec

SITES = tuple(SiteSpec(f"layers.{i}.mlp.input", "moe_input", i, 256, "nvfp4", 1) for i in range(6))


def test_cpu_branch_runs_the_records_in_place(gen):
    x = torch.randn(32, 256, generator=gen)
    direct = RecordSlab.allocate(SITES, 32, "cpu")
    forked = RecordSlab.allocate(SITES, 32, "cpu")
    branch = RecordBranch("cpu")
    for i, s in enumerate(SITES):
        record_from_activations(x * (i + 1), s, direct[s.name], global_scale=0.01)
        with branch.fork(x):
            record_from_activations(x * (i + 1), s, forked[s.name], global_scale=0.01)
    assert torch.equal(direct.data, forked.data)
    assert branch.forks == 0 and join_pending() == 0  # nothing was forked: nothing to join
    branch.join()
    with pytest.raises(ConfigError, match="no stream"):
        _ = branch.stream


def engine_forward(x0, weights, branch, slab, g):
    """A stand-in decode forward: each layer allocates its output and drops its input, the records
    read each layer's output on the branch (or on the engine's stream when branch is None)."""
    h = x0
    for w, s in zip(weights, SITES, strict=True):
        h = torch.tanh(h @ w)  # a new activation; the previous one is freed here
        if branch is None:
            record_from_activations(h, s, slab[s.name], global_scale=g)
        else:
            with branch.fork(h):
                record_from_activations(h, s, slab[s.name], global_scale=g)
    return h


def _weights(gen):
    return [(torch.randn(256, 256, generator=gen) / 16).to("cuda", torch.bfloat16) for _ in SITES]


@pytest.mark.gpu
def test_gpu_branch_eager_equals_the_engine_stream_and_joins_once(gen):
    weights = _weights(gen)
    x0 = torch.randn(128, 256, generator=gen).to("cuda", torch.bfloat16)
    g = torch.full((1,), 0.02, device="cuda")
    ref = RecordSlab.allocate(SITES, 128, "cuda")
    engine_forward(x0, weights, None, ref, g)
    slab = RecordSlab.allocate(SITES, 128, "cuda")
    branch = RecordBranch("cuda")
    engine_forward(x0, weights, branch, slab, g)
    assert branch.forks == len(SITES)
    assert join_pending(torch.device("cpu")) == 0  # another device's branches are left alone
    assert join_pending() == 1 and join_pending() == 0  # one join per branch, however many forks
    assert_bits_equal(slab.data, ref.data, "slab")


@pytest.mark.gpu
def test_gpu_branch_pending_is_per_thread(gen):
    """A branch forked on one thread is not joined into another thread's stream."""
    branch = RecordBranch("cuda")
    slab = RecordSlab.allocate(SITES, 16, "cuda")
    x = torch.randn(16, 256, generator=gen).cuda()
    with branch.fork(x):
        record_from_activations(x, SITES[0], slab[SITES[0].name], global_scale=0.01)
    seen = []
    t = threading.Thread(target=lambda: seen.append(join_pending()))
    t.start()
    t.join()
    assert seen == [0] and join_pending() == 1


@pytest.mark.gpu
def test_gpu_branch_in_a_cuda_graph_is_exact_and_stage_rows_joins_it(gen):
    """The records forked inside a captured graph (a parallel branch) equal eager records on the
    engine's stream after every replay; stage_rows joins the branch (else the capture would end
    with an unjoined stream) and the ring slot holds the slab's rows."""
    n = 192
    weights = _weights(gen)
    x0 = torch.zeros(n, 256, device="cuda", dtype=torch.bfloat16)
    g = torch.full((n,), 0.02, device="cuda")
    slab = RecordSlab.allocate(SITES, n, "cuda")
    ring = torch.zeros(2, n * slab.row_bytes, dtype=torch.uint8, device="cuda")
    slot = torch.zeros(1, dtype=torch.int32, device="cuda")
    branch = RecordBranch("cuda")

    def step():
        engine_forward(x0, weights, branch, slab, g)
        stage_rows(slab, n, ring, slot)

    graph = capture_graph(step)
    ref = RecordSlab.allocate(SITES, n, "cuda")
    for k in range(6):
        x0.copy_(torch.randn(n, 256, generator=gen).to(torch.bfloat16))
        g.copy_(torch.rand(n, generator=gen) / 30 + 1e-3)
        slot.fill_(k % 2)
        graph.replay()
        engine_forward(x0, weights, None, ref, g)  # queued after the replay on the engine's stream
        torch.cuda.synchronize()
        assert_bits_equal(slab.data, ref.data, f"replay {k}")
        assert np.array_equal(ring[k % 2].cpu().numpy(), slab.data.reshape(-1).cpu().numpy()), f"replay {k} slot"


@pytest.mark.gpu
def test_gpu_record_slab_joins_an_eager_branch(gen):
    """RolloutRecorder.record_slab joins the calling thread's branches before its staging copy."""
    from tracestore.client import RolloutRecorder

    spec = RunSpec("branch", SITES)
    weights = _weights(gen)
    x0 = torch.randn(64, 256, generator=gen).to("cuda", torch.bfloat16)
    g = torch.full((1,), 0.02, device="cuda")
    slab = RecordSlab.allocate(SITES, 64, "cuda")
    branch = RecordBranch("cuda")
    rec = RolloutRecorder("127.0.0.1:1", spec, writer="w", connect=False, staging_bytes=1 << 24)
    try:
        engine_forward(x0, weights, branch, slab, g)
        assert rec.record_slab([(f"t{i}", 0, 1) for i in range(64)], slab)
        assert join_pending() == 0  # record_slab joined it
        fwd = list(rec._queue)[-1]
        torch.cuda.synchronize()
        off = fwd.staged[0][1]
        assert bytes(rec._np[off : off + 64 * slab.row_bytes]) == slab.data[:64].cpu().numpy().tobytes()
    finally:
        rec.close(timeout=0)
