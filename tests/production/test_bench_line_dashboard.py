"""bench_line's ``dashboard`` rows: Debian's Prometheus scrapes the run's real sidecars and the Grafana
dashboard's own panel queries are evaluated over the sustained window; the Backlog panel must show
every sidecar and agree with the bench's own Stat sampler (both read the sidecars' backlog)."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

line_dashboard = pytest.importorskip("line_dashboard")

MiB = 1 << 20


def test_substitute_as_grafana_does() -> None:
    expr = 'sum(rate(x{job=~"$job", pod=~"${pod}"}[$__rate_interval]))'
    got = line_dashboard.substitute(expr, {"job": ".*", "pod": ["sidecar-0", "a.b"]}, "4s")
    assert got == 'sum(rate(x{job=~".*", pod=~"(sidecar\\\\-0|a\\\\.b)"}[4s]))'
    assert line_dashboard.substitute('x{pod=~"$pod"}', {"pod": ["p-1"]}, "4s") == 'x{pod=~"p\\\\-1"}'
    with pytest.raises(KeyError, match=r"\$node"):
        line_dashboard.substitute('x{n="$node"}', {}, "4s")
    assert line_dashboard.rate_interval(1.0, 1.0) == "4s"  # max(4 x 1 s, 1 s + 1 s)
    assert line_dashboard.rate_interval(15.0, 60.0) == "75s"


def test_the_dashboard_has_every_panel_and_a_missing_one_is_named() -> None:
    dash = json.loads(line_dashboard.DASHBOARD.read_text())
    panels = line_dashboard.find_panels(dash)
    values = line_dashboard.saved_selection(dash)
    assert set(values) == {"job", "namespace", "pod"}
    for p in panels.values():
        for t in p["targets"]:
            assert "$" not in line_dashboard.substitute(t["expr"], values, "4s"), t["expr"]
    dash["panels"] = [
        {**p, "panels": [q for q in p.get("panels", []) if q.get("title") != "Backlog"]}
        for p in dash["panels"]
        if p.get("title") != "Backlog"
    ]
    with pytest.raises(ValueError, match="Backlog"):
        line_dashboard.find_panels(dash)


def test_backlog_verdict() -> None:
    ts = [float(t) for t in range(61)]
    gib = float(1 << 30)
    flat = line_dashboard.backlog_verdict(ts, [0.6 * gib] * 61, gib)  # high but not growing
    assert flat["flat"] and not flat["far_from_budget"]
    saw = [0.2 * gib + (t % 10) * 0.01 * gib for t in ts]  # shard commits: up and down, no trend
    assert line_dashboard.backlog_verdict(ts, saw, gib)["flat"]
    growing = line_dashboard.backlog_verdict(ts, [0.3 * gib + t * 0.01 * gib for t in ts], gib)
    assert not growing["flat"] and not growing["room_60s"]  # 0.01 GiB/s x 60 s > the 0.1 GiB left
    assert growing["slope_x_window_of_budget"] == pytest.approx(0.6)
    # 8 sidecars, 16 GiB of budget, 1.4 -> 4.0 GiB in 60 s (an H100 host run): room left, not flat
    climbing = [1.4 * gib + t * (2.6 / 60) * gib for t in ts]
    got = line_dashboard.backlog_verdict(ts, climbing, 16 * gib, sidecars=8)
    assert got["room_60s"] and not got["flat"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_line_dashboard_rows_match_its_sampler(tmp_path: Path) -> None:
    prometheus = shutil.which("prometheus") or "/usr/bin/prometheus"
    if not Path(prometheus).exists():
        pytest.skip("no Prometheus binary (Debian: apt-get install prometheus)")
    cmd = [sys.executable, str(ROOT / "bench" / "bench_line.py"), "--cpu", "--procs", "2", "--sidecars", "0",
           "--batch", "64", "--forward-ms", "40", "--overhead-s", "2", "--block-s", "0.5", "--duration", "12",
           "--verify-steps", "1", "--prometheus", prometheus, "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "bench_line.jsonl").read_text().splitlines()]
    assert not [r for r in rows if r["kind"] == "error"], proc.stdout[-3000:]
    dash = {r["panel"]: r for r in rows if r["kind"] == "dashboard"}
    assert set(dash) == set(line_dashboard.PANELS), [r.get("error") for r in rows if r["kind"] == "dashboard"]
    (run,) = [r for r in rows if r["kind"] == "run"]
    (stage,) = [r for r in rows if r["kind"] == "stage"]
    assert run["unguided"] == 0 and stage["sustained"], (run, stage)

    backlog = dash["Backlog"]
    window = backlog["window_s"]
    assert window == pytest.approx(stage["seconds"], abs=0.5)
    (target,) = backlog["targets"]
    assert target["expr"].startswith("sum by (namespace, pod) (tracestore_backlog_bytes{")
    assert sorted(s["labels"]["pod"] for s in target["series"]) == ["sidecar-0", "sidecar-1"]
    for s in target["series"]:
        assert s["samples"] >= window - 1, s  # a point per 1 s step: no scrape missed for long
    node = target["node"]
    assert node["samples"] >= window - 1

    # the bench's own sampler (Stat RPC every 0.5 s, summed over the sidecars) over the same window:
    # (seconds from the sustained start, backlog MiB, ...), the same t0 as the dashboard's rows
    sampled = [b for t, b, *_ in run["sidecar_samples"] if 0 <= t <= window]
    panel = [v / MiB for _, v in node["points"]]
    assert len(sampled) >= 10 and max(sampled) > 0, run["sidecar_samples"]
    assert max(panel) > 0, node
    # a saw-tooth (shard commits) sampled at 0.5 s and at 1 s: compare means over the window (a
    # factor of 2, e.g. series counted twice, fails; so does a panel of zeros)
    m_s, m_p = statistics.fmean(sampled), statistics.fmean(panel)
    assert abs(m_p - m_s) <= 0.3 * max(m_s, m_p) + 4, (m_p, m_s, panel, sampled)
    assert max(panel) <= 1.5 * max(sampled) + 8, (panel, sampled)
    assert backlog["budget_bytes"] == 2 * 1024 * MiB  # the Memory budget panel: 2 sidecars, 1 GiB each (default)
    assert backlog["room_60s"] is True  # the bench called the stage sustained; far from the 2 GiB of budgets

    # the sidecars' ingest rate (a counter: smooth), last third (past the alternating phase's 4 s
    # rate window) vs the rate the engines offered, summed over the sidecars
    ingest = dash["Ingest throughput"]["targets"][0]["node"]
    assert ingest["last_third_mean"] == pytest.approx(stage["offered_GBps"] * 1e9, rel=0.25)
    assert {v for _, v in dash["Sidecars up"]["targets"][0]["node"]["points"]} == {2.0}
    assert dash["Unguided trajectories"]["node_max"] == 0
    oldest = dash["Oldest backlog record"]["targets"][0]  # an age: the node's is the oldest pod's
    assert oldest["node_of_series"] == "max" and target["node_of_series"] == "sum"
    assert oldest["node"]["max"] == max(s["max"] for s in oldest["series"])
