"""Every row belongs to its token: FP4SiteRecorder around generate() in each way an RL rollout calls
it, through a real `tracestore serve` and storage to GuidanceReader, each stored row checked against
a fresh quantization of its own token's activation.

The oracle runs each returned sequence alone (no padding, no cache) through the same model and
quantizes its activation at every position with the stored row's global scale. The rollout runs
without fake quantization so both see the same activations up to float rounding; a code may
differ only where the activation sits within 1e-4 (relative) of a rounding boundary.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the hook helper needs torch")
pytest.importorskip("transformers", reason="the hook helper needs the demo extra (transformers)")
pytest.importorskip("grpc", reason="the sidecar needs the server extra")

from tracestore.client import GuidanceReader, RolloutRecorder  # noqa: E402
from tracestore.client.hf.hooks import HFSiteHooks  # noqa: E402
from tracestore.client.hf.recorder import FP4SiteRecorder  # noqa: E402
from tracestore.server.testing import ServeProcess  # noqa: E402

from tracestore.demo.model import ModelSpec, build_model  # noqa: E402
from tracestore.errors import ConfigError, GuidanceMismatch  # noqa: E402
from tracestore.formats import NVFP4  # noqa: E402
from tracestore.fp4 import quantize  # noqa: E402
from tracestore.packing import unpack_bits  # noqa: E402
from tracestore.plan import MicrobatchPlan  # noqa: E402
from tracestore.records import RunSpec  # noqa: E402
from tracestore.storage.reader import StoreReader  # noqa: E402
from tracestore.storage.store import Store  # noqa: E402

PAD = 0
NEW = 5
_runs = itertools.count()


def tiny(seed: int = 1) -> Any:
    spec = ModelSpec("qwen3_moe", layers=2, hidden=32, heads=2, kv_heads=1, experts=4, top_k=2, expert_hidden=32,
                     vocab=64)  # fmt: skip
    model = build_model(spec, dtype=torch.float32, seed=seed)
    model.generation_config.pad_token_id = PAD
    return model


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with ServeProcess(tmp_path_factory.mktemp("positions")) as sp:
        yield sp


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny()


def left_padded(*rows: list[int]) -> tuple[Any, Any]:
    width = max(map(len, rows))
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def prompts(*lengths: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 64, (n,), generator=g).tolist() for n in lengths]


def returned(out: Any, mask: Any, per_prompt: int = 1) -> list[list[int]]:
    """Each returned sequence without its left padding."""
    pads = (mask == 0).sum(-1).repeat_interleave(per_prompt)
    return [row[int(p) :].tolist() for row, p in zip(out, pads, strict=True)]


def oracle_codes(model: Any, seq: list[int], sites: list[str]) -> dict[str, Any]:
    """{site: activation float32 [len(seq), width]} of one unpadded sequence in one no-cache forward."""
    seen: dict[str, Any] = {}

    def grab(site: Any, x: Any) -> None:
        seen[site.name] = x[0].detach().float().clone()

    with HFSiteHooks(model, grab), torch.no_grad():
        model(input_ids=torch.tensor([seq]), use_cache=False)
    return {s: seen[s] for s in sites}


def row_matches(code_row: Any, scale_row: Any, x: Any, g: float) -> bool:
    candidates = [quantize(x * (1 + e), NVFP4, g) for e in (-1e-4, 0.0, 1e-4)]
    codes_ok = torch.zeros_like(code_row, dtype=torch.bool)
    scales_ok = torch.zeros_like(scale_row, dtype=torch.bool)
    for q in candidates:
        codes_ok |= q.codes == code_row
        scales_ok |= q.scales == scale_row
    return bool(codes_ok.all() and scales_ok.all())


def record(sidecar: Any, model: Any, run_generate: Callable[[FP4SiteRecorder], list[tuple[str, list[int]]]],
           n_segments: int) -> tuple[int, int, list[str]]:  # fmt: skip
    """Record ``run_generate`` into a fresh run; read every returned sequence back; check each row.
    Returns (rows checked, rows matching their own token, problems)."""
    run = f"pos-{next(_runs)}"
    hooks_sites = HFSiteHooks(model, lambda s, x: None)
    spec = RunSpec(run, tuple(s.spec(bits=4) for s in hooks_sites.sites))
    names = [s.name for s in hooks_sites.sites]
    widths = {s.name: s.width for s in hooks_sites.sites}
    hooks_sites.remove()
    rec = RolloutRecorder(sidecar.address, spec, writer=f"w-{run}")
    try:
        with FP4SiteRecorder(model, [rec], fake_quant=False) as fp4, torch.no_grad():
            sequences = run_generate(fp4)
        assert len(sequences) == n_segments
        for traj, seq in sequences:
            rec.finish(traj, len(seq))
        assert rec.flush(timeout=60)
    finally:
        rec.close()
    plan = MicrobatchPlan([(traj, 0, len(seq)) for traj, seq in sequences])
    ids = {traj: seq for traj, seq in sequences}
    guidance = GuidanceReader(sidecar.address, run, prefetch=False, on_missing="mask").read(plan, token_ids=ids)
    problems = identity_problems(sidecar, run, plan, ids)
    checked = ok = 0
    row = 0
    for traj, seq in sequences:
        truth = oracle_codes(model, seq[:-1], names)  # the last token never enters a forward
        for p in range(len(seq)):
            for name in names:
                gd = guidance[name]
                valid = bool(gd.valid[row + p]) if gd.valid is not None else True
                if p == len(seq) - 1:
                    if valid:
                        problems.append(f"{traj} position {p} ({name}): the last token has a record")
                    continue
                if not valid:
                    problems.append(f"{traj} position {p} ({name}): no record")
                    continue
                g = gd.global_scale
                g_row = float(g[row + p]) if isinstance(g, torch.Tensor) else float(g)
                codes = unpack_bits(gd.codes[row + p], 4, widths[name])
                checked += 1
                if row_matches(codes, gd.scales[row + p], truth[name][p], g_row):
                    ok += 1
                elif len(problems) < 8:
                    problems.append(f"{traj} position {p} ({name}): the record is another token's")
        row += len(seq)
    return checked, ok, problems


def identity_problems(sidecar: Any, run: str, plan: MicrobatchPlan, ids: dict[str, list[int]]) -> list[str]:
    """Every stored chunk the plan reads carries its token identity and it equals the one of the
    returned sequences (read from storage, where the counts are seen); ids shifted by one token
    are refused by the sidecar's Read and the storage read alike."""
    problems: list[str] = []
    with StoreReader(Store(sidecar.storage), run) as reader:
        res = reader.read(plan, on_missing="mask", token_ids=ids)
        st = res.stats
        if st.ids_absent or st.ids_unverifiable or not st.ids_verified or st.ids_verified != st.chunks:
            problems.append(f"identity: {st.ids_verified} of {st.chunks} chunks verified, {st.ids_absent} without "
                            f"ids, {st.ids_unverifiable} unverifiable")  # fmt: skip
        shifted = {t: [seq[0], *seq[:-1]] for t, seq in ids.items()}
        with pytest.raises(GuidanceMismatch, match="other token ids"):
            reader.read(plan, on_missing="mask", token_ids=shifted)
    with pytest.raises(GuidanceMismatch, match="other token ids"):
        GuidanceReader(sidecar.address, run, prefetch=False, on_missing="mask").read_host(plan, token_ids=shifted)
    return problems


