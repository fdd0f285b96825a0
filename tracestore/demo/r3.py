"""The demo's "R3 + TRACE" mode: rollout routing replay beside TRACE, end to end.

A sampling FP4 rollout (``FP4SiteRecorder`` with a KV cache, NVFP4/MXFP4 fake quantization at every
site) records, into one run through a ``tracestore serve`` subprocess and ``file://`` storage, the
FP4 records of every site (b = 1), the routed experts of every MoE layer (bfloat16 gate weights) and
the sampled tokens' log-probs (an artifact row per forward position: the log-prob of the token the
forward sampled; prompt positions are stored invalid). ``GuidanceReader`` reads all of it back for
the training batch with token identity checked, and six trainers take one step each on a copy of
the model: BF16, FP4 (RTN QAT) and FP4 + TRACE, each without and with ``RoutingReplayHooks``.
Measured on each trainer's first forward: routing agreement with the rollout on the rows with valid
routing (the experts each router handed its block, seen by a ``RoutingCapture`` inside the replay),
the replay's fallback rows, and the log-prob difference (against the log-probs read back) and
KL(rollout || trainer) over the generated tokens.
"""

from __future__ import annotations

import copy
import textwrap
import time
from collections.abc import Mapping
from typing import Any

import torch

from tracestore.artifacts import LogProbs, Routing, encode_logprobs, logprobs_site
from tracestore.client.hf.hooks import HFSiteHooks
from tracestore.client.hf.recorder import FP4SiteRecorder
from tracestore.client.hf.routing import RoutingCapture, RoutingReplayHooks, moe_routers
from tracestore.client.hf.train_hooks import GuidedFP4Hooks
from tracestore.demo.model import DTYPES, build_model
from tracestore.errors import StorageError
from tracestore.guidance import Guidance
from tracestore.records import RunSpec
from tracestore.site_output import SiteOutput

RUN = "demo-r3"
TRAINERS = (
    ("bf16", "BF16", False, False),
    ("bf16_r3", "BF16 + R3", False, True),
    ("fp4", "FP4 QAT (RTN)", True, False),
    ("fp4_r3", "FP4 QAT + R3", True, True),
    ("trace", "FP4 + TRACE", True, False),
    ("trace_r3", "FP4 + TRACE + R3", True, True),
)  # (name, label, fp4, replay); TRACE rows train with the records read back


def _traj(b: int) -> str:
    return f"r3-traj-{b}"


def run_spec(model: Any, fmt: str) -> RunSpec:
    """FP4 sites of every hooked layer (b = 1), every MoE layer's routing, the log-probs."""
    with HFSiteHooks(model, lambda site, x: None) as hooks:
        fp4 = [s.spec(bits=1, format=fmt) for s in hooks.sites]
    return RunSpec(RUN, (*fp4, *(r.spec("bfloat16") for r in moe_routers(model)), logprobs_site()))


def rollout(model: Any, prompts: torch.Tensor, n_new: int, fmt: str, recorder: Any, seed: int) -> dict[str, Any]:
    """Sample ``n_new`` tokens with FP4 at every site, recording FP4 codes and routing; then record
    the sampled tokens' log-probs. Returns tokens [B, P+n], the rollout's next-token log-prob
    distributions [B, n, V] and its routing ``{site: ids [B*(P+n-1), top_k]}``."""
    b, p = prompts.shape
    torch.manual_seed(seed)
    with FP4SiteRecorder(model, [recorder], fmt=fmt) as fp4, torch.no_grad():
        with fp4.forward([(_traj(i), 0, None) for i in range(b)]):
            gen = model.generate(
                prompts, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=True, output_logits=True,
                return_dict_in_generate=True, **fp4.hooks.cache_kwargs(fp4.hooks.new_cache()),
            )  # fmt: skip
        routing = {r.site: fp4.records[r.site][0].reshape(-1, r.top_k) for r in fp4.routing.routers}  # type: ignore[union-attr]
    tokens = gen.sequences
    dist = torch.log_softmax(torch.stack(gen.logits, 1).float(), dim=-1)
    n = p + n_new
    # row at position q: the log-prob of the token sampled by the forward at q (q = P-1 .. n-2)
    lp = torch.zeros(b, n - 1)
    lp[:, p - 1 :] = dist.gather(2, tokens[:, p:, None]).squeeze(2).cpu()
    valid = torch.zeros(b, n - 1, dtype=torch.bool)
    valid[:, p - 1 :] = True
    site = recorder.run_spec.site("logprobs")
    codes, scales = encode_logprobs(site, lp.reshape(-1).numpy(), valid.reshape(-1).numpy())
    segs = [(_traj(i), 0, n - 1) for i in range(b)]
    if not recorder.record_forward(segs, {"logprobs": SiteOutput(codes, scales)}, token_ids=tokens[:, :-1].reshape(-1)):
        raise StorageError(f"run {RUN}: the recorder refused the log-probs ({recorder.stats})")
    return {"tokens": tokens, "dist": dist, "routing": routing}


