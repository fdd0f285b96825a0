"""Routing capture and replay (R3) on tiny transformers MoE models.

- Capture sees the experts the expert module consumes, family by family.
- Replay forces them on a model whose routers were perturbed: the experts consumed are the recorded
  ones on valid rows, the live router's on the others (counted), and gradients reach the router.
- End to end through a real `tracestore serve` process and storage: FP4SiteRecorder records
  routing beside FP4 sites, GuidanceReader reads it for a padded plan with token identity, and
  RoutingReplayHooks with GuidedFP4Hooks gives 100% routing agreement on valid rows; a plan shifted
  by one token is refused by identity, and replaying it unchecked breaks agreement.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the hooks need torch")
pytest.importorskip("transformers", reason="the hooks need the demo extra (transformers)")

from tracestore.client import GuidanceReader, GuidedFP4Hooks, RolloutRecorder, RoutingReplayHooks  # noqa: E402
from tracestore.client.hf.recorder import FP4SiteRecorder  # noqa: E402
from tracestore.client.hf.routing import RoutingCapture, moe_routers  # noqa: E402
from tracestore.server.testing import ServeProcess  # noqa: E402

from tracestore.artifacts import Routing  # noqa: E402
from tracestore.demo.model import ModelSpec, build_model  # noqa: E402
from tracestore.errors import ConfigError, GuidanceMismatch  # noqa: E402
from tracestore.plan import MicrobatchPlan  # noqa: E402
from tracestore.records import RunSpec, SiteSpec  # noqa: E402

ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "granitemoe", "dbrx")


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@functools.cache
def _tiny(arch: str) -> Any:
    spec = ModelSpec(arch, layers=2, hidden=64, heads=2, kv_heads=1, experts=4, top_k=2, expert_hidden=32, vocab=64)
    return build_model(spec, dtype=torch.float32, seed=1)


def tiny(arch: str) -> Any:
    return copy.deepcopy(_tiny(arch))


def tokens(b: int, t: int, seed: int = 2) -> Any:
    return torch.randint(7, 64, (b, t), generator=torch.Generator().manual_seed(seed))


def perturb_routers(model: Any, scale: float = 0.5) -> None:
    """Noise on every router weight ([n_experts, hidden] matrices of the MoE blocks), so the live
    router picks other experts than the rollout's on some tokens."""
    g = torch.Generator().manual_seed(5)
    for r in moe_routers(model):
        for _, p in r.module.named_parameters():
            if p.dim() == 2 and p.shape[0] == r.n_experts:
                with torch.no_grad():
                    p.add_(torch.randn(p.shape, generator=g) * scale)


class Consumed:
    """The expert ids each MoE block's expert module is called with (its ``top_k_index`` argument)."""

    def __init__(self, model: Any) -> None:
        self.seen: dict[str, Any] = {}
        self.handles = []
        for r in moe_routers(model):

            def pre(mod: Any, args: Any, site: str = r.site) -> None:
                self.seen[site] = args[1].clone()

            self.handles.append(r.module.experts.register_forward_pre_hook(pre))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def capture(model: Any, ids: Any) -> dict[str, Any]:
    cap = RoutingCapture(model)
    try:
        with torch.no_grad():
            model(ids)
    finally:
        cap.remove()
    return {k: v[0] for k, v in cap.last.items()}


def agreement(used: Any, truth: Any, valid: Any) -> float:
    """Share of valid rows whose used expert set equals the truth's."""
    same = (used.sort(dim=1).values == truth.sort(dim=1).values).all(dim=1)
    return float(same[valid].float().mean())


@pytest.mark.parametrize("arch", ARCHS)
def test_capture_is_what_the_experts_consume(arch: str) -> None:
    model = tiny(arch)
    watch = Consumed(model)
    got = capture(model, tokens(2, 6))
    watch.remove()
    assert got and set(got) == set(watch.seen)
    for site, ids in got.items():
        assert ids.shape == (12, 2) and torch.equal(ids, watch.seen[site]), site


