"""MicrobatchPlan constructors: packed (cu_seqlens), padded, context-parallel (plain and zig-zag)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracestore import ConfigError, ShapeError, ValidationError
from tracestore.plan import MicrobatchPlan


def test_cu_seqlens():
    plan = MicrobatchPlan.from_cu_seqlens(["a", "b", "c"], [0, 3, 10, 11], offsets=[5, 0, 2])
    assert [tuple(s) for s in plan] == [("a", 5, 8), ("b", 0, 7), ("c", 2, 3)]
    assert plan.n_tokens == 11 and plan.offsets.tolist() == [0, 3, 10, 11]
    with pytest.raises(ShapeError):
        MicrobatchPlan.from_cu_seqlens(["a"], [0, 3, 4])
    with pytest.raises(ShapeError):
        MicrobatchPlan.from_cu_seqlens(["a"], [1, 3])
    with pytest.raises(ValidationError, match="strictly increasing"):
        MicrobatchPlan.from_cu_seqlens(["a", "b"], [0, 3, 3])


def test_padded_right_and_left():
    plan = MicrobatchPlan.padded(["a", None, "b"], [2, 0, 4], max_len=4)
    assert [tuple(s) for s in plan] == [("a", 0, 2), (None, 0, 2), (None, 0, 4), ("b", 0, 4)]
    left = MicrobatchPlan.padded(["a", "b"], [2, 4], left=True)
    assert [tuple(s) for s in left] == [(None, 0, 2), ("a", 0, 2), ("b", 0, 4)]
    with pytest.raises(ValidationError):
        MicrobatchPlan.padded(["a"], [5], max_len=4)


def test_zigzag_split_gives_chunks_r_and_2cp_minus_1_minus_r():
    # 16 tokens, CP=2: chunks of 4; rank 0 gets chunks 0 and 3, rank 1 chunks 1 and 2
    r0 = MicrobatchPlan.context_parallel(["a"], [16], cp_size=2, cp_rank=0)
    r1 = MicrobatchPlan.context_parallel(["a"], [16], cp_size=2, cp_rank=1)
    assert [tuple(s) for s in r0] == [("a", 0, 4), ("a", 12, 16)]
    assert [tuple(s) for s in r1] == [("a", 4, 8), ("a", 8, 12)]
    plain = MicrobatchPlan.context_parallel(["a"], [16], cp_size=2, cp_rank=1, zigzag=False)
    assert [tuple(s) for s in plain] == [("a", 8, 16)]
    # 14 tokens pad to 16: rank 0's second chunk is 2 real tokens and 2 padding rows
    p = MicrobatchPlan.context_parallel(["a"], [14], cp_size=2, cp_rank=0)
    assert [tuple(s) for s in p] == [("a", 0, 4), ("a", 12, 14), (None, 0, 2)]
    with pytest.raises(ConfigError):
        MicrobatchPlan.context_parallel(["a"], [8], cp_size=2, cp_rank=2)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.integers(1, 50), min_size=1, max_size=5),
    st.integers(1, 4),
    st.booleans(),
)
def test_context_parallel_partitions_every_token(lengths, cp, zigzag):
    trajs = [f"t{i}" for i in range(len(lengths))]
    seen = []
    sizes = set()
    for rank in range(cp):
        plan = MicrobatchPlan.context_parallel(trajs, lengths, cp, rank, zigzag=zigzag)
        sizes.add(plan.n_tokens)  # every rank holds the same number of rows (padding included)
        seen += [(s.trajectory, t) for s in plan if s.trajectory for t in range(s.token_start, s.token_end)]
    assert sorted(seen) == sorted((t, i) for t, n in zip(trajs, lengths, strict=True) for i in range(n))
    assert len(sizes) == 1


@pytest.mark.parametrize(
    "segments",
    [[("a", 3, 3)], [("a", -1, 2)], [("a/b", 0, 1)], [("a", 0)], [("a", 0.5, 2)]],
)
def test_bad_segments(segments):
    with pytest.raises(ValidationError):
        MicrobatchPlan(segments)
