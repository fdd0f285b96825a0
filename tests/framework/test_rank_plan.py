"""Rank plans against a trivially correct model of the trainer's layout.

For every (DP, CP, PP, TP) combination up to 2x2x2x2, packed or padded (left or right), zig-zag
or contiguous context parallelism, with guided and unguided refs: each rank's rows are exactly the
tokens a brute-force, position-by-position model of that layout puts on the rank, in its order;
across ranks every (trajectory, token, site, column block) is held exactly once (TP-replicated
sites: once per TP rank).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tracestore.client.record.traceref import TraceRef, site_digest

from tracestore.errors import ConfigError, ShapeError, ValidationError
from tracestore.rank_plan import RankCoord, TrainerLayout, all_coords, rank_plan
from tracestore.records import RunSpec, SiteSpec

SPEC = RunSpec(
    "rp",
    (
        SiteSpec("layers.0.mlp.input", "moe_input", 0, 64),
        SiteSpec("layers.0.attn.k", "key", 0, 64),
        SiteSpec("layers.1.attn.v", "value", 1, 64, bits=2),
        SiteSpec("layers.2.mlp.input", "moe_input", 2, 64, rows_per_token=2),
        SiteSpec("layers.3.attn.k", "key", 3, 64, format="mxfp4"),
    ),
)
DIGEST = site_digest(SPEC)


def ref(i: int, n: int, guided: bool = True, version: int = 0) -> TraceRef:
    return TraceRef(SPEC.run, version, f"s{i}", 0, n, DIGEST, guided, "" if guided else "sidecar_unreachable")


def model_rows(refs: list[TraceRef], layout: TrainerLayout, dp: int, cp: int) -> list[tuple[str | None, int]]:
    """Position by position: which (stored id, token) the trainer's rank (dp, cp) holds, in order."""
    mine = [int(i) for i in np.array_split(np.arange(len(refs)), layout.dp_size)[dp]]
    k = 2 * layout.cp_size if (layout.zigzag and layout.cp_size > 1) else layout.cp_size
    width = None
    if layout.packing == "padded" and mine:
        longest = max(refs[i].n_tokens for i in mine)
        width = ((longest + k - 1) // k) * k
    out: list[tuple[str | None, int]] = []
    for i in mine:
        n = refs[i].n_tokens
        row = width if width is not None else ((n + k - 1) // k) * k
        lead = row - n if (width is not None and layout.pad_left) else 0
        size = row // k
        for p in range(row):
            chunk = p // size
            holder = chunk if chunk < layout.cp_size else k - 1 - chunk
            if holder != cp:
                continue
            t = p - lead
            out.append((refs[i].stored_id, t) if 0 <= t < n else (None, -1))
    return out


def model_stage(layer: int, layout: TrainerLayout, n_layers: int = 4) -> int:
    per = [n_layers // layout.pp_size + (1 if s < n_layers % layout.pp_size else 0) for s in range(layout.pp_size)]
    bounds = np.cumsum(per)
    return int(np.searchsorted(bounds, layer, side="right"))


layouts = st.builds(
    TrainerLayout,
    dp_size=st.integers(1, 2),
    cp_size=st.integers(1, 2),
    pp_size=st.integers(1, 2),
    tp_size=st.integers(1, 2),
    packing=st.sampled_from(["packed", "padded"]),
    pad_left=st.booleans(),
    zigzag=st.booleans(),
)
steps = st.lists(st.tuples(st.integers(1, 37), st.booleans()), min_size=1, max_size=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts, step=steps)
def test_rank_plans_cover_each_token_once(layout: TrainerLayout, step: list[tuple[int, bool]]) -> None:
    if layout.packing == "packed" and layout.pad_left:
        layout = TrainerLayout(**{**layout.__dict__, "pad_left": False})
    refs = [ref(i, n, g) for i, (n, g) in enumerate(step)]
    held: Counter[tuple[str, int, str, int]] = Counter()
    for c in all_coords(layout):
        rp = rank_plan(refs, layout, c, run_spec=SPEC)
        want = model_rows(refs, layout, c.dp, c.cp)
        assert rp.token_map() == want, (c, layout)
        assert rp.plan.n_tokens == len(want)
        # the reader only looks up guided refs' tokens; unguided ones are padding in the plan
        looked_up = [
            (s.trajectory, t) for s in rp.plan.segments if s.trajectory for t in range(s.token_start, s.token_end)
        ]
        guided_ids = {r.stored_id for r in refs if r.guided}
        assert looked_up == [x for x in want if x[0] in guided_ids]
        assert rp.real_tokens == sum(1 for t, _ in want if t is not None)
        assert rp.unguided_tokens == sum(1 for t, _ in want if t is not None and t not in guided_ids)
        for site in SPEC.sites:
            in_stage = model_stage(site.layer, layout) == c.pp
            assert (site.name in rp.sites) == in_stage
            if not in_stage:
                continue
            a, b = rp.columns[site.name]
            assert a % 16 == 0 and b % 16 == 0 and 0 <= a < b <= site.width
            for traj, tok in want:
                if traj is None:
                    continue
                for blk in range(a // 16, b // 16):
                    held[(traj, tok, site.name, blk)] += 1
    for r in refs:
        for tok in range(r.n_tokens):
            for site in SPEC.sites:
                copies = layout.tp_size if site.kind not in layout.tp_kinds else 1
                for blk in range(site.width // 16):
                    assert held[(r.stored_id, tok, site.name, blk)] == copies, (r.stored_id, tok, site.name, blk)


def test_dp_assignment_and_trainer_lengths_are_checked() -> None:
    refs = [ref(i, n) for i, n in enumerate([5, 7, 3])]
    layout = TrainerLayout(dp_size=2, dp_assignment=((2, 0), (1,)))
    rp = rank_plan(refs, layout, RankCoord(dp=0), run_spec=SPEC, cu_seqlens=[0, 3, 8])
    assert [s for s in rp.plan] == [("s2::a0", 0, 3), ("s0::a0", 0, 5)]
    with pytest.raises(ShapeError, match=r"sample 0 \(s0::a0\) 4 tokens, its ref 5"):
        rank_plan(refs, layout, RankCoord(dp=0), run_spec=SPEC, cu_seqlens=[0, 3, 7])
    with pytest.raises(ShapeError, match="the trainer has 6 tokens"):
        rank_plan(refs, layout, RankCoord(dp=0), run_spec=SPEC, lengths=[5, 6, 3])
    with pytest.raises(ValidationError, match="exactly once"):
        rank_plan(refs, TrainerLayout(dp_size=2, dp_assignment=((0,), (0, 1))), run_spec=SPEC)
    with pytest.raises(ConfigError, match="outside"):
        rank_plan(refs, layout, RankCoord(dp=2), run_spec=SPEC)


def test_refs_of_another_run_and_unguided_refs_with_error() -> None:
    other = TraceRef("other-run", 0, "x", 0, 4, DIGEST)
    with pytest.raises(ValidationError, match="belongs to run 'other-run', not 'rp'"):
        rank_plan([ref(0, 3), other], TrainerLayout(), run_spec=SPEC)
    with pytest.raises(ValidationError, match="unguided"):
        rank_plan([ref(0, 3, guided=False)], TrainerLayout(), run_spec=SPEC, on_missing="error")
    with pytest.raises(ValidationError, match="twice"):
        rank_plan([ref(0, 3), ref(0, 3)], TrainerLayout(), run_spec=SPEC)
