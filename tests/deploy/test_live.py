"""Live: Prometheus (Debian's package) scrapes a real `tracestore serve` under a bounded workload.

Both processes are started here on free loopback ports and stopped at the end. The workload is two
RolloutRecorders (shared memory over the unix socket, inline bytes over TCP) and one sidecar read.
Then every dashboard query (variables substituted as Grafana would) must parse and return data,
every rule must be healthy, `promtool check metrics` must pass on the live /metrics, and no label
may carry an unbounded value. A broken copy of the dashboard must fail the same check.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

RUN = "ci-deploy"
SITES = ("layers.0.mlp.input", "layers.1.attn.k")
N_TRAJ = 6  # per writer
PROMPT, DECODE = 24, 6
NAMESPACE, POD = "ci", "tracestore-ci-0"
RATE_INTERVAL = "4s"  # Grafana's $__rate_interval at a 1 s scrape interval: max(4 x scrape, step + scrape)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float = 5) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        body: bytes = resp.read()
        return body


def api(base: str, path: str, **params: str) -> Any:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}" if params else f"{base}{path}"
    try:
        body = http_get(url)
    except urllib.error.HTTPError as exc:  # 400 with a JSON error body for bad queries
        body = exc.read()
    return json.loads(body)


def wait_for(what: str, check: Any, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: process exited with {proc.returncode}")
        try:
            last = check()
            if last:
                return last
        except (OSError, ValueError, KeyError) as exc:
            last = exc
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def stop(proc: subprocess.Popen[bytes], timeout: float = 15) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, h: Any) -> Iterator[dict[str, Any]]:
    prometheus = h.tool("prometheus")
    tmp = tmp_path_factory.mktemp("live")
    logs = {name: open(tmp / f"{name}.log", "wb") for name in ("serve", "prometheus")}  # noqa: SIM115
    ready = tmp / "ready.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    serve = subprocess.Popen(
        [sys.executable, "-m", "tracestore.cli", "serve",
         "--storage", f"file://{tmp / 'data'}", "--wal-dir", str(tmp / "wal"),
         "--host", "127.0.0.1", "--port", "0", "--metrics-host", "127.0.0.1", "--metrics-port", "0",
         "--unix-socket", str(tmp / "tracestore.sock"), "--ready-file", str(ready),
         "--flush-interval", "0.5", "--grace", "10"],
        stdout=logs["serve"], stderr=subprocess.STDOUT, env=env, cwd=tmp,
    )  # fmt: skip
    procs = [serve]
    try:
        info = wait_for("tracestore serve to be ready", lambda: ready.exists() and json.loads(ready.read_text()), 60,
                        serve)  # fmt: skip
        shutil.copytree(h.DEPLOY / "prometheus", tmp / "prometheus")
        targets = tmp / "prometheus" / "ci" / "targets"
        targets.mkdir()
        (targets / "tracestore.json").write_text(json.dumps(
            [{"targets": [f"127.0.0.1:{info['metrics_port']}"], "labels": {"namespace": NAMESPACE, "pod": POD}}]
        ))  # fmt: skip
        prom_port = free_port()
        prom = subprocess.Popen(
            [prometheus, f"--config.file={tmp / 'prometheus' / 'ci' / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}",
             "--log.level=warn"],
            stdout=logs["prometheus"], stderr=subprocess.STDOUT, cwd=tmp,
        )  # fmt: skip
        procs.append(prom)
        base = f"http://127.0.0.1:{prom_port}"
        wait_for("Prometheus to be ready", lambda: http_get(f"{base}/-/ready"), 30, prom)
        yield {
            "tmp": tmp,
            "grpc": f"127.0.0.1:{info['port']}",
            "unix": f"unix://{tmp / 'tracestore.sock'}",
            "metrics": f"http://127.0.0.1:{info['metrics_port']}/metrics",
            "prom": base,
            "serve": serve,
            "prom_proc": prom,
        }
    finally:
        for p in reversed(procs):
            stop(p)
        for f in logs.values():
            f.close()
        if serve.returncode not in (0, None):
            print((tmp / "serve.log").read_text()[-4000:])


@pytest.fixture(scope="module")
def workload(stack: dict[str, Any]) -> dict[str, Any]:
    """A bounded rollout: prefill + decode forwards for 2 x N_TRAJ trajectories, seals, one read."""
    from tracestore.client import GuidanceReader, RolloutRecorder, SiteOutput

    from tracestore.records import RunSpec, SiteSpec

    spec = RunSpec(RUN, (SiteSpec(SITES[0], "moe_input", 0, 64), SiteSpec(SITES[1], "key", 1, 32, bits=2)))
    rng = np.random.default_rng(7)
    ids: set[str] = {RUN}
    sent: dict[tuple[str, str, int], np.ndarray] = {}
    for writer, address in (("ci-writer-shm", stack["unix"]), ("ci-writer-grpc", stack["grpc"])):
        ids.add(writer)
        trajs = [f"{writer}-traj-{i}" for i in range(N_TRAJ)]
        ids.update(trajs)
        rec = RolloutRecorder(address, spec, writer, staging_bytes=8 << 20, give_up_s=20)
        try:

            def forward(segments: list[tuple[str, int, int]], rec: Any = rec) -> None:
                n = sum(b - a for _, a, b in segments)
                outs = {}
                for site in spec.sites:
                    codes = rng.integers(0, 256, (n, site.code_bytes), dtype=np.uint8)
                    scales = rng.integers(0, 127, (n, site.scale_bytes), dtype=np.uint8)
                    outs[site.name] = SiteOutput(codes, scales, 1.0)
                    row = 0
                    for t, a, b in segments:
                        for tok in range(a, b):
                            sent[(t, site.name, tok)] = codes[row]
                            row += 1
                assert rec.record_forward(segments, outs), rec.stats

            for t in trajs:
                forward([(t, 0, PROMPT)])
            for k in range(DECODE):
                forward([(t, PROMPT + k, PROMPT + k + 1) for t in trajs])
            for t in trajs:
                rec.finish(t, PROMPT + DECODE + 1)  # the last sampled token runs no forward
            assert rec.flush(timeout=30), f"not everything was durably acked: {rec.stats}"
            assert rec.stats["unguided"] == 0, rec.stats
        finally:
            rec.close()
    # a trainer reading one microbatch through the sidecar (exercises Read and the reads row)
    reader = GuidanceReader(stack["grpc"], RUN, prefetch=False)
    try:
        t = f"ci-writer-grpc-traj-{N_TRAJ - 1}"
        rows = reader.read_host([(t, 0, PROMPT + DECODE)])
    finally:
        reader.close()
    got = rows[SITES[0]]
    assert bool(np.all(got.valid))
    assert np.array_equal(got.codes[PROMPT + 2], sent[(t, SITES[0], PROMPT + 2)])
    sealed = 2 * N_TRAJ
    base = stack["prom"]

    def scraped() -> bool:
        q = api(
            base,
            "/api/v1/query",
            query="sum(tracestore_sealed_trajectories_total) and sum(tracestore_read_bytes_total) > 0",
        )
        res = q["data"]["result"]
        return bool(res) and float(res[0]["value"][1]) >= sealed

    wait_for("Prometheus to scrape the workload", scraped, 30)

    def rate_window_filled() -> bool:
        # >= 3 scrapes inside the 4 s rate window (rate() needs 2), and so >= 2 rule evaluations since
        q = api(
            base, "/api/v1/query", query=f'count_over_time(tracestore_build_info{{job="tracestore"}}[{RATE_INTERVAL}])'
        )
        res = q["data"]["result"]
        return bool(res) and float(res[0]["value"][1]) >= 3

    wait_for("the rate window to hold the workload's samples", rate_window_filled, 30)
    return {"ids": ids}


def variable_values(base: str, dash: dict[str, Any]) -> dict[str, list[str]]:
    """Resolve the dashboard's query variables like Grafana does (label_values via the series API)."""
    import re

    values: dict[str, list[str]] = {"datasource": ["prometheus"]}
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["query"].strip())
        assert m, var["query"]
        selector = m.group(1)
        for name, vals in values.items():
            selector = selector.replace(f"${name}", "|".join(vals))
        series = api(base, "/api/v1/series", **{"match[]": selector})["data"]
        values[var["name"]] = sorted({s[m.group(2)] for s in series if m.group(2) in s})
    return values


