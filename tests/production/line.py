"""The production line for the tests: kernels -> RolloutRecorder.record_slab -> sidecar process ->
storage -> GuidanceReader -> GuidedFP4Hooks -> backward, on one device (CPU reference or CUDA).

The rollout is one full forward of a small random MoE model with FP4 at every hooked site, recorded
by ``record_from_activations`` into a ``RecordSlab`` (with the engine's packed FP4 codes, which
the model consumes dequantized). Training runs the same forward with the guided hooks: with the
same input every site must give the rollout's values bit for bit, hence the same logits.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import torch
from tracestore.client import GuidanceReader, GuidedFP4Hooks, RolloutRecorder, Segments
from tracestore.client.hf.hooks import HFSiteHooks
from tracestore.server.testing import ServeProcess

from tracestore.demo.model import ModelSpec, build_model
from tracestore.formats import get_format
from tracestore.kernels import RecordSlab, record_from_activations
from tracestore.plan import MicrobatchPlan
from tracestore.records import RunSpec

SMALL = ModelSpec(
    "qwen3_moe", layers=2, hidden=64, heads=2, kv_heads=1, experts=4, top_k=2, expert_hidden=64, vocab=128
)
B, T = 2, 12
TRAJS = [f"traj-{b}" for b in range(B)]


@dataclasses.dataclass
class Rollout:
    model: Any
    ids: torch.Tensor
    spec: RunSpec
    slab: RecordSlab
    logits: torch.Tensor
    site_y: dict[str, torch.Tensor]  # what each site consumed, [B*T, w] float32
    staged: torch.Tensor  # the slab's used rows after the forward


def g_for(mode: str, rows: torch.Tensor, static: dict[str, float], name: str) -> Any:
    """The engine's decode-side g: calibrated static per site, per token, or per forward (None)."""
    if mode == "static":
        return torch.tensor([static[name]], dtype=torch.float32, device=rows.device)
    if mode == "token":
        return (rows.detach().float().abs().amax(-1) / 2688.0).contiguous()
    return None


def rollout(device: str, fmt: str = "nvfp4", g_mode: str = "forward", bits: int = 1, seed: int = 0) -> Rollout:
    f = get_format(fmt)
    model = build_model(SMALL, dtype=torch.float32, device=device, seed=seed)
    ids = torch.randint(3, SMALL.vocab, (B, T), generator=torch.Generator().manual_seed(seed + 1)).to(device)
    with HFSiteHooks(model, lambda s, x: None) as h:
        sites = h.sites
    spec = RunSpec("line", tuple(s.spec(bits=bits, format=fmt) for s in sites))
    specs = {s.name: s for s in spec.sites}
    static: dict[str, float] = {}
    if g_mode == "static":  # calibration: one unquantized forward, amax per site

        def calib(site: Any, x: torch.Tensor) -> None:
            static[site.name] = float(x.detach().float().abs().amax()) / 2688.0

        with HFSiteHooks(model, calib), torch.no_grad():
            model(input_ids=ids, use_cache=False)
    slab = RecordSlab.allocate(spec.sites, B * T, device, with_fp4=True)
    site_y: dict[str, torch.Tensor] = {}

    def engine(site: Any, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        g = g_for(g_mode, rows, static, site.name) if f.has_global_scale else None
        r = record_from_activations(rows, specs[site.name], slab[site.name], global_scale=g)
        y = r.dequantize(f)
        site_y[site.name] = y
        return y.reshape(x.shape).to(x.dtype)

    with HFSiteHooks(model, engine), torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    return Rollout(model, ids, spec, slab, logits, site_y, slab.data[: B * T].clone())


def record_and_read(roll: Rollout, workdir: pathlib.Path, unix: bool = False, columns: bool = False) -> dict[str, Any]:
    """record_slab through a sidecar process (acks at commit), drain it, read the plan from storage.
    ``columns``: the segments as :class:`Segments` (column form) instead of a list of tuples."""
    with ServeProcess(workdir, wal=False, unix_socket=unix, flags=["--flush-interval", "0.1"]) as sp:
        rec = RolloutRecorder(sp.unix_address if unix else sp.address, roll.spec, writer="line-0")
        try:
            segs: Any = [(t, 0, T) for t in TRAJS]
            if columns:
                segs = Segments(tuple(TRAJS), [0] * len(TRAJS), [T] * len(TRAJS))
            assert rec.record_slab(segs, roll.slab, n_rows=B * T)
            for t in TRAJS:
                assert rec.finish(t, T + 1)  # as if one more token was sampled: every position recorded
            assert rec.flush(timeout=60), sp.log_tail()
        finally:
            rec.close()
        assert sp.terminate() == 0
    device = str(roll.slab.device)
    with GuidanceReader(sp.storage, roll.spec.run, device=device, prefetch=False) as reader:
        got = reader.read(MicrobatchPlan([(t, 0, T) for t in TRAJS]))
    return dict(got)


def check_records(roll: Rollout, got: dict[str, Any]) -> None:
    """The read rows equal the slab's bytes; the effective g (g x token scale) equals the slab's g."""
    assert set(got) == {s.name for s in roll.spec.sites}
    n = B * T
    for f in roll.slab.layout:
        g = got[f.name]
        assert bool(g.valid.all()), f.name
        raw = roll.staged.cpu()
        assert torch.equal(g.codes.cpu(), raw[:, f.codes : f.codes + f.code_bytes]), f.name
        assert torch.equal(g.scales.cpu(), raw[:, f.scales : f.scales + f.scale_bytes]), f.name
        want = raw[:, f.g : f.g + 4].contiguous().view(torch.float32).reshape(n)
        gs = torch.as_tensor(g.global_scale, dtype=torch.float32).cpu().expand(n)
        eff = gs * (g.token_scales.cpu() if g.token_scales is not None else 1.0)
        assert torch.equal(eff, want), f.name


class Spy(GuidedFP4Hooks):
    """The public hook, keeping what each site returned."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        self.seen: dict[str, torch.Tensor] = {}
        super().__init__(*a, **kw)

    def __call__(self, site: Any, x: torch.Tensor) -> torch.Tensor | None:
        y = super().__call__(site, x)
        if y is not None:
            self.seen[site.name] = y.detach().reshape(-1, x.shape[-1]).float()
        return y


def train_identity(roll: Rollout, got: dict[str, Any], fmt: str = "nvfp4", compile: bool = False) -> Spy:
    """Guided training forward on the rollout's own input: every site equals the rollout's values
    and the logits are the rollout's; then a backward reaches every parameter that takes part."""
    model = roll.model
    model.train()
    hooks = Spy(model, fmt)
    hooks.set_guidance(got)
    fwd = torch.compile(model, fullgraph=False) if compile else model
    logits = fwd(input_ids=roll.ids, use_cache=False).logits
    for name, y in roll.site_y.items():
        assert torch.equal(hooks.seen[name], y), name
    assert torch.equal(logits.detach(), roll.logits), float((logits.detach() - roll.logits).abs().max())
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), roll.ids[:, 1:].reshape(-1))
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(bool(torch.isfinite(g).all()) for g in grads)
    hooks.remove()
    return hooks
