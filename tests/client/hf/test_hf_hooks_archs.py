"""HFSiteHooks on every MoE architecture family of transformers the demo builds (tiny, randomly
initialised, 2 layers, hidden 64): the one-liner attaches, ``generate()`` with the hooked cache
gives the tokens it gives without hooks, every expected site is seen at every position, shared
experts consume the hooked MoE input, MLA sites are what the cache holds, and TRACE on all layers
(b = 1) reproduces the rollout's codes when the training forward sees the rollout's inputs. Besides
the demo's architectures: Gemma 4 (experts held by the decoder layer itself) and LongCat-Flash (two
MLA attention modules per decoder layer), built here from their configs at the same sizes."""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch", reason="the hook helper needs torch")
pytest.importorskip("transformers", reason="the hook helper needs the demo extra (transformers)")

from tracestore.client.hf.hooks import HFSiteHooks  # noqa: E402
from tracestore.client.hf.recorder import FP4SiteRecorder  # noqa: E402

from tracestore.demo.model import ARCHS, ModelSpec, build_model  # noqa: E402
from tracestore.demo.train import codes_on_grid  # noqa: E402
from tracestore.formats import get_format  # noqa: E402
from tracestore.guided import guided_round  # noqa: E402
from tracestore.packing import pack_bits  # noqa: E402

B, PROMPT, NEW = 2, 5, 4
GQA = ("mlp.input", "attn.k", "attn.v")
MLA = ("attn.kv_latent", "attn.k_rope")
WIDTH = {"mlp.input": 64, "attn.k": 32, "attn.v": 32, "attn.kv_latent": 32, "attn.k_rope": 32,
         "attn1.kv_latent": 32, "attn1.k_rope": 32}  # fmt: skip
_SPECIAL = {"max_position_embeddings": 4096, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
# Architectures the demo does not build: model type -> config (2 layers, hidden 64, 2 heads, 1 K/V head of 32)
EXTRA: dict[str, dict] = {
    # experts and router on the decoder layer (no MoE block module); sliding + full attention, no KV sharing
    "gemma4_text": dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=32, global_head_dim=32, sliding_window=128,
                        layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0,
                        vocab_size_per_layer_input=64, enable_moe_block=True, num_experts=4, top_k_experts=2,
                        moe_intermediate_size=32, num_kv_shared_layers=0, attention_k_eq_v=False, **_SPECIAL),
    # two MLA attention modules per decoder layer (cache slots 2i and 2i+1), one shortcut MoE block
    "longcat_flash": dict(vocab_size=64, hidden_size=64, num_layers=2, num_attention_heads=2, num_key_value_heads=2,
                          ffn_hidden_size=64, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=32,
                          head_dim=32, v_head_dim=32, moe_topk=2, n_routed_experts=4, zero_expert_num=2,
                          expert_ffn_hidden_size=32, **_SPECIAL),
}  # fmt: skip
ALL = sorted(ARCHS) + sorted(EXTRA)
# arch -> the site suffixes of layers 0 and 1 (hidden 64, 2 heads, 1 K/V head of 32; MLA latent and
# rotary key 32 wide). Dense first layer (DeepSeek); Mamba / linear attention first layer (hybrids).
EXPECTED: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    **{a: (GQA, GQA) for a in ARCHS},
    "deepseek_v2": (MLA, ("mlp.input", *MLA)),
    "deepseek_v3": (MLA, ("mlp.input", *MLA)),
    "jamba": (("mlp.input",), GQA),
    "qwen3_next": (("mlp.input",), GQA),
    "qwen3_5_moe": (("mlp.input",), GQA),
    "granitemoehybrid": (("mlp.input",), GQA),
    "lfm2_moe": (("mlp.input",), GQA),
    "minimax": (GQA, ("mlp.input",)),  # lightning (linear) attention in layer 1
    "nemotron_h": (("attn.k", "attn.v"), ("mlp.input",)),  # one mixer per layer: attention, then MoE
    "gemma4_text": (GQA, GQA),  # mlp.input: what the layer's own experts consume
    "longcat_flash": (("mlp.input", *MLA, "attn1.kv_latent", "attn1.k_rope"),) * 2,  # self_attn[0], self_attn[1]
}
# arch -> (MoE block, shared expert) paths in a decoder layer: the shared expert inside the block, or beside it
SHARED = {
    "qwen2_moe": ("mlp", "mlp.shared_expert"),
    "qwen3_next": ("mlp", "mlp.shared_expert"),
    "qwen3_5_moe": ("mlp", "mlp.shared_expert"),
    "deepseek_v2": ("mlp", "mlp.shared_experts"),
    "deepseek_v3": ("mlp", "mlp.shared_experts"),
    "llama4": ("feed_forward", "feed_forward.shared_expert"),
    "nemotron_h": ("mixer", "mixer.shared_experts"),
    "granitemoeshared": ("block_sparse_moe", "shared_mlp"),
    "granitemoehybrid": ("block_sparse_moe", "shared_mlp"),
}


