"""HFSiteHooks on real (tiny, randomly initialised) transformers MoE models: every MoE-block input
and the post-RoPE K/V entering the KV cache, with and without a cache, on four architectures."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the hook helper needs torch")
pytest.importorskip("transformers", reason="the hook helper needs the demo extra (transformers)")

from tracestore.client.hf_hooks import HFSiteHooks, site_name  # noqa: E402

from tracestore.demo.model import ModelSpec, build_model  # noqa: E402
from tracestore.errors import ConfigError, ShapeError  # noqa: E402

ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]


def tiny(arch: str = "qwen3_moe", layers: int = 2) -> object:
    spec = ModelSpec(
        arch, layers=layers, hidden=32, heads=2, kv_heads=1, experts=4, top_k=2, expert_hidden=32, vocab=64
    )
    return build_model(spec, dtype=torch.float32, seed=1)


def ids(b: int = 2, n: int = 7) -> torch.Tensor:
    return torch.randint(3, 64, (b, n), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("arch", ARCHS)
def test_every_site_seen_once_with_shapes_and_identity_hooks_change_nothing(arch: str) -> None:
    model = tiny(arch)
    x = ids()
    ref = model(input_ids=x).logits
    seen: list[tuple[str, tuple[int, ...]]] = []
    with HFSiteHooks(model, lambda site, t: seen.append((site.name, tuple(t.shape)))) as hooks:
        assert [s.name for s in hooks.sites] == [
            site_name(i, k) for i in range(2) for k in ("moe_input", "key", "value")
        ]
        out = model(input_ids=x).logits
    assert torch.equal(out, ref)
    assert sorted(seen) == sorted(
        [(site_name(i, "moe_input"), (2, 7, 32)) for i in range(2)]
        + [(site_name(i, k), (2, 7, 16)) for i in range(2) for k in ("key", "value")]
    )


def test_key_is_seen_after_the_rotary_embedding() -> None:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import apply_rotary_pos_emb

    model = tiny()
    attn = model.model.layers[1].self_attn
    captured: dict[str, object] = {}

    def grab(module: object, args: tuple, kwargs: dict) -> None:
        captured.update(kwargs)

    handle = attn.register_forward_pre_hook(grab, with_kwargs=True)
    keys: dict[str, torch.Tensor] = {}
    with HFSiteHooks(model, lambda site, t: keys.setdefault(site.name, t.clone())):
        model(input_ids=ids())
    handle.remove()
    h = captured["hidden_states"]
    cos, sin = captured["position_embeddings"]
    k = attn.k_norm(attn.k_proj(h).view(2, 7, -1, attn.head_dim)).transpose(1, 2)
    pre_rope = k.transpose(1, 2).reshape(2, 7, -1)
    _, k_rot = apply_rotary_pos_emb(k, k, cos, sin)
    post_rope = k_rot.transpose(1, 2).reshape(2, 7, -1)
    got = keys["layers.1.attn.k"]
    assert torch.allclose(got, post_rope, atol=1e-6)
    assert not torch.allclose(got[:, 1:], pre_rope[:, 1:], atol=1e-3)  # position 0 has no rotation


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_path_transforms_each_new_kv_exactly_once(arch: str) -> None:
    """An elementwise transform applied through the hooked cache during incremental decoding gives
    the same logits as applying it in one uncached full forward (each K/V row transformed once)."""
    model = tiny(arch)
    x = ids(2, 9)

    def halve_kv(site, t):  # noqa: ANN001, ANN202
        return t * 0.5 if site.kind != "moe_input" else t * 0.75

    with HFSiteHooks(model, halve_kv):
        full = model(input_ids=x, use_cache=False).logits
    calls: list[tuple[str, int]] = []

    def counted(site, t):  # noqa: ANN001, ANN202
        calls.append((site.name, t.shape[1]))
        return halve_kv(site, t)

    with HFSiteHooks(model, counted) as hooks, torch.no_grad():
        cache = hooks.new_cache()
        steps = [model(input_ids=x[:, :5], **hooks.cache_kwargs(cache), use_cache=True).logits]
        for i in range(5, 9):
            steps.append(model(input_ids=x[:, i : i + 1], **hooks.cache_kwargs(cache), use_cache=True).logits)
        stored = cache.layers[0].values
    inc = torch.cat(steps, dim=1)
    assert torch.allclose(inc, full, atol=1e-5), (inc - full).abs().max()
    assert len(calls) == 5 * 6  # 5 forwards x (2 layers x 3 sites), never twice
    assert {n for _, n in calls} == {5, 1}
    # the cache holds the transformed values
    with HFSiteHooks(model, lambda s, t: None) as plain, torch.no_grad():
        c2 = plain.new_cache()
        model(input_ids=x, **plain.cache_kwargs(c2), use_cache=True)
    assert torch.allclose(stored, 0.5 * c2.layers[0].values, atol=1e-6)


def test_remove_restores_attention_and_stops_hooks() -> None:
    model = tiny()
    calls = []
    hooks = HFSiteHooks(model, lambda s, t: calls.append(s.name))
    assert model.config._attn_implementation == "tracestore_sdpa"
    hooks.remove()
    assert model.config._attn_implementation == "sdpa"
    model(input_ids=ids())
    assert calls == []


def test_moe_only_and_layer_subset() -> None:
    model = tiny(layers=3)
    with HFSiteHooks(model, lambda s, t: None, layers=[2], kv=False) as hooks:
        assert [s.name for s in hooks.sites] == ["layers.2.mlp.input"]
        assert model.config._attn_implementation == "sdpa"


def test_dense_layers_have_no_moe_site() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        mlp_only_layers=[0],
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    with HFSiteHooks(model, lambda s, t: None) as hooks:
        names = [s.name for s in hooks.sites]
    assert "layers.0.mlp.input" not in names and "layers.1.mlp.input" in names
    assert "layers.0.attn.k" in names


def test_bad_inputs_raise_clear_errors() -> None:
    model = tiny()
    with pytest.raises(ConfigError, match="out of range"):
        HFSiteHooks(model, lambda s, t: None, layers=[5])
    with pytest.raises(ConfigError, match="callable"):
        HFSiteHooks(model, "not a function")  # type: ignore[arg-type]
    with HFSiteHooks(model, lambda s, t: t[..., :8]), pytest.raises(ShapeError, match="must return None or a tensor"):
        model(input_ids=ids())
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ConfigError, match="decoder layers"):
        HFSiteHooks(torch.nn.Linear(2, 2), lambda s, t: None)


def test_fp4_site_recorder_records_a_generation_through_a_real_sidecar(tmp_path) -> None:  # noqa: ANN001
    """Prefill + decode on a tiny model with FP4SiteRecorder → RolloutRecorder → `tracestore serve`
    subprocess → file:// storage → GuidanceReader: the bytes read back are the ones quantized."""
    pytest.importorskip("grpc", reason="the sidecar needs the server extra")
    from tracestore.client import GuidanceReader, RolloutRecorder
    from tracestore.client.hf_hooks import FP4SiteRecorder
    from tracestore.server.testing import ServeProcess

    from tracestore.formats import NVFP4
    from tracestore.fp4 import Quantized, dequantize
    from tracestore.packing import pack_bits
    from tracestore.plan import MicrobatchPlan
    from tracestore.records import RunSpec, SiteSpec

    model = tiny()
    spec = RunSpec(
        "hooks-test",
        (
            SiteSpec("layers.1.mlp.input", "moe_input", 1, 32, bits=1),
            SiteSpec("layers.1.attn.v", "value", 1, 16, bits=4),
        ),
    )
    x = ids(2, 6)
    kept: list[dict] = []
    consumed: list[torch.Tensor] = []
    with ServeProcess(tmp_path / "sidecar") as sp:
        rec = RolloutRecorder(sp.address, spec, writer="w0")
        with FP4SiteRecorder(model, [rec]) as fp4, torch.no_grad():
            # registered after FP4SiteRecorder's hook, so it sees what the MoE block consumes
            grab = model.model.layers[1].mlp.register_forward_pre_hook(lambda m, a: consumed.append(a[0].clone()))
            cache = fp4.hooks.new_cache()
            for start, end in [(0, 4), (4, 5)]:  # the 6th token never enters a forward
                with fp4.forward([("t0", start, end), ("t1", start, end)]) as got:
                    model(input_ids=x[:, start:end], **fp4.hooks.cache_kwargs(cache), use_cache=True)
                kept.append(dict(got))
        for t in ("t0", "t1"):
            rec.finish(t, 6)
        assert rec.flush(timeout=60)
        rec.close()
        storage = sp.storage
    grab.remove()
    # the MoE block consumed exactly the dequantized record
    codes0, scales0, g0 = kept[0]["layers.1.mlp.input"]
    assert torch.equal(dequantize(Quantized(codes0, scales0, g0, NVFP4)), consumed[0].float())
    guidance = GuidanceReader(storage, "hooks-test", prefetch=False).read(MicrobatchPlan([("t0", 0, 6), ("t1", 0, 6)]))
    for name, bits in (("layers.1.mlp.input", 1), ("layers.1.attn.v", 4)):
        g = guidance[name]
        expect_codes = torch.cat([kept[0][name][0], kept[1][name][0]], dim=1)  # [2, 5, w]
        expect_scales = torch.cat([kept[0][name][1], kept[1][name][1]], dim=1)
        rows = g.codes.reshape(2, 6, -1)
        assert torch.equal(rows[:, :5], pack_bits(expect_codes, bits)), name
        assert torch.equal(g.scales.reshape(2, 6, -1)[:, :5], expect_scales), name
        gs = torch.as_tensor(g.global_scale).reshape(2, 6)
        assert torch.all(gs[:, :4] == kept[0][name][2]) and torch.all(gs[:, 4] == kept[1][name][2])
        valid = g.valid.reshape(2, 6)
        assert valid[:, :5].all() and not valid[:, 5].any()  # last position: unrecorded by design


def test_fp4_site_recorder_refuses_sites_the_model_does_not_have() -> None:
    from tracestore.client.hf_hooks import FP4SiteRecorder

    from tracestore.records import RunSpec, SiteSpec

    pytest.importorskip("grpc", reason="RolloutRecorder needs the server extra")
    from tracestore.client import RolloutRecorder

    # a real recorder; nothing listens on its address and nothing is recorded: refused up front
    rec = RolloutRecorder("127.0.0.1:9", RunSpec("r", (SiteSpec("layers.9.mlp.input", "moe_input", 9, 32),)), "w")
    model = tiny()
    try:
        with pytest.raises(ConfigError, match="no hook for"):
            FP4SiteRecorder(model, [rec])
    finally:
        rec.close(timeout=5)
    assert model.config._attn_implementation == "sdpa"
