"""A real Ray pipeline on one machine's CPUs: rollout actors record TRACE guidance through their own
`tracestore serve` sidecars, the driver moves only TraceRefs, trainer actors read their own
slices from the shared storage URL and take training steps with guided fake-quant.

    python examples/ray_pipeline.py --workdir /tmp/trace-ray      # prints a JSON summary

Layout. ``n_rollout`` rollout actors, each with a sidecar process beside it (WAL on, ``file://``
storage shared by all), generate with a tiny random-init transformers MoE model
(:func:`tracestore.demo.model.build_model`) and record every MoE-block input and K/V site with
:class:`tracestore.client.hf.recorder.FP4SiteRecorder`. Each trajectory is recorded under a
write-once attempt id and handed out as a :class:`~tracestore.client.record.traceref.TraceRef` once its
shard is on storage (``RolloutRecorder.refs``). The driver gathers samples (token ids, which any
framework moves anyway) and refs, and hands every trainer rank the whole step: each rank builds
its own plan (:func:`tracestore.rank_plan.rank_plan`) and reads only its rows. Two trainer
groups train on the same steps: data-parallel 2 on a padded ``[B, S]`` batch, and
context-parallel 2 on packed sequences cut zig-zag (each CP rank forwards its own chunks; this
CPU example runs attention within a chunk, where a real CP trainer would exchange K/V in a ring:
the guidance alignment, which is what this pipeline checks, is the same).

Checks (:func:`run`, returned in the summary, asserted by tests/framework/test_ray_pipeline.py):
every rank's guidance rows equal the rollout's records of exactly its tokens (RTN rows exactly
where the trajectory is unguided, padding, or at its final position), and in the forward the
trained FP4 codes keep the recorded low bits (``agreement`` per site: 1.0 on the data-parallel
ranks, whose full-sequence forward reproduces the rollout's activations; ~0.98-1.0 on the CP
ranks, whose chunk-local attention moves them slightly; rows aligned to the wrong tokens would
agree on about half); each rank's reader holds
only its slice (the Arrow memory it keeps is its output buffer); killing one rollout actor's
sidecar in the middle of a rollout leaves that rollout's trajectories unguided in their refs
while every ref handed out before stays readable.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
MODEL = dict(
    arch="qwen3_moe", layers=2, hidden=64, heads=4, kv_heads=2, experts=4, top_k=2, expert_hidden=32, vocab=128
)
RUN = "ray-pipeline"
REF_BYTES_MAX = 512


def run_spec() -> Any:
    """The run's sites: every hooked site of the model (MoE input, K, V per layer), NVFP4, b = 1."""
    from tracestore.demo.model import ModelSpec
    from tracestore.records import RunSpec, SiteSpec

    m = ModelSpec(**MODEL)  # type: ignore[arg-type]
    sites = []
    for layer in range(m.layers):
        sites.append(SiteSpec(f"layers.{layer}.mlp.input", "moe_input", layer, m.hidden))
        sites.append(SiteSpec(f"layers.{layer}.attn.k", "key", layer, m.kv_width))
        sites.append(SiteSpec(f"layers.{layer}.attn.v", "value", layer, m.kv_width))
    return RunSpec(RUN, tuple(sites))


def _model(train: bool) -> Any:
    import torch

    from tracestore.demo.model import ModelSpec, build_model

    torch.set_num_threads(1)
    model = build_model(ModelSpec(**MODEL), seed=0)  # type: ignore[arg-type]
    return model.train() if train else model


