"""Static checks of the Grafana dashboard and provisioning files."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

SAMPLE_VARS = {"job": ["tracestore"], "namespace": ["rl", "rl-2"], "pod": ["rollout-0"], "datasource": ["prometheus"]}


def load(h) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(h.DASHBOARD.read_text())
    return doc


def panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dash["panels"] if p["type"] != "row"]


def check_queries(h, dash: dict[str, Any], exporter_names: set[str]) -> list[str]:
    """Problems with the dashboard's queries: parse errors, unknown metrics, unsubstituted variables."""
    problems = []
    recorded = h.recorded_names()
    for p in panels(dash):
        for t in p["targets"]:
            try:
                expr = h.substitute(t["expr"], SAMPLE_VARS, "1m")
                names = h.metric_names(expr)
            except (ValueError, KeyError) as exc:
                problems.append(f"{p['title']}: {exc}")
                continue
            for n in names - exporter_names - recorded - h.PROMETHEUS_SYNTHETIC:
                problems.append(f"{p['title']}: {n} is neither exported nor recorded")
    return problems


def test_schema_conventions(h):
    cjs = h.tool("check-jsonschema")
    schema = h.DEPLOY / "grafana" / "dashboard.schema.json"
    proc = h.run([cjs, "--schemafile", str(schema), str(h.DASHBOARD)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "breakage",
    ["no-unit", "no-description", "inputs", "schema-version", "no-pod-variable", "hard-coded-datasource"],
)
def test_schema_rejects_broken_dashboards(h, tmp_path: Path, breakage: str):
    cjs = h.tool("check-jsonschema")
    dash = load(h)
    p = panels(dash)[3]
    if breakage == "no-unit":
        del p["fieldConfig"]["defaults"]["unit"]
    elif breakage == "no-description":
        del p["description"]
    elif breakage == "inputs":
        dash["__inputs"] = [{"name": "DS_PROMETHEUS", "type": "datasource", "pluginId": "prometheus"}]
    elif breakage == "schema-version":
        dash["schemaVersion"] = 36
    elif breakage == "no-pod-variable":
        dash["templating"]["list"] = [v for v in dash["templating"]["list"] if v["name"] != "pod"]
    elif breakage == "hard-coded-datasource":
        p["datasource"] = {"type": "prometheus", "uid": "P1809F7CD0C75ACF3"}
    broken = tmp_path / "tracestore.json"
    broken.write_text(json.dumps(dash))
    schema = h.DEPLOY / "grafana" / "dashboard.schema.json"
    proc = h.run([cjs, "--schemafile", str(schema), str(broken)])
    assert proc.returncode != 0, breakage


def test_every_query_parses_and_names_exported_metrics(h, exporter_names):
    assert check_queries(h, load(h), exporter_names) == []


def test_broken_copy_fails_the_query_check(h, exporter_names):
    """Negative control: a renamed metric and a syntax error are both caught."""
    dash = copy.deepcopy(load(h))
    ps = panels(dash)
    ps[5]["targets"][0]["expr"] = ps[5]["targets"][0]["expr"].replace("tracestore_", "tracestor_", 1)
    ps[7]["targets"][0]["expr"] = "sum(rate(tracestore_ingest_bytes_total[$__rate_interval]"
    problems = check_queries(h, dash, exporter_names)
    assert len(problems) == 2, problems
    assert ps[5]["title"] in problems[0] and ps[7]["title"] in problems[1]


def test_rates_use_rate_interval_and_filter_by_variables(h):
    for p in panels(load(h)):
        for t in p["targets"]:
            for window in re.findall(r"\[([^\]]+)\]", t["expr"]):
                assert window == "$__rate_interval", f"{p['title']}: range [{window}]"
            for selector in re.findall(r"\b(?:tracestore_\w+|up)\{([^}]*)\}", t["expr"]):
                for var in ("job", "namespace", "pod"):
                    assert f'{var}=~"${var}"' in selector, f"{p['title']}: selector {{{selector}}} ignores ${var}"
            assert "{" in t["expr"], f"{p['title']}: a query without a selector ignores the variables"


def test_variables_chain(h):
    vs = {v["name"]: v for v in load(h)["templating"]["list"]}
    assert vs["datasource"]["type"] == "datasource" and vs["datasource"]["query"] == "prometheus"
    assert vs["job"]["query"] == "label_values(tracestore_build_info, job)"
    assert "$job" in vs["namespace"]["query"]
    assert "$job" in vs["pod"]["query"] and "$namespace" in vs["pod"]["query"]
    for name in ("job", "namespace", "pod"):
        assert vs[name]["includeAll"] and vs[name]["allValue"] == ".*"


def test_rows_and_layout(h):
    dash = load(h)
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    for word in ("Health", "Ingest", "Durability", "Memory", "Reads"):
        assert any(word in r for r in rows), word
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps another panel"
                cells.add((x, y))


def test_provisioning(h):
    prov = h.DEPLOY / "grafana" / "provisioning"
    dashboards = yaml.safe_load((prov / "dashboards" / "tracestore.yml").read_text())
    (provider,) = dashboards["providers"]
    assert dashboards["apiVersion"] == 1 and provider["type"] == "file" and provider["options"]["path"]
    datasources = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())
    (ds,) = datasources["datasources"]
    assert datasources["apiVersion"] == 1 and ds["type"] == "prometheus" and ds["url"].startswith("http")
    assert ds["jsonData"]["timeInterval"] == "15s"  # = the PodMonitor interval
    pm = yaml.safe_load((h.DEPLOY / "k8s" / "base" / "podmonitor.yaml").read_text())
    assert pm["spec"]["podMetricsEndpoints"][0]["interval"] == ds["jsonData"]["timeInterval"]