@pytest.fixture(autouse=True)
def _one_thread():  # noqa: ANN202 - tiny ops: extra threads only synchronise on the shared 2-core box
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@functools.cache
def tiny(arch: str) -> object:
    if arch in EXTRA:
        import transformers

        torch.manual_seed(1)
        cfg = transformers.AutoConfig.for_model(arch, **EXTRA[arch])
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
        return model.eval()
    spec = ModelSpec(arch, layers=2, hidden=64, heads=2, kv_heads=1, experts=4, top_k=2, expert_hidden=32, vocab=64)
    return build_model(spec, dtype=torch.float32, seed=1)


def prompt() -> torch.Tensor:
    return torch.randint(7, 64, (B, PROMPT), generator=torch.Generator().manual_seed(2))  # 3..6: VL special ids


def generate(model, hooks: HFSiteHooks | None = None, n: int = NEW) -> torch.Tensor:  # noqa: ANN001
    kw = hooks.cache_kwargs(hooks.new_cache()) if hooks is not None else {}
    with torch.no_grad():
        return model.generate(prompt(), max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)


def layers_of(model) -> list:  # noqa: ANN001
    from tracestore.client.hf.layouts import decoder_layers, layout_for

    return decoder_layers(model, layout_for(model)[1])[1]


@pytest.mark.parametrize("arch", ALL)
def test_generate_with_hooks_gives_the_same_tokens_and_sees_every_site_at_every_position(arch: str) -> None:
    model = tiny(arch)
    ref = generate(model)
    calls: list[tuple[str, tuple[int, ...]]] = []
    with HFSiteHooks(model, lambda site, x: calls.append((site.name, tuple(x.shape)))) as hooks:  # the one-liner
        expected = [f"layers.{i}.{s}" for i in (0, 1) for s in EXPECTED[arch][i]]
        assert [s.name for s in hooks.sites] == expected
        assert {s.name: s.width for s in hooks.sites} == {n: WIDTH[n.split(".", 2)[2]] for n in expected}
        out = generate(model, hooks)
    assert torch.equal(out, ref), "an identity callback changed the generation"
    assert out.shape == (B, PROMPT + NEW)
    for name in expected:  # one call per forward: the prompt, then one new position per decode step
        shapes = [s for n, s in calls if n == name]
        assert shapes == [(B, PROMPT, WIDTH[name.split(".", 2)[2]])] + [(B, 1, shapes[0][2])] * (NEW - 1), name


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("arch", ALL)
def test_trace_on_all_layers_b1_reproduces_the_rollout_codes(arch: str, fmt: str) -> None:
    """Rollout: FP4SiteRecorder around generate() (every decode step kept). Training: one teacher-forced
    forward without a cache over the positions the rollout ran, guided_round (b = 1) at every site
    with the rollout's records: the training side lands on the rollout's codes everywhere."""
    model, f = tiny(arch), get_format(fmt)
    with FP4SiteRecorder(model, fmt=fmt) as fp4, fp4.forward([("t0", 0, None), ("t1", 0, None)]) as rolled:
        tokens = generate(model, fp4.hooks)
    n = PROMPT + NEW - 1  # the last sampled token never enters a forward
    assert sorted(rolled) == sorted(s.name for s in fp4.hooks.sites)
    for name, (codes, scales, g) in rolled.items():
        assert codes.shape == (B, n, WIDTH[name.split(".", 2)[2]]) and scales.shape[:2] == (B, n), name
        assert g.shape == (B, n) and torch.all(g[:, PROMPT - 1] == g[:, 0]) and (g > 0).all(), name

    trained: dict[str, torch.Tensor] = {}

    def trace(site, x):  # noqa: ANN001, ANN202
        codes, scales, g = rolled[site.name]
        y = guided_round(x, pack_bits(codes, 1), scales, g, 1, f)
        trained[site.name] = codes_on_grid(y, scales, g, f)
        return y

    with HFSiteHooks(model, trace), torch.no_grad():
        model(input_ids=tokens[:, :n], use_cache=False)
    assert sorted(trained) == sorted(rolled)
    for name, codes in trained.items():
        assert torch.equal(codes, rolled[name][0]), (name, int((codes != rolled[name][0]).sum()))