def live_problems(h: Any, base: str, dash: dict[str, Any], exported: set[str]) -> list[str]:
    """Every panel target: substituted, parsed, naming exported metrics, returning a non-empty result."""
    values = variable_values(base, dash)
    problems = [f"variable {k} resolved to nothing" for k, v in values.items() if not v]
    recorded = h.recorded_names()
    for p in dash["panels"]:
        for t in p.get("targets", []):
            expr = h.substitute(t["expr"], values, RATE_INTERVAL)
            try:
                names = h.metric_names(expr)
            except ValueError as exc:
                problems.append(f"{p['title']}: does not parse: {exc}")
                continue
            problems += [f"{p['title']}: {n} is not exported" for n in sorted(names - exported - recorded)
                         if n not in h.PROMETHEUS_SYNTHETIC]  # fmt: skip
            r = api(base, "/api/v1/query", query=expr)
            if r.get("status") != "success":
                problems.append(f"{p['title']}: Prometheus refused it: {r.get('error')}")
            elif not r["data"]["result"]:
                problems.append(f"{p['title']}: empty result for {expr}")
    return problems


@pytest.fixture(scope="module")
def live_metrics(stack: dict[str, Any], workload: dict[str, Any]) -> str:
    return http_get(stack["metrics"]).decode()


