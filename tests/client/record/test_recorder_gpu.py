"""RolloutRecorder from CUDA tensors through a real sidecar process (GPU only).

What a rollout engine does: its kernels write each forward's records into a static GPU slab, then
``record_forward`` hands slices of that slab to the recorder, which copies them on a side stream
into the pinned staging pool and returns at once. Checked here:

- bytes read back from storage are identical to what the kernels wrote, over TCP (inline bytes)
  and over the unix socket (shared-memory descriptors);
- the same while the producing kernels are a CUDA graph replayed on a non-default stream;
- the caller never synchronizes: ``record_forward`` returns while a long kernel queued ahead of
  the producing kernel is still running (and ``torch.cuda.set_sync_debug_mode("error")`` raises
  on any synchronizing call inside it), and the copy still sees the producer's output;
- the engine may rewrite its slab right after ``record_forward``: the copy is ordered before it
  (the side stream is held back here so a missing dependency would read the new bytes).

Run on a GPU machine (needs torch with CUDA plus the server extra; no s3fs/moto/zstandard)::

    pip install -e '.[server]' pytest && python -m pytest -q -m gpu tests/client/record/test_recorder_gpu.py
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the GPU recorder tests need torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)
for _mod in ("grpc", "grpc_health", "pyarrow", "fsspec", "prometheus_client"):
    pytest.importorskip(_mod, reason=f"the sidecar needs {_mod}: pip install -e '.[server]'")

from tracestore.client import GuidanceReader, RolloutRecorder, SiteOutput  # noqa: E402
from tracestore.server.testing import ServeProcess  # noqa: E402

from tracestore.records import RunSpec, SiteSpec  # noqa: E402

pytestmark = pytest.mark.gpu

SPEC = RunSpec(
    "gpu",
    (
        SiteSpec("layers.20.mlp.input", "moe_input", layer=20, width=2048),
        SiteSpec("layers.21.mlp.input", "moe_input", layer=21, width=512, bits=2),
        SiteSpec("layers.21.attn.k", "key", layer=21, width=256, format="mxfp4"),
    ),
)
MAX_ROWS = 1024  # the engine's static slab holds this many token rows per site


class Engine:
    """A fake engine with static GPU slabs per site that its 'kernels' (torch ops on the current
    stream, or a captured CUDA graph of them) fill from per-forward inputs."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator(device="cuda").manual_seed(seed)
        dev = torch.device("cuda")
        self.slab = {s.name: torch.zeros(MAX_ROWS, s.code_bytes, dtype=torch.uint8, device=dev) for s in SPEC.sites}
        self.sslab = {s.name: torch.zeros(MAX_ROWS, s.scale_bytes, dtype=torch.uint8, device=dev) for s in SPEC.sites}
        self.g = {s.name: torch.ones(1, dtype=torch.float32, device=dev) for s in SPEC.sites}
        # static inputs of the graph variant
        self.src = {s.name: torch.zeros_like(self.slab[s.name]) for s in SPEC.sites}
        self.ssrc = {s.name: torch.zeros_like(self.sslab[s.name]) for s in SPEC.sites}
        self.key = {s.name: torch.full((1, s.code_bytes), 0x5A, dtype=torch.uint8, device=dev) for s in SPEC.sites}
        # expected bytes per (trajectory, site): {token: (codes row, scales row, g)}
        self.expected: dict[tuple[str, str], dict[int, tuple[bytes, bytes, float]]] = {}
        self.graph: Any = None

    def _rand(self, shape: tuple[int, ...]) -> Any:
        return torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda", generator=self.gen)

    def kernels(self, rows: int) -> None:
        """Eager 'kernels': write fresh rows into the slabs on the current stream."""
        for s in SPEC.sites:
            self.slab[s.name][:rows].copy_(self._rand((rows, s.code_bytes)))
            self.sslab[s.name][:rows].copy_(self._rand((rows, s.scale_bytes)))
            # decode-side global scale (NVFP4 only; MXFP4 has none): a host scalar, no sync
            g = 0.01 + float(np.random.default_rng(rows).random()) if s.fmt.has_global_scale else 1.0
            self.g[s.name].fill_(g)

    def capture(self, stream: Any) -> None:
        """Capture the producing kernels (slab = src ^ key, scales = ssrc) as one CUDA graph."""
        self.graph = torch.cuda.CUDAGraph()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the capture, as CUDA graphs want
                self._graph_body()
            torch.cuda.current_stream().synchronize()
            with torch.cuda.graph(self.graph, stream=stream):
                self._graph_body()
        torch.cuda.current_stream().wait_stream(stream)

    def _graph_body(self) -> None:
        for s in SPEC.sites:
            torch.bitwise_xor(self.src[s.name], self.key[s.name], out=self.slab[s.name])
            self.sslab[s.name].copy_(self.ssrc[s.name])

    def outputs(self, rows: int) -> dict[str, SiteOutput]:
        return {
            s.name: SiteOutput(self.slab[s.name][:rows], self.sslab[s.name][:rows], self.g[s.name]) for s in SPEC.sites
        }

    def remember(self, segs: list[tuple[str, int, int]]) -> None:
        """Note what the slabs hold now for ``segs`` (synchronizes: test bookkeeping only)."""
        torch.cuda.synchronize()
        row = 0
        for s in SPEC.sites:
            codes = self.slab[s.name].cpu().numpy()
            scales = self.sslab[s.name].cpu().numpy()
            g = float(self.g[s.name].item())
            row = 0
            for t, a, b in segs:
                d = self.expected.setdefault((t, s.name), {})
                for tok in range(a, b):
                    d[tok] = (codes[row].tobytes(), scales[row].tobytes(), g)
                    row += 1