@pytest.mark.parametrize("arch", sorted(SHARED))
def test_shared_expert_consumes_the_hooked_moe_input(arch: str) -> None:
    """A callback that changes the MoE input (and counts its calls): the shared expert receives the
    changed tensor, the one the routed experts' block consumed, and the callback runs once per layer
    and forward; no site of its own."""
    model = tiny(arch)
    layer = max(i for i in (0, 1) if "mlp.input" in EXPECTED[arch][i])
    decoder = layers_of(model)[layer]
    moe_path, shared_path = SHARED[arch]
    calls: list[str] = []

    def halve(site, x):  # noqa: ANN001, ANN202
        if site.kind == "moe_input":
            calls.append(site.name)
            return x * 0.5
        return None

    seen: dict[str, torch.Tensor] = {}
    with HFSiteHooks(model, halve, layers=[layer]) as hooks, torch.no_grad():
        assert not [s for s in hooks.sites if "shared" in s.name]
        handles = [
            decoder.get_submodule(p).register_forward_pre_hook(lambda m, a, p=p: seen.setdefault(p, a[0].clone()))
            for p in (moe_path, shared_path)
        ]  # registered after the site hooks: they see what the modules consume
        model(input_ids=prompt(), use_cache=False)
    for h in handles:
        h.remove()
    block_in, shared_in = seen[moe_path], seen[shared_path]
    assert torch.equal(shared_in.reshape(block_in.shape), block_in)
    assert calls.count(f"layers.{layer}.mlp.input") == 1
    # and it is the hooked value: half of what the block gets without hooks (only this layer is hooked)
    with torch.no_grad():
        plain: dict[str, torch.Tensor] = {}
        h = decoder.get_submodule(moe_path).register_forward_pre_hook(lambda m, a: plain.setdefault("x", a[0].clone()))
        model(input_ids=prompt(), use_cache=False)
        h.remove()
    assert torch.allclose(block_in, 0.5 * plain["x"])


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_mla_sites_are_the_normalized_latent_and_rotary_key_the_cache_holds(arch: str) -> None:
    """MLA caches the latent after kv_a_layernorm (kv_lora_rank wide) and the post-RoPE rotary key
    (qk_rope_head_dim wide), one "head" each: the sites see exactly those, and what the callback
    returns is what the cache stores, both with a cache and in a training forward without one."""
    model = tiny(arch)
    cfg = model.config
    attn = layers_of(model)[1].self_attn
    normed: list[torch.Tensor] = []
    handle = attn.kv_a_layernorm.register_forward_hook(lambda m, a, out: normed.append(out.detach().clone()))
    seen: dict[str, torch.Tensor] = {}

    def scale(site, x):  # noqa: ANN001, ANN202
        seen[site.name] = x.clone()
        return x * 0.25 if site.kind != "moe_input" else None

    x = prompt()
    with HFSiteHooks(model, scale, layers=[1]) as hooks, torch.no_grad():
        widths = {s.name: s.width for s in hooks.sites if s.layer == 1}
        assert widths == {"layers.1.mlp.input": 64, "layers.1.attn.kv_latent": cfg.kv_lora_rank,
                          "layers.1.attn.k_rope": cfg.qk_rope_head_dim}  # fmt: skip
        specs = [s.spec(bits=1, format="mxfp4") for s in hooks.sites]  # declarable as a run's sites
        assert [(p.name, p.kind, p.width) for p in specs[1:]] == [
            ("layers.1.attn.kv_latent", "other", cfg.kv_lora_rank),
            ("layers.1.attn.k_rope", "key", cfg.qk_rope_head_dim),
        ]
        cache = hooks.new_cache()
        model(input_ids=x, **hooks.cache_kwargs(cache), use_cache=True)
        no_cache = dict(seen)
        seen.clear()
        model(input_ids=x, use_cache=False)
    handle.remove()
    assert torch.equal(no_cache["layers.1.attn.kv_latent"], normed[0].reshape(B, PROMPT, -1))
    for name in ("layers.1.attn.kv_latent", "layers.1.attn.k_rope"):
        assert torch.equal(seen[name], no_cache[name]), name  # training sees what the rollout cached
    with torch.no_grad():
        plain = HFSiteHooks(model, lambda s, t: None)
        ref = plain.new_cache()
        model(input_ids=x, **plain.cache_kwargs(ref), use_cache=True)
        plain.remove()
    stored, unhooked = cache.layers[1], ref.layers[1]
    assert stored.keys.shape == (B, 1, PROMPT, cfg.kv_lora_rank) and stored.values.shape[-1] == cfg.qk_rope_head_dim
    assert torch.equal(stored.keys, 0.25 * unhooked.keys) and torch.equal(stored.values, 0.25 * unhooked.values)