@pytest.mark.parametrize("arch", ARCHS)
def test_replay_forces_recorded_experts_and_the_router_still_learns(arch: str) -> None:
    model = tiny(arch)
    ids = tokens(2, 6)
    recorded = capture(model, ids)
    perturb_routers(model)
    live = capture(model, ids)
    valid = torch.ones(12, dtype=torch.bool)
    valid[8:] = False  # the second row's last 4 tokens: no valid routing (retracted, unrecorded)
    routers = {r.site: r for r in moe_routers(model)}
    rows = {s: Routing(routers[s].spec(), e, valid) for s, e in recorded.items()}
    watch = Consumed(model)
    r3 = RoutingReplayHooks(model).set_routing(rows)
    out = model(ids).logits
    out.float().pow(2).mean().backward()
    r3.remove()
    watch.remove()
    for site, want in recorded.items():
        used = watch.seen[site]
        assert torch.equal(used[valid], want[valid]), site  # replayed
        assert agreement(used, want, valid) == 1.0
    first = min(recorded, key=lambda s: routers[s].layer)  # its input is the same with and without replay
    assert torch.equal(watch.seen[first][~valid], live[first][~valid])  # the live router's choice
    n = len(recorded)
    assert r3.stats["replayed_rows"] == 8 * n and r3.stats["fallback_rows"] == 4 * n and r3.stats["live_blocks"] == 0
    # the count of rows the live router already agreed on, for the first router alone
    r3 = RoutingReplayHooks(model).set_routing({first: rows[first]})
    with torch.no_grad():
        model(ids)
    r3.remove()
    agreed = int(((live[first].sort(1).values == recorded[first].sort(1).values).all(1) & valid).sum())
    assert r3.stats == {"replayed_rows": 8, "fallback_rows": 4, "live_agreed_rows": agreed, "live_blocks": n - 1}
    assert agreed < 8 or n > 1 and agreement(live[max(recorded)], recorded[max(recorded)], valid) < 1.0, (
        "the perturbation changed no routing: the test would not see replay working"
    )
    grads = [p.grad for r in routers.values() for _, p in r.module.named_parameters()
             if p.dim() == 2 and p.shape[0] == r.n_experts]  # fmt: skip
    assert grads and all(g is not None and bool(g.abs().sum() > 0) and bool(torch.isfinite(g).all()) for g in grads)


def test_replay_refuses_mismatched_routing_and_routers_that_do_not_topk() -> None:
    model = tiny("qwen3_moe")
    r3 = RoutingReplayHooks(model)
    site = moe_routers(model)[0]
    with pytest.raises(ConfigError, match="top-2 of 8 experts; the model's router is top-2 of 4"):
        other = SiteSpec(site.site, "routed_experts", 0, 2, n_experts=8)
        r3.set_routing(
            {site.site: Routing(other, torch.zeros(3, 2, dtype=torch.long), torch.ones(3, dtype=torch.bool))}
        )
    r3.set_routing(
        {site.site: Routing(site.spec(), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, dtype=torch.bool))}
    )
    with pytest.raises(Exception, match="routing has 3 rows but the router scores 10 tokens"):
        model(tokens(2, 5))
    r3.remove()
    with pytest.raises(ConfigError, match="torch.compile'd model"):
        RoutingReplayHooks(torch.compile(model))
    phi = build_model(ModelSpec("phimoe", layers=2, hidden=64, heads=2, kv_heads=1, experts=4, top_k=2,
                                expert_hidden=32, vocab=64), dtype=torch.float32, seed=1)  # fmt: skip
    cap = RoutingCapture(phi)
    with pytest.raises(ConfigError, match="without a torch.topk"), torch.no_grad():
        phi(tokens(1, 4))
    cap.remove()


_SPECIAL = {"max_position_embeddings": 4096, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
# Families with no MoE block module (Gemma 4: router and experts on the decoder layer) and with
# zero-computation experts (LongCat-Flash: ids past the routed experts), at the hook tests' sizes
LAYER_HELD: dict[str, dict[str, Any]] = {
    "gemma4_text": dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=32, global_head_dim=32, sliding_window=128,
                        layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0,
                        vocab_size_per_layer_input=64, enable_moe_block=True, num_experts=4, top_k_experts=2,
                        moe_intermediate_size=32, num_kv_shared_layers=0, attention_k_eq_v=False, **_SPECIAL),
    "longcat_flash": dict(vocab_size=64, hidden_size=64, num_layers=2, num_attention_heads=2, num_key_value_heads=2,
                          ffn_hidden_size=64, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=32,
                          head_dim=32, v_head_dim=32, moe_topk=2, n_routed_experts=4, zero_expert_num=2,
                          expert_ffn_hidden_size=32, **_SPECIAL),
}  # fmt: skip


@pytest.mark.parametrize("arch", sorted(LAYER_HELD))
def test_replay_on_layer_held_experts_and_zero_experts(arch: str) -> None:
    import transformers

    torch.manual_seed(1)
    cfg = transformers.AutoConfig.for_model(arch, **LAYER_HELD[arch])
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()
    routers = moe_routers(model)
    assert routers and all(r.top_k == 2 for r in routers)
    assert {r.n_experts for r in routers} == {6 if arch == "longcat_flash" else 4}
    ids = tokens(2, 5)
    recorded = capture(model, ids)
    with torch.no_grad():
        ref = model(ids).logits
    ones = torch.ones(10, dtype=torch.bool)
    with RoutingReplayHooks(model) as r3, torch.no_grad():
        r3.set_routing({r.site: Routing(r.spec(), recorded[r.site], ones) for r in routers})
        assert torch.equal(model(ids).logits, ref)  # its own routing: the same forward
        other = {r.site: Routing(r.spec(), (recorded[r.site] + 1) % r.n_experts, ones) for r in routers}
        r3.set_routing(other)
        assert not torch.allclose(model(ids).logits, ref)  # other experts: another forward
        assert r3.stats["replayed_rows"] == 2 * 10 * len(routers)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    sp = ServeProcess(tmp_path_factory.mktemp("r3"), flags=["--flush-interval", "0.1"])
    with sp:
        yield sp