def check_read_back(sp: ServeProcess, eng: Engine, plan: list[tuple[str, int, int]]) -> None:
    """Read ``plan`` through the sidecar (its Read commits the backlog first), then from storage."""
    for source in (sp.address, sp.storage):
        with GuidanceReader(source, SPEC.run, prefetch=False) as reader:
            _compare(reader.read_host(plan), eng, plan)


def _compare(rows: dict[str, Any], eng: Engine, plan: list[tuple[str, int, int]]) -> None:
    for s in SPEC.sites:
        r = rows[s.name]
        assert bool(r.valid.all()), s.name
        want = [eng.expected[(t, s.name)][tok] for t, a, b in plan for tok in range(a, b)]
        assert r.codes.tobytes() == b"".join(w[0] for w in want), s.name
        assert r.scales.tobytes() == b"".join(w[1] for w in want), s.name
        assert np.array_equal(r.global_scale, np.array([w[2] for w in want], np.float32)), s.name


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    sp = ServeProcess(tmp_path_factory.mktemp("gpu"), unix_socket=True,
                      flags=["--flush-interval", "0.1", "--metrics-port", "off"])  # fmt: skip
    with sp:
        yield sp


def _address(sp: ServeProcess, transport: str) -> str:
    return sp.address if transport == "tcp" else sp.unix_address


def _finish(rec: RolloutRecorder, trajs: list[str], n: int) -> None:
    for t in trajs:
        rec.finish(t, n)
    assert rec.flush(120), rec.stats
    assert rec.stats["unguided"] == 0 and rec.stats["acked_messages"] == rec.stats["messages"] > 0, rec.stats


@pytest.mark.parametrize("transport", ["tcp", "unix-shm"])
def test_record_from_cuda_slab_bytes_identical(served: ServeProcess, transport: str) -> None:
    """Prefill then decode forwards from a static CUDA slab; the slab is rewritten by the next
    forward's kernels right after each record_forward."""
    eng = Engine(seed=1)
    rec = RolloutRecorder(_address(served, transport), SPEC, f"gpu-slab-{transport}", staging_bytes=64 << 20)
    assert rec.pinned, "the staging pool must be registered with CUDA at start-up"
    trajs = [f"slab-{transport}-{k}" for k in range(8)]
    prompt, gen = 48, 12
    try:
        segs = [(t, 0, prompt) for t in trajs]
        eng.kernels(len(trajs) * prompt)
        eng.remember(segs)
        assert rec.record_forward(segs, eng.outputs(len(trajs) * prompt))
        for step in range(gen):
            segs = [(t, prompt + step, prompt + step + 1) for t in trajs]
            eng.kernels(len(trajs))  # overwrites the slab the previous copy reads from
            eng.remember(segs)
            assert rec.record_forward(segs, eng.outputs(len(trajs)))
        _finish(rec, trajs, prompt + gen + 1)
    finally:
        rec.close(timeout=30)
    check_read_back(served, eng, [(t, 0, prompt + gen) for t in reversed(trajs)])


