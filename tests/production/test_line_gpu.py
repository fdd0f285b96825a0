"""The production line on a CUDA GPU (marker gpu): CUDA kernels -> a CUDA-graph-captured recording
step -> RolloutRecorder -> sidecar process -> storage -> GuidanceReader(device="cuda") -> the public
training hook with kernels.guided_fp4 under torch.compile, forward and backward.

Run on a GPU machine: ``python -m pytest -q -m gpu tests/production``."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)
pytest.importorskip("cupy", reason="the CUDA kernels need CuPy")
pytest.importorskip("transformers")
pytest.importorskip("grpc")

import numpy as np  # noqa: E402
from tracestore.client import GuidanceReader, GuidedFP4Hooks, RolloutRecorder, Segments  # noqa: E402
from tracestore.server.testing import ServeProcess  # noqa: E402

from tests.production import line  # noqa: E402
from tracestore.errors import ShapeError  # noqa: E402
from tracestore.kernels import RecordBranch, RecordSlab, record_from_activations  # noqa: E402
from tracestore.kernels.testing import capture_graph  # noqa: E402
from tracestore.plan import MicrobatchPlan  # noqa: E402
from tracestore.records import RunSpec, SiteSpec  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    ("fmt", "g_mode", "unix"), [("nvfp4", "token", True), ("nvfp4", "static", False), ("mxfp4", "forward", False)]
)
def test_line_gpu_records_bytes_and_trains_on_them(tmp_path, fmt: str, g_mode: str, unix: bool) -> None:  # noqa: ANN001
    roll = line.rollout("cuda", fmt, g_mode)
    got = line.record_and_read(roll, tmp_path, unix=unix)
    assert all(g.codes.is_cuda for g in got.values())
    line.check_records(roll, got)
    line.train_identity(roll, got, fmt)


def test_line_gpu_train_step_under_torch_compile(tmp_path) -> None:  # noqa: ANN001
    """torch.compile (inductor) of the hooked model: the guided op sits inside a compiled graph
    (no graph break at it), outputs equal the rollout's, backward runs."""
    from torch._dynamo.utils import counters

    roll = line.rollout("cuda", "nvfp4", "token")
    got = line.record_and_read(roll, tmp_path)
    graphs: list = []

    def backend(gm, inputs):  # noqa: ANN001, ANN202
        from torch._inductor.compile_fx import compile_fx

        out = compile_fx(gm, inputs)  # transformers' MoE routing reads a count (.item()): dynamo splits there
        graphs.append(gm)  # only graphs inductor compiled
        return out

    counters.clear()
    model = roll.model
    model.train()
    with GuidedFP4Hooks(model, "nvfp4") as hooks:
        hooks.set_guidance(got)
        fwd = torch.compile(model, backend=backend)
        for _ in range(2):  # the second call runs the compiled graph without recompiling
            logits = fwd(input_ids=roll.ids, use_cache=False).logits
            # inductor fuses the model's other ops (norms, softmax) and rounds them differently, so
            # the logits match the eager rollout's closely, not bit for bit (eager: test above)
            torch.testing.assert_close(logits.detach(), roll.logits, rtol=1e-3, atol=1e-3)
            logits.float().logsumexp(-1).mean().backward()
    guided = sum(1 for g in graphs for n in g.graph.nodes if "guided_fp4" in str(n.target))
    assert guided >= len(got), (guided, len(got))  # every site's guided op inside a compiled graph
    breaks = {k: v for k, v in counters["graph_break"].items() if "guided" in k or "tracestore" in k}
    assert not breaks, breaks
    assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize(("copy", "branch"), [("driver", False), ("torch", False), ("driver", True)])