def test_r3_end_to_end_through_the_sidecar(served: ServeProcess) -> None:
    rollout = tiny("qwen3_moe")
    routers = moe_routers(rollout)
    fp4 = [SiteSpec(f"layers.{r.layer}.mlp.input", "moe_input", r.layer, 64) for r in routers]
    spec = RunSpec("r3-e2e", (*fp4, *(r.spec("float32") for r in routers)))
    full = tokens(2, 8, seed=3)  # 7 prompt+generated tokens per sequence, then the last sampled one
    rec = RolloutRecorder(served.address, spec, "r3-writer")
    with FP4SiteRecorder(rollout, [rec], fake_quant=False) as cap, torch.no_grad():  # noqa: SIM117
        with cap.forward([("t0", 0, None), ("t1", 0, None)]):
            rollout(full[:, :7])  # the last sampled token never enters the rollout
    recorded = {r.site: cap.records[r.site][0].reshape(14, 2) for r in routers}
    rec.finish("t0", 8)
    rec.finish("t1", 8)
    assert rec.flush(60) and rec.stats["unguided"] == 0, rec.stats
    rec.close()

    plan = MicrobatchPlan.padded(["t0", "t1"], [8, 8])
    ids = {"t0": full[0], "t1": full[1]}
    with GuidanceReader(served.address, spec.run, prefetch=False, on_missing="mask") as reader:
        rows = reader.read(plan, token_ids=ids)
    trainer = tiny("qwen3_moe")
    perturb_routers(trainer)
    watch = Consumed(trainer)
    r3 = RoutingReplayHooks(trainer)
    qat = GuidedFP4Hooks(trainer, sites=[s.name for s in fp4], kv=False)
    r3.set_routing(rows)
    qat.set_guidance(rows)
    trainer(full).logits.float().pow(2).mean().backward()
    for r in routers:
        got = rows[r.site]
        assert got.valid.tolist() == ([True] * 7 + [False]) * 2  # the final position: unrecorded by design
        want = recorded[r.site]
        used = watch.seen[r.site].reshape(2, 8, 2)[:, :7].reshape(14, 2)
        assert agreement(used, want, torch.ones(14, dtype=torch.bool)) == 1.0, r.site
    assert r3.stats["replayed_rows"] == 14 * len(routers) and r3.stats["fallback_rows"] == 2 * len(routers)
    assert r3.stats["live_agreed_rows"] < r3.stats["replayed_rows"]  # without replay, routing would differ

    # a trainer whose tokens are shifted by one (a dropped BOS) is refused by token identity ...
    shifted = {"t0": full[0, 1:], "t1": full[1, 1:]}
    with GuidanceReader(served.address, spec.run, prefetch=False, on_missing="mask") as reader:
        with pytest.raises(GuidanceMismatch, match="t0|t1"):
            reader.read(MicrobatchPlan.padded(["t0", "t1"], [7, 7]), token_ids=shifted)
        unchecked = reader.read(MicrobatchPlan.padded(["t0", "t1"], [7, 7]))  # ... and unchecked, replay is wrong
    watch.seen.clear()
    r3.reset_stats()
    r3.set_routing(unchecked)
    qat.set_guidance(unchecked)
    with torch.no_grad():
        trainer(full[:, 1:])
    worst = min(
        agreement(watch.seen[r.site].reshape(2, 7, 2)[:, :6].reshape(12, 2),
                  recorded[r.site].reshape(2, 7, 2)[:, 1:].reshape(12, 2), torch.ones(12, dtype=torch.bool))
        for r in routers
    )  # fmt: skip
    assert worst < 1.0
    r3.remove()
    qat.remove()
    watch.remove()


def test_routing_capture_on_the_plain_recorder_path(served: ServeProcess) -> None:
    """RoutingCapture.site_outputs feeds RolloutRecorder.record_forward directly (no FP4 sites)."""
    model = tiny("mixtral")
    cap = RoutingCapture(model)
    spec = RunSpec("r3-plain", tuple(cap.sites("bfloat16")))
    ids = tokens(2, 6, seed=4)
    with torch.no_grad():
        model(ids)
    rec = RolloutRecorder(served.address, spec, "plain-writer")
    segs = [("p0", 0, 6), ("p1", 0, 6)]
    assert rec.record_forward(segs, cap.site_outputs(spec), token_ids=ids.reshape(-1))
    rec.finish("p0", 7)
    rec.finish("p1", 7)
    assert rec.flush(60), rec.stats
    rec.close()
    cap.remove()
    with GuidanceReader(served.address, spec.run, prefetch=False) as reader:
        rows = reader.read(segs, token_ids=ids.reshape(-1))
    for r in cap.routers:
        got = rows[r.site]
        ids_, values = cap.last[r.site]
        assert torch.equal(got.experts, ids_) and bool(got.valid.all())
        assert got.gate is not None and torch.equal(got.gate, values.to(torch.bfloat16).float())