def assert_exact(result: tuple[int, int, list[str]]) -> None:
    checked, ok, problems = result
    assert not problems and checked and ok == checked, f"{ok} of {checked} rows are their token's: {problems}"


def test_batched_prompts_of_one_length(sidecar: Any, model: Any) -> None:
    def go(fp4: FP4SiteRecorder) -> list[tuple[str, list[int]]]:
        ids, mask = left_padded(*prompts(6, 6))
        with fp4.forward([("a", 0, None), ("b", 0, None)]):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        return list(zip("ab", returned(out, mask), strict=True))

    assert_exact(record(sidecar, model, go, 2))


def test_left_padded_batch(sidecar: Any, model: Any) -> None:
    """Before: rows keyed by the padded index; 0 rows of the padded sequences held their token's code."""

    def go(fp4: FP4SiteRecorder) -> list[tuple[str, list[int]]]:
        ids, mask = left_padded(*prompts(16, 11, 6))
        with fp4.forward([("a", 0, None), ("b", 0, None), ("c", 0, None)]):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        return list(zip("abc", returned(out, mask), strict=True))

    assert_exact(record(sidecar, model, go, 3))


def test_sampling_groups(sidecar: Any, model: Any) -> None:
    """GRPO: num_return_sequences=2 per prompt of a left-padded batch, one segment per returned sequence."""

    def go(fp4: FP4SiteRecorder) -> list[tuple[str, list[int]]]:
        ids, mask = left_padded(*prompts(9, 4))
        names = ["a0", "a1", "b0", "b1"]
        torch.manual_seed(0)
        with fp4.forward([(n, 0, None) for n in names]):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=True,
                                 num_return_sequences=2)  # fmt: skip
        return list(zip(names, returned(out, mask, 2), strict=True))

    assert_exact(record(sidecar, model, go, 4))