@pytest.fixture(scope="module")
def exported(live_metrics: str, h: Any) -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    return set(h.exposition_names(text_string_to_metric_families(live_metrics)))


def test_target_is_up(stack, workload):
    targets = api(stack["prom"], "/api/v1/targets")["data"]["activeTargets"]
    assert [(t["labels"]["job"], t["health"]) for t in targets] == [("tracestore", "up")], targets


def test_every_dashboard_query_returns_data(h, stack, workload, exported):
    dash = json.loads(h.DASHBOARD.read_text())
    values = variable_values(stack["prom"], dash)
    assert values["job"] == ["tracestore"] and values["namespace"] == [NAMESPACE] and values["pod"] == [POD]
    problems = live_problems(h, stack["prom"], dash, exported)
    assert not problems, "\n".join(problems)


def test_broken_dashboard_fails_the_same_check(h, stack, workload, exported):
    dash = copy.deepcopy(json.loads(h.DASHBOARD.read_text()))
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    renamed, unparsable, wrong_label = panels[7], panels[8], panels[9]  # Ingest throughput, Token rows, Resends
    renamed["targets"][0]["expr"] = renamed["targets"][0]["expr"].replace(
        "tracestore_ingest_bytes_total", "tracestore_ingest_byte_total"
    )
    unparsable["targets"][0]["expr"] = 'sum(rate(tracestore_ingest_records_total{job=~"$job"}[$__rate_interval])'
    wrong_label["targets"][0]["expr"] = wrong_label["targets"][0]["expr"].replace('pod=~"$pod"', 'pod=~"$pod-x"')
    problems = live_problems(h, stack["prom"], dash, exported)
    assert any(renamed["title"] in p and "not exported" in p for p in problems), problems
    assert any(renamed["title"] in p and "empty result" in p for p in problems), problems
    assert any(unparsable["title"] in p and "does not parse" in p for p in problems), problems
    assert any(wrong_label["title"] in p and "empty result" in p for p in problems), problems