def _train(
    base: Any, rows: Mapping[str, Any], tokens: torch.Tensor, p: int, dist: torch.Tensor, fmt: str,
    fp4: bool, replay: bool, trace: bool, lr: float,
) -> dict[str, Any]:  # fmt: skip
    model = copy.deepcopy(base).train()
    r3 = RoutingReplayHooks(model) if replay else None  # before the capture: it sees the replayed ids
    seen = RoutingCapture(model)
    qat = GuidedFP4Hooks(model, fmt) if fp4 else None
    try:
        if r3 is not None:
            r3.set_routing(rows)
        if qat is not None:
            qat.set_guidance({k: v for k, v in rows.items() if isinstance(v, Guidance)} if trace else None)
        logits = model(input_ids=tokens, use_cache=False).logits[:, p - 1 : -1].float()
        lp_all = torch.log_softmax(logits, dim=-1)
        lp = lp_all.gather(2, tokens[:, p:, None]).squeeze(2)
        stored = rows["logprobs"]
        assert isinstance(stored, LogProbs)
        b, n = tokens.shape
        ref = stored.values.reshape(b, n)[:, p - 1 : -1].to(lp.device)
        with torch.no_grad():
            diff = (lp - ref).abs()
            kl = (dist.exp() * (dist - lp_all)).sum(-1)
            agree = total = 0
            for site, r in rows.items():
                if isinstance(r, Routing):
                    used = seen.last[site][0].cpu()
                    same = (used.sort(1).values == r.experts.sort(1).values).all(1) & r.valid
                    agree += int(same.sum())
                    total += int(r.valid.sum())
        loss = -lp.mean()
        loss.backward()
        router_grad = sum(
            float(prm.grad.abs().sum())
            for r in moe_routers(model)
            for _, prm in r.module.named_parameters()
            if prm.grad is not None and prm.dim() == 2 and prm.shape[0] == r.n_experts
        )
        torch.optim.AdamW(model.parameters(), lr=lr).step()
    finally:
        for h in (qat, seen, r3):
            if h is not None:
                h.remove()
    return {
        "routing_agreement": agree / total if total else None,
        "routing_rows": total,
        "replay": None if r3 is None else dict(r3.stats),
        "logp_mean": float(diff.mean()),
        "logp_max": float(diff.max()),
        "kl_mean": float(kl.mean()),
        "router_grad_l1": router_grad,
    }


def run_r3(cfg: Any, workdir: Any) -> dict[str, Any]:
    """The "R3 + TRACE" mode for ``cfg`` (a ``DemoConfig``: model, batch, format, device, seed, lr)
    through its own ``tracestore serve`` under ``workdir`` (storage ``workdir/store``). Returns the
    table and its checks for ``results.json``."""
    from tracestore.demo.transport import ServiceTransport

    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    if cfg.threads is not None and cfg.device == "cpu":
        torch.set_num_threads(cfg.threads)
    try:
        model = build_model(cfg.model, dtype=DTYPES[cfg.dtype], device=cfg.device, seed=cfg.seed)
        with ServiceTransport({"r3": run_spec(model, cfg.format)}, workdir, None) as transport:
            out = _run(cfg, model, transport)
    finally:
        torch.set_num_threads(threads)
    out["seconds"] = time.perf_counter() - t0
    return out


