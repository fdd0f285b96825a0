"""Recorder -> separate `tracestore serve` process -> storage -> GuidanceReader, on the CPU.

Bytes read back (from storage directly, from the sidecar over TCP and over the unix socket) are
identical to what the recorder was given, in plan order, including prefix links and several rows
per token. Also: the recorder never blocks or crashes when the sidecar is away.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from tracestore.client import GuidanceReader, RolloutRecorder, SiteOutput
from tracestore.server.testing import ServeProcess

from tracestore.errors import DTypeError, MissingRecordsError, ShapeError, ValidationError
from tracestore.records import RunSpec, SiteSpec

SPEC = RunSpec(
    "e2e",
    (
        SiteSpec("layers.20.mlp.input", "moe_input", layer=20, width=128),
        SiteSpec("layers.20.mlp.experts", "moe_input", layer=20, width=64, rows_per_token=2, bits=2),
        SiteSpec("layers.20.attn.k", "key", layer=20, width=64, format="mxfp4"),
    ),
)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    sp = ServeProcess(tmp_path_factory.mktemp("e2e"), unix_socket=True, flags=["--flush-interval", "0.1"])
    with sp:
        yield sp


class Rollout:
    """A fake engine: prefill forwards of whole prompts, then decode forwards of one token each."""

    def __init__(self, n_traj: int, prompt: int, gen: int, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.n_traj, self.prompt, self.gen = n_traj, prompt, gen
        self.rows: dict[tuple[str, str], list[tuple[int, np.ndarray, np.ndarray, float, np.ndarray | None]]] = {}

    def traj(self, i: int) -> str:
        return f"q{i // 4}-s{i % 4}"

    def forward(self, segs: list[tuple[str, int, int]], torch_tensors: bool = False) -> dict[str, SiteOutput]:
        out = {}
        n = sum(b - a for _, a, b in segs)
        for s in SPEC.sites:
            rows = n * s.rows_per_token
            codes = self.rng.integers(0, 256, (rows, s.code_bytes), dtype=np.uint8)
            scales = self.rng.integers(0, 256, (rows, s.scale_bytes), dtype=np.uint8)
            g = float(np.float32(self.rng.uniform(0.01, 1))) if s.fmt.has_global_scale else 1.0
            ts = self.rng.uniform(0.5, 2, rows).astype(np.float32) if s.name.endswith("experts") else None
            r = 0
            for t, a, b in segs:
                k = (b - a) * s.rows_per_token
                self.rows.setdefault((t, s.name), []).append(
                    (a, codes[r : r + k], scales[r : r + k], g, None if ts is None else ts[r : r + k])
                )
                r += k
            if torch_tensors:
                out[s.name] = SiteOutput(torch.from_numpy(codes), torch.from_numpy(scales), torch.tensor(g),
                                         None if ts is None else torch.from_numpy(ts))  # fmt: skip
            else:
                out[s.name] = SiteOutput(codes, scales, g, ts)
        return out

    def expected(self, plan: list[tuple[str, int, int]], site: str, links: dict[str, str]) -> dict[str, np.ndarray]:
        s = SPEC.site(site)
        parts: dict[str, list[np.ndarray]] = {"codes": [], "scales": [], "g": []}
        for t, a, b in plan:
            for tok in range(a, b):
                owner = links.get(t, t) if tok < self.prompt else t
                for start, codes, scales, g, _ in self.rows[(owner, site)]:
                    n = len(codes) // s.rows_per_token
                    if start <= tok < start + n:
                        k = (tok - start) * s.rows_per_token
                        parts["codes"].append(codes[k : k + s.rows_per_token])
                        parts["scales"].append(scales[k : k + s.rows_per_token])
                        parts["g"].append(np.full(s.rows_per_token, g, np.float32))
        return {k: np.concatenate(v) for k, v in parts.items()}


def _record(rec: RolloutRecorder, ro: Rollout, links: bool, torch_tensors: bool = False) -> dict[str, str]:
    linked: dict[str, str] = {}
    # prefill: sample 0 of each group runs the prompt; samples 1..3 hit the prefix cache (linked)
    firsts = [ro.traj(i) for i in range(ro.n_traj) if i % 4 == 0 or not links]
    assert rec.record_forward([(t, 0, ro.prompt) for t in firsts], ro.forward([(t, 0, ro.prompt) for t in firsts]))
    if links:
        for i in range(ro.n_traj):
            if i % 4:
                rec.link_prefix(ro.traj(i), ro.traj(i - i % 4), ro.prompt)
                linked[ro.traj(i)] = ro.traj(i - i % 4)
    for step in range(ro.gen - 1):  # the last sampled token never runs a forward
        segs = [(ro.traj(i), ro.prompt + step, ro.prompt + step + 1) for i in range(ro.n_traj)]
        assert rec.record_forward(segs, ro.forward(segs, torch_tensors))
    for i in range(ro.n_traj):
        rec.finish(ro.traj(i), ro.prompt + ro.gen)
    return linked


@pytest.mark.parametrize("transport", ["tcp", "unix-shm"])
def test_end_to_end_bytes_identical(served: ServeProcess, transport: str) -> None:
    address = served.address if transport == "tcp" else served.unix_address
    ro = Rollout(n_traj=16, prompt=9, gen=6, seed=hash(transport) % 1000)
    rec = RolloutRecorder(address, SPEC, f"writer-{transport}", staging_bytes=8 << 20, batch_bytes=64 << 10)
    assert (rec.pool.name is not None) == (transport == "unix-shm")
    # distinct trajectory names per transport
    ro.traj = lambda i, tr=transport: f"{tr}-q{i // 4}-s{i % 4}"  # type: ignore[method-assign]
    links = _record(rec, ro, links=True, torch_tensors=transport == "tcp")
    assert rec.flush(60), rec.stats
    assert rec.stats["unguided"] == 0 and rec.stats["acked_messages"] == rec.stats["messages"] > 0
    rec.close()
    n = ro.prompt + ro.gen - 1
    plan = [(ro.traj(i), 0, n) for i in (5, 0, 15, 2, 9)] + [(ro.traj(3), 4, 11)]
    for source in (served.address, served.unix_address, served.storage):  # sidecar Read flushes first
        with GuidanceReader(source, SPEC.run, prefetch=True) as reader:
            reader.prefetch(plan)
            got = reader.read(plan)
        for s in SPEC.sites:
            want = ro.expected(plan, s.name, links)
            g = got[s.name]
            assert g.codes.dtype == torch.uint8 and g.codes.shape == (len(want["codes"]), s.code_bytes)
            assert g.codes.numpy().tobytes() == want["codes"].tobytes(), (source, s.name)
            assert g.scales.numpy().tobytes() == want["scales"].tobytes(), (source, s.name)
            assert np.array_equal(g.global_scale.numpy(), want["g"]), (source, s.name)
            assert bool(g.valid.all()) and g.bits == s.bits and g.fmt == s.fmt
            assert (g.token_scales is not None) == s.name.endswith("experts")
    if transport == "unix-shm":
        text = urllib.request.urlopen(f"http://127.0.0.1:{served.metrics_port}/metrics", timeout=10).read().decode()
        line = next(x for x in text.splitlines() if x.startswith('tracestore_ingest_bytes_total{path="shm"}'))
        assert float(line.split()[-1]) > 0
        cap = next(x for x in text.splitlines() if x.startswith("tracestore_shm_capacity_bytes"))
        assert float(cap.split()[-1]) >= 8 << 20  # the recorder's pool is mapped and reported


def test_reader_missing_records(served: ServeProcess) -> None:
    rec = RolloutRecorder(served.address, SPEC, "writer-missing")
    ro = Rollout(4, 3, 2, seed=3)
    ro.traj = lambda i: f"miss-{i}"  # type: ignore[method-assign]
    _record(rec, ro, links=False)
    assert rec.flush(30)
    rec.close()
    plan = [("miss-0", 0, 4), ("miss-1", 0, 9)]  # tokens 5..8 of miss-1 were never recorded
    for source in (served.address, served.storage):
        with (
            GuidanceReader(source, SPEC.run, prefetch=False) as reader,
            pytest.raises(MissingRecordsError, match="miss-1"),
        ):
            reader.read(plan)
        with GuidanceReader(source, SPEC.run, on_missing="mask", sites=["layers.20.mlp.input"]) as reader:
            g = reader.read(plan)["layers.20.mlp.input"]
        # sealed with n_tokens 5: position 4 is unrecorded by design, 5..8 are beyond the seal
        assert g.valid.tolist() == [True] * 4 + [True] * 4 + [False] * 5


def test_unreachable_sidecar_never_blocks(tmp_path: Path) -> None:
    sp = ServeProcess(tmp_path)
    sp.port = _free_port()
    rec = RolloutRecorder(sp.address, SPEC, "lonely", give_up_s=1.5, staging_bytes=1 << 20)
    ro = Rollout(4, 8, 1, seed=1)
    ro.traj = lambda i: f"lost-{i}"  # type: ignore[method-assign]
    t0 = time.monotonic()
    for _ in range(20):
        rec.record_forward([(ro.traj(i), 0, 8) for i in range(4)], ro.forward([(ro.traj(i), 0, 8) for i in range(4)]))
    assert time.monotonic() - t0 < 1.0  # staging copies only, no network wait
    deadline = time.monotonic() + 20
    while rec.stats["unguided"] < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rec.unguided == {f"lost-{i}" for i in range(4)}
    assert rec.finish("lost-0", 9) is False  # unguided trajectories are never sealed
    assert rec.pool.in_use == 0  # dropped records released their staging
    sp.start()  # the sidecar appears: new trajectories flow
    try:
        segs = [("found-0", 0, 8)]
        assert rec.record_forward(segs, ro.forward(segs))
        rec.finish("found-0", 9)
        assert rec.flush(30), rec.stats
        assert rec.stats["unguided"] == 4, rec.stats  # found-0 went through
        with GuidanceReader(sp.address, SPEC.run) as reader:
            assert reader.read([("found-0", 0, 8)])["layers.20.mlp.input"].valid.all()
        text = urllib.request.urlopen(f"http://127.0.0.1:{sp.metrics_port}/metrics", timeout=10).read().decode()
        assert 'tracestore_unguided_trajectories_total{reason="sidecar_unreachable"} 4.0' in text
    finally:
        rec.close(timeout=5)
        sp.terminate()


def test_staging_full_refuses_without_blocking(served: ServeProcess) -> None:
    rec = RolloutRecorder(served.address, SPEC, "tiny", staging_bytes=8192, connect=False)
    ro = Rollout(2, 64, 1)
    segs = [("big-0", 0, 64), ("big-1", 0, 64)]
    assert rec.record_forward(segs, ro.forward(segs)) is False
    assert rec.unguided == {"big-0", "big-1"} and rec.stats["refused_forwards"] == 1
    rec.close(timeout=1)


def test_record_forward_never_waits_for_the_sender(served: ServeProcess) -> None:
    """No rollout slowdown: the engine thread must not wait while the sender holds the recorder's lock (it
    expands, coalesces and serializes under it); a decode step costs the same with the sender busy.
    Before the fix record_forward took that lock: this call waited the full hold."""
    import threading

    rec = RolloutRecorder(served.address, SPEC, "never-waits", connect=False)
    ro = Rollout(64, 1, 1, seed=3)
    segs = [(ro.traj(i), 0, 1) for i in range(64)]
    out = ro.forward(segs)
    held, release = threading.Event(), threading.Event()

    def busy_sender() -> None:
        with rec._lock:  # noqa: SLF001 - stands in for the sender thread mid-batch
            held.set()
            release.wait(10)

    t = threading.Thread(target=busy_sender)
    t.start()
    try:
        assert held.wait(5)
        t0 = time.monotonic()
        for step in range(5):
            assert rec.record_forward([(tr, step, step + 1) for tr, _, _ in segs], out)
            assert rec.finish(f"done-{step}", 2) is True
        assert time.monotonic() - t0 < 2.0, "record_forward waited for the sender's lock"
    finally:
        release.set()
        t.join()
    pieces, extras = rec._outbox.take(1 << 30)  # noqa: SLF001 - the sender's view of the queue
    assert len(pieces) == 5 * 64 * len(SPEC.sites) and len(extras) == 5
    assert all(e.sites == tuple(sorted(s.name for s in SPEC.sites)) for e in extras)  # type: ignore[union-attr]
    rec.close(timeout=1)


def test_rejected_message_marks_only_its_trajectories(served: ServeProcess) -> None:
    a = RolloutRecorder(served.address, SPEC, "dup-a")
    b = RolloutRecorder(served.address, SPEC, "dup-b", batch_bytes=1)  # one forward per message
    ro = Rollout(1, 4, 1, seed=11)
    segs = [("clash", 0, 4)]
    a.record_forward(segs, ro.forward(segs))
    assert a.flush(30)
    b.record_forward(segs, ro.forward(segs))  # same key, other bytes: ALREADY_EXISTS
    later = [("after-clash", 0, 4)]
    b.record_forward(later, ro.forward(later))
    b.finish("after-clash", 5)
    assert not b.flush(30), b.stats  # False: a message was refused and dropped while it waited
    assert not b._session.pending() and b.stats["dropped"] >= 1  # noqa: SLF001 - everything else went
    # clash's three chunks travel as three messages; those already in flight when the first is
    # refused are refused too (each alone), the rest are dropped as unguided before sending
    assert b.unguided == {"clash"} and 1 <= b.stats["rejected_messages"] <= len(SPEC.sites)
    with GuidanceReader(served.address, SPEC.run) as reader:
        assert reader.read(later)["layers.20.mlp.input"].valid.all()
    a.close()
    b.close()


def test_bad_arguments_raise(served: ServeProcess) -> None:
    rec = RolloutRecorder(served.address, SPEC, "args", connect=False)
    ro = Rollout(1, 4, 1)
    out = ro.forward([("x", 0, 4)])
    with pytest.raises(ShapeError, match=r"must have shape \[6, 16\]"):
        rec.record_forward([("x", 0, 6)], out)
    with pytest.raises(ValidationError, match="invalid trajectory id"):
        rec.record_forward([("../x", 0, 4)], out)
    with pytest.raises(ValidationError, match="declares no site"):
        rec.record_forward([("x", 0, 4)], {"nope": out["layers.20.mlp.input"]})
    # wrong dtypes, numpy and torch, refused on every call (the dtype decision is cached per dtype)
    site = "layers.20.mlp.input"
    good = out[site]
    for codes in (good.codes.view(np.int8), torch.from_numpy(good.codes.view(np.int8))):
        for _ in range(2):
            with pytest.raises(DTypeError, match=rf"{site}.codes must have dtype uint8, got (torch\.)?int8"):
                rec.record_forward([("x", 0, 4)], {**out, site: SiteOutput(codes, good.scales, good.global_scale)})
    bad_ts = SiteOutput(good.codes, good.scales, good.global_scale, np.ones(good.codes.shape[0], np.float64))
    with pytest.raises(DTypeError, match="token_scales must have dtype float32, got float64"):
        rec.record_forward([("x", 0, 4)], {**out, site: bad_ts})
    assert rec.record_forward([("x", 0, 4)], out)  # and the right ones still pass
    rec.close(timeout=1)


def test_client_import_is_light() -> None:
    code = ("import sys, tracestore.client, tracestore.server; "
            "print(sorted(m for m in ('torch', 'grpc', 'cupy', 'triton') if m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_policy_version_per_chunk_and_large_reads(served: ServeProcess) -> None:
    """A trajectory spanning two policy versions (partial rollout), and a read larger than one
    Read message (the sidecar splits per site into 4 MiB slices; the reader reassembles)."""
    site = SPEC.site("layers.20.mlp.input")
    rec = RolloutRecorder(served.address, SPEC, "versions", staging_bytes=64 << 20)
    rng = np.random.default_rng(21)
    n = 120000  # the experts site: 240k rows x 37 B on the wire = 3 Read slices of <= 4 MiB
    parts = []
    for version, (a, b) in ((0, (0, n // 2)), (1, (n // 2, n))):
        out = {}
        for s in SPEC.sites:
            rows = (b - a) * s.rows_per_token
            codes = rng.integers(0, 256, (rows, s.code_bytes), dtype=np.uint8)
            scales = rng.integers(0, 256, (rows, s.scale_bytes), dtype=np.uint8)
            out[s.name] = SiteOutput(codes, scales, 0.5 if s.fmt.has_global_scale else 1.0)
        parts.append(out[site.name])
        assert rec.record_forward([("long", a, b)], out, policy_version=version)
    rec.finish("long", n + 1)
    assert rec.flush(60), rec.stats
    rec.close()
    for source in (served.address, served.storage):
        with GuidanceReader(source, SPEC.run, prefetch=False) as reader:
            host = reader.read_host([("long", 0, n)])
        rows = host[site.name]
        assert rows.codes.tobytes() == parts[0].codes.tobytes() + parts[1].codes.tobytes()
        assert rows.policy_version.tolist() == [0] * (n // 2) + [1] * (n // 2)
        experts = host["layers.20.mlp.experts"]
        assert experts.codes.shape == (2 * n, 16) and experts.valid.all()


@pytest.mark.parametrize("transport", ["tcp", "unix-shm"])
def test_decode_steps_coalesce_into_one_chunk_per_run(served: ServeProcess, transport: str) -> None:
    """Decode forwards (one token per sequence) with a static global scale: consecutive tokens of a
    (trajectory, site) travel and are stored as one chunk; a change of global scale starts a new one.
    The bytes read back are those recorded, token for token."""
    address = served.address if transport == "tcp" else served.unix_address
    rec = RolloutRecorder(address, SPEC, f"decode-{transport}", linger_s=30.0)  # only flush() sends
    rng = np.random.default_rng(5)
    trajs = [f"dec-{transport}-{i}" for i in range(8)]
    steps = 24
    sent: dict[tuple[str, str], list[bytes]] = {}
    for step in range(steps):
        out = {}
        for s in SPEC.sites:
            rows = len(trajs) * s.rows_per_token
            codes = rng.integers(0, 256, (rows, s.code_bytes), dtype=np.uint8)
            scales = rng.integers(0, 256, (rows, s.scale_bytes), dtype=np.uint8)
            g = (0.5 if step < 16 else 0.25) if s.fmt.has_global_scale else 1.0  # scale changes at step 16
            ts = np.full(rows, 1.5, np.float32) if s.name.endswith("experts") else None
            out[s.name] = SiteOutput(codes, scales, g, ts)
            r = s.rows_per_token
            for i, t in enumerate(trajs):
                sent.setdefault((t, s.name), []).append(codes[i * r : (i + 1) * r].tobytes())
        assert rec.record_forward([(t, step, step + 1) for t in trajs], out)
    for t in trajs:
        rec.finish(t, steps + 1)
    assert rec.flush(60), rec.stats
    pieces = steps * len(trajs) * len(SPEC.sites)
    # NVFP4 sites split once at the scale change, the MX site not at all
    assert rec.stats["chunks"] == len(trajs) * (2 + 2 + 1), rec.stats
    assert rec.stats["chunks"] < pieces
    rec.close()
    for source in (served.address, served.storage):  # the sidecar's Read commits what it holds first
        with GuidanceReader(source, SPEC.run) as reader:
            host = reader.read_host([(t, 0, steps) for t in trajs])
        for s in SPEC.sites:
            want = b"".join(b"".join(sent[(t, s.name)]) for t in trajs)
            assert host[s.name].codes.tobytes() == want, (source, s.name)
            assert host[s.name].valid.all()


def test_decode_steps_larger_than_batch_bytes_coalesce(served: ServeProcess) -> None:
    """A decode step larger than ``batch_bytes`` (a wide model's) waits to be coalesced with the
    next ones (not sent at once, while the next step is computed): each (trajectory, site) travels
    as one chunk over the steps, not one per token."""
    rec = RolloutRecorder(served.unix_address, SPEC, "decode-wide", batch_bytes=1 << 10, linger_s=30.0)
    rng = np.random.default_rng(11)
    trajs = [f"wide-{i}" for i in range(32)]
    steps = 6
    sent: dict[tuple[str, str], list[bytes]] = {}
    for step in range(steps):
        out = {}
        for s in SPEC.sites:
            rows = len(trajs) * s.rows_per_token
            codes = rng.integers(0, 256, (rows, s.code_bytes), dtype=np.uint8)
            scales = rng.integers(0, 256, (rows, s.scale_bytes), dtype=np.uint8)
            out[s.name] = SiteOutput(codes, scales, 0.5 if s.fmt.has_global_scale else 1.0)
            r = s.rows_per_token
            for i, t in enumerate(trajs):
                sent.setdefault((t, s.name), []).append(codes[i * r : (i + 1) * r].tobytes())
        step_bytes = sum(o.codes.nbytes + o.scales.nbytes for o in out.values())
        assert step_bytes > rec.batch_bytes
        assert rec.record_forward([(t, step, step + 1) for t in trajs], out)
        time.sleep(0.2)  # the next step's forward: time for the sender to take what is ready
    assert rec.flush(60), rec.stats
    assert rec.stats["chunks"] == len(trajs) * len(SPEC.sites), rec.stats
    rec.close()
    with GuidanceReader(served.address, SPEC.run) as reader:
        host = reader.read_host([(t, 0, steps) for t in trajs])
    for s in SPEC.sites:
        assert host[s.name].codes.tobytes() == b"".join(b"".join(sent[(t, s.name)]) for t in trajs), s.name


@pytest.mark.parametrize("transport", ["tcp", "unix-shm"])
def test_prefill_forwards_are_sent_at_once_whatever_batch_bytes(served: ServeProcess, transport: str) -> None:
    """A forward whose sequences are long (prefill: >= 32 tokens each) is not held back to be
    coalesced with later forwards, even when it is smaller than ``batch_bytes``: it is acknowledged
    without a flush although linger_s is 30 s, and each sequence travels as one chunk per site."""
    address = served.address if transport == "tcp" else served.unix_address
    rec = RolloutRecorder(address, SPEC, f"prefill-{transport}", batch_bytes=64 << 20, linger_s=30.0)
    rng = np.random.default_rng(9)
    trajs = [f"pre-{transport}-{i}" for i in range(3)]
    out = {}
    for s in SPEC.sites:
        rows = 3 * 40 * s.rows_per_token
        out[s.name] = SiteOutput(rng.integers(0, 256, (rows, s.code_bytes), dtype=np.uint8),
                                 rng.integers(0, 256, (rows, s.scale_bytes), dtype=np.uint8),
                                 0.5 if s.fmt.has_global_scale else 1.0)  # fmt: skip
    assert rec.record_forward([(t, 0, 40) for t in trajs], out)
    deadline = time.monotonic() + 10
    while rec.stats["acked_messages"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rec.stats["acked_messages"] >= 1, rec.stats  # sent without flush(): it did not linger
    assert rec.stats["chunks"] == len(trajs) * len(SPEC.sites), rec.stats
    rec.close()
    with GuidanceReader(served.address, SPEC.run) as reader:
        host = reader.read_host([(t, 0, 40) for t in trajs])
    for s in SPEC.sites:
        assert host[s.name].codes.tobytes() == out[s.name].codes.tobytes(), s.name


def test_padding_segments_read_through_the_sidecar(served: ServeProcess) -> None:
    """A padded plan (None segments) reads the same through the sidecar as from storage (the sidecar
    refused the empty trajectory id the client sends for padding with INVALID_ARGUMENT)."""
    rec = RolloutRecorder(served.address, SPEC, "writer-padding")
    ro = Rollout(2, 3, 2, seed=4)
    ro.traj = lambda i: f"pad-{i}"  # type: ignore[method-assign]
    _record(rec, ro, links=False)
    assert rec.flush(30)
    rec.close()
    plan = [("pad-0", 0, 4), (None, 0, 3), ("pad-1", 1, 3)]
    got = {}
    for source in (served.address, served.storage):
        with GuidanceReader(source, SPEC.run, sites=["layers.20.mlp.input"]) as reader:
            got[source] = reader.read(plan)["layers.20.mlp.input"]
        assert got[source].valid.tolist() == [True] * 4 + [False] * 3 + [True] * 2
    a, b = got[served.address], got[served.storage]
    assert a.codes.numpy().tobytes() == b.codes.numpy().tobytes()


@pytest.mark.parametrize("transport", ["tcp", "unix-shm"])
def test_closed_recorder_frees_its_pool_without_the_cycle_collector(served: ServeProcess, transport: str) -> None:
    """A closed recorder is in no reference cycle, so its staging pool (whose memory the cycle
    collector cannot see) is unmapped when the last reference goes. A recorder that depended on the
    cycle collector kept every closed pool mapped until a full collection: a process opening a
    256 MiB recorder per 192 MiB stream grew by ~270 MB per recorder. Also: the policy version set
    on the recorder is the one its records and seals carry."""
    import gc
    import weakref

    address = served.address if transport == "tcp" else served.unix_address
    site = SPEC.site("layers.20.mlp.input")
    ro = Rollout(n_traj=4, prompt=5, gen=3, seed=7)
    ro.traj = lambda i, tr=transport: f"freed-{tr}-{i}"  # type: ignore[method-assign]
    gc.collect()
    gc.disable()
    try:
        rec = RolloutRecorder(address, SPEC, f"freed-{transport}", staging_bytes=16 << 20, batch_bytes=64 << 10)
        rec.policy_version = 7
        assert rec.policy_version == 7
        _record(rec, ro, links=False)
        assert rec.flush(60), rec.stats
        assert rec.close()
        freed = [weakref.ref(rec), weakref.ref(rec.pool)]
        del rec
        assert [r() for r in freed] == [None, None], "the closed recorder waits for the cycle collector"
    finally:
        gc.enable()
    with GuidanceReader(served.address, SPEC.run, prefetch=False) as reader:
        host = reader.read_host([(ro.traj(0), 0, ro.prompt + ro.gen - 1)])
    assert host[site.name].policy_version.tolist() == [7] * (ro.prompt + ro.gen - 1)


def test_degenerate_global_scales_are_stored_as_one(served: ServeProcess) -> None:
    """A g of 0, a negative number or a non-finite one means g = 1 (docs/numerics.md §3), and is
    stored as 1: a scalar g through the chunk, a per-row g through the rows' token scales (a NaN
    there would make the trainer's output NaN; a scalar one was refused by the sidecar)."""
    site = SPEC.site("layers.20.mlp.input")
    rec = RolloutRecorder(served.address, SPEC, "degenerate-g")
    rng = np.random.default_rng(5)
    bad = [0.0, -0.0, -2.0, float("inf"), float("-inf"), float("nan")]

    def forward(traj: str, g: object) -> None:
        out = {}
        for s in SPEC.sites:
            rows = len(bad) * s.rows_per_token
            codes = rng.integers(0, 256, (rows, s.code_bytes), dtype=np.uint8)
            scales = rng.integers(0, 256, (rows, s.scale_bytes), dtype=np.uint8)
            out[s.name] = SiteOutput(codes, scales, g if s.name == site.name else 1.0)
        assert rec.record_forward([(traj, 0, len(bad))], out)
        rec.finish(traj, len(bad) + 1)

    for k, g in enumerate(bad):
        forward(f"scalar-{k}", g)
    per_row = np.array(bad, np.float32)
    per_row[0] = 0.375  # a valid g among them stays as it is
    forward("per-row", per_row)
    assert rec.flush(30), rec.stats
    rec.close()
    with GuidanceReader(served.address, SPEC.run) as reader:
        for k in range(len(bad)):
            rows = reader.read_host([(f"scalar-{k}", 0, len(bad))])[site.name]
            assert rows.valid.all() and np.all(rows.global_scale == 1.0), (bad[k], rows.global_scale)
        rows = reader.read_host([("per-row", 0, len(bad))])[site.name]
        assert rows.valid.all()
        assert rows.global_scale.tolist() == [1.0] * len(bad)
        assert rows.token_scales.tolist() == [0.375, 1.0, 1.0, 1.0, 1.0, 1.0], rows.token_scales


def test_recorder_config_is_validated_and_builds_the_same_recorder(served: ServeProcess) -> None:
    """RecorderConfig checks its values on construction (the keyword arguments go through it too)
    and from_config builds a recorder with exactly those settings."""
    from tracestore.client import RecorderConfig

    from tracestore.errors import ConfigError

    for bad in ({"staging_bytes": 0}, {"batch_bytes": -1}, {"give_up_s": float("nan")}, {"linger_s": -1},
                {"reconnect_backoff_s": 20.0}, {"epoch": -3}, {"staging_bytes": True}):  # fmt: skip
        with pytest.raises(ConfigError):
            RecorderConfig(**bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigError):
            RolloutRecorder(served.address, SPEC, "cfg-bad", connect=False, **bad)  # type: ignore[arg-type]
    cfg = RecorderConfig(staging_bytes=8 << 20, batch_bytes=256 << 10, linger_s=0.25, epoch=7, connect=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.linger_s = 1.0  # type: ignore[misc]
    rec = RolloutRecorder.from_config(served.address, SPEC, "cfg-ok", cfg, policy_version=3)
    try:
        assert rec.config == cfg and rec.pool.capacity == 8 << 20 and rec.batch_bytes == 256 << 10
        assert rec.linger_s == 0.25 and rec.epoch == 7 and rec.policy_version == 3
    finally:
        rec.close()


def test_reader_config_is_validated_and_builds_the_same_reader(served: ServeProcess) -> None:
    from tracestore.client import ReaderConfig

    from tracestore.errors import ConfigError

    for bad in ({"on_missing": "skip"}, {"on_mismatch": "ignore"}, {"rule": "nearest"}, {"timeout": 0},
                {"process": -1}, {"sites": "layers.20.mlp.input"}, {"sites": ["../x"]}):  # fmt: skip
        with pytest.raises((ConfigError, ValueError)):
            ReaderConfig(**bad)  # type: ignore[arg-type]
        with pytest.raises((ConfigError, ValueError)):
            GuidanceReader(served.storage, SPEC.run, **bad)  # type: ignore[arg-type]
    cfg = ReaderConfig(sites=["layers.20.mlp.input"], on_missing="mask", prefetch=False, versions=range(2))
    assert cfg.sites == ("layers.20.mlp.input",) and cfg.versions == (0, 1)
    rec = RolloutRecorder(served.address, SPEC, "cfg-reader")
    rng = np.random.default_rng(2)
    out = {}
    for s in SPEC.sites:
        rows = 2 * s.rows_per_token
        codes = rng.integers(0, 256, (rows, s.code_bytes), dtype=np.uint8)
        out[s.name] = SiteOutput(codes, rng.integers(0, 256, (rows, s.scale_bytes), dtype=np.uint8), 1.0)
    assert rec.record_forward([("cfg-t", 0, 2)], out)
    rec.finish("cfg-t", 3)
    assert rec.flush(30)
    rec.close()
    with GuidanceReader.from_config(served.address, SPEC.run, cfg) as reader:
        assert reader.config == cfg and reader.sites == ["layers.20.mlp.input"]
        got = reader.read_host([("cfg-t", 0, 3)])  # token 2 was never recorded: masked, not an error
        assert list(got) == ["layers.20.mlp.input"]
        assert got["layers.20.mlp.input"].valid.tolist() == [True, True, False]
