"""Speculative decoding under graph-safe capture: draft rows wait in the slab's spare rows on the
device, confirmed ones are committed with a later forward's rows (or at the request's end), and
rejected ones are never stored — all without a host read of device data (checked by listing the
dispatched ops on the CPU, and under CUDA's sync debug mode on a GPU). Rows are checked through a
real sidecar against an independent quantization of each (request, position, token id)'s
activation, so a rejected draft's row stored in place of the accepted token's shows up."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from tracestore.client.engines.capture import SCOPE, wrap_moe_entry
from tracestore.client.engines.graph import GraphCapture
from tracestore.client.engines.recording import EngineRecorder
from tracestore.client.engines.rows import RowMapper, Scheduled
from tracestore.client.engines.setting import parse_setting
from tracestore.server.testing import ServeProcess

from tests.engines.test_graph_capture import FORBIDDEN, SITE, H, OpLog
from tracestore import NVFP4, Store, StoreReader, quantize
from tracestore.packing import pack_bits, pack_fp4

BITS = 4


def activation(rid: str, pos: int, tok: int) -> torch.Tensor:
    """The FC1 input of ``rid`` at ``pos`` fed token ``tok``: a rejected draft's row differs from
    the accepted token's at the same position."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{rid}:{pos}:{tok}".encode()))
    return torch.randn(1, H, generator=gen) * (1 + pos % 3)


def quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: FP4 codes, E4M3 scale bytes and the per-token decode-side g (row amax / 2688)."""
    g = x.abs().amax(-1) / 2688
    qs = [quantize(x[r : r + 1], NVFP4, global_scale=float(g[r])) for r in range(x.shape[0])]
    return torch.cat([q.codes for q in qs]), torch.cat([q.scales for q in qs]), g.float()


class SpecEngine:
    """A forward = the wrapped FlashInfer entry fed one batch's codes (per-token scales), padded
    with junk rows; the graph capture armed with ``spare`` rows for drafts."""

    def __init__(self, address: str, run: str, device: str, spare: int) -> None:
        text = f"sidecar={address} run={run} policy_version=0 writer=w-{run} bits={BITS}"
        self.rec = EngineRecorder(parse_setting(text))
        self.graph = GraphCapture(BITS)
        self.graph.active = True
        self.graph.install()
        self.rec.graph = self.graph
        self.mapper = RowMapper(block=4)
        self.entry = wrap_moe_entry(self._flashinfer, self.rec.capture, lambda: BITS, self.graph)
        self.device = device
        self.spare = spare

    def _flashinfer(self, **kw: Any) -> torch.Tensor:
        x = kw["hidden_states"]
        return torch.zeros(x.shape[0], x.shape[1] * 2, dtype=torch.bfloat16, device=x.device)

    def forward(self, rows: list[tuple[str, int, int]], padded: int) -> None:
        xs = [activation(*r) for r in rows]
        junk = torch.Generator().manual_seed(len(rows) * 31 + padded)
        xs += [torch.randn(1, H, generator=junk) * 50 for _ in range(padded - len(rows))]
        codes, sf, g = quantized(torch.cat(xs))
        packed, sf, g = pack_fp4(codes).to(self.device), sf.to(self.device), g.to(self.device)
        SCOPE.enter(SITE, None)
        try:
            self.entry(hidden_states=packed, hidden_states_scale=sf, per_token_scale=g, num_experts=8)
        finally:
            SCOPE.leave()

    def arm(self) -> None:
        self.forward([("warm", 0, 0)], 4)  # the engine's warm-up: notes the site, not committed
        self.rec.discard_forward()
        assert self.graph.arm(16, self.device, spare=self.spare)


def run_spec(eng: SpecEngine, around: Callable[[], Any]) -> tuple[dict[str, dict], dict[str, list[int]]]:
    """Two requests decoding with drafts; ``around()`` is entered around every call of the
    recorder after a forward (end_forward, end_request). Returns the endings and the final ids."""
    m, rec = eng.mapper, eng.rec
    ids = {"a": [11, 12, 13, 14, 15], "b": [21, 22, 23]}
    for rid, prompt in ids.items():
        m.add(rid, prompt)
    eng.arm()

    def step(batch: list[Scheduled], order: list[str], padded: int) -> None:
        plan = m.step(batch)
        by = {s.request_id: s for s in batch}
        rows = [(rid, by[rid].start + i, int(by[rid].token_ids[i])) for rid in order for i in range(by[rid].n)]  # type: ignore[index]
        eng.forward(rows, padded)
        with around():
            assert rec.end_forward(plan, [(rid, by[rid].n) for rid in order])

    step([Scheduled("a", 0, 5, 0, ids["a"]), Scheduled("b", 0, 3, 0, ids["b"])], ["b", "a"], 12)
    ids["a"].append(16)
    ids["b"].append(24)
    # a: 16 at 5, drafts 17 at 6 and 18 at 7; b: 24 at 3, draft 25 at 4
    step([Scheduled("a", 5, 3, 2, [16, 17, 18]), Scheduled("b", 3, 2, 1, [24, 25])], ["a", "b"], 8)
    ids["a"] += [17, 30]  # 17 accepted, 18 rejected: the bonus token 30 at 7
    ids["b"] += [26]  # 25 rejected: the bonus token 26 at 4
    # a: 30 at 7, drafts 31 at 8, 32 at 9; b: 26 at 4, draft 27 at 5 (in the worker's order b, a)
    step([Scheduled("a", 7, 3, 2, [30, 31, 32]), Scheduled("b", 4, 2, 1, [26, 27])], ["b", "a"], 8)
    ids["a"] += [31, 32, 33]  # both accepted, bonus 33; confirmed only by the final ids
    ids["b"] += [27, 28]
    with around():
        out = {rid: rec.end_request(m.finish(rid, ids[rid])) for rid in ("a", "b")}
    assert rec.close(30)
    return out, ids


def check_stored(sp: ServeProcess, run: str, traj: str, ids: list[int], rid: str) -> None:
    n = len(ids)
    with StoreReader(Store(sp.storage), run) as reader:
        rows = reader.read([(traj, 0, n)], on_missing="mask")[SITE]
    for p in range(n - 1):
        codes, sf, g = quantized(activation(rid, p, ids[p]))
        assert rows.valid[p], (traj, p)
        assert rows.codes[p].tobytes() == pack_bits(codes, BITS)[0].numpy().tobytes(), (traj, p)
        assert rows.scales[p].tobytes() == sf[0].numpy().tobytes(), (traj, p)
        ts = 1.0 if rows.token_scales is None else float(rows.token_scales[p])
        assert np.float32(rows.global_scale[p] * ts) == np.float32(g[0]), (traj, p)
    assert not rows.valid[n - 1]


class NoHostReads:
    """Fails on any op that reads device data on the host or sizes its output by values."""

    def __enter__(self) -> None:
        self.log = OpLog()
        self.log.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.log.__exit__(*exc)
        if exc[0] is None:
            bad = [n for n in self.log.names if n.split("::")[1] in FORBIDDEN]
            assert not bad, f"host reads of device data after a forward: {bad}"


def test_drafts_wait_on_the_device_and_rejections_are_never_stored(sidecar: ServeProcess) -> None:
    eng = SpecEngine(sidecar.address, "gspec", "cpu", spare=8)
    out, ids = run_spec(eng, NoHostReads)
    assert out["a"]["gap"] is None and out["b"]["gap"] is None
    st = eng.rec.stats
    assert st["held"] == 6 and st["released"] == 4 and st["dropped"] == 2 and st["held_overflow"] == 0
    assert eng.graph.spare_free == 8  # every spare row given back
    drain(sidecar)
    check_stored(sidecar, "gspec", "a::a0", ids["a"], "a")
    check_stored(sidecar, "gspec", "b::a0", ids["b"], "b")


def test_drafts_past_the_spare_rows_leave_a_gap_never_a_wrong_row(sidecar: ServeProcess) -> None:
    """Two spare rows for three drafts in one step: a's two drafts are kept, b's is not, so b ends
    with a gap (its confirmed draft was never stored) and a is still sealed."""
    eng = SpecEngine(sidecar.address, "gspill", "cpu", spare=2)
    m, rec = eng.mapper, eng.rec
    m.add("a", [1, 2, 3])
    m.add("b", [4, 5])
    eng.arm()
    plan = m.step([Scheduled("a", 0, 3, 0, [1, 2, 3]), Scheduled("b", 0, 2, 0, [4, 5])])
    eng.forward([("a", 0, 1), ("a", 1, 2), ("a", 2, 3), ("b", 0, 4), ("b", 1, 5)], 8)
    assert rec.end_forward(plan)
    plan = m.step([Scheduled("a", 3, 3, 2, [6, 7, 8]), Scheduled("b", 2, 2, 1, [9, 10])])
    eng.forward([("a", 3, 6), ("a", 4, 7), ("a", 5, 8), ("b", 2, 9), ("b", 3, 10)], 8)
    assert rec.end_forward(plan)
    assert rec.stats["held_overflow"] == 1
    final = {"a": [1, 2, 3, 6, 7, 8, 11], "b": [4, 5, 9, 10, 12]}
    out = {r: rec.end_request(m.finish(r, final[r])) for r in ("a", "b")}
    assert rec.close(30)
    assert out["a"]["gap"] is None
    assert out["b"]["gap"] == "unrecorded_positions"
    assert eng.graph.spare_free == 2
    drain(sidecar)
    check_stored(sidecar, "gspill", "a::a0", final["a"], "a")


def drain(sp: ServeProcess) -> None:
    sp.terminate()
    sp.start()


@pytest.mark.gpu
def test_spec_decode_steps_never_sync_the_host_on_a_gpu(sidecar: ServeProcess) -> None:
    """The same steps with the slab on a GPU, every call after a forward under
    ``torch.cuda.set_sync_debug_mode("error")``: a device-to-host copy or a host read raises."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the sync check needs one")

    class NoSync:
        def __enter__(self) -> None:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")

        def __exit__(self, *exc: Any) -> None:
            torch.cuda.set_sync_debug_mode("default")

    eng = SpecEngine(sidecar.address, "gspecgpu", "cuda", spare=8)
    out, ids = run_spec(eng, NoSync)
    assert out["a"]["gap"] is None and out["b"]["gap"] is None
    drain(sidecar)
    check_stored(sidecar, "gspecgpu", "a::a0", ids["a"], "a")
    check_stored(sidecar, "gspecgpu", "b::a0", ids["b"], "b")