def test_recording_step_captured_in_a_cuda_graph_through_a_sidecar(
    tmp_path, copy: str, branch: bool, monkeypatch
) -> None:  # noqa: ANN001
    """A decode loop replays one captured graph (record kernels on 20 sites + stage.capture());
    the engine thread commits after each replay without synchronizing; storage returns each step's
    slab rows bit for bit. Both copy paths: the CUDA driver's (the default) and torch's; and the
    record kernels on a RecordBranch (a parallel branch of the graph, each reading a temporary the
    engine frees right after the fork), joined by stage.capture()."""
    _copy_path(copy, monkeypatch)
    n_seq, steps = 64, 5
    spec = RunSpec("graph", tuple(SiteSpec(f"layers.{i}.mlp.input", "moe_input", i, 256) for i in range(20)))
    slab = RecordSlab.allocate(spec.sites, n_seq, "cuda")
    x = torch.zeros(n_seq, 256, device="cuda", dtype=torch.bfloat16)
    g = torch.ones(n_seq, device="cuda")
    trajs = [f"t{i}" for i in range(n_seq)]
    with ServeProcess(tmp_path, wal=False, unix_socket=True, flags=["--flush-interval", "0.1"]) as sp:
        rec = RolloutRecorder(sp.unix_address, spec, writer="graph-0")
        stage = rec.slab_stage(slab)

        side = RecordBranch("cuda")

        def step() -> None:
            for i, s in enumerate(spec.sites):
                if branch:
                    h = x * (1 + i / 8)
                    with side.fork(h):
                        record_from_activations(h, s, slab[s.name], global_scale=g)
                    del h  # freed at once: the allocator must not hand its block to the next site's temporary
                    torch.tanh(x @ x.T)  # engine work the branch overlaps
                else:
                    record_from_activations(x * (1 + i / 8), s, slab[s.name], global_scale=g)
            stage.capture()

        graph = capture_graph(step)
        want = []
        gen = torch.Generator(device="cuda").manual_seed(0)
        tokens = np.random.default_rng(0).integers(0, 150_000, (steps, n_seq))  # each step's input ids (host)
        for k in range(steps):
            x.copy_(torch.randn(n_seq, 256, device="cuda", generator=gen))
            g.copy_(torch.rand(n_seq, device="cuda", generator=gen) / 30 if k % 2 else torch.full_like(g, 0.01))
            graph.replay()
            torch.cuda.set_sync_debug_mode("error")
            try:
                assert stage.commit([(t, k, k + 1) for t in trajs], token_ids=tokens[k])
            finally:
                torch.cuda.set_sync_debug_mode(0)
            want.append(slab.data[:n_seq].clone())  # after the graph on the stream: this step's rows
            if branch:  # the branch's rows against the same records made eagerly on the engine's stream
                ref = RecordSlab.allocate(spec.sites, n_seq, "cuda")
                for i, s in enumerate(spec.sites):
                    record_from_activations(x * (1 + i / 8), s, ref[s.name], global_scale=g)
                assert torch.equal(want[-1], ref.data), f"step {k}: the branch's records differ"
        _seal_and_stop(rec, sp, trajs, steps)
    _check_steps(sp.storage, "graph", slab, want, trajs)
    # every committed step carries its token identity (slab_stage's commit(token_ids=...))
    from tracestore.storage.reader import StoreReader
    from tracestore.storage.store import Store

    with StoreReader(Store(sp.storage), "graph") as reader:
        ids = {t: tokens[:, i] for i, t in enumerate(trajs)}
        st = reader.read([(t, 0, steps) for t in trajs], on_missing="mask", token_ids=ids).stats
        assert st.ids_verified == st.chunks > 0 and st.ids_absent == 0, st
    assert rec.stats["driver_copies"] == (steps if copy == "driver" else 0), rec.stats
    assert side.forks == (2 * len(spec.sites) if branch else 0)  # capture_graph: a warm-up call and the capture


