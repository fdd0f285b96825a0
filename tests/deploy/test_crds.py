"""The PodMonitor and PrometheusRule of deploy/k8s/base against the Prometheus Operator's CRD schemas.

tests/deploy/schemas/ holds the two CRDs' ``openAPIV3Schema`` (monitoring.coreos.com/v1) as JSON
Schema, vendored from prometheus-operator v0.93.0 (each file's ``$comment`` names the source path and
commit); no network at test time. Unknown fields are refused here (as ``kubectl apply`` with strict
field validation does; the API server would otherwise prune them silently).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = Path(__file__).resolve().parent / "schemas"
BASE = ROOT / "deploy" / "k8s" / "base"
CASES = {
    "PodMonitor": (BASE / "podmonitor.yaml", SCHEMAS / "podmonitors.monitoring.coreos.com.v1.json"),
    "PrometheusRule": (BASE / "prometheusrule.yaml", SCHEMAS / "prometheusrules.monitoring.coreos.com.v1.json"),
}


def strict(schema: Any) -> Any:
    """The schema with ``additionalProperties: false`` on every object that lists its properties
    (and does not already say what else it admits), and Go's ``^(?i)`` patterns in Python's
    spelling ``(?i)^`` (Python refuses a global flag after the start)."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        lists = "properties" in out and "additionalProperties" not in out
        if lists and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        if isinstance(out.get("pattern"), str) and out["pattern"].startswith("^(?i)"):
            out["pattern"] = "(?i)^" + out["pattern"][5:]
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def validator(kind: str) -> Any:
    jsonschema = pytest.importorskip("jsonschema")
    schema = strict(json.loads(CASES[kind][1].read_text()))
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def errors(kind: str, doc: dict[str, Any]) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator(kind).iter_errors(doc)]


@pytest.mark.parametrize("kind", sorted(CASES))
def test_schemas_are_vendored_with_their_source(kind):
    schema = json.loads(CASES[kind][1].read_text())
    assert "prometheus-operator v0.93.0" in schema["$comment"] and "commit " in schema["$comment"]
    assert schema["properties"]["kind"]["type"] == "string"


@pytest.mark.parametrize("kind", sorted(CASES))
def test_shipped_resource_matches_the_crd_schema(kind):
    (doc,) = [d for d in yaml.safe_load_all(CASES[kind][0].read_text()) if d]
    assert doc["kind"] == kind and doc["apiVersion"] == "monitoring.coreos.com/v1"
    assert errors(kind, doc) == []


def test_a_typo_and_a_wrong_type_are_caught():
    (pm,) = [d for d in yaml.safe_load_all(CASES["PodMonitor"][0].read_text()) if d]
    bad = copy.deepcopy(pm)
    bad["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    assert any("intervall" in e for e in errors("PodMonitor", bad))
    (pr,) = [d for d in yaml.safe_load_all(CASES["PrometheusRule"][0].read_text()) if d]
    bad = copy.deepcopy(pr)
    bad["spec"]["groups"][0]["rules"] = {"alert": "x"}
    assert errors("PrometheusRule", bad)
