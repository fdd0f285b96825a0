"""``python -m tracestore``; ``tracestore inspect`` exit statuses and ``--json``; ``tracestore selftest``'s
quick default and progress lines."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import uuid
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from tracestore.server.testing import SPEC, make_chunk

from tracestore import __version__
from tracestore.cli import main
from tracestore.records import TrajectorySeal
from tracestore.storage.store import Store

SITE = SPEC.sites[0].name


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TRACESTORE_")}


def test_python_dash_m_tracestore() -> None:
    proc = subprocess.run([sys.executable, "-m", "tracestore", "--help"], capture_output=True, text=True, timeout=60,
                          env=_env())  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.startswith("usage: tracestore "), proc.stderr
    for command in ("serve", "inspect", "selftest", "check"):
        assert command in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "tracestore", "--version"], capture_output=True, text=True,
                          timeout=60, env=_env())  # fmt: skip
    assert proc.stdout.strip() == f"tracestore {__version__}"
    proc = subprocess.run([sys.executable, "-m", "tracestore"], capture_output=True, text=True, timeout=60, env=_env())
    assert proc.returncode == 2 and "usage: tracestore" in proc.stdout


def _inspect(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            rc = main(["inspect", *args])
        except SystemExit as exc:
            rc = int(exc.code or 0)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def stored() -> str:
    url = f"memory://tracestore-cli-{uuid.uuid4().hex}"
    store = Store(url)
    store.put_run(SPEC)
    store.write_shard(SPEC.run, 0, "w0", 0, [make_chunk("t1", 0, 8)],
                      seals=[TrajectorySeal(SPEC.run, 0, "t1", 9, (SITE,))])  # fmt: skip
    store.write_shard(SPEC.run, 2, "w0", 0, [make_chunk("t2", 0, 4, version=2)])
    return url


def test_inspect_nothing_there_exits_3(tmp_path: Path) -> None:
    rc, out, err = _inspect((tmp_path / "nonexistent").as_uri())
    assert rc == 3 and "nothing there (no such location)" in err and out == ""
    rc, out, err = _inspect(tmp_path.as_uri())
    assert rc == 3 and "holds no tracestore runs" in err
    rc, out, err = _inspect(tmp_path.as_uri(), "--json")
    report = json.loads(out)
    assert rc == 3 and report["ok"] is False and report["runs"] == [] and report["nothing"]


def test_inspect_records_exit_0_and_json(stored: str) -> None:
    rc, out, err = _inspect(stored)
    assert rc == 0 and f"run {SPEC.run}: 2 sites, versions [0, 2]" in out and "v0:" in out and "v2:" in out, err
    rc, out, err = _inspect(stored, "--json", "--validate", "--trajectory", "t1")
    assert rc == 0, err
    report = json.loads(out)
    assert report["ok"] is True and report["url"] == stored
    (run,) = report["runs"]
    assert run["run"] == SPEC.run and [s["name"] for s in run["sites"]] == list(SPEC.site_names)
    v0, v2 = run["versions"]
    assert (v0["version"], v0["shards"], v0["chunks"], v0["sealed"], v0["site_tokens"]) == (0, 1, 1, 1, {SITE: 8})
    assert v0["validation"] == {"ok": True, "problems": []}
    assert v0["trajectory"]["sealed_tokens"] == 9 and v0["trajectory"]["coverage"] == {SITE: [[0, 8]]}
    assert v2["trajectory"]["present"] is False


def test_inspect_missing_run_or_version_exits_3(stored: str) -> None:
    rc, _, err = _inspect(stored, "--run", "no-such-run")
    assert rc == 3 and "no run 'no-such-run'" in err and SPEC.run in err
    rc, _, err = _inspect(stored, "--policy-version", "1")
    assert rc == 3 and "has no policy version 1 (versions: [0, 2])" in err
    rc, _, err = _inspect(stored, "--run", "Not/A/Run")
    assert rc == 2 and "invalid run id" in err


def test_inspect_policy_version_and_its_old_spelling(stored: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rc, out, err = _inspect(stored, "--policy-version", "2")
    assert rc == 0 and "versions [2]" in out and err == ""
    rc, out, err = _inspect(stored, "--version", "2")
    assert rc == 0 and "versions [2]" in out and "--version is deprecated, use --policy-version" in err
    monkeypatch.setenv("TRACESTORE_POLICY_VERSION", "0")
    rc, out, _ = _inspect(stored)
    assert rc == 0 and "versions [0]" in out


def test_inspect_storage_error_names_the_root(tmp_path: Path) -> None:
    """A failing list of the storage root reads "list on <url>", not "list  on" (an empty path)."""
    from tracestore.errors import StorageError
    from tracestore.storage.fs import Storage

    st = Storage(tmp_path.as_uri(), retries=0)

    def boom() -> None:
        raise PermissionError("denied")

    with pytest.raises(StorageError) as info:
        st.call("list ", boom)
    assert f"list: permission denied on {tmp_path.as_uri()}" in str(info.value) and "  " not in str(info.value)


@pytest.mark.slow
def test_selftest_quick_default_with_progress() -> None:
    pytest.importorskip("torch")
    proc = subprocess.Popen([sys.executable, "-m", "tracestore", "selftest"], stdout=subprocess.PIPE, text=True,
                            env=_env())  # fmt: skip
    assert proc.stdout is not None
    first = proc.stdout.readline()  # printed before torch is imported
    assert first.startswith("selftest: 64 tokens x 2048 values"), first
    rest = proc.stdout.read()
    assert proc.wait(timeout=120) == 0, rest
    rows = [line for line in rest.splitlines() if "/12 " in line]
    assert len(rows) == 12 and rows[-1].lstrip().startswith("12/12") and "selftest passed in" in rest