def test_deferred_commits_stage_every_step_when_the_stager_falls_behind(tmp_path) -> None:  # noqa: ANN001
    """Commits leave the copies to the stage's stager thread. Here that thread is stopped after
    the first step, so each later commit finds the copy that last read its next slot not yet
    queued (2 slots) and must queue it itself before that slot is rewritten; the engine advances
    its positions array in place right after each commit. Storage holds every step's rows bit for
    bit, at the right tokens."""
    n_seq, steps = 32, 7
    spec = RunSpec("behind", tuple(SiteSpec(f"layers.{i}.mlp.input", "moe_input", i, 256) for i in range(4)))
    slab = RecordSlab.allocate(spec.sites, n_seq, "cuda")
    x = torch.zeros(n_seq, 256, device="cuda", dtype=torch.bfloat16)
    g = torch.full((n_seq,), 0.01, device="cuda")
    trajs = [f"t{i}" for i in range(n_seq)]
    with ServeProcess(tmp_path, wal=False, unix_socket=True, flags=["--flush-interval", "0.1"]) as sp:
        rec = RolloutRecorder(sp.unix_address, spec, writer="behind-0")
        stage = rec.slab_stage(slab, slots=2)

        def step() -> None:
            for i, s in enumerate(spec.sites):
                record_from_activations(x * (1 + i / 4), s, slab[s.name], global_scale=g)
            stage.capture()

        graph = capture_graph(step)
        ids, positions = tuple(trajs), np.zeros(n_seq, np.int64)
        gen = torch.Generator(device="cuda").manual_seed(3)
        want = []
        for k in range(steps):
            x.copy_(torch.randn(n_seq, 256, device="cuda", generator=gen))
            graph.replay()
            assert stage.commit(Segments.decode(ids, positions))
            positions += 1  # the engine's next positions, in place
            want.append(slab.data[:n_seq].clone())
            if k == 0:
                stage._wake.put(False)  # stop the stager: from now on only the commits queue copies
                stage._thread.join(timeout=10)
                assert not stage._thread.is_alive()
            assert len(stage._todo) < stage.slots, len(stage._todo)
        assert rec.stats["stager_behind"] >= (steps - 1) // 2, rec.stats  # every other commit
        _seal_and_stop(rec, sp, trajs, steps)
    _check_steps(sp.storage, "behind", slab, want, trajs)
    assert rec.stats["driver_copies"] == steps, rec.stats


def test_deferred_commit_raises_a_malformed_step_at_the_next_call(tmp_path) -> None:  # noqa: ANN001
    """A commit's segments are checked on the stager thread: a step with more rows than the stage
    holds is refused there, its trajectories unguided, and the engine's next commit raises it."""
    spec = RunSpec("bad", (SiteSpec("layers.0.mlp.input", "moe_input", 0, 64),))
    slab = RecordSlab.allocate(spec.sites, 4, "cuda")
    rec = RolloutRecorder("unix:" + str(tmp_path / "none.sock"), spec, writer="bad-0", connect=False)
    try:
        stage = rec.slab_stage(slab)
        record_from_activations(
            torch.randn(4, 64, device="cuda"), spec.sites[0], slab[spec.sites[0].name], global_scale=0.01
        )
        stage.capture()
        assert stage.commit([("a", 0, 9)])  # 9 rows: accepted now, refused by the stager
        for _ in range(1000):
            if not stage._todo:
                break
            time.sleep(0.005)
        with pytest.raises(ShapeError, match=r"slab stage commit 1: .*9 rows, more than the 4"):
            stage.commit([("a", 9, 10)])
        assert "a" in rec.unguided
    finally:
        rec.close(timeout=0)


def _seal_and_stop(rec: RolloutRecorder, sp: ServeProcess, trajs: list[str], steps: int) -> None:
    """Seal every trajectory after ``steps`` decode steps, flush, close, stop the sidecar cleanly."""
    for t in trajs:
        rec.finish(t, steps + 1)
    assert rec.flush(timeout=60), sp.log_tail()
    rec.close()
    assert sp.terminate() == 0