def _run(cfg: Any, model: Any, transport: Any) -> dict[str, Any]:
    from tracestore.client import GuidanceReader
    from tracestore.plan import MicrobatchPlan

    gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed + 1)
    prompts = torch.randint(3, cfg.model.vocab, (cfg.trajectories, cfg.prompt), generator=gen, device=cfg.device)
    rec = transport.recorders["r3"]
    roll = rollout(copy.deepcopy(model).eval(), prompts, cfg.tokens, cfg.format, rec, cfg.seed + 2)
    tokens = roll["tokens"]
    b, n = tokens.shape
    for i in range(b):
        rec.finish(_traj(i), n)
    if not rec.flush(timeout=60):
        raise StorageError(f"run {RUN}: records were not durably acked ({rec.stats})")
    plan = MicrobatchPlan([(_traj(i), 0, n) for i in range(b)])
    with GuidanceReader(transport.storage, RUN, device=cfg.device, prefetch=False) as reader:
        rows = dict(reader.read(plan, token_ids=tokens.reshape(-1)))
    # what came back is what the rollout routed (the final position: unrecorded by design)
    read_back = all(
        torch.equal(r.experts.reshape(b, n, -1)[:, :-1].reshape(-1, r.top_k).cpu(), roll["routing"][k].cpu())
        and bool(r.valid.reshape(b, n)[:, :-1].all()) and not bool(r.valid.reshape(b, n)[:, -1].any())
        for k, r in rows.items() if isinstance(r, Routing)
    )  # fmt: skip
    table = {}
    for name, label, fp4, replay in TRAINERS:
        m = _train(
            model, rows, tokens, cfg.prompt, roll["dist"], cfg.format, fp4, replay, name.startswith("trace"), cfg.lr
        )
        table[name] = {"label": label, **m}
    replays = [v for v in table.values() if v["replay"] is not None]
    checks = [
        {
            "check": "R3: routing read back through the sidecar and storage is what the rollout routed",
            "measured": str(read_back),
            "ok": read_back,
        },
        {
            "check": "R3: with replay, routing agreement on valid rows is 100% in every trainer",
            "measured": ", ".join(f"{k}: {v['routing_agreement']:.4f}" for k, v in table.items() if v["replay"]),
            "ok": all(v["routing_agreement"] == 1.0 for v in replays),
        },
        {
            "check": "R3: replay falls back to the live router exactly on rows without valid routing (final positions)",
            "measured": ", ".join(f"{k}: {v['replay']['fallback_rows']}" for k, v in table.items() if v["replay"]),
            "ok": all(v["replay"]["fallback_rows"] == b * len(moe_routers(model)) for v in replays),
        },
        {
            "check": "R3: gradients reach the routers with replay",
            "measured": ", ".join(f"{k}: {v['router_grad_l1']:.3g}" for k, v in table.items() if v["replay"]),
            "ok": all(v["router_grad_l1"] > 0 for v in replays),
        },
    ]
    spec = rec.run_spec
    route_bytes = sum(s.code_bytes + s.scale_bytes for s in spec.sites if s.kind == "routed_experts")
    return {
        "run": RUN,
        "arch": cfg.model.arch,
        "moe_layers": len(moe_routers(model)),
        "table": table,
        "expectations": checks,
        "routing_bytes_per_token": route_bytes,
        "storage": transport.storage,
    }


def format_r3(r3: Mapping[str, Any]) -> list[str]:
    """The R3 table as report lines."""
    lines = textwrap.wrap(
        f"R3 + TRACE ({r3['arch']}, {r3['moe_layers']} MoE layers, routing {r3['routing_bytes_per_token']} B/token "
        "stored with bf16 gate weights), first forward of each trainer: routing agreement with the rollout on rows "
        "with valid routing, replay fallback rows, |log p_train - log p_rollout| against the log-probs read back, "
        "KL(rollout || trainer)",
        120,
        subsequent_indent="  ",
    )
    lines += [
        f"  {'trainer':<20} {'routing agree':>13} {'fallback rows':>13} {'|dlogp| mean':>12} {'|dlogp| max':>11} "
        f"{'KL mean':>10}",
    ]
    for v in r3["table"].values():
        fb = "-" if v["replay"] is None else str(v["replay"]["fallback_rows"])
        agree = "-" if v["routing_agreement"] is None else f"{100 * v['routing_agreement']:.2f}%"
        nums = f"{v['logp_mean']:>12.4g} {v['logp_max']:>11.4g} {v['kl_mean']:>10.4g}"
        lines.append(f"  {v['label']:<20} {agree:>13} {fb:>13} {nums}")
    return lines
