"""The engine plugins' graph-safe capture on a GPU: what recording adds to a CUDA-graph decode step.

Run on a GPU machine: ``python bench/bench_engine_capture.py`` (prints a table, appends rows to
``bench/results/bench_engine_capture.jsonl``). No engine is needed. The decode step is a stand-in
for a MoE model's: per layer a bf16 GEMM produces the FC1 input, whose bytes serve as its packed
FP4 codes and linear E4M3 scales (values do not change the record path's cost), with a per-token
float32 scale, handed to a FlashInfer-shaped entry wrapped exactly as the plugins wrap
``trtllm_fp4_block_scale_moe`` (:func:`tracestore.client.engines.capture.wrap_moe_entry`), whose
body is a second GEMM; with ``--routing`` each layer also records its router's top-8 of 128
experts (top-k of the FC1 input's first 128 columns) through the routing op, as the plugins'
default ``routing=1`` does. One CUDA graph per variant, captured at a padded batch (the engine pads
the scheduled batch to a captured size), replayed ``--steps`` times per timed loop with CUDA events
around the loop, the variants interleaved over ``--reps`` rounds (median per step):

- ``no capture``: the wrapped entry with the graph capture off (the hook records nothing);
- ``capture``: the same graph captured with the capture on — the op's record kernel per site
  (``tracestore.kernels.record_from_codes``) replays with the graph; nothing committed;
- ``capture, torch ops``: the same with the op writing through :func:`record_rows`' torch ops;
- ``capture + commit``: ``capture``, and after each replay the step's plan committed
  (:meth:`EngineRecorder.end_forward`: a decode step of ``--batch`` requests, rows ``[0, batch)``
  of the slab staged by ``record_slab``) to a real sidecar over the unix socket (the plans, the
  scheduler process's work in vLLM, are made before the timed loops);
- ``capture + commit, gathered``: as above with the worker's row order reversed, so the planned
  rows are gathered into the second slab first;
- ``capture + commit, async``: as ``capture + commit`` under vLLM's asynchronous scheduling (the
  plan is made before the previous step's token is known): every row is pending, copied into a
  spare slab row, and committed by the next step with its id (gathered from the spare rows).

Overhead = (median ms/step - ``no capture``'s) / ``no capture``'s. The commit's engine-thread time
(``perf_counter`` around ``end_forward``) is reported too. Before timing, the slab rows after a
replay are checked bit for bit against :func:`record_rows` of the same inputs.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/common.py

import torch  # noqa: E402
from common import append_results, print_table  # noqa: E402
from tracestore.client.engines.capture import SCOPE, wrap_moe_entry  # noqa: E402
from tracestore.client.engines.codes import record_rows  # noqa: E402
from tracestore.client.engines.graph import GraphCapture  # noqa: E402
from tracestore.client.engines.recording import EngineRecorder  # noqa: E402
from tracestore.client.engines.routing import route_spec  # noqa: E402
from tracestore.client.engines.rows import RowMapper, Scheduled  # noqa: E402
from tracestore.client.engines.setting import parse_setting  # noqa: E402

from tracestore.kernels.testing import capture_graph  # noqa: E402


class DecodeStep:
    """``layers`` layers of (GEMM -> FC1 codes, scales, per-token g -> wrapped entry -> GEMM) on
    static buffers of ``padded`` rows."""

    def __init__(
        self, layers: int, hidden: int, padded: int, graph: GraphCapture, bits: int, device: str, routes: list
    ) -> None:
        self.layers, self.hidden = layers, hidden
        self.graph, self.routes = graph, routes  # routes: one routed_experts SiteSpec per layer, or none
        gen = torch.Generator(device=device).manual_seed(0)
        self.w1 = [torch.randn(hidden, hidden, device=device, generator=gen).bfloat16() / 40 for _ in range(layers)]
        self.w2 = [torch.randn(hidden, hidden, device=device, generator=gen).bfloat16() / 40 for _ in range(layers)]
        self.x0 = torch.randn(padded, hidden, device=device, dtype=torch.bfloat16)
        self.entry = wrap_moe_entry(self._experts, self._no_eager, lambda: bits, graph)
        self.last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.scoped = True  # False: no MoE site is entered, so the wrapped entry records nothing

    @staticmethod
    def _no_eager(*_: Any) -> None:
        raise AssertionError("the eager capture path ran inside the bench")

    def _experts(self, **kw: Any) -> torch.Tensor:
        return kw["_h"] @ kw["_w"]

    def fc1(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raw = h.contiguous().view(torch.uint8)  # [P, 2H] bytes
        packed = raw[:, : self.hidden // 2]
        sf = raw[:, self.hidden // 2 : self.hidden // 2 + self.hidden // 16] & 0x7E  # finite E4M3 bytes
        pts = h.float().abs().amax(-1) / 2688 + 1e-6
        return packed, sf, pts

    def __call__(self) -> None:
        x = self.x0
        for i in range(self.layers):
            h = x @ self.w1[i]
            packed, sf, pts = self.fc1(h)
            if i == 0:
                self.last = (packed, sf, pts)
            if self.scoped:
                SCOPE.enter(f"layers.{i}.mlp.input", None)
            try:
                y = self.entry(hidden_states=packed, hidden_states_scale=sf, per_token_scale=pts, _h=h, _w=self.w2[i])
            finally:
                SCOPE.leave()
            if self.routes:  # the router's top-k experts (computed either way), through the routing op
                spec = self.routes[i]
                ids = h[:, : spec.n_experts].float().topk(spec.width, dim=-1).indices
                if self.scoped:
                    self.graph.route(spec, ids)
            x = x + y


def run(args: argparse.Namespace, rows: list[dict]) -> None:
    from tracestore.server.testing import ServeProcess

    batch, padded = args.batch, args.padded or (args.batch + 8)
    flags = ["--flush-interval", "0.2"]
    with tempfile.TemporaryDirectory() as tmp, ServeProcess(tmp, wal=False, unix_socket=True, flags=flags) as sp:
        text = f"sidecar={sp.unix_address} run=bench-capture policy_version=0 writer=bench bits={args.bits}"
        setting = parse_setting(f"{text} staging_mb={args.staging_mb}")
        rec = EngineRecorder(setting)
        graph = GraphCapture(args.bits)
        graph.install()
        rec.graph = graph
        dev = args.device
        routes = [route_spec(i, 8, 128) for i in range(args.layers)] if args.routing else []
        for spec in routes:
            graph.note_route(spec)
        model = DecodeStep(args.layers, args.hidden, padded, graph, args.bits, dev, routes)
        # --device cpu checks the harness without a GPU: "graphs" are eager calls, host timers
        capture: Any = capture_graph if dev == "cuda" else (lambda fn: types.SimpleNamespace(replay=fn))
        sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

        def step(scoped: bool, kernel: bool = True) -> None:
            model.scoped = scoped
            graph.kernel = kernel  # one record kernel per site, or record_rows' torch ops
            model()

        graphs = {"no capture": capture(lambda: step(False))}
        graph.active = True
        step(True)  # the warm-up: notes the sites
        sync()
        assert graph.arm(padded, dev, spare=2 * batch), "no site noted"  # (spare rows: the async variant's)
        lasts, kernels, used = {}, {"capture": True, "capture, torch ops": False}, {}
        for label, kernel in kernels.items():
            graphs[label] = capture(lambda kernel=kernel: step(True, kernel))
            lasts[label] = model.last  # layer 0's inputs, in the graph's own buffers
            # what the capture wrote with: a kernel that failed while capturing set it False (a
            # replay runs no Python, so graph.kernel afterwards says nothing about this graph)
            used[label] = graph.kernel

        # bit for bit: the slab after a replay against record_rows of the same inputs (layer 0)
        for label in lasts:
            for _ in range(3):
                model.x0.normal_()
                graphs[label].replay()
                sync()
                last = lasts[label] if dev == "cuda" else model.last  # (on the CPU each "replay" runs anew)
                assert last is not None and graph.slab is not None
                want = record_rows(last[0], last[1], layout="linear", bits=args.bits, token_scale=last[2])
                buf = graph.slab["layers.0.mlp.input"]
                exact = (
                    torch.equal(buf.codes[:padded], want[0])
                    and torch.equal(buf.scales[:padded], want[1])
                    and torch.equal(buf.global_scale[:padded], want[2])
                )
                assert exact, f"{label}: slab rows differ from record_rows of the same inputs"
            if dev != "cuda":
                used[label] = graph.kernel  # (on the CPU each "replay" runs the Python anew)
            assert used[label] is kernels[label], "the record kernel failed (see the log): torch ops were used"
            print(f"  {label}: slab rows equal record_rows of the replayed inputs: {exact}")

        # the scheduler's side (the row mapper) runs in vLLM's engine-core process, not on the
        # worker: every step's plan is made before the timed loops
        mapper = RowMapper(block=16)
        rids = [f"r{i}" for i in range(batch)]
        for r in rids:
            mapper.add(r, [1])
        n_plans = 1 + 2 * args.reps * args.steps  # (the sync and gathered variants' steps)
        plans = [
            mapper.step([Scheduled(r, p, 1, 0, [(p * 7 + j) % 50000]) for j, r in enumerate(rids)])
            for p in range(n_plans)
        ]
        # asynchronous scheduling: position p's id is learned only after step p was planned
        arids = [f"a{i}" for i in range(batch)]
        for r in arids:
            mapper.add(r, [1])
        aplans = [mapper.step([Scheduled(r, 0, 1, 0, [1]) for r in arids])]
        for p in range(1, 1 + args.reps * args.steps + 1):
            if p >= 2:
                for j, r in enumerate(arids):
                    mapper.learn(r, p - 1, [(p * 7 + j) % 50000])
            aplans.append(mapper.step([Scheduled(r, p, 1, 0, [], n_pending=1) for r in arids]))
        orders = {
            "": [(r, 1) for r in rids],
            "gathered": [(r, 1) for r in reversed(rids)],  # the worker's batch order differs: rows gathered
            "async": [(r, 1) for r in arids],
        }
        pos = {"": 0, "gathered": 0, "async": 0}

        def commit(kind: str) -> float:
            """The worker's part of a step after the replay: EngineRecorder.end_forward."""
            step_plans = aplans if kind == "async" else plans
            at = pos["" if kind == "gathered" else kind]
            pos["" if kind == "gathered" else kind] = at + 1
            t0 = time.perf_counter()
            rec.end_forward(step_plans[at], orders[kind])
            return time.perf_counter() - t0

        graphs["capture"].replay()
        commit("")  # the first commit declares the run and connects the recorder: not timed
        for _ in range(2):  # the async requests' prompts, then their first pending rows
            graphs["capture"].replay()
            commit("async")

        variants = [
            "no capture",
            "capture",
            "capture, torch ops",
            "capture + commit",
            "capture + commit, gathered",
            "capture + commit, async",
        ]
        per_step: dict[str, list[float]] = {v: [] for v in variants}
        host: dict[str, list[float]] = {v: [] for v in variants}
        for _rep in range(args.reps):
            for v in variants:
                g = graphs[v if v in graphs else "capture"]
                sync()
                t0 = time.perf_counter()
                if dev == "cuda":
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                for _ in range(args.steps):
                    g.replay()
                    if "commit" in v:
                        host[v].append(commit(v.partition(", ")[2]))
                if dev == "cuda":
                    b.record()
                    b.synchronize()
                    per_step[v].append(a.elapsed_time(b) / args.steps)
                else:
                    per_step[v].append((time.perf_counter() - t0) * 1e3 / args.steps)
        base = statistics.median(per_step["no capture"])
        stats = dict(rec.recorder.stats) if rec.recorder is not None else {}
        for v in variants:
            med = statistics.median(per_step[v])
            row = {
                "device": dev,
                "kernel": f"decode step {args.layers} MoE sites H={args.hidden} batch {batch} padded {padded}"
                + (f" + {args.layers} routing sites" if args.routing else ""),
                "provider": v,
                "median_ms": med,
                "min_ms": min(per_step[v]),
                "max_ms": max(per_step[v]),
                "baseline_ms": base,
                "overhead_%": 100 * (med - base) / base,
                "commit_host_ms_median": statistics.median(host[v]) * 1e3 if host[v] else None,
                "commit_host_ms_p99": sorted(host[v])[math.ceil(0.99 * len(host[v])) - 1] * 1e3 if host[v] else None,
                "bits": args.bits,
                "slab_bytes_per_step": batch * graph.slab.row_bytes if graph.slab is not None else None,
                "gathers": graph.stats["gathers"],
                "refused_forwards": stats.get("refused_forwards"),
                "released_rows": rec.stats["released"],
                "held_overflow": rec.stats["held_overflow"],
            }
            rows.append(row)
            c = row["commit_host_ms_median"]
            print(f"  {v:28s} {med:8.4f} ms/step  overhead {row['overhead_%']:6.3f}%  commit {c} ms")
        rec.close(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256, help="scheduled decode rows per step")
    ap.add_argument("--padded", type=int, default=0, help="captured batch size (default: batch + 8)")
    ap.add_argument("--layers", type=int, default=20, help="MoE sites (one per layer)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--bits", type=int, default=1)
    ap.add_argument("--routing", action="store_true", help="also record each layer's top-8 of 128 experts")
    ap.add_argument("--steps", type=int, default=30, help="replays per timed loop")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--staging-mb", type=int, default=2048)
    ap.add_argument("--device", default="cuda", help="cuda; cpu only checks the harness (no graphs)")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_engine_capture needs a CUDA GPU (--device cpu checks the harness only)")
    rows: list[dict] = []
    run(args, rows)
    print_table(rows, ["provider", "median_ms", "overhead_%", "commit_host_ms_median", "commit_host_ms_p99"])
    if not args.no_save:
        append_results("bench_engine_capture", rows)


if __name__ == "__main__":
    main()
