"""Static and semantic checks of deploy/k8s (kustomize base and overlays) and yamllint on deploy/."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

KUBE_VERSIONS = ("1.29.0", None)  # None = the newest schema kubernetes-validate ships


def raw_manifests(h) -> list[Path]:
    """Complete objects under deploy/k8s (patches are partial: they are checked in the rendered output)."""
    patches = set()
    for kust in (h.DEPLOY / "k8s").rglob("kustomization.yaml"):
        for patch in yaml.safe_load(kust.read_text()).get("patches", []):
            patches.add((kust.parent / patch["path"]).resolve())
    files = sorted((h.DEPLOY / "k8s").rglob("*.yaml"))
    return [f for f in files if f.name != "kustomization.yaml" and f.resolve() not in patches]


def rendered(h, overlay: str) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = h.kustomize(h.DEPLOY / "k8s" / "overlays" / overlay)
    return docs


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def containers(deploy: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    spec = deploy["spec"]["template"]["spec"]
    (sidecar,) = [c for c in spec["initContainers"] if c["name"] == "tracestore"]
    (engine,) = [c for c in spec["containers"] if c["name"] == "engine"]
    return sidecar, engine


def env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def to_seconds(value: str | int) -> int:
    return int(value)


def quantity_bytes(q: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}
    m = re.fullmatch(r"(\d+)([A-Za-z]*)", q)
    if m is None:
        raise ValueError(f"unsupported quantity {q!r}")
    return int(m.group(1)) * units.get(m.group(2), 1)


# ---- linters -------------------------------------------------------------------------------------


def test_yamllint(h):
    yamllint = h.tool("yamllint")
    proc = h.run([yamllint, "-s", "-c", str(h.DEPLOY / ".yamllint.yaml"), str(h.DEPLOY)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_yamllint_catches_a_broken_file(h, tmp_path: Path):
    yamllint = h.tool("yamllint")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: 1\na: 2\nb:   [1,2\n")
    proc = h.run([yamllint, "-c", str(h.DEPLOY / ".yamllint.yaml"), str(bad)])
    assert proc.returncode != 0


@pytest.mark.parametrize("version", KUBE_VERSIONS, ids=["1.29", "newest"])
def test_kubernetes_validate_raw(h, version):
    kv = h.tool("kubernetes-validate")
    argv = [kv, "--strict", "--quiet"] + (["-k", version] if version else []) + [str(f) for f in raw_manifests(h)]
    proc = h.run(argv)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("version", KUBE_VERSIONS, ids=["1.29", "newest"])
@pytest.mark.parametrize("overlay", ["sglang", "vllm"])
def test_kubernetes_validate_kustomized(h, tmp_path: Path, overlay, version):
    kv = h.tool("kubernetes-validate")
    out = tmp_path / f"{overlay}.yaml"
    out.write_text(yaml.safe_dump_all(rendered(h, overlay)))
    proc = h.run([kv, "--strict", "--quiet"] + (["-k", version] if version else []) + [str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_kubernetes_validate_strict_catches_a_typo(h, tmp_path: Path):
    """Negative control: strict validation rejects an unknown field in the sidecar spec."""
    kv = h.tool("kubernetes-validate")
    text = (h.DEPLOY / "k8s" / "base" / "rollout.yaml").read_text()
    broken = tmp_path / "rollout.yaml"
    line = "\n          restartPolicy: Always\n"
    assert text.count(line) == 1
    broken.write_text(text.replace(line, line + "          readOnlyRootFS: true\n"))
    proc = h.run([kv, "--strict", "--quiet", "-k", "1.29.0", str(broken)])
    assert proc.returncode != 0
    assert "'readOnlyRootFS' was unexpected" in proc.stdout + proc.stderr


def test_native_sidecar_needs_the_1_29_schema(h):
    """Negative control for the version pin: Kubernetes 1.27's schema has no init-container restartPolicy."""
    kv = h.tool("kubernetes-validate")
    proc = h.run([kv, "--strict", "--quiet", "-k", "1.27.0", str(h.DEPLOY / "k8s" / "base" / "rollout.yaml")])
    assert proc.returncode != 0
    assert "'restartPolicy' was unexpected" in proc.stdout + proc.stderr


# ---- semantics of the rendered overlays -----------------------------------------------------------


@pytest.fixture(scope="module", params=["sglang", "vllm"])
def docs(request, h) -> list[dict[str, Any]]:
    return rendered(h, request.param)


