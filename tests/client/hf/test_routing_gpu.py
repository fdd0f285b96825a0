"""Routing replay on a GPU: a bf16 tiny MoE on CUDA, its routing captured, then replayed on a copy
whose routers were perturbed: the experts the expert modules consume are the recorded ones on every
valid row, rows without valid routing are counted as fallbacks, and gradients reach the routers."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="the hooks need the demo extra (transformers)")

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)

from tracestore.client import RoutingCapture, RoutingReplayHooks  # noqa: E402
from tracestore.client.hf.routing import moe_routers  # noqa: E402

from tracestore.artifacts import Routing  # noqa: E402
from tracestore.demo.model import ModelSpec, build_model  # noqa: E402


def _consumed(model: Any) -> tuple[dict[str, torch.Tensor], list[Any]]:
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for r in moe_routers(model):

        def pre(mod: Any, args: Any, site: str = r.site) -> None:
            seen[site] = args[1].clone()

        handles.append(r.module.experts.register_forward_pre_hook(pre))
    return seen, handles


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_replay_on_cuda(arch: str) -> None:
    spec = ModelSpec(arch, layers=2, hidden=128, heads=2, kv_heads=1, experts=8, top_k=2, expert_hidden=64, vocab=256)
    model = build_model(spec, dtype=torch.bfloat16, device="cuda", seed=1)
    ids = torch.randint(7, 256, (4, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    cap = RoutingCapture(model)
    with torch.no_grad():
        model(ids)
    cap.remove()
    recorded = {k: v[0] for k, v in cap.last.items()}
    trainer = copy.deepcopy(model)
    g = torch.Generator("cuda").manual_seed(5)
    for r in moe_routers(trainer):
        for _, p in r.module.named_parameters():
            if p.dim() == 2 and p.shape[0] == r.n_experts:
                with torch.no_grad():
                    p.add_(torch.randn(p.shape, generator=g, device="cuda", dtype=p.dtype) * 0.5)
    valid = torch.ones(4 * 64, dtype=torch.bool, device="cuda")
    valid[-16:] = False
    routers = {r.site: r for r in moe_routers(trainer)}
    rows = {s: Routing(routers[s].spec(), e, valid) for s, e in recorded.items()}
    seen, handles = _consumed(trainer)
    r3 = RoutingReplayHooks(trainer).set_routing(rows)
    trainer(ids).logits.float().pow(2).mean().backward()
    for site, want in recorded.items():
        assert torch.equal(seen[site][valid], want[valid]), site
    assert r3.stats["replayed_rows"] == int(valid.sum()) * len(recorded)
    assert r3.stats["fallback_rows"] == 16 * len(recorded)
    grads = [p.grad for r in routers.values() for _, p in r.module.named_parameters()
             if p.dim() == 2 and p.shape[0] == r.n_experts]  # fmt: skip
    assert grads and all(x is not None and bool(torch.isfinite(x).all()) and bool(x.abs().sum() > 0) for x in grads)
    r3.remove()
    for h in handles:
        h.remove()