class Rollout:
    """A rollout worker: a sidecar beside it, a model, a recorder (made a Ray actor by :func:`run`)."""

    def __init__(self, index: int, storage: str, workdir: str) -> None:
        from tracestore.client import RolloutRecorder
        from tracestore.server.testing import ServeProcess

        self.index = index
        self.sidecar = ServeProcess(Path(workdir) / f"sidecar-{index}", storage=storage,
                                    flags=["--flush-interval", "0.05"]).start()  # fmt: skip
        self.spec = run_spec()
        self.model = _model(train=False)
        self.recorder = RolloutRecorder(self.sidecar.address, self.spec, f"rollout-{index}", give_up_s=2.0)
        self.recorded: dict[str, dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}

    def generate(
        self, prompts: list[tuple[str, list[int]]], n_new: int, policy_version: int, kill_sidecar_after: int = -1
    ) -> tuple[list[tuple[str, list[int]]], list[Any]]:
        """Generate ``n_new`` tokens after each prompt (all of one length) with a KV cache,
        recording every forward; ``kill_sidecar_after``: SIGKILL the sidecar after that many
        forwards (a crash in the middle of the rollout). Returns (samples, refs)."""
        import torch
        from tracestore.client.hf.recorder import FP4SiteRecorder

        from tracestore.packing import pack_bits

        self.recorder.set_policy_version(policy_version)
        ids = [self.recorder.attempt(name) for name, _ in prompts]
        toks = torch.tensor([p for _, p in prompts], dtype=torch.long)
        b, plen = toks.shape
        n = plen + n_new
        out = torch.zeros(b, n, dtype=torch.long)
        out[:, :plen] = toks
        gen = torch.Generator().manual_seed(1000 * policy_version + self.index)
        keep: dict[str, dict[str, list[Any]]] = {t: {s.name: [] for s in self.spec.sites} for t in ids}
        forwards = 0
        with FP4SiteRecorder(self.model, [self.recorder]) as fp4, torch.no_grad():
            cache = fp4.hooks.new_cache()
            start, end = 0, plen
            while True:
                segs = [(t, start, end) for t in ids]
                with fp4.forward(segs) as records:
                    logits = self.model(input_ids=out[:, start:end], **fp4.hooks.cache_kwargs(cache), use_cache=True)
                for s in self.spec.sites:
                    codes, scales, g = records[s.name]
                    for i, t in enumerate(ids):
                        keep[t][s.name].append((pack_bits(codes[i], s.bits).numpy(), scales[i].numpy(), g))
                forwards += 1
                if forwards == kill_sidecar_after:
                    self.sidecar.kill()
                probs = torch.softmax(logits.logits[:, -1].float(), dim=-1)
                out[:, end] = torch.multinomial(probs, 1, generator=gen).squeeze(1)
                if end == n - 1:
                    break
                start, end = end, end + 1
        for t in ids:
            self.recorder.finish(t, n)
            self.recorded[t] = {
                name: (
                    np.concatenate([c for c, _, _ in parts]),
                    np.concatenate([sc for _, sc, _ in parts]),
                    np.concatenate([np.full(len(c), g, np.float32) for c, _, g in parts]),
                )
                for name, parts in keep[t].items()
            }
        refs = self.recorder.refs(ids, timeout=20)
        return [(t, out[i].tolist()) for i, t in enumerate(ids)], refs

    def records(self, ids: list[str]) -> dict[str, dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]]:
        """What this actor recorded for ``ids`` (verification only; never on the training path)."""
        return {t: self.recorded[t] for t in ids if t in self.recorded}

    def close(self) -> dict[str, int]:
        self.recorder.close(timeout=5)
        if self.sidecar.proc is not None:
            self.sidecar.terminate(30)
        return dict(self.recorder.stats)


class GuidedSiteHook:
    """``fn(site, x)`` for :class:`tracestore.client.hf.hooks.HFSiteHooks` in training: guided
    rounding (straight-through backward) with ``guidance[site]`` rows at each batch position
    (``index[b, t]`` = the plan row, -1 for a position the plan does not hold), RTN with the
    trainer's own global scale where a row has no record and at sites without guidance."""

    def __init__(self, guidance: dict[str, Any], index: Any) -> None:
        self.guidance, self.index = guidance, index
        # per site: the share of recorded values whose trained FP4 code keeps the rollout's low bits
        self.agreement: dict[str, float] = {}

    def __call__(self, site: Any, x: Any) -> Any:
        import torch

        from tracestore.formats import NVFP4
        from tracestore.fp4 import resolve_global_scale
        from tracestore.guided import guided_round, rtn_fake_quant

        g_own = resolve_global_scale(x.detach(), None)
        rows = self.guidance.get(site.name)
        if rows is None:
            return rtn_fake_quant(x, NVFP4, g_own)
        idx = self.index.clamp(min=0)
        has = self.index >= 0
        codes = torch.from_numpy(rows.codes)[idx]
        scales = torch.from_numpy(rows.scales)[idx]
        g = torch.from_numpy(rows.global_scale)[idx]
        valid = torch.from_numpy(rows.valid)[idx] & has
        y = guided_round(x, codes, scales, g, rows.site.bits, NVFP4, valid=valid, fallback_global_scale=g_own)
        if bool(valid.any()):
            from tracestore.demo.train import codes_on_grid
            from tracestore.packing import unpack_bits

            bits = rows.site.bits
            got = codes_on_grid(y.detach(), scales, g, NVFP4) & ((1 << bits) - 1)
            want = unpack_bits(codes, bits, x.shape[-1])
            self.agreement[site.name] = float((got == want)[valid].float().mean())
        return y


