"""What routing artifacts (``routed_experts`` sites, docs/data-model.md "Artifacts") cost beside the
FP4 records, against the same records without them, in the same run.

Configurations: the paper's (FP4 records: width 2048, 20 sites, b = 1, NVFP4, 7,680 B per token;
routing at every one of its 40 MoE layers, top-8 of 128 experts assumed) and DeepSeek-V3 scale
(58 MoE layers, top-8 of 256 experts). Expert ids are distinct random experts per token (uint8 up to
256 experts); gate weights none, bfloat16 or float32.

Cases:

- ``bytes``: payload bytes per token (formula: ids + flag byte + gates, per MoE layer) and bytes on
  storage per token (shard + manifest, ``Store.write_shard`` of a routing-only run to local disk) for
  a prefill step (8 trajectories x 2048 tokens in 512-token chunks) and a decode shard (64
  sequences x 32 steps of one-token chunks at every layer); ``share_of_fp4_pct`` = stored routing
  bytes / 7,680 B.
- ``ingest``: ``RolloutRecorder.record_forward`` of a prefill step (8 trajectories x 2048 tokens,
  512-token forwards, every site) into a real ``tracestore serve`` on its unix socket (shared
  memory, WAL with fsync, local storage), until every forward is durable; FP4 records only
  ("routing off") vs FP4 records + the paper configuration's routing with bfloat16 gates ("routing
  on"), interleaved over ``--repeat`` rounds: seconds, tokens/s and MB/s of payload.
- ``read``: a fresh ``StoreReader.read`` of a plan (2 of the step's trajectories, 2048 tokens each,
  page and chunk checksums verified) from one store holding both: the FP4 sites only ("routing
  off"), the FP4 sites and the routing sites ("routing on", routing rows decoded with
  ``decode_routing``), and the routing sites alone; interleaved over ``--repeat`` rounds.

Run: ``python bench/bench_routing.py [--cases bytes,ingest,read] [--repeat 5]`` (``--quick``: small
shapes, a check that the bench runs); prints the machine and tables and appends rows to
``bench/results/bench_routing.jsonl``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_storage import SPEC, TARGET_BYTES_PER_TOKEN, interleaved, machine_load, make_step  # noqa: E402
from common import append_results, git_commit, machine, print_table  # noqa: E402

from tracestore.artifacts import decode_routing, encode_routing, routed_experts_site, routing_bytes_per_token  # noqa: E402
from tracestore.records import RecordChunk, RunSpec, SiteSpec  # noqa: E402
from tracestore.storage.store import Store  # noqa: E402

CONFIGS = {"paper": (40, 8, 128), "deepseek-v3": (58, 8, 256)}  # MoE layers, top_k, experts


def routing_sites(config: str, gate: str | None) -> tuple[SiteSpec, ...]:
    layers, k, n = CONFIGS[config]
    return tuple(routed_experts_site(i, k, n, gate=gate) for i in range(layers))


def experts(rng: np.random.Generator, n: int, k: int, e: int) -> np.ndarray:
    """``n`` rows of ``k`` distinct experts of ``e``."""
    return np.argsort(rng.random((n, e), dtype=np.float32), axis=1)[:, :k]


def routing_chunks(
    run: str, sites: tuple[SiteSpec, ...], shape: list[tuple[str, int, int]], seed: int = 0
) -> list[RecordChunk]:
    """Chunks of every routing site for ``shape`` = [(trajectory, token_start, n_tokens), ...]."""
    rng = np.random.default_rng(seed)
    out = []
    for s in sites:
        for t, a, n in shape:
            gate = rng.random((n, s.width), dtype=np.float32) if s.gate else None
            codes, scales = encode_routing(s, experts(rng, n, s.width, s.n_experts), gate)
            out.append(RecordChunk(run, 0, t, s.name, a, n, codes, scales, 1.0))
    return out


def prefill_shape(n_traj: int, n_tokens: int, chunk: int) -> list[tuple[str, int, int]]:
    return [(f"traj-{t:04d}", a, min(chunk, n_tokens - a)) for t in range(n_traj) for a in range(0, n_tokens, chunk)]


def decode_shape(seqs: int, steps: int) -> list[tuple[str, int, int]]:
    return [(f"seq-{q:04d}", i, 1) for q in range(seqs) for i in range(steps)]


def stored_bytes(root: Path, run: str) -> int:
    """Shard and manifest bytes of ``run`` under local storage ``root`` (run.json left out)."""
    return sum(p.stat().st_size for p in (root / run).rglob("*") if p.is_file() and p.name != "run.json")


def bench_bytes(ns: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    rows = []
    shapes = {
        "prefill 8 x 2048 tok, 512-tok chunks": prefill_shape(2 if ns.quick else 8, 2048, 512),
        "decode 64 seqs x 32 one-token steps": decode_shape(8 if ns.quick else 64, 32),
    }
    for config in CONFIGS:
        for gate in (None, "bfloat16", "float32"):
            sites = routing_sites(config, gate)
            layers, k, n = CONFIGS[config]
            payload = routing_bytes_per_token(layers, k, n, gate)
            for shape_name, shape in shapes.items():
                run = f"b-{config}-{gate or 'ids'}-{'p' if shape_name.startswith('prefill') else 'd'}".replace("_", "-")
                store = Store(f"file://{workdir / 'bytes'}")
                store.put_run(RunSpec(run, sites))
                store.write_shard(run, 0, "w", 1, routing_chunks(run, sites, shape))
                tokens = sum(x[2] for x in shape)
                stored = stored_bytes(workdir / "bytes", run) / tokens
                rows.append({
                    "case": "bytes", "config": config, "layers x top_k / experts": f"{layers} x {k} / {n}",
                    "gate": gate or "none", "shape": shape_name, "payload_bytes_per_token": payload,
                    "storage_bytes_per_token": round(stored, 1),
                    "share_of_fp4_pct": round(100 * stored / TARGET_BYTES_PER_TOKEN, 2),
                })  # fmt: skip
    rows += bytes_through_recorder(ns, workdir)
    return rows


def bytes_through_recorder(ns: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    """Decode steps through ``RolloutRecorder.record_forward`` into a real ``tracestore serve``:
    the recorder coalesces consecutive one-token steps of a (trajectory, site) into longer chunks
    (routing rows all have g = 1), so what a run keeps is less than the one-token-chunk shard."""
    from tracestore.client import RolloutRecorder
    from tracestore.server.testing import ServeProcess

    from tracestore.site_output import SiteOutput

    seqs, steps = (8, 32) if ns.quick else (64, 32)
    sp = ServeProcess(workdir / "coalesce", unix_socket=True, flags=["--metrics-port", "off"]).start()
    rows: list[tuple[str, str, str | None, int, int, int]] = []
    try:
        for config in CONFIGS:
            for gate in (None, "bfloat16"):
                sites = routing_sites(config, gate)
                layers, k, n = CONFIGS[config]
                run = f"c-{config}-{gate or 'ids'}"
                rec = RolloutRecorder(sp.unix_address, RunSpec(run, sites), "w", staging_bytes=256 << 20)
                rng = np.random.default_rng(3)
                try:
                    for i in range(steps):
                        d = {}
                        for s in sites:
                            g = rng.random((seqs, k), dtype=np.float32) if gate else None
                            d[s.name] = SiteOutput(*encode_routing(s, experts(rng, seqs, k, n), g))
                        if not rec.record_forward([(f"seq-{q}", i, i + 1) for q in range(seqs)], d):
                            raise RuntimeError(f"refused: {rec.stats}")
                    if not rec.flush(300):
                        raise RuntimeError(f"not durable: {rec.stats}")
                finally:
                    rec.close(timeout=60)
                rows.append((run, config, gate, layers, k, n))
    finally:
        sp.terminate()  # a graceful stop commits every acknowledged message to storage
    out = []
    root = Path(sp.storage.removeprefix("file://"))
    for run, config, gate, layers, k, n in rows:
        stored = stored_bytes(root, run) / (seqs * steps)
        if not stored:
            raise RuntimeError(f"run {run}: nothing on storage after the sidecar stopped")
        out.append({
            "case": "bytes", "config": config, "layers x top_k / experts": f"{layers} x {k} / {n}",
            "gate": gate or "none", "shape": f"decode {seqs} seqs x {steps} steps via the recorder",
            "payload_bytes_per_token": routing_bytes_per_token(layers, k, n, gate),
            "storage_bytes_per_token": round(stored, 1),
            "share_of_fp4_pct": round(100 * stored / TARGET_BYTES_PER_TOKEN, 2),
        })  # fmt: skip
    return out


def _outputs(spec: RunSpec, routing: tuple[SiteSpec, ...], n_traj: int, n_tok: int, fwd: int, seed: int) -> list[Any]:
    """Per forward: (segments, {site: SiteOutput}) of every site of ``spec``."""
    from tracestore.site_output import SiteOutput

    rng = np.random.default_rng(seed)
    fp4 = {c.site: c for c in make_step(1, fwd * n_traj, fwd * n_traj, random_scales=False, seed=seed)}
    out = []
    for a in range(0, n_tok, fwd):
        segs = [(f"traj-{t:04d}", a, a + fwd) for t in range(n_traj)]
        n = fwd * n_traj
        d = {name: SiteOutput(c.codes, c.scales, c.global_scale) for name, c in fp4.items()}
        for s in routing:
            gate = rng.random((n, s.width), dtype=np.float32) if s.gate else None
            d[s.name] = SiteOutput(*encode_routing(s, experts(rng, n, s.width, s.n_experts), gate))
        out.append((segs, d))
    return out


def bench_ingest(ns: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    from tracestore.client import RolloutRecorder
    from tracestore.server.testing import ServeProcess

    n_traj, n_tok, fwd = (2, 512, 256) if ns.quick else (8, 2048, 512)
    routing = routing_sites("paper", "bfloat16")
    specs = {"routing off": RunSpec("ingest-off", SPEC.sites), "routing on": RunSpec("ingest-on", SPEC.sites + routing)}
    forwards = {k: _outputs(s, routing if k == "routing on" else (), n_traj, n_tok, fwd, 1) for k, s in specs.items()}
    payload = {k: sum(o.codes.nbytes + o.scales.nbytes for _, d in f for o in d.values()) for k, f in forwards.items()}
    sp = ServeProcess(workdir / "sidecar", unix_socket=True, flags=["--metrics-port", "off"]).start()
    rounds = {"n": 0}

    def provider(name: str) -> Any:
        def run() -> None:
            rounds["n"] += 1
            rec = RolloutRecorder(sp.unix_address, specs[name], f"w{rounds['n']}", staging_bytes=512 << 20)
            try:
                for segs, d in forwards[name]:
                    tag = [(f"r{rounds['n']}-{t}", a, b) for t, a, b in segs]
                    if not rec.record_forward(tag, d):
                        raise RuntimeError(f"refused: {rec.stats}")
                if not rec.flush(300):
                    raise RuntimeError(f"not durable: {rec.stats}")
            finally:
                rec.close(timeout=60)

        return run

    try:
        load = machine_load()
        times = interleaved({k: provider(k) for k in specs}, ns.repeat)
    finally:
        sp.kill()
    rows = []
    tokens = n_traj * n_tok
    for name, (wall, cpu) in times.items():
        med = statistics.median(wall)
        rows.append({
            "case": "ingest", "provider": name, "step": f"{n_traj} x {n_tok} tok, {fwd}-tok forwards",
            "sites": len(specs[name].sites), "payload_mb": round(payload[name] / 1e6, 1), "repeats": len(wall),
            "median_s": round(med, 3), "spread": f"{min(wall):.2f}-{max(wall):.2f} s",
            "tokens_per_s": round(tokens / med), "payload_mb_per_s": round(payload[name] / med / 1e6, 1),
            "caller_cpu_s": round(statistics.median(cpu), 3), **load,
        })  # fmt: skip
    rows[1]["time_ratio_vs_off"] = round(rows[1]["median_s"] / rows[0]["median_s"], 3)
    return rows


def bench_read(ns: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    from tracestore.storage.reader import StoreReader

    n_traj, n_tok = (2, 512) if ns.quick else (8, 2048)
    routing = routing_sites("paper", "bfloat16")
    spec = RunSpec("read", SPEC.sites + routing)
    store = Store(f"file://{workdir / 'read'}")
    store.put_run(spec)
    fp4 = [
        RecordChunk("read", 0, c.trajectory, c.site, c.token_start, c.n_tokens, c.codes, c.scales, c.global_scale)
        for c in make_step(n_traj, n_tok, 512, random_scales=False)
    ]
    store.write_shard("read", 0, "w", 1, fp4 + routing_chunks("read", routing, prefill_shape(n_traj, n_tok, 512)))
    plan = [(f"traj-{t:04d}", 0, n_tok) for t in range(2)]
    fp4_names = [s.name for s in SPEC.sites]
    route_names = [s.name for s in routing]
    got: dict[str, int] = {}

    def reader(names: list[str], key: str) -> Any:
        def run() -> None:
            with StoreReader(store, "read") as r:
                res = r.read(plan, sites=names)
            nbytes = 0
            for n in names:
                rows = res[n]
                if rows.site.is_artifact:
                    decode_routing(rows.site, rows.codes, rows.scales, rows.valid)
                nbytes += rows.codes.nbytes + rows.scales.nbytes
            got[key] = nbytes

        return run

    providers = {
        "routing off (FP4 sites)": reader(fp4_names, "off"),
        "routing on (FP4 + routing)": reader(fp4_names + route_names, "on"),
        "routing only": reader(route_names, "only"),
    }
    load = machine_load()
    times = interleaved(providers, ns.repeat)
    rows = []
    for (name, (wall, cpu)), key in zip(times.items(), ("off", "on", "only"), strict=True):
        med = statistics.median(wall)
        rows.append({
            "case": "read", "provider": name, "plan": f"2 x {n_tok} tok", "mb_out": round(got[key] / 1e6, 2),
            "repeats": len(wall), "median_ms": round(med * 1e3, 1),
            "spread": f"{min(wall) * 1e3:.0f}-{max(wall) * 1e3:.0f} ms", "mb_per_s": round(got[key] / med / 1e6, 1),
            "cpu_ms": round(statistics.median(cpu) * 1e3, 1), **load,
        })  # fmt: skip
    rows[1]["time_ratio_vs_off"] = round(rows[1]["median_ms"] / rows[0]["median_ms"], 3)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="bytes,ingest,read")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-save", action="store_true")
    ns = ap.parse_args()
    cases = ns.cases.split(",")
    m = machine()
    print(f"# bench_routing on {m.get('cpu')} ({m.get('cores')} cores), commit {git_commit()}")
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-routing-", dir=os.environ.get("BENCH_DIR")) as tmp:
        if "bytes" in cases:
            b = bench_bytes(ns, Path(tmp))
            print_table(b, ["config", "layers x top_k / experts", "gate", "shape", "payload_bytes_per_token",
                            "storage_bytes_per_token", "share_of_fp4_pct"])  # fmt: skip
            rows += b
        if "ingest" in cases:
            i = bench_ingest(ns, Path(tmp))
            print()
            print_table(i, ["provider", "step", "sites", "payload_mb", "median_s", "spread", "tokens_per_s",
                            "payload_mb_per_s", "time_ratio_vs_off", "loadavg_1m"])  # fmt: skip
            rows += i
        if "read" in cases:
            r = bench_read(ns, Path(tmp))
            print()
            print_table(r, ["provider", "plan", "mb_out", "median_ms", "spread", "mb_per_s", "cpu_ms",
                            "time_ratio_vs_off", "loadavg_1m"])  # fmt: skip
            rows += r
    print(f"\n# {time.perf_counter() - t0:.0f} s")
    if not ns.no_save and not ns.quick:
        print(f"appended to {append_results('bench_routing', rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