def test_demo_arch_flag_names_every_arch_and_runs_mla_and_hybrids() -> None:
    from tracestore.cli import build_parser
    from tracestore.demo.run import DemoConfig, run_demo

    demo = build_parser()._subparsers._group_actions[0].choices["demo"]  # type: ignore[union-attr]
    arch_help = next(a.help for a in demo._actions if "--arch" in a.option_strings)
    assert all(a in arch_help for a in ARCHS), [a for a in ARCHS if a not in arch_help]
    for arch in ("deepseek_v3", "jamba"):  # MLA sites; a layer without attention
        spec = ModelSpec(arch, layers=2, hidden=64, heads=2, kv_heads=1, experts=4, top_k=2, expert_hidden=32, vocab=64)
        results = run_demo(DemoConfig(model=spec, trajectories=2, prompt=4, tokens=3, transport="memory", device="cpu"))
        assert [r["layer"] for r in results["moe_input"]] == ([1] if arch == "deepseek_v3" else [0, 1])
        assert results["record_bytes_per_token"]["trace_all"] == sum(  # every site of every layer recorded
            WIDTH[s] // 8 + WIDTH[s] // 16 for i in (0, 1) for s in EXPECTED[arch][i]
        )


def test_gemma4_moe_input_is_what_the_layers_own_experts_consume_and_kv_sharing_layers_have_no_kv_sites() -> None:
    """Gemma 4 holds router and experts on the decoder layer: ``mlp.input`` is the experts' input (the
    residual after pre_feedforward_layernorm_2, [batch*tokens, hidden] there, [batch, tokens, hidden]
    at the callback) and its replacement is what they consume. Layers that reuse another layer's K/V
    (num_kv_shared_layers) write none: no K/V sites, and generation is unchanged."""
    import transformers

    # per-layer inputs on: transformers 5.24 slices them unconditionally once layers share K/V
    cfg = dict(EXTRA["gemma4_text"], num_hidden_layers=4, num_kv_shared_layers=2, hidden_size_per_layer_input=16,
               layer_types=["sliding_attention", "full_attention"] * 2)  # fmt: skip
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("gemma4_text", **cfg), dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    ref = generate(model)
    layer = layers_of(model)[1]
    seen: list[torch.Tensor] = []
    plain: list[torch.Tensor] = []
    with HFSiteHooks(model, lambda s, x: None) as hooks:
        assert [s.name for s in hooks.sites] == [f"layers.{i}.{s}" for i in (0, 1) for s in GQA] + [
            "layers.2.mlp.input", "layers.3.mlp.input"]  # fmt: skip
        assert torch.equal(generate(model, hooks), ref)
    with torch.no_grad():
        h = layer.experts.register_forward_pre_hook(lambda m, a: plain.append(a[0].clone()))
        model(input_ids=prompt(), use_cache=False)
        h.remove()
        with HFSiteHooks(model, lambda s, x: x * 0.5 if s.name == "layers.1.mlp.input" else None, layers=[1]):
            h = layer.experts.register_forward_pre_hook(lambda m, a: seen.append(a[0].clone()))
            model(input_ids=prompt(), use_cache=False)
            h.remove()
    assert plain[0].shape == (B * PROMPT, 64)
    assert torch.allclose(seen[0], 0.5 * plain[0])


def test_longcat_flash_sites_of_each_attention_module_are_what_its_cache_slot_holds() -> None:
    """LongCat-Flash: self_attn[j] of decoder layer i writes cache slot 2i + j; its sites are
    ``attn.*`` (j = 0) and ``attn1.*`` (j = 1), and what the callback returns is what that slot stores."""
    model = tiny("longcat_flash")
    returned: dict[str, torch.Tensor] = {}

    def scale(site, x):  # noqa: ANN001, ANN202
        if site.kind == "moe_input":
            return None
        returned[site.name] = y = x * (0.25 if ".attn1." in site.name else 0.5)
        return y

    with HFSiteHooks(model, scale) as hooks, torch.no_grad():
        cache = hooks.new_cache()
        model(input_ids=prompt(), **hooks.cache_kwargs(cache), use_cache=True)
    assert len(returned) == 8
    for i in (0, 1):
        for j, attn in enumerate(("attn", "attn1")):
            stored = cache.layers[2 * i + j]
            assert stored.keys.shape == (B, 1, PROMPT, 32), (i, j)
            assert torch.equal(stored.keys[:, 0], returned[f"layers.{i}.{attn}.kv_latent"]), (i, j)
            assert torch.equal(stored.values[:, 0], returned[f"layers.{i}.{attn}.k_rope"]), (i, j)