class Trainer:
    """One trainer rank: a model, an optimizer, a StoreReader of the shared storage, its layout."""

    def __init__(self, storage: str, layout: dict[str, Any], coord: dict[str, int]) -> None:
        import torch

        from tracestore.rank_plan import RankCoord, TrainerLayout

        self.layout = TrainerLayout(**layout)
        self.coord = RankCoord(**coord)
        self.model = _model(train=True)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.spec = run_spec()
        self.storage = storage
        self.reader: Any = None  # made at the first step, once the rollouts declared the run

    def _reader(self) -> Any:
        from tracestore import Store, StoreReader

        if self.reader is None:
            self.reader = StoreReader(Store(self.storage), RUN)
        return self.reader

    def ready(self) -> bool:
        return True

    def step(self, samples: list[tuple[str, list[int]]], refs: list[Any]) -> dict[str, Any]:
        """Plan, read, forward, backward, optimizer step. Returns the loss, what the rank read
        (for the driver's alignment check) and the memory its reader holds."""
        import pyarrow as pa
        import torch
        from tracestore.client.hf.hooks import HFSiteHooks

        from tracestore.rank_plan import rank_plan

        tokens = {t: toks for t, toks in samples}
        base = pa.total_allocated_bytes()
        rp = rank_plan(
            refs, self.layout, self.coord, run_spec=self.spec, lengths=[len(tokens[r.stored_id]) for r in refs]
        )
        got = rp.read(self._reader())
        held = pa.total_allocated_bytes() - base  # what the reader keeps while the step holds its rows
        slice_bytes = sum(
            int(x.nbytes)
            for name in got.rows
            for x in (
                got[name].codes,
                got[name].scales,
                got[name].global_scale,
                got[name].valid,
                got[name].policy_version,
            )
        )
        ids, pos, index = self._batch(rp, tokens)
        hook = GuidedSiteHook(dict(got.rows), index)
        with HFSiteHooks(self.model, hook):
            mask = (index >= 0).long()
            logits = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False).logits
        lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(2, ids[:, 1:, None]).squeeze(2)
        w = (mask[:, :-1] * mask[:, 1:]).float()
        loss = -(lp * w).sum() / w.sum().clamp(min=1)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return dict(
            coord=self.coord.__dict__,
            loss=loss.item(),
            token_map=rp.token_map(),
            rows={
                name: (
                    got[name].codes.copy(),
                    got[name].scales.copy(),
                    got[name].global_scale.copy(),
                    got[name].valid.copy(),
                )
                for name in got.rows
            },
            held_bytes=int(held),
            slice_bytes=slice_bytes,
            rows_total=got.rows_total,
            unguided_fraction=got.unguided_fraction,
            agreement=hook.agreement,
            plan_tokens=rp.n_tokens,
        )

    def _batch(self, rp: Any, tokens: dict[str, list[int]]) -> tuple[Any, Any, Any]:
        """The rank's model batch: input ids, position ids and, per position, its plan row (-1:
        none). A padded layout is one batch row per sample; a CP layout one per local chunk."""
        import torch

        pieces: list[list[tuple[int, int, int]]] = []  # per batch row: (plan row, token id, position)
        row = 0
        cur: list[tuple[int, int, int]] = []
        tm = rp.token_map()
        # cut the plan rows into batch rows: one per sample (padded) or per CP chunk (packed + CP)
        width = rp.plan.n_tokens // max(1, len(rp.refs)) if self.layout.packing == "padded" else 0
        chunk_sizes = []
        if self.layout.packing == "packed":
            k = self.layout.cp_chunks
            for r in rp.refs:
                size = -(-r.n_tokens // k)
                chunk_sizes += [size] * (len(range(k)) if k == self.layout.cp_size else 2)
        sizes = [width] * len(rp.refs) if width else chunk_sizes
        for size in sizes:
            cur = []
            for j in range(size):
                traj, tok = tm[row + j]
                cur.append((row + j, tokens[traj][tok], tok) if traj is not None else (-1, 0, 0))
            pieces.append(cur)
            row += size
        assert row == rp.plan.n_tokens, (row, rp.plan.n_tokens)
        s = max(len(p) for p in pieces)
        ids = torch.zeros(len(pieces), s, dtype=torch.long)
        pos = torch.zeros(len(pieces), s, dtype=torch.long)
        index = torch.full((len(pieces), s), -1, dtype=torch.long)
        for b, p in enumerate(pieces):
            for t, (r, tok_id, position) in enumerate(p):
                ids[b, t], pos[b, t], index[b, t] = tok_id, position, r
            # padding positions keep increasing positions (ignored by the mask)
            last = max((q[2] for q in p if q[0] >= 0), default=0)
            for t, (r, _, _) in enumerate(p):
                if r < 0:
                    last += 1
                    pos[b, t] = last
        return ids, pos, index


def check_alignment(result: dict[str, Any], records: dict[str, Any], refs: dict[str, Any]) -> list[str]:
    """Problems with one rank's rows against the rollouts' records (empty: aligned)."""
    problems = []
    for name, (codes, scales, g, valid) in result["rows"].items():
        k = 1
        for i, (traj, tok) in enumerate(result["token_map"]):
            r0 = i * k
            ref = refs.get(traj) if traj is not None else None
            if traj is None or ref is None or not ref.guided or tok == ref.n_tokens - 1:
                if valid[r0]:
                    problems.append(f"{result['coord']} {name} row {i} ({traj}, {tok}) should be RTN")
                continue
            want_c, want_s, want_g = (x[tok] for x in records[traj][name])
            if not valid[r0] or not np.array_equal(codes[r0], want_c) or not np.array_equal(scales[r0], want_s):
                problems.append(f"{result['coord']} {name} row {i} ({traj}, {tok}) differs from its record")
            elif g[r0] != want_g:
                problems.append(f"{result['coord']} {name} row {i}: global scale {g[r0]} != {want_g}")
    return problems


def run(workdir: str, *, n_rollout: int = 2, batch: int = 3, num_cpus: int = 4) -> dict[str, Any]:
    """Run two steps (policy versions 0 and 1; in step 1 the last rollout actor's sidecar is killed
    mid-rollout) and return the summary with every check's outcome."""
    import ray
    from tracestore.client.record.traceref import write_jsonl

    t0 = time.monotonic()
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    storage = f"file://{work / 'store'}"
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=True,
        object_store_memory=80 << 20,
        # workers import this module by name (a test loads it as "ray_pipeline") and tracestore
        runtime_env={
            "env_vars": {
                "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "examples"), os.environ.get("PYTHONPATH", "")])
            }
        },
    )
    summary: dict[str, Any] = {"steps": [], "problems": [], "phases": {}}
    summary["phases"]["ray_init_s"] = round(time.monotonic() - t0, 1)
    try:
        rollout_cls = ray.remote(num_cpus=0.5)(Rollout)
        trainer_cls = ray.remote(num_cpus=0.5)(Trainer)
        rollouts = [rollout_cls.remote(i, storage, str(work)) for i in range(n_rollout)]  # type: ignore[attr-defined]
        groups = {
            "dp2-padded": [({"dp_size": 2, "packing": "padded"}, {"dp": d}) for d in range(2)],
            "cp2-zigzag": [({"cp_size": 2, "packing": "packed"}, {"cp": c}) for c in range(2)],
        }
        trainers = [(g, trainer_cls.remote(storage, lay, coord)) for g, ranks in groups.items() for lay, coord in ranks]  # type: ignore[attr-defined]
        ray.get([a.records.remote([]) for a in rollouts] + [t.ready.remote() for _, t in trainers])
        summary["phases"]["actors_ready_s"] = round(time.monotonic() - t0, 1)
        all_refs: list[Any] = []
        for version in (0, 1):
            calls = []
            for i, actor in enumerate(rollouts):
                plen, n_new = 4 + i, 6 + 3 * i + version
                prompts = [(f"v{version}-r{i}-p{j}", [(7 * j + i + version) % 100 + 3] * plen) for j in range(batch)]
                kill = 3 if (version == 1 and i == n_rollout - 1) else -1
                calls.append(actor.generate.remote(prompts, n_new, version, kill))
            samples: list[tuple[str, list[int]]] = []
            refs: list[Any] = []
            for s, r in ray.get(calls):
                samples += s
                refs += r
            # the driver moves only refs (and the samples' token ids): a few hundred bytes each
            sizes = [len(pickle.dumps(r)) for r in refs]
            if max(sizes) > REF_BYTES_MAX:
                summary["problems"].append(f"a ref pickles to {max(sizes)} bytes")
            all_refs += refs
            summary["phases"][f"rollout_v{version}_s"] = round(time.monotonic() - t0, 1)
            results = ray.get([t.step.remote(samples, refs) for _, t in trainers])
            records: dict[str, Any] = {}
            for got in ray.get([a.records.remote([r.stored_id for r in refs]) for a in rollouts]):
                records.update(got)
            by_id = {r.stored_id: r for r in refs}
            step_tokens = sum(r.n_tokens for r in refs)
            for (group, _), res in zip(trainers, results, strict=True):
                summary["problems"] += check_alignment(res, records, by_id)
                # memory: the rank's reader keeps its output rows and nothing sized by the step
                if res["held_bytes"] > 2 * res["slice_bytes"] + (256 << 10):
                    summary["problems"].append(
                        f"{group} {res['coord']} holds {res['held_bytes']} bytes for a {res['slice_bytes']}-byte slice"
                    )
                if not np.isfinite(res["loss"]):
                    summary["problems"].append(f"{group} {res['coord']} loss {res['loss']}")
            # every token of the step is on exactly one rank of each group
            for group in groups:
                seen: dict[tuple[str, int], int] = {}
                for (g, _), res in zip(trainers, results, strict=True):
                    if g == group:
                        for x in res["token_map"]:
                            if x[0] is not None:
                                seen[x] = seen.get(x, 0) + 1
                if len(seen) != step_tokens or set(seen.values()) != {1}:
                    summary["problems"].append(
                        f"{group} v{version}: {len(seen)} of {step_tokens} tokens, counts {set(seen.values())}"
                    )
            summary["phases"][f"train_v{version}_s"] = round(time.monotonic() - t0, 1)
            summary["steps"].append(
                dict(
                    policy_version=version,
                    refs=len(refs),
                    unguided=[(r.stored_id, r.reason) for r in refs if not r.guided],
                    ref_bytes_max=max(sizes),
                    ranks=[
                        dict(group=g, coord=res["coord"], loss=res["loss"], plan_tokens=res["plan_tokens"],
                             slice_bytes=res["slice_bytes"], held_bytes=res["held_bytes"],
                             unguided_fraction=round(res["unguided_fraction"], 4),
                             agreement={k: round(v, 4) for k, v in res["agreement"].items()})
                        for (g, _), res in zip(trainers, results, strict=True)
                    ],
                )
            )  # fmt: skip
        write_jsonl(all_refs, work / "refs.jsonl")
        summary["refs_file"] = str(work / "refs.jsonl")
        summary["storage"] = storage
        summary["recorder_stats"] = ray.get([a.close.remote() for a in rollouts])
    finally:
        ray.shutdown()
    summary["seconds"] = round(time.monotonic() - t0, 1)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default=None, help="where storage, sidecars and refs.jsonl go (default: a temp dir)")
    ap.add_argument("--rollouts", type=int, default=2)
    ap.add_argument("--batch", type=int, default=3)
    args = ap.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="trace-ray-")
    summary = run(workdir, n_rollout=args.rollouts, batch=args.batch)
    json.dump(summary, sys.stdout, indent=1, default=str)
    print()
    return 1 if summary["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