def test_every_rule_is_healthy(h, stack, workload):
    def evaluated() -> list[dict[str, Any]]:
        groups = api(stack["prom"], "/api/v1/rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return rules if rules and all(not r["lastEvaluation"].startswith("0001") for r in rules) else []

    rules = wait_for("every rule to be evaluated", evaluated, 20)
    assert len(rules) == len(h.all_rules())
    bad = [(r["name"], r["health"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert bad == []
    # a healthy sidecar under a normal workload raises no alert, not even a pending one
    active = [(r["name"], r["state"]) for r in rules if r["type"] == "alerting" and r["state"] != "inactive"]
    assert active == []


def test_rules_name_only_live_metrics(h, workload, exported):
    recorded = h.recorded_names()
    for rule in h.all_rules():
        missing = h.metric_names(rule["expr"]) - exported - recorded - h.PROMETHEUS_SYNTHETIC
        assert missing == set(), rule.get("alert") or rule.get("record")


def test_promtool_check_metrics(h, live_metrics):
    promtool = h.tool("promtool")
    proc = subprocess.run([promtool, "check", "metrics"], input=live_metrics, capture_output=True, text=True,
                          timeout=30, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_labels_are_bounded(h, workload, live_metrics):
    from prometheus_client.parser import text_string_to_metric_families

    ids = workload["ids"]
    series_per_family: dict[str, int] = {}
    for fam in text_string_to_metric_families(live_metrics):
        for sample in fam.samples:
            extra = set(sample.labels) - h.BOUNDED_LABELS
            assert not extra, f"{sample.name} carries labels {extra}"
            leaked = {v for v in sample.labels.values() if v in ids or any(i in v for i in ids)}
            assert not leaked, f"{sample.name} carries run/writer/trajectory ids {leaked}"
            series_per_family[fam.name] = series_per_family.get(fam.name, 0) + 1
    # every tracestore_* family, workload or not, stays small (histograms: ~20 series per label set)
    assert series_per_family and max(series_per_family.values()) <= 64, series_per_family


def test_shm_staging_is_reported(stack, workload):
    """The shm writer registered an 8 MiB staging pool over the unix socket: its capacity shows."""
    q = api(stack["prom"], "/api/v1/query", query="sum(tracestore_shm_capacity_bytes)")
    assert float(q["data"]["result"][0]["value"][1]) > 0


def test_sigterm_drains_and_exits(stack, workload):
    """The sidecar half of the Kubernetes shutdown story: SIGTERM -> exit 0 well within its grace."""
    serve = stack["serve"]
    t0 = time.monotonic()
    serve.send_signal(signal.SIGTERM)
    assert serve.wait(15) == 0
    assert time.monotonic() - t0 < 10 + 2  # --grace 10


@pytest.fixture(scope="module")
def outage(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A sidecar whose object storage is unreachable, after a recorder tried to write through it."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from tracestore.client import RolloutRecorder, SiteOutput

    from tracestore.records import RunSpec, SiteSpec

    pytest.importorskip("s3fs", reason="the s3 extra is not installed")
    tmp = tmp_path_factory.mktemp("outage")
    dead = free_port()  # nothing listens here: every S3 call is refused
    ready = tmp / "ready.json"
    options = {"endpoint_url": f"http://127.0.0.1:{dead}", "key": "ci", "secret": "ci"}
    log = open(tmp / "serve.log", "wb")  # noqa: SIM115
    serve = subprocess.Popen(
        [sys.executable, "-m", "tracestore.cli", "serve", "--storage", "s3://tracestore-ci/records",
         "--storage-timeout", "2", "--flush-interval", "0.5",
         "--wal-dir", str(tmp / "wal"), "--port", "0", "--metrics-port", "0", "--grace", "3",
         "--ready-file", str(ready)],
        stdout=log, stderr=subprocess.STDOUT, cwd=tmp,
        env={**os.environ, "TRACESTORE_STORAGE_OPTIONS": json.dumps(options)},  # credentials: never the command line
    )  # fmt: skip
    try:
        info = wait_for("tracestore serve to be ready", lambda: ready.exists() and json.loads(ready.read_text()), 60,
                        serve)  # fmt: skip
        address = f"127.0.0.1:{info['port']}"

        def health(service: str = "") -> int:
            with grpc.insecure_channel(address) as ch:
                request = health_pb2.HealthCheckRequest(service=service)
                return int(health_pb2_grpc.HealthStub(ch).Check(request, timeout=5).status)

        before = health()
        spec = RunSpec(RUN, (SiteSpec(SITES[0], "moe_input", 0, 64),))
        rec = RolloutRecorder(address, spec, "ci-outage-writer", staging_bytes=1 << 20, give_up_s=5)
        try:
            n = 4
            codes = np.zeros((n, spec.sites[0].code_bytes), np.uint8)
            scales = np.full((n, spec.sites[0].scale_bytes), 56, np.uint8)
            rec.record_forward([("ci-outage-traj", 0, n)], {SITES[0]: SiteOutput(codes, scales, 1.0)})
            acked = rec.flush(timeout=4)
        finally:
            rec.close()
        metrics = wait_for(
            "the outage to show in the metrics",
            lambda: (
                (m := http_get(f"http://127.0.0.1:{info['metrics_port']}/metrics").decode())
                and "tracestore_storage_errors_total{" in m
                and m
            ),
            20,
        )
        return {
            "before": before,
            "after": health(),
            "liveness_after": health("tracestore.v1.Liveness"),  # what deploy/k8s's probes watch
            "acked": acked,
            "metrics": metrics,
            "ids": {RUN, "ci-outage-writer", "ci-outage-traj"},
            "serving": health_pb2.HealthCheckResponse.SERVING,
        }
    finally:
        stop(serve)
        log.close()


def test_readiness_does_not_depend_on_storage(outage):
    """What the Kubernetes probes see during an S3 outage (they watch tracestore.v1.Liveness): SERVING
    before and after writes fail, with the failure visible in the metrics (TraceStoreStorageErrors)
    instead. The overall name stays SERVING too until --storage-unhealthy (300 s) has passed."""
    assert outage["before"] == outage["serving"]
    assert outage["after"] == outage["serving"]
    assert outage["liveness_after"] == outage["serving"]
    assert "tracestore_storage_errors_total{" in outage["metrics"]


def test_labels_stay_bounded_during_an_outage(h, outage):
    """Storage retries/errors are labelled by operation only (once 'write <run>/run.json' leaked ids)."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(outage["metrics"]):
        for sample in fam.samples:
            leaked = {v for v in sample.labels.values() if any(i in v for i in outage["ids"])}
            assert not leaked, f"{sample.name} carries run/writer/trajectory ids {leaked}"