def test_no_cache_records_only_the_new_positions(sidecar: Any, model: Any) -> None:
    """Before: every full-sequence forward was recorded again after the last (63 rows for 13 tokens)."""

    def go(fp4: FP4SiteRecorder) -> list[tuple[str, list[int]]]:
        ids, mask = left_padded(*prompts(8, 5))
        with fp4.forward([("a", 0, None), ("b", 0, None)]):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                 use_cache=False)  # fmt: skip
        return list(zip("ab", returned(out, mask), strict=True))

    assert_exact(record(sidecar, model, go, 2))


def test_assisted_generation_never_records_rejected_drafts(sidecar: Any, model: Any) -> None:
    """Prompt lookup proposes the prompt's own continuation; the model rejects what it would not
    have generated, and the records of the rejected tokens are dropped."""
    forwards: list[int] = []

    def go(fp4: FP4SiteRecorder) -> list[tuple[str, list[int]]]:
        prompt = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])
        handle = model.register_forward_pre_hook(lambda m, a, k: forwards.append(k["input_ids"].shape[1]),
                                                 with_kwargs=True)  # fmt: skip
        try:
            with fp4.forward([("a", 0, None)]):
                out = model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                     prompt_lookup_num_tokens=3)  # fmt: skip
        finally:
            handle.remove()
        return [("a", out[0].tolist())]

    assert_exact(record(sidecar, model, go, 1))
    assert forwards[0] > 13  # the first forward carried draft tokens beyond the prompt


def test_static_cache(sidecar: Any, model: Any) -> None:
    def go(fp4: FP4SiteRecorder) -> list[tuple[str, list[int]]]:
        ids, mask = left_padded(*prompts(7, 4))
        with fp4.forward([("a", 0, None), ("b", 0, None)]):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                 cache_implementation="static")  # fmt: skip
        return list(zip("ab", returned(out, mask), strict=True))

    assert_exact(record(sidecar, model, go, 2))


def test_chunked_prompt_then_decode_by_hand(sidecar: Any, model: Any) -> None:
    """A prompt fed in two chunks through one cache, then greedy decode steps, in one block."""

    def go(fp4: FP4SiteRecorder) -> list[tuple[str, list[int]]]:
        (seq,) = prompts(11)
        cache = fp4.hooks.new_cache()
        kw = fp4.hooks.cache_kwargs(cache)
        with fp4.forward([("a", 0, None)]):
            model(input_ids=torch.tensor([seq[:6]]), use_cache=True, **kw)
            logits = model(input_ids=torch.tensor([seq[6:]]), use_cache=True, **kw).logits
            for _ in range(3):
                seq.append(int(logits[0, -1].argmax()))
                logits = model(input_ids=torch.tensor([[seq[-1]]]), use_cache=True, **kw).logits
        seq.append(int(logits[0, -1].argmax()))
        return [("a", seq)]

    assert_exact(record(sidecar, model, go, 1))


def test_two_models_in_one_process(sidecar: Any, model: Any) -> None:
    other = tiny(seed=7)

    def go_other(fp4: FP4SiteRecorder) -> list[tuple[str, list[int]]]:
        ids, mask = left_padded(*prompts(5, 8, seed=9))
        with fp4.forward([("x", 0, None), ("y", 0, None)]):
            out = other.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        return list(zip("xy", returned(out, mask), strict=True))

    def go(fp4: FP4SiteRecorder) -> list[tuple[str, list[int]]]:
        # the other model records into its own run while this one's recorder is attached
        assert_exact(record(sidecar, other, go_other, 2))
        ids, mask = left_padded(*prompts(6, 3))
        with fp4.forward([("a", 0, None), ("b", 0, None)]):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        return list(zip("ab", returned(out, mask), strict=True))

    assert_exact(record(sidecar, model, go, 2))