@pytest.mark.parametrize("transport", ["tcp", "unix-shm"])
def test_record_while_cuda_graph_replays_on_another_stream(served: ServeProcess, transport: str) -> None:
    """The producing kernels are a CUDA graph replayed on a side stream of the engine; the
    recorder is called with that stream current, once per replay, without synchronizing."""
    eng = Engine(seed=2)
    stream = torch.cuda.Stream()
    eng.capture(stream)
    rec = RolloutRecorder(_address(served, transport), SPEC, f"gpu-graph-{transport}", staging_bytes=64 << 20)
    trajs = [f"graph-{transport}-{k}" for k in range(16)]
    steps = 24
    host_src = {s.name: np.zeros((len(trajs), s.code_bytes), np.uint8) for s in SPEC.sites}
    host_ssrc = {s.name: np.zeros((len(trajs), s.scale_bytes), np.uint8) for s in SPEC.sites}
    rng = np.random.default_rng(2)
    n = len(trajs)
    try:
        for step in range(steps):
            segs = [(t, step, step + 1) for t in trajs]
            for s in SPEC.sites:
                host_src[s.name][:] = rng.integers(0, 256, host_src[s.name].shape, dtype=np.uint8)
                host_ssrc[s.name][:] = rng.integers(0, 256, host_ssrc[s.name].shape, dtype=np.uint8)
                want = host_src[s.name] ^ np.uint8(0x5A)
                for i, t in enumerate(trajs):
                    eng.expected.setdefault((t, s.name), {})[step] = (
                        want[i].tobytes(), host_ssrc[s.name][i].tobytes(), 1.0,
                    )  # fmt: skip
            with torch.cuda.stream(stream):
                for s in SPEC.sites:  # new inputs (pageable host -> device: ordered on this stream)
                    eng.src[s.name][:n].copy_(torch.from_numpy(host_src[s.name]))
                    eng.ssrc[s.name][:n].copy_(torch.from_numpy(host_ssrc[s.name]))
                eng.graph.replay()
                assert rec.record_forward(segs, eng.outputs(n))
        torch.cuda.current_stream().wait_stream(stream)
        _finish(rec, trajs, steps + 1)
    finally:
        rec.close(timeout=30)
    check_read_back(served, eng, [(t, 0, steps) for t in trajs])


