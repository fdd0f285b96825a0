"""Static checks of deploy/prometheus: promtool config/rules/unit tests, runbooks, metric names, labels."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml


def test_promtool_check_rules(h):
    promtool = h.tool("promtool")
    proc = h.run([promtool, "check", "rules", str(h.RULES)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(h.all_rules())} rules found" in proc.stdout


def test_promtool_unit_tests_pass(h):
    promtool = h.tool("promtool")
    proc = h.run([promtool, "test", "rules", str(h.RULE_TESTS)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_alert_has_a_firing_and_a_quiet_case(h):
    tests = yaml.safe_load(h.RULE_TESTS.read_text())["tests"]
    firing: set[str] = set()
    quiet: set[str] = set()
    for t in tests:
        for case in t.get("alert_rule_test", []):
            (firing if case["exp_alerts"] else quiet).add(case["alertname"])
    alerts = {r["alert"] for r in h.all_rules() if "alert" in r}
    assert alerts - firing == set(), "alerts without a firing unit test"
    assert alerts - quiet == set(), "alerts without a non-firing unit test"


def test_promtool_unit_tests_catch_a_broken_rule(h, tmp_path: Path):
    """Negative control: the same unit tests fail once one alert's threshold is wrong."""
    promtool = h.tool("promtool")
    (tmp_path / "rules").mkdir()
    (tmp_path / "tests").mkdir()
    text = h.RULES.read_text()
    broken = text.replace(
        "tracestore_backlog_oldest_age_seconds) > 300", "tracestore_backlog_oldest_age_seconds) > 3000"
    )
    assert broken != text
    (tmp_path / "rules" / "tracestore.rules.yml").write_text(broken)
    shutil.copy(h.RULE_TESTS, tmp_path / "tests")
    proc = h.run([promtool, "test", "rules", str(tmp_path / "tests" / h.RULE_TESTS.name)])
    assert proc.returncode != 0
    assert "TraceStoreBacklogAgeHigh" in proc.stdout + proc.stderr


def test_promtool_check_ci_config(h, tmp_path: Path):
    promtool = h.tool("promtool")
    shutil.copytree(h.DEPLOY / "prometheus", tmp_path / "prometheus")
    targets = tmp_path / "prometheus" / "ci" / "targets"
    targets.mkdir()
    (targets / "tracestore.json").write_text('[{"targets": ["127.0.0.1:9433"], "labels": {"pod": "p"}}]')
    proc = h.run([promtool, "check", "config", str(tmp_path / "prometheus" / "ci" / "prometheus.yml")])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 rule files found" in proc.stdout


def test_promtool_check_example_config(h, tmp_path: Path):
    """The example config is valid. Debian's Prometheus is built without Kubernetes discovery, so
    where promtool rejects only `kubernetes_sd_configs`, the rest is checked without that block and
    the block's relabelling is checked against the pod-role meta labels below."""
    promtool = h.tool("promtool")
    shutil.copytree(h.DEPLOY / "prometheus", tmp_path / "prometheus")
    path = tmp_path / "prometheus" / "prometheus.example.yml"
    proc = h.run([promtool, "check", "config", str(path)])
    if proc.returncode != 0 and "field kubernetes_sd_configs not found" in proc.stdout + proc.stderr:
        doc = yaml.safe_load(path.read_text())
        for job in doc["scrape_configs"]:
            sd = job.pop("kubernetes_sd_configs", None)
            if sd is not None:
                assert sd == [{"role": "pod"}]
                for relabel in job["relabel_configs"]:
                    for label in relabel.get("source_labels", []):
                        assert label.startswith(("__meta_kubernetes_pod_", "__meta_kubernetes_namespace")), label
                job["static_configs"] = [{"targets": ["placeholder:9433"]}]
        path.write_text(yaml.safe_dump(doc))
        proc = h.run([promtool, "check", "config", str(path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 rule files found" in proc.stdout


def test_every_alert_is_documented(h):
    anchors = h.github_anchors(h.README.read_text())
    base = "https://github.com/tracestore/tracestore/blob/main/deploy/README.md#"
    for rule in h.all_rules():
        if "alert" not in rule:
            continue
        name = rule["alert"]
        ann, labels = rule.get("annotations", {}), rule.get("labels", {})
        assert labels.get("severity") in {"warning", "critical"}, name
        assert ann.get("summary") and ann.get("description"), name
        url = ann.get("runbook_url", "")
        assert url.startswith(base), f"{name}: runbook_url {url!r} must point into deploy/README.md"
        anchor = url[len(base) :]
        assert anchor == name.lower(), name
        assert anchor in anchors, f"{name}: deploy/README.md has no heading for #{anchor}"


def test_alert_and_record_names_are_unique(h):
    names = [r.get("alert") or r.get("record") for r in h.all_rules()]
    assert len(names) == len(set(names))


def test_rules_name_only_exported_metrics(h, exporter_names):
    recorded = h.recorded_names()
    for rule in h.all_rules():
        for name in h.metric_names(rule["expr"]):
            ok = name in exporter_names or name in recorded or name in h.PROMETHEUS_SYNTHETIC
            assert ok, f"{rule.get('alert') or rule.get('record')}: {name} is not exported by server/metrics.py"


def test_metric_check_catches_a_misspelled_name(h, exporter_names):
    """Negative control for the check above."""
    names = h.metric_names("rate(tracestore_ingest_byte_total[5m])")
    assert names == {"tracestore_ingest_byte_total"}
    assert not names <= exporter_names


def test_rules_group_only_by_bounded_labels(h):
    allowed = {"job", "namespace", "pod", "instance"} | h.BOUNDED_LABELS
    for rule in h.all_rules():
        labels = h.grouping_labels(rule["expr"])
        assert labels <= allowed, f"{rule.get('alert') or rule.get('record')} groups by {labels - allowed}"


def test_every_design_signal_has_an_alert(h):
    """The signals the SRE brief names each drive at least one alert."""
    exprs = " ".join(r["expr"] for r in h.all_rules() if "alert" in r)
    exprs += " ".join(r["expr"] for r in h.all_rules() if "record" in r)
    for metric in (
        "tracestore_backlog_oldest_age_seconds",
        "tracestore_last_commit_timestamp_seconds",
        "tracestore_durable_ack_latency_seconds_bucket",
        "tracestore_requests_total",
        "tracestore_backpressure_events_total",
        "tracestore_storage_retries_total",
        "tracestore_storage_errors_total",
        "tracestore_checksum_failures_total",
        "tracestore_shm_in_use_bytes",
        "tracestore_wal_bytes",
        "tracestore_memory_in_use_bytes",
        "tracestore_unguided_trajectories_total",
        "tracestore_degraded",
    ):
        assert metric in exprs, metric


@pytest.mark.parametrize("severity", ["warning", "critical"])
def test_both_severities_used(h, severity):
    assert any(r.get("labels", {}).get("severity") == severity for r in h.all_rules() if "alert" in r)
