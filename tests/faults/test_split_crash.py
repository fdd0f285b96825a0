"""SIGKILL at the crash points of a commit whose shards are written as two files side by side
(``TRACESTORE_SHARD_FILES=2``, ``TRACESTORE_SHARD_SPLIT_MIB=0``: every shard of two or more
trajectories is split), with chunks large enough to be split (2048 tokens: 48-72 KiB per chunk).
``store.manifest_published:1`` kills between the two files' manifests. The restarts that follow a
crash split too; the last, fault-free restart runs the default settings, which write these ~1 MiB
shards as one file, so the WAL replay of a crashed two-file commit repeats it in the other layout.
As in test_crash_points: every acknowledged record reads back bit-identical and exactly once, and
the sidecar converges."""

from __future__ import annotations

from pathlib import Path

import pytest

from tracestore.storage.store import PART_SEQ_STRIDE, SHARD_FILES_ENV, SPLIT_MIB_ENV

from .test_crash_points import NS, _crash_trials

SPLIT = {SHARD_FILES_ENV: "2", SPLIT_MIB_ENV: "0"}


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "point", ["store.temp_written", "store.shard_published", "store.manifest_published", "commit.stored"]
)
def test_sigkill_in_a_two_file_commit(point: str, tmp_path: Path) -> None:
    env = {n: {"TRACESTORE_FAULT": f"{point}:{n}", **SPLIT} for n in NS}
    _crash_trials(f"two files {point}", tmp_path, env, tokens=2048)
    second_files = [
        p for p in (tmp_path / "data").rglob("part-*.manifest.json") if int(p.name[5:-14]) >= PART_SEQ_STRIDE
    ]
    assert second_files, "no shard was written as two files"