def _cycles_per_second() -> float:
    """GPU clock cycles of torch.cuda._sleep per second (measured: clocks differ per GPU)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm-up
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    return 50_000_000 / (start.elapsed_time(end) / 1e3)


@pytest.mark.parametrize("transport", ["tcp", "unix-shm"])
def test_record_forward_never_synchronizes(served: ServeProcess, transport: str) -> None:
    """A 1 s kernel is queued ahead of the producing kernel: record_forward must return long
    before it ends (no device sync, no blocking copy), and the copy must still see the producer's
    output (ordered after it on the device)."""
    eng = Engine(seed=3)
    rec = RolloutRecorder(_address(served, transport), SPEC, f"gpu-nosync-{transport}", staging_bytes=64 << 20)
    trajs = [f"nosync-{transport}-{k}" for k in range(4)]
    rows = len(trajs) * 32
    segs = [(t, 0, 32) for t in trajs]
    hz = _cycles_per_second()
    try:
        # warm-up forward: first-use work (side stream, pool tensor) is not what we time
        eng.kernels(rows)
        eng.remember(segs)
        assert rec.record_forward(segs, eng.outputs(rows))
        _finish(rec, trajs, 33)

        segs2 = [(t, 0, 32) for t in (f"{x}-b" for x in trajs)]
        final = {s.name: torch.randint(0, 256, (rows, s.code_bytes), dtype=torch.uint8, device="cuda")
                 for s in SPEC.sites}  # fmt: skip
        torch.cuda.synchronize()
        torch.cuda._sleep(int(hz * 1.0))  # the long kernel ahead
        for s in SPEC.sites:  # the producer: runs only after the sleep
            eng.slab[s.name][:rows].copy_(final[s.name])
        t0 = time.perf_counter()
        torch.cuda.set_sync_debug_mode("error")
        try:
            ok = rec.record_forward(segs2, eng.outputs(rows))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        elapsed = time.perf_counter() - t0
        still_running = not torch.cuda.current_stream().query()
        assert ok
        assert elapsed < 0.25, f"record_forward took {elapsed:.3f} s behind a 1 s kernel: it waited for the GPU"
        assert still_running, "the long kernel had finished when record_forward returned: it synchronized"
        eng.remember(segs2)  # (synchronizes) what the slab holds after the producer ran
        for s in SPEC.sites:
            assert eng.slab[s.name][:rows].cpu().numpy().tobytes() == final[s.name].cpu().numpy().tobytes()
        _finish(rec, [t for t, _, _ in segs2], 33)
    finally:
        rec.close(timeout=30)
    check_read_back(served, eng, segs2)


def test_slab_rewrite_waits_for_the_copy(served: ServeProcess) -> None:
    """The side stream is held back by a long kernel, so the copy of forward 1 runs late; the
    engine's kernels for forward 2 rewrite the slab at once on its stream. The recorder must order
    them after its copy, or forward 1's records would hold forward 2's bytes."""
    eng = Engine(seed=4)
    rec = RolloutRecorder(served.unix_address, SPEC, "gpu-rewrite", staging_bytes=64 << 20)
    trajs = [f"rewrite-{k}" for k in range(4)]
    rows = len(trajs) * 16
    hz = _cycles_per_second()
    try:
        eng.kernels(rows)  # warm-up forward creates the side stream
        seg0 = [(t, 0, 16) for t in trajs]
        eng.remember(seg0)
        assert rec.record_forward(seg0, eng.outputs(rows))
        side = rec._side_stream  # noqa: SLF001 - the test delays the recorder's own copy stream
        assert side is not None
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(hz * 0.3))
        seg1 = [(t, 16, 32) for t in trajs]
        eng.kernels(rows)
        eng.remember(seg1)  # synchronizes everything: includes the sleep, fine (bookkeeping)
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(hz * 0.3))  # the next copy will run late
        assert rec.record_forward(seg1, eng.outputs(rows))
        for s in SPEC.sites:  # forward 2's kernels rewrite the slab right away
            eng.slab[s.name][:rows].copy_(torch.full_like(eng.slab[s.name][:rows], 0xEE))
        _finish(rec, trajs, 33)
    finally:
        rec.close(timeout=30)
    check_read_back(served, eng, [(t, 0, 32) for t in trajs])


def test_pool_is_pinned_at_start_up() -> None:
    rec = RolloutRecorder("127.0.0.1:1", SPEC, "gpu-pin", staging_bytes=8 << 20, connect=False)
    try:
        assert rec.pinned
        assert rec.pool.tensor().is_pinned(), "torch must see the registered pool as pinned (else copies block)"
    finally:
        rec.close(timeout=0.1)


def test_reads_through_child_processes_land_on_the_gpu(tmp_path) -> None:
    # GuidanceReader(process=2, device="cuda"): rows decoded by two child processes into shared
    # memory, pinned and copied to the GPU, equal to the same read decoded in this process
    from tracestore.records import RecordChunk
    from tracestore.storage.store import Store

    url = f"file://{tmp_path}/store"
    store = Store(url)
    store.put_run(SPEC)
    rng = np.random.default_rng(7)
    chunks = [
        RecordChunk(SPEC.run, 0, t, s.name, 0, 300,
                    rng.integers(0, 256, (300 * s.rows_per_token, s.code_bytes), dtype=np.uint8),
                    rng.integers(0, 256, (300 * s.rows_per_token, s.scale_bytes), dtype=np.uint8),
                    0.5 if s.format == "nvfp4" else 1.0)
        for t in ("a", "b") for s in SPEC.sites
    ]  # fmt: skip
    store.write_shard(SPEC.run, 0, "w0", 0, chunks)
    plan = [("b", 10, 300), ("a", 0, 300)]
    from tracestore.client.read import read_process

    old, read_process.MIN_SLICE_BYTES = read_process.MIN_SLICE_BYTES, 1  # split even this small read
    try:
        with (
            GuidanceReader(url, SPEC.run, prefetch=False) as here,
            GuidanceReader(url, SPEC.run, device="cuda", process=2) as there,
        ):
            want = here.read_host(plan)
            there.prefetch(plan)
            got = there.read(plan)
            assert len(there._rows.procs.pids) == 2
    finally:
        read_process.MIN_SLICE_BYTES = old
    for s in SPEC.sites:
        g = got[s.name]
        assert g.codes.is_cuda and g.scales.is_cuda
        assert np.array_equal(g.codes.cpu().numpy(), want[s.name].codes), s.name
        assert np.array_equal(g.scales.cpu().numpy(), want[s.name].scales), s.name
        assert bool(g.valid.all())
