"""Gradients through HFSiteHooks, with and without activation checkpointing (tiny random-init
qwen3_moe on the CPU): a hooked model whose callback is the identity has exactly the parameter
gradients of the unhooked model; with guided FP4 fake quantization (GuidedFP4Hooks: guided_fp4 at
sites with records, RTN elsewhere) the gradients are finite and straight-through, i.e. exactly those
of the same model whose callback returns the same values but is the identity in backward."""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the hook helper needs torch")
pytest.importorskip("transformers", reason="the hook helper needs the demo extra (transformers)")

from tracestore.client.hf.hooks import HFSiteHooks  # noqa: E402
from tracestore.client.hf.train_hooks import GuidedFP4Hooks  # noqa: E402

from tests.hf_compat import checkpointing_off, checkpointing_on  # noqa: E402
from tracestore.demo.model import ModelSpec, build_model  # noqa: E402
from tracestore.formats import NVFP4  # noqa: E402
from tracestore.fp4 import quantize  # noqa: E402
from tracestore.guidance import Guidance  # noqa: E402
from tracestore.packing import pack_bits  # noqa: E402

SPEC = ModelSpec("qwen3_moe", layers=2, hidden=32, heads=2, kv_heads=1, experts=4, top_k=2, expert_hidden=32, vocab=64)
CHECKPOINTING = [None, "non-reentrant", "reentrant"]


def tiny() -> Any:
    return build_model(SPEC, dtype=torch.float32, seed=1).train()


def batch() -> torch.Tensor:
    return torch.randint(3, SPEC.vocab, (2, 7), generator=torch.Generator().manual_seed(2))


def grads(model: Any, checkpointing: str | None) -> dict[str, torch.Tensor]:
    """Parameter gradients of a fixed random projection of the logits (no cache: a training forward)."""
    if checkpointing is None:
        checkpointing_off(model)
    else:
        checkpointing_on(model, {"use_reentrant": checkpointing == "reentrant"})
        if checkpointing == "reentrant":
            model.enable_input_require_grads()  # reentrant checkpoints need an input that requires grad
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=batch(), use_cache=False).logits
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3))
    (logits * w).sum().backward()
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for n in want:
        assert torch.equal(got[n], want[n]), n


def test_reference_gradients_reach_every_layer() -> None:
    g = grads(tiny(), None)
    for i in range(SPEC.layers):
        assert any(n.startswith(f"model.layers.{i}.mlp.experts") for n in g), i
        assert g[f"model.layers.{i}.self_attn.k_proj.weight"].abs().sum() > 0


@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
@pytest.mark.parametrize("identity", ["same tensor", "new tensor"])
def test_identity_callback_gives_the_unhooked_gradients_exactly(checkpointing: str | None, identity: str) -> None:
    model = tiny()
    want = grads(model, None)
    calls: list[str] = []

    def fn(site: Any, x: torch.Tensor) -> torch.Tensor:
        calls.append(site.name)
        return x if identity == "same tensor" else x.clone()

    with HFSiteHooks(model, fn) as hooks:
        got = grads(model, checkpointing)
        names = {s.name for s in hooks.sites}
    assert_same(got, want)
    assert set(calls) == names
    # checkpointing recomputes each layer once in backward: every site seen twice
    assert len(calls) == len(names) * (1 if checkpointing is None else 2)
    assert_same(grads(model, checkpointing), want)  # removed: the unhooked model again


class _StraightThrough(torch.autograd.Function):
    """Returns ``y`` in forward, passes the gradient to ``x`` unchanged in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return y.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def rollout_guidance(model: Any) -> dict[str, Guidance]:
    """Records of the rollout model's site inputs (b = 1, NVFP4, one g per site), the last position
    of each row without a record; for layer 1's sites and layer 0's MoE input only (the others RTN)."""
    seen: dict[str, torch.Tensor] = {}
    keep = lambda s, x: seen.__setitem__(s.name, x.detach().reshape(-1, x.shape[-1]))  # noqa: E731
    with HFSiteHooks(model, keep), torch.no_grad():
        model(input_ids=batch(), use_cache=False)
    out = {}
    for name, x in seen.items():
        if name.startswith("layers.0.attn."):
            continue
        q = quantize(x.float(), NVFP4)
        valid = torch.ones(x.shape[0], dtype=torch.bool)
        valid[6::7] = False
        g = torch.full((x.shape[0],), float(q.global_scale), dtype=torch.float32)
        out[name] = Guidance(pack_bits(q.codes, 1), q.scales, g, bits=1, fmt=NVFP4, valid=valid)
    assert set(out) == {"layers.0.mlp.input", "layers.1.mlp.input", "layers.1.attn.k", "layers.1.attn.v"}
    return out


@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
def test_guided_fake_quant_gradients_are_finite_and_straight_through(checkpointing: str | None) -> None:
    rollout = tiny()
    guidance = rollout_guidance(rollout)
    model = copy.deepcopy(rollout)  # the trainer's weights have moved since the rollout
    with torch.no_grad():
        gen = torch.Generator().manual_seed(4)
        for p in model.parameters():
            p.add_(1e-2 * p.abs().mean() * torch.randn(p.shape, generator=gen))
    unhooked = grads(model, None)

    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = GuidedFP4Hooks(model, "nvfp4").set_guidance(guidance)
    quant = hooks.hooks.fn

    def capture(site: Any, x: torch.Tensor) -> torch.Tensor:
        y = quant(site, x)
        assert y is not None and y.shape == x.shape
        seen[site.name] = (x.detach().clone(), y.detach().clone())
        return y

    hooks.hooks.fn = capture
    try:
        got = grads(model, checkpointing)
    finally:
        hooks.remove()
    assert set(seen) == {s.name for s in hooks.sites}
    for name, (x, y) in seen.items():
        assert not torch.equal(x, y), f"{name} was not quantized"
    for n, g in got.items():
        assert torch.isfinite(g).all(), n
    assert any(not torch.equal(got[n], unhooked[n]) for n in got), "fake quantization changed no gradient"

    def straight(site: Any, x: torch.Tensor) -> torch.Tensor:
        x0, y0 = seen[site.name]
        assert torch.equal(x.detach(), x0), f"{site.name}: the forward differs from the quantized one"
        return _StraightThrough.apply(x, y0)

    with HFSiteHooks(model, straight):
        want = grads(model, checkpointing)
    assert_same(got, want)
    if checkpointing is not None:  # and a checkpointed backward is the plain one
        with GuidedFP4Hooks(model, "nvfp4") as again:
            again.set_guidance(guidance)
            assert_same(grads(model, None), got)
