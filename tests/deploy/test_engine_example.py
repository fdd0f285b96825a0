"""The example recording engine (examples/engine/record_engine.py) against a real `tracestore serve`
over its unix socket: it generates for a few seconds, exits 0 on SIGTERM after flushing, and its
records and seals are in storage."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "examples" / "engine" / "record_engine.py"


def test_example_engine_records_through_the_sidecar_and_exits_cleanly_on_sigterm(tmp_path: Path) -> None:
    pytest.importorskip("grpc", reason="the sidecar needs the server extra")
    pytest.importorskip("transformers", reason="the example engine needs transformers (demo extra)")
    from tracestore.client import GuidanceReader
    from tracestore.server.testing import ServeProcess

    from tracestore.plan import MicrobatchPlan
    from tracestore.storage.store import Store

    with ServeProcess(tmp_path / "sidecar", unix_socket=True) as sp:
        env = {
            **os.environ,
            "TRACESTORE_ADDRESS": sp.unix_address,
            "ENGINE_RUN": "engine-example",
            "ENGINE_WRITER": "example-0",
            "ENGINE_NEW_TOKENS": "4",
            "ENGINE_FLUSH_TIMEOUT": "60",
        }
        proc = subprocess.Popen([sys.executable, str(ENGINE)], env=env, cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            line = ""
            while time.monotonic() < deadline and proc.poll() is None:  # wait until it is generating
                line = proc.stderr.readline() if proc.stderr else ""
                if "recording run" in line:
                    break
            assert "recording run" in line, f"the engine did not start: {line!r}, rc {proc.poll()}"
            time.sleep(4)  # a few seconds of continuous generation
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 0, f"rc {proc.returncode}\n{err[-3000:]}\n{sp.log_tail()}"
        summary = json.loads(out.strip().splitlines()[-1])
        assert summary["durable"] and summary["error"] is None and summary["unguided"] == 0, summary
        assert summary["rollouts"] >= 1 and summary["trajectories_sealed"] == 2 * summary["rollouts"], summary
        storage = sp.storage
    # after the sidecar's drain: every sealed trajectory is in storage, complete
    with Store(storage) as store:
        versions = store.list_versions("engine-example")
        trajs = sorted({t for v in versions for t in store.list_trajectories("engine-example", v)})
    expected = sorted(f"example-0-{r:06d}-{b}" for r in range(summary["rollouts"]) for b in range(2))
    assert trajs == expected
    n = 8 + 4  # ENGINE_PROMPT_LEN + ENGINE_NEW_TOKENS: positions 0..n-2 entered the model
    plan = MicrobatchPlan([(t, 0, n) for t in trajs])
    guidance = GuidanceReader(storage, "engine-example", prefetch=False).read(plan)
    assert len(guidance) > 0
    for name in guidance:
        valid = guidance[name].valid.reshape(len(trajs), n)
        assert valid[:, : n - 1].all() and not valid[:, n - 1].any(), name