def test_native_sidecar(docs):
    deploy = one(docs, "Deployment")
    sidecar, engine = containers(deploy)
    assert sidecar["restartPolicy"] == "Always"
    assert engine["image"] != "registry.invalid/rollout-engine:unset", "overlay did not set the engine"
    assert "restartPolicy" not in engine


def test_probes_use_grpc_on_a_declared_numeric_port(docs):
    sidecar, _ = containers(one(docs, "Deployment"))
    ports = {p["containerPort"] for p in sidecar["ports"]}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = sidecar[kind]
        assert set(probe) & {"grpc", "httpGet", "exec", "tcpSocket"} == {"grpc"}, f"{kind} must be a gRPC health probe"
        port = probe["grpc"]["port"]
        assert isinstance(port, int) and port in ports, f"{kind} port {port!r} not a container port {ports}"
        assert port == int(env(sidecar)["TRACESTORE_PORT"])
    # liveness must not be stricter than readiness: a slow moment should unready, not restart
    live, ready = sidecar["livenessProbe"], sidecar["readinessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > ready["periodSeconds"] * ready["failureThreshold"]


def test_engine_probe_ports_are_container_ports(docs):
    _, engine = containers(one(docs, "Deployment"))
    ports = {p["containerPort"] for p in engine.get("ports", [])}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        if kind in engine:
            probe = engine[kind]
            port = (probe.get("httpGet") or probe.get("tcpSocket") or probe.get("grpc"))["port"]
            assert isinstance(port, int) and port in ports


def test_shared_volumes(docs):
    deploy = one(docs, "Deployment")
    spec = deploy["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    sidecar, engine = containers(deploy)
    mounts_s = {m["name"]: m["mountPath"] for m in sidecar["volumeMounts"]}
    mounts_e = {m["name"]: m["mountPath"] for m in engine["volumeMounts"]}
    # shared memory: memory-backed, bounded, /dev/shm in both
    shm = [n for n, p in mounts_s.items() if p == "/dev/shm"]
    assert len(shm) == 1 and mounts_e.get(shm[0]) == "/dev/shm"
    assert volumes[shm[0]]["emptyDir"]["medium"] == "Memory"
    assert quantity_bytes(volumes[shm[0]]["emptyDir"]["sizeLimit"]) >= 2**30
    assert env(sidecar)["TRACESTORE_SHM_DIR"] == "/dev/shm"
    # unix socket: same volume, same path, and the engine is told where it is
    sock = env(sidecar)["TRACESTORE_UNIX_SOCKET"]
    sock_dir = str(Path(sock).parent)
    (sock_vol,) = [n for n, p in mounts_s.items() if p == sock_dir]
    assert mounts_e.get(sock_vol) == sock_dir
    assert "emptyDir" in volumes[sock_vol]
    assert env(engine)["TRACESTORE_ADDRESS"] == f"unix://{sock}"
    # every mount refers to a declared volume
    for name in list(mounts_s) + list(mounts_e):
        assert name in volumes, name


def test_sidecar_env_are_serve_flags(h, docs):
    sidecar, _ = containers(one(docs, "Deployment"))
    names = {e["name"] for e in sidecar["env"] if e["name"].startswith("TRACESTORE_")}
    known = h.serve_env_names()
    assert {"TRACESTORE_STORAGE", "TRACESTORE_GRACE"} <= known  # the check itself sees the flags
    assert names - known == set(), "variables `tracestore serve` does not read"


def test_sidecar_writes_only_to_volumes(docs):
    sidecar, _ = containers(one(docs, "Deployment"))
    mounts = {m["mountPath"] for m in sidecar["volumeMounts"]}
    e = env(sidecar)
    assert e["TRACESTORE_WAL_DIR"] in mounts
    assert "/tmp" in mounts
    assert not e["TRACESTORE_STORAGE"].startswith("file://") or any(
        e["TRACESTORE_STORAGE"][len("file://") :].startswith(m) for m in mounts
    )


def test_restricted_security_context_matches_image_user(h, docs):
    deploy = one(docs, "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    sidecar, _ = containers(deploy)
    sc = sidecar["securityContext"]
    user = re.search(r"^USER\s+(\d+)(?::(\d+))?\s*$", h.DOCKERFILE.read_text(), re.M)
    assert user is not None, "the Dockerfile must set a numeric USER"
    assert sc["runAsUser"] == int(user.group(1)) != 0
    if user.group(2):
        assert sc["runAsGroup"] == int(user.group(2))
    assert sc["runAsNonRoot"] is True
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
    seccomp = sc.get("seccompProfile") or pod["securityContext"].get("seccompProfile")
    assert seccomp["type"] in {"RuntimeDefault", "Localhost"}
    assert pod["securityContext"]["fsGroup"] == sc["runAsGroup"]


def test_grace_period_covers_engine_exit_and_drain(docs):
    deploy = one(docs, "Deployment")
    tmpl = deploy["spec"]["template"]
    sidecar, _ = containers(deploy)
    engine_exit = to_seconds(tmpl["metadata"]["annotations"]["tracestore.dev/engine-exit-seconds"])
    drain = float(env(sidecar)["TRACESTORE_GRACE"])
    assert tmpl["spec"]["terminationGracePeriodSeconds"] >= engine_exit + drain


def test_resources(docs):
    sidecar, engine = containers(one(docs, "Deployment"))
    res = sidecar["resources"]
    assert res["requests"]["cpu"] and res["requests"]["memory"] == res["limits"]["memory"]
    budget = int(env(sidecar)["TRACESTORE_MEMORY_BUDGET_MIB"]) * 2**20
    assert quantity_bytes(res["limits"]["memory"]) >= budget + 2**30, "memory limit must exceed the budget"
    assert "nvidia.com/gpu" in engine["resources"]["limits"]


def test_spool_limit_matches_the_spool_alert(h, docs):
    deploy = one(docs, "Deployment")
    sidecar, _ = containers(deploy)
    volumes = {v["name"]: v for v in deploy["spec"]["template"]["spec"]["volumes"]}
    (spool,) = [m["name"] for m in sidecar["volumeMounts"] if m["mountPath"] == env(sidecar)["TRACESTORE_WAL_DIR"]]
    limit = quantity_bytes(volumes[spool]["emptyDir"]["sizeLimit"])
    (rule,) = [r for r in h.all_rules() if r.get("alert") == "TraceStoreSpoolHigh"]
    threshold = eval(rule["expr"].split(">")[-1].strip(), {"__builtins__": {}})  # "8 * 1024 * 1024 * 1024"
    assert 0 < threshold <= limit / 2
    assert quantity_bytes(sidecar["resources"]["limits"]["ephemeral-storage"]) >= limit


def test_podmonitor_scrapes_the_metrics_port(docs):
    deploy = one(docs, "Deployment")
    pm = one(docs, "PodMonitor")
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert pm["metadata"]["namespace"] == deploy["metadata"]["namespace"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    sidecar, _ = containers(deploy)
    names = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert names[endpoint["port"]] == int(env(sidecar)["TRACESTORE_METRICS_PORT"])
    assert "tracestore" in f"{pm['metadata']['namespace']}/{pm['metadata']['name']}"  # job label of TraceStoreDown


def test_network_policies_admit_every_container_port(docs):
    deploy = one(docs, "Deployment")
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    spec = deploy["spec"]["template"]["spec"]
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    selecting = [p for p in policies if p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
    assert selecting, "no NetworkPolicy selects the rollout pods"
    admitted = {port["port"] for p in selecting for rule in p["spec"]["ingress"] for port in rule["ports"]}
    for c in spec["initContainers"] + spec["containers"]:
        for port in c.get("ports", []):
            assert port["containerPort"] in admitted, f"{c['name']} port {port['containerPort']} is never admitted"
    for p in selecting:
        for rule in p["spec"]["ingress"]:
            assert rule.get("from"), f"{p['metadata']['name']}: an ingress rule open to every source"


def test_prometheusrule_holds_the_rules_file(h, docs):
    pr = one(docs, "PrometheusRule")
    assert pr["spec"]["groups"] == h.rules_doc()["groups"]


def test_generated_prometheusrule_is_in_sync(h):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_prometheusrule", h.DEPLOY / "tools" / "gen_prometheusrule.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    expected = gen.render(h.RULES.read_text())
    committed = (h.DEPLOY / "k8s" / "base" / "prometheusrule.yaml").read_text()
    assert committed == expected, "run: python deploy/tools/gen_prometheusrule.py"
    # negative control: a changed rules file no longer matches
    assert gen.render(h.RULES.read_text().replace("> 300", "> 301")) != committed


def test_overlays_are_isolated(h):
    namespaces = {one(rendered(h, o), "Deployment")["metadata"]["namespace"] for o in h.OVERLAYS}
    assert len(namespaces) == len(h.OVERLAYS)
