"""Static and semantic checks of deploy/k8s (kustomize base and overlays) and yamllint on deploy/."""

from __future__ import annotations

import argparse
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

KUBE_VERSIONS = ("1.29.0", None)  # None = the newest schema kubernetes-validate ships
# Every engine overlay (also in conftest.OVERLAYS; test modules cannot import conftest).
OVERLAYS = ("sglang", "vllm", "example-recording")


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


def rendered_with_serve_reads(h, overlay: str, tmp: Path) -> list[dict[str, Any]]:
    """An engine overlay with the serve-reads component added the documented way: a copy of
    deploy/k8s whose overlay lists ``components: [../../components/serve-reads]``."""
    copy = tmp / "k8s"
    shutil.copytree(h.DEPLOY / "k8s", copy)
    kust = copy / "overlays" / overlay / "kustomization.yaml"
    doc = yaml.safe_load(kust.read_text())
    doc["components"] = [*doc.get("components", []), "../../components/serve-reads"]
    kust.write_text(yaml.safe_dump(doc, sort_keys=False))
    docs: list[dict[str, Any]] = h.kustomize(copy / "overlays" / overlay)
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


def serve_config(h, container_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The ServerConfig `tracestore serve` builds from the image's ENV overlaid by ``container_env``
    (what the container runs with); raises ConfigError where the sidecar would exit 2 at start."""
    from tracestore.server.cli import config_from_args

    from tracestore.cli import build_parser

    for k in [k for k in os.environ if k.startswith("TRACESTORE_")]:
        monkeypatch.delenv(k)
    for k, v in {**h.image_env(), **container_env}.items():
        monkeypatch.setenv(k, v)
    return config_from_args(build_parser().parse_args(["serve"]))


def health_probe(command: list[str], environ: dict[str, str] | None = None) -> argparse.Namespace:
    """An exec probe's command parsed and resolved by the real CLI (in the container's environment):
    it must be `tracestore health ...`."""
    from tracestore.cli import build_parser, resolve

    assert command[0] == "tracestore", command
    ns = build_parser().parse_args(command[1:])
    assert ns.command == "health", command
    return resolve(ns, environ or {})


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
@pytest.mark.parametrize("overlay", OVERLAYS)
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


@pytest.fixture(scope="module", params=OVERLAYS)
def docs(request, h) -> list[dict[str, Any]]:
    return rendered(h, request.param)


def test_native_sidecar(docs):
    deploy = one(docs, "Deployment")
    sidecar, engine = containers(deploy)
    assert sidecar["restartPolicy"] == "Always"
    assert engine["image"] != "registry.invalid/rollout-engine:unset", "overlay did not set the engine"
    assert "restartPolicy" not in engine


def test_probes_exec_tracestore_health_on_the_liveness_name_over_the_socket(docs):
    """Kubelet gRPC probes dial the pod IP in plaintext, where no gRPC listens: every probe runs
    `tracestore health` over the unix socket, on the name a storage outage never turns NOT_SERVING."""
    from tracestore.server import cli_health
    from tracestore.server.rpc.service import LIVENESS

    sidecar, _ = containers(one(docs, "Deployment"))
    e = env(sidecar)
    mounts = {m["mountPath"] for m in sidecar["volumeMounts"]}
    sock = e["TRACESTORE_UNIX_SOCKET"]
    assert str(Path(sock).parent) in mounts
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = sidecar[kind]
        assert set(probe) & {"grpc", "httpGet", "exec", "tcpSocket"} == {"exec"}, f"{kind} must be an exec probe"
        ns = health_probe(probe["exec"]["command"], e)
        assert ns.func is cli_health.run
        assert ns.service == LIVENESS, f"{kind} must watch {LIVENESS} (readiness must not follow storage)"
        assert (ns.target or cli_health.default_target(e)) == f"unix://{sock}", kind
        # the command reports (exit 1, one line) before the kubelet kills it (default timeoutSeconds: 1)
        assert 0 < ns.timeout < probe["timeoutSeconds"], kind
    # liveness must not be stricter than readiness: a slow moment should unready, not restart
    live, ready = sidecar["livenessProbe"], sidecar["readinessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > ready["periodSeconds"] * ready["failureThreshold"]
    # a slow start (WAL replay) has time: startup allows at least a minute
    start = sidecar["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= 60


def test_the_shipped_sidecar_config_starts_and_is_loopback_only(h, docs, monkeypatch):
    """What exited 2 at start: a non-loopback gRPC host without TLS and tokens. The shipped env
    (image ENV + container env) must build a ServerConfig, with gRPC on loopback and no --insecure."""
    from tracestore.server.security.auth import is_loopback_host

    sidecar, _ = containers(one(docs, "Deployment"))
    e = env(sidecar)
    cfg = serve_config(h, e, monkeypatch)
    assert is_loopback_host(cfg.host) and not cfg.insecure
    assert (cfg.tls_cert, cfg.tls_key, cfg.auth_tokens) == (None, None, None)
    assert cfg.unix_socket == e["TRACESTORE_UNIX_SOCKET"]
    assert cfg.metrics_host == "0.0.0.0" and cfg.metrics_port == 9433  # Prometheus scrapes the pod IP
    assert "TRACESTORE_INSECURE" not in e
    # no gRPC port on the pod IP: only the metrics port is declared
    assert {p["containerPort"] for p in sidecar["ports"]} == {cfg.metrics_port}
    # negative control: the previous base (0.0.0.0 without TLS and tokens) is refused
    from tracestore.errors import ConfigError

    with pytest.raises(ConfigError, match="not loopback"):
        serve_config(h, {**e, "TRACESTORE_HOST": "0.0.0.0"}, monkeypatch)


def test_socket_group_is_the_pods_fsgroup(docs):
    """The socket is 0600 by default: an engine of another uid connects through the group (fsGroup is a
    supplemental group of every container), and creates its staging pools in the same group."""
    deploy = one(docs, "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    sidecar, engine = containers(deploy)
    fs_group = pod["securityContext"]["fsGroup"]
    assert env(sidecar)["TRACESTORE_SOCKET_GROUP"] == str(fs_group)
    assert "TRACESTORE_SOCKET_MODE" not in env(sidecar)  # the default with a group: 0660
    assert env(engine)["TRACESTORE_SHM_GROUP"] == str(fs_group)
    assert sidecar["securityContext"]["runAsGroup"] == fs_group  # the sidecar may chown the socket to it


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
    memory = int(env(sidecar)["TRACESTORE_MEMORY_BUDGET_MIB"])
    budget = (memory + int(env(sidecar).get("TRACESTORE_READ_BUDGET_MIB", memory // 4))) * 2**20  # reads' own
    assert quantity_bytes(res["limits"]["memory"]) >= budget + 2**30, "memory limit must exceed both budgets"
    if engine["image"].split("/")[-1].startswith("tracestore-engine-example:"):
        assert "nvidia.com/gpu" not in engine["resources"]["limits"]  # the CPU example engine
    else:
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


def test_no_network_path_to_grpc_by_default(docs):
    """Trainers read storage directly: without serve-reads no policy admits the gRPC port."""
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    ports = {port["port"] for p in policies for rule in p["spec"]["ingress"] for port in rule["ports"]}
    assert 7433 not in ports
    (metrics,) = [
        rule for p in policies for rule in p["spec"]["ingress"] if any(x["port"] == 9433 for x in rule["ports"])
    ]
    assert metrics["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]


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


# ---- the serve-reads component ---------------------------------------------------------------------


@pytest.fixture(scope="module", params=OVERLAYS)
def reads_docs(request, h, tmp_path_factory) -> list[dict[str, Any]]:
    return rendered_with_serve_reads(h, request.param, tmp_path_factory.mktemp(f"reads-{request.param}"))


def test_serve_reads_opens_grpc_with_tls_and_tokens_from_secrets(h, reads_docs, monkeypatch):
    deploy = one(reads_docs, "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    sidecar, _ = containers(deploy)
    e = env(sidecar)
    cfg = serve_config(h, e, monkeypatch)  # starts: TLS and tokens, no --insecure
    assert cfg.host == "0.0.0.0" and not cfg.insecure
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert ports == {"grpc": cfg.port, "metrics": cfg.metrics_port}
    # every file the sidecar reads is a key of a Secret mounted read-only (whole directory: updates
    # reach the files, then SIGHUP)
    volumes = {v["name"]: v for v in pod["volumes"]}
    for var in ("TRACESTORE_TLS_CERT", "TRACESTORE_TLS_KEY", "TRACESTORE_AUTH_TOKENS"):
        path = Path(e[var])
        (mount,) = [m for m in sidecar["volumeMounts"] if m["mountPath"] == str(path.parent)]
        assert mount["readOnly"] is True and "subPath" not in mount, var
        secret = volumes[mount["name"]]["secret"]
        assert secret.get("optional") is not True, f"{var}: the pod must not start without its Secret"
        assert path.name in {i["path"] for i in secret["items"]}, var
        assert secret["defaultMode"] & 0o007 == 0, f"{var}: readable by other users"
        assert secret["defaultMode"] & 0o040, f"{var}: the sidecar reads it through fsGroup"
    # the probes do not change: exec over the unix socket (no token, no TLS needed there)
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "exec" in sidecar[kind] and health_probe(sidecar[kind]["exec"]["command"]).target is None


def test_serve_reads_admits_trainer_pods_on_grpc_only(reads_docs):
    deploy = one(reads_docs, "Deployment")
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    policies = [d for d in reads_docs if d["kind"] == "NetworkPolicy"]
    assert all(p["metadata"]["namespace"] == deploy["metadata"]["namespace"] for p in policies)
    grpc_rules = [
        rule
        for p in policies
        if p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
        for rule in p["spec"]["ingress"]
        if any(x["port"] == 7433 for x in rule["ports"])
    ]
    assert grpc_rules == [
        {
            "from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/component": "trainer"}}}],
            "ports": [{"protocol": "TCP", "port": 7433}],
        }
    ]
    test_network_policies_admit_every_container_port(reads_docs)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubernetes_validate_serve_reads(h, tmp_path: Path, overlay):
    kv = h.tool("kubernetes-validate")
    out = tmp_path / f"{overlay}-reads.yaml"
    out.write_text(yaml.safe_dump_all(rendered_with_serve_reads(h, overlay, tmp_path)))
    for version in KUBE_VERSIONS:
        proc = h.run([kv, "--strict", "--quiet"] + (["-k", version] if version else []) + [str(out)])
        assert proc.returncode == 0, proc.stdout + proc.stderr
