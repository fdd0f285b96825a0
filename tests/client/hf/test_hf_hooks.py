"""HFSiteHooks on real (tiny, randomly initialised) transformers MoE models: every MoE-block input
and the post-RoPE K/V entering the KV cache, with and without a cache; the layout registry; errors
that name the site; FP4SiteRecorder over whole generations. The per-architecture matrix is in
test_hf_hooks_archs.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the hook helper needs torch")
pytest.importorskip("transformers", reason="the hook helper needs the demo extra (transformers)")

from tracestore.client.hf.hooks import HFSiteHooks, site_name  # noqa: E402
from tracestore.client.hf.layouts import LAYOUTS, KVStyle, Layout, register_layout  # noqa: E402
from tracestore.client.hf.recorder import FP4SiteRecorder  # noqa: E402

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


def test_remove_stops_hooks_and_the_attention_implementation_is_untouched() -> None:
    model = tiny()
    calls = []
    hooks = HFSiteHooks(model, lambda s, t: calls.append(s.name))
    assert model.config._attn_implementation == "sdpa"
    model(input_ids=ids())
    assert len(calls) == 6
    hooks.remove()
    model(input_ids=ids())
    assert len(calls) == 6


def test_any_attention_implementation_and_any_cache_work() -> None:
    """eager attention, and a plain DynamicCache that generate() makes itself: each new K/V row is
    seen once, as it enters that cache."""
    model = tiny()
    model.set_attn_implementation("eager")
    calls: list[tuple[str, int]] = []
    with HFSiteHooks(model, lambda s, t: calls.append((s.name, t.shape[1]))), torch.no_grad():
        model.generate(ids(2, 5), max_new_tokens=3, min_new_tokens=3, do_sample=False)
    model.set_attn_implementation("sdpa")
    assert [n for name, n in calls if name == "layers.1.attn.v"] == [5, 1, 1]


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
    with pytest.raises(ConfigError, match="no transformers config"):
        HFSiteHooks(torch.nn.Linear(2, 2), lambda s, t: None)
    assert not model.model.layers[0].mlp._forward_pre_hooks  # a refused attach leaves nothing behind


def test_site_errors_name_the_site_the_expected_and_the_seen_shape() -> None:
    model = tiny()
    with HFSiteHooks(model, lambda s, t: t[..., :8]), pytest.raises(ShapeError) as err:
        model(input_ids=ids())
    msg = "hook for layers.0.attn.k must return None or a tensor of shape (2, 7, 16), got (2, 7, 8)"
    assert str(err.value) == msg

    def bad_widths(cfg, attn):  # noqa: ANN001, ANN202 - a layout that declares the wrong K/V width
        return 32, 16

    wrong = Layout(kv=KVStyle("gqa", (("attn.k", "key"), ("attn.v", "value")), bad_widths))
    with HFSiteHooks(model, lambda s, t: None, layout=wrong), pytest.raises(ShapeError) as err:
        model(input_ids=ids())
    msg = str(err.value)
    assert msg.startswith("layers.0.attn.k: expected") and msg.endswith("heads x head_dim = 32, got (2, 1, 7, 16)")
    # a format whose block does not divide a site's width: refused up front, every such site named
    with pytest.raises(ShapeError, match=r"mxfp4.*blocks of 32.*layers\.0\.attn\.k \(width 16\)"):
        FP4SiteRecorder(model, fmt="mxfp4")
    # ... and when the callback itself meets it, the error names the site and its input shape
    from tracestore.fp4 import quantize

    def mxfp4(site, t):  # noqa: ANN001, ANN202
        quantize(t, "mxfp4")

    with HFSiteHooks(model, mxfp4), pytest.raises(ShapeError) as err:
        model(input_ids=ids())
    assert str(err.value).startswith("layers.0.attn.k (input (2, 7, 16), torch.float32): ")
    assert "block size 32" in str(err.value)


def test_fp4_site_recorder_records_a_whole_generate_through_a_real_sidecar(tmp_path) -> None:  # noqa: ANN001
    """FP4SiteRecorder around generate() (prefill + every decode step) → RolloutRecorder → `tracestore
    serve` subprocess → file:// storage → GuidanceReader: every position that entered a forward is read
    back with the bytes and per-forward g it was quantized with."""
    pytest.importorskip("grpc", reason="the sidecar needs the server extra")
    from tracestore.client import GuidanceReader, RolloutRecorder
    from tracestore.server.testing import ServeProcess

    from tracestore.formats import NVFP4
    from tracestore.fp4 import dequantize_codes
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
    consumed: list[torch.Tensor] = []
    with ServeProcess(tmp_path / "sidecar") as sp:
        rec = RolloutRecorder(sp.address, spec, writer="w0")
        with FP4SiteRecorder(model, [rec]) as fp4, torch.no_grad():
            # registered after FP4SiteRecorder's hook, so it sees what the MoE block consumes
            grab = model.model.layers[1].mlp.register_forward_pre_hook(lambda m, a: consumed.append(a[0].clone()))
            with fp4.forward([("t0", 0, None), ("t1", 0, None)]) as got:
                tokens = model.generate(ids(2, 4), max_new_tokens=3, min_new_tokens=3, do_sample=False,
                                        **fp4.hooks.cache_kwargs(fp4.hooks.new_cache()))  # fmt: skip
            grab.remove()
        assert tokens.shape == (2, 7)  # positions 0..5 entered a forward (4 + 1 + 1); the 7th never does
        for t in ("t0", "t1"):
            rec.finish(t, 7)
        assert rec.flush(timeout=60)
        rec.close()
        storage = sp.storage
    assert [c.shape[1] for c in consumed] == [4, 1, 1]
    codes, scales, g = got["layers.1.mlp.input"]
    assert codes.shape == (2, 6, 32) and g.shape == (2, 6)
    for step, (lo, hi) in enumerate([(0, 4), (4, 5), (5, 6)]):  # each forward consumed its dequantized record
        deq = dequantize_codes(codes[:, lo:hi], scales[:, lo:hi], float(g[0, lo]), NVFP4)
        assert torch.equal(deq, consumed[step].float()) and torch.all(g[:, lo:hi] == g[0, lo])
    plan = MicrobatchPlan([("t0", 0, 7), ("t1", 0, 7)])
    guidance = GuidanceReader(storage, "hooks-test", prefetch=False).read(plan)
    for name, bits in (("layers.1.mlp.input", 1), ("layers.1.attn.v", 4)):
        rd = guidance[name]
        assert torch.equal(rd.codes.reshape(2, 7, -1)[:, :6], pack_bits(got[name][0], bits)), name
        assert torch.equal(rd.scales.reshape(2, 7, -1)[:, :6], got[name][1]), name
        assert torch.equal(torch.as_tensor(rd.global_scale).reshape(2, 7)[:, :6], got[name][2]), name
        valid = rd.valid.reshape(2, 7)
        assert valid[:, :6].all() and not valid[:, 6].any()  # last position: unrecorded by design


def test_fp4_site_recorder_splits_a_block_of_forwards_by_the_positions_each_covered() -> None:
    """A hand-written decode loop inside one forward() block: each forward goes to the recorders at its
    own positions with its own g; segments that do not add up are refused, naming what ran."""
    model = tiny()
    x = ids(2, 6)

    class Capture:  # a RolloutRecorder stand-in: what record_forward receives
        def __init__(self) -> None:
            from tracestore.records import RunSpec, SiteSpec

            self.run_spec = RunSpec("r", (SiteSpec("layers.0.attn.k", "key", 0, 16, bits=2),))
            self.calls: list[tuple[list, dict]] = []

        def record_forward(self, segments: list, outputs: dict, token_ids: object = None) -> bool:
            self.calls.append((segments, outputs))
            return True

    cap = Capture()
    with FP4SiteRecorder(model, [cap]) as fp4, torch.no_grad():
        cache = fp4.hooks.new_cache()
        with fp4.forward([("a", 10, 15), ("b", 0, 5)]) as got:
            for lo, hi in [(0, 3), (3, 4), (4, 5)]:
                model(input_ids=x[:, lo:hi], **fp4.hooks.cache_kwargs(cache), use_cache=True)
        assert [segs for segs, _ in cap.calls] == [
            [("a", 10, 13), ("b", 0, 3)], [("a", 13, 14), ("b", 3, 4)], [("a", 14, 15), ("b", 4, 5)]
        ]  # fmt: skip
        assert [out["layers.0.attn.k"].codes.shape for _, out in cap.calls] == [(6, 4), (2, 4), (2, 4)]
        k_g = got["layers.0.attn.k"][2]
        assert [out["layers.0.attn.k"].global_scale for _, out in cap.calls] == [k_g[0, 0], k_g[0, 3], k_g[0, 4]]
        refused = (
            r"ran 2 model forward\(s\); batch row 0 \('a'\) recorded 4 position\(s\) 5\.\.8, which must be "
            r"contiguous and number end - start = 5; forwards of 3 \+ 1 tokens"
        )
        with pytest.raises(ConfigError, match=refused), fp4.forward([("a", 0, 5), ("b", 0, 5)]):
            for lo, hi in [(5, 8), (8, 9)]:
                model(input_ids=ids(2, 9)[:, lo:hi], **fp4.hooks.cache_kwargs(cache), use_cache=True)
        assert len(cap.calls) == 3  # nothing of the refused block was recorded


def test_fp4_site_recorder_refuses_sites_the_model_does_not_have() -> None:
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


def test_a_new_architecture_is_one_declarative_line(monkeypatch) -> None:  # noqa: ANN001
    """Granite-MoE-Shared's shared expert sits beside the MoE block: a layout that does not name it
    leaves it eating the layer's unquantized input; one line (or the default layout's AUTO) fixes it."""
    model = build_model(
        ModelSpec("granitemoeshared", layers=2, hidden=32, heads=2, kv_heads=1, experts=4, top_k=2, vocab=64), seed=1
    )
    layer = model.model.layers[1]

    def consumed() -> tuple[torch.Tensor, torch.Tensor]:
        seen: dict[str, torch.Tensor] = {}
        with HFSiteHooks(model, lambda s, t: t * 0.5 if s.kind == "moe_input" else None), torch.no_grad():
            hs = [layer.get_submodule(p).register_forward_pre_hook(lambda m, a, p=p: seen.setdefault(p, a[0]))
                  for p in ("block_sparse_moe", "shared_mlp")]  # fmt: skip
            model(input_ids=ids(), use_cache=False)
        for h in hs:
            h.remove()
        return seen["block_sparse_moe"], seen["shared_mlp"]

    monkeypatch.setitem(LAYOUTS, "granitemoeshared", Layout(moe="block_sparse_moe"))  # restored after the test
    block, shared = consumed()
    assert not torch.allclose(block, shared)  # missed: the shared expert ate the unhooked input
    register_layout("granitemoeshared", Layout(moe="block_sparse_moe", shared="shared_mlp"))
    block, shared = consumed()
    assert torch.equal(block, shared)
    monkeypatch.delitem(LAYOUTS, "granitemoeshared")  # unregistered: the default layout finds it (AUTO)
    block, shared = consumed()
    assert torch.equal(block, shared)


def test_layouts_that_do_not_fit_are_refused_naming_the_layer() -> None:
    jamba = build_model(
        ModelSpec("jamba", layers=2, hidden=32, heads=2, kv_heads=1, experts=4, top_k=2, vocab=64), seed=1
    )
    with pytest.raises(
        ConfigError, match=r"model\.layers\.0 \(JambaMambaDecoderLayer\) has neither an attention module"
    ):
        HFSiteHooks(jamba, lambda s, t: None, layout=Layout(moe="feed_forward", no_kv=("linear_attn",), no_kv_types=()))
    with pytest.raises(ConfigError, match="no hooked decoder layer has an attention module at 'attn'"):
        HFSiteHooks(tiny(), lambda s, t: None, layout=Layout(attention="attn"))
    with pytest.raises(ConfigError, match="no decoder-layer list 'blocks'"):
        HFSiteHooks(tiny(), lambda s, t: None, layout=Layout(layers="blocks"))
    assert not any(m._forward_pre_hooks for m in jamba.modules())  # nothing left attached


def test_an_attention_that_writes_no_kv_is_an_error_not_a_silent_gap() -> None:
    """MiniMax's lightning (linear) attention sits at self_attn like its softmax attention; its layer
    type in the config keeps it free of K/V sites. A layout that ignores the types hooks it, and the
    first forward says that its sites would never be seen."""
    model = build_model(
        ModelSpec("minimax", layers=2, hidden=32, heads=2, kv_heads=1, experts=4, top_k=2, vocab=64), seed=1
    )
    with HFSiteHooks(model, lambda s, t: None) as hooks:
        assert [s.name for s in hooks.sites if s.layer == 1] == ["layers.1.mlp.input"]
    blind = Layout(no_kv_types=())
    with HFSiteHooks(model, lambda s, t: None, layout=blind), pytest.raises(ConfigError) as err, torch.no_grad():
        model(input_ids=ids())
    assert str(err.value).startswith(
        "model.layers.1.self_attn (MiniMaxLightningAttention) ran without writing new K/V into its cache, so "
        "layers.1.attn.k and layers.1.attn.v would never be seen"
    )


def test_experts_held_by_the_decoder_layer_itself_are_refused() -> None:
    """A decoder layer that owns its experts with no MoE block module (Gemma 4's layout): refused with
    the reason, not hooked without its MoE input; moe=False still hooks its K/V."""
    model = tiny()
    layer = model.model.layers[0]
    layer.experts = layer.mlp.experts  # a layer shaped like Gemma 4's: experts on the layer itself
    try:
        with pytest.raises(ConfigError, match=r"model\.layers\.0 \(Qwen3MoeDecoderLayer\) holds its experts itself"):
            HFSiteHooks(model, lambda s, t: None, layout=Layout(moe="router"))
        with HFSiteHooks(model, lambda s, t: None, moe=False) as hooks:
            assert [s.kind for s in hooks.sites] == ["key", "value"] * 2
    finally:
        del layer.experts
