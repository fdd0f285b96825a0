"""tools/prose_stats.py counts docstring and comment lines and the measurements among them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def prose():
    spec = importlib.util.spec_from_file_location("prose_stats", ROOT / "tools" / "prose_stats.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["prose_stats"] = module
    spec.loader.exec_module(module)
    return module


SAMPLE = '''"""A module.

Reads 4 MiB at a time.
"""

X = 1  # 0.35 ms on the bench box
Y = 0x10  # a hex constant, not a figure
s = "3 ms in a string is code, not prose"


def f():
    """It was slower before."""
    return 2  # plain comment
'''


def test_counts_docstrings_comments_and_measurements(prose, tmp_path):
    path = tmp_path / "m.py"
    path.write_text(SAMPLE)
    stats = prose.file_stats(path)
    assert stats.lines == 13
    # docstring lines: "A module.", "Reads 4 MiB ...", the one-line function docstring
    assert stats.doc_lines == 3
    # plus three comments
    assert stats.prose_lines == 6
    assert stats.figure_lines == 2  # 4 MiB, 0.35 ms
    assert stats.measurement_lines == 3  # and "was ... before"
    summary = prose.summary([stats])
    assert summary["measurement_per_kloc"] == pytest.approx(3 / 0.013)


def test_skips_generated_stubs_and_tests(prose):
    stats = prose.collect(["tracestore"], ROOT)
    paths = [s.path for s in stats]
    assert "tracestore/__init__.py" in paths
    assert not [p for p in paths if p.startswith("tracestore/v1/")]