@pytest.mark.parametrize("returned_sequences", [4, 2])
def test_beam_search_is_refused_naming_sampling_groups(model: Any, returned_sequences: int) -> None:
    """Before: rows followed beam slots, not the returned sequences (322 of 480 rows wrong), silently."""

    class Refuses:
        run_spec = RunSpec("beams", ())

        def record_forward(self, *a: object, **kw: object) -> bool:
            raise AssertionError("nothing of a refused generate() is recorded")

    with FP4SiteRecorder(model, [Refuses()]) as fp4, torch.no_grad():
        ids, mask = left_padded(*prompts(6, 6))
        refused = r"num_beams=4.*beam search cannot be recorded.*num_return_sequences"
        segments = [(f"t{i}", 0, None) for i in range(2 * returned_sequences)]
        with pytest.raises(ConfigError, match=refused), fp4.forward(segments):
            model.generate(ids, attention_mask=mask, max_new_tokens=3, num_beams=4,
                           num_return_sequences=returned_sequences)  # fmt: skip
    assert "generate" not in vars(model)  # the guard is gone with the block


def test_one_segment_per_prompt_under_sampling_groups_is_refused_with_the_reason(model: Any) -> None:
    with FP4SiteRecorder(model, []) as fp4, torch.no_grad():
        ids, mask = left_padded(*prompts(6, 6))
        refused = r"num_return_sequences=2\) runs 4 rows: give one segment per returned"
        with pytest.raises(ConfigError, match=refused), fp4.forward([("a", 0, None), ("b", 0, None)]):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=True, num_return_sequences=2)


def test_a_forward_outside_the_model_entry_still_counts_on(tmp_path: Path, model: Any) -> None:
    """The backbone called directly (no model-level position information): rows continue per row."""

    with HFSiteHooks(model, lambda s, x: None) as probe:
        first_site = probe.sites[0].spec(bits=4)

    class Capture:
        run_spec = RunSpec("r", (first_site,))

        def __init__(self) -> None:
            self.segments: list[Any] = []

        def record_forward(self, segments: Any, outputs: Any, token_ids: Any = None) -> bool:
            self.segments.append(segments)
            return True

    cap = Capture()
    with FP4SiteRecorder(model, [cap]) as fp4, torch.no_grad():
        cache = fp4.hooks.new_cache()
        with fp4.forward([("a", 3, None)]):
            model.model(input_ids=torch.tensor([[4, 5, 6]]), past_key_values=cache, use_cache=True)
            model.model(input_ids=torch.tensor([[7]]), past_key_values=cache, use_cache=True)
    assert cap.segments == [[("a", 3, 6)], [("a", 6, 7)]]


def test_hooks_on_a_compiled_model_are_refused_naming_compile(model: Any) -> None:
    """Before: GuidedFP4Hooks attached after torch.compile left the compiled output unhooked, silently."""
    from tracestore.client import GuidedFP4Hooks

    compiled = torch.compile(model)
    for attach in (lambda m: GuidedFP4Hooks(m), lambda m: FP4SiteRecorder(m, []), lambda m: HFSiteHooks(m, print)):
        with pytest.raises(ConfigError, match=r"on a torch.compile'd module .*attach the hooks to the plain model"):
            attach(compiled)
    inner = tiny()
    inner.model.layers[1].compile()  # compiled in place: the module's own call is compiled
    with pytest.raises(ConfigError, match=r"torch.compile'd module \(model.layers.1\)"):
        GuidedFP4Hooks(inner)
    with GuidedFP4Hooks(model):  # the plain model is fine, and compiling after attaching is the way
        pass


def test_a_second_hook_set_is_refused_unless_stacked(model: Any) -> None:
    """Before: a forgotten GuidedFP4Hooks under an FP4SiteRecorder ran first, and the recorder
    recorded already-rounded inputs."""
    from tracestore.client import GuidedFP4Hooks

    first = GuidedFP4Hooks(model)
    try:
        with pytest.raises(ConfigError, match=r"FP4SiteRecorder: this model already has GuidedFP4Hooks attached"):
            FP4SiteRecorder(model, [])
        with FP4SiteRecorder(model, [], stack=True) as fp4:
            assert len(fp4.hooks.sites) == len(first.hooks.sites)
    finally:
        first.remove()
    with FP4SiteRecorder(model, []):  # once removed, the model takes a new set
        pass
