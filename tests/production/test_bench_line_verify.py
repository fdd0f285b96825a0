"""bench_line's sampled steps: the steps whose stored rows are checked against an independent
quantization of their activations."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

bench_line = pytest.importorskip("bench_line")


def test_first_sampled_step_comes_early() -> None:
    # a K = 8 run stopped ~8 s into its 60 s phase (staging full) kept no step: 0 rows were checked
    times = bench_line.verify_times(100.0, 60.0, 3)
    assert len(times) == 3
    assert times[0] <= 101.0
    assert all(100.0 <= t < 160.0 for t in times)
    assert sorted(times) == times
    assert bench_line.verify_times(100.0, 2.0, 1) == [100.5]
    assert bench_line.verify_times(100.0, 60.0, 0) == []