def _check_steps(storage: str, run: str, slab: RecordSlab, want: list, trajs: list[str]) -> None:
    """Storage holds, for step k of every trajectory, the slab rows ``want[k]`` bit for bit."""
    steps, n_seq = len(want), len(trajs)
    with GuidanceReader(storage, run, prefetch=False) as reader:
        got = reader.read(MicrobatchPlan([(t, 0, steps) for t in trajs]))
    for f in slab.layout:
        rg = got[f.name]
        for k in range(steps):
            raw = want[k].cpu()
            rows = [j * steps + k for j in range(n_seq)]  # plan rows: trajectory-major
            assert torch.equal(torch.as_tensor(rg.codes)[rows], raw[:, f.codes : f.codes + f.code_bytes]), (f.name, k)
            assert torch.equal(torch.as_tensor(rg.scales)[rows], raw[:, f.scales : f.scales + f.scale_bytes])
            gw = raw[:, f.g : f.g + 4].contiguous().view(torch.float32).reshape(-1)
            gs = torch.as_tensor(rg.global_scale, dtype=torch.float32).expand(n_seq * steps)[rows]
            ts = torch.as_tensor(rg.token_scales)[rows] if rg.token_scales is not None else 1.0
            assert torch.equal(gs * ts, gw), (f.name, k)


def _copy_path(copy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Select the recorder's slab copy path: the CUDA driver's (default) or torch's."""
    from tracestore.client.record import _cuda

    if copy == "torch":
        monkeypatch.setattr(_cuda, "_DRIVER", [None])
    else:
        assert _cuda.driver() is not None, "libcuda.so.1 cannot be bound on this GPU machine"


@pytest.mark.parametrize("copy", ["driver", "torch"])
def test_record_slab_orders_the_next_forward_after_its_late_copy(tmp_path, copy: str, monkeypatch) -> None:  # noqa: ANN001
    """The recorder's side stream is held back, so forward 1's staging copy runs late, and the
    engine rewrites the slab at once on its stream. record_slab must order the rewrite after its
    copy (a device-side wait), else forward 1's records would hold the rewritten bytes."""
    _copy_path(copy, monkeypatch)
    n_seq = 32
    spec = RunSpec("late", tuple(SiteSpec(f"layers.{i}.mlp.input", "moe_input", i, 256) for i in range(3)))
    slab = RecordSlab.allocate(spec.sites, n_seq, "cuda")
    g = torch.full((n_seq,), 0.01, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(5)
    hz = torch.cuda.get_device_properties(0).clock_rate * 1000  # kHz -> cycles per second
    trajs = [f"t{i}" for i in range(n_seq)]

    def forward() -> None:
        x = torch.randn(n_seq, 256, device="cuda", generator=gen)
        for s in spec.sites:
            record_from_activations(x, s, slab[s.name], global_scale=g)

    with ServeProcess(tmp_path, wal=False, unix_socket=True, flags=["--flush-interval", "0.1"]) as sp:
        rec = RolloutRecorder(sp.unix_address, spec, writer="late-0")
        want = []
        for k in range(2):
            forward()
            want.append(slab.data[:n_seq].clone())
            if k:  # the side stream exists after the first forward; hold its next copy back
                with torch.cuda.stream(rec._side_stream):  # noqa: SLF001 - the test delays the recorder's stream
                    torch.cuda._sleep(int(hz * 0.3))
            assert rec.record_slab([(t, k, k + 1) for t in trajs], slab)
            if k:
                slab.data.fill_(0xEE)  # the next forward's kernels rewrite the slab right away
        for t in trajs:
            rec.finish(t, 3)
        assert rec.flush(timeout=60), sp.log_tail()
        rec.close()
        assert sp.terminate() == 0
    _check_steps(sp.storage, "late", slab, want, trajs)
    assert rec.stats["driver_copies"] == (2 if copy == "driver" else 0), rec.stats
