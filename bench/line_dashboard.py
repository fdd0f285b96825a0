"""The Grafana dashboard's view of a bench_line run: Prometheus scrapes the run's sidecars and the
dashboard's own panel queries are evaluated over the sustained window.

:class:`LineDashboard` starts a Prometheus binary (``--prometheus BIN`` of bench_line) on a free
loopback port, in a directory of its own, with a generated config: a 1 s scrape of every sidecar's
metrics endpoint under job ``tracestore`` with the labels Kubernetes pod discovery would add
(namespace ``bench``, pod ``sidecar-<j>``), no rule files. It waits until every target is up.
After the engines finish (the sidecars still running), :meth:`LineDashboard.evaluate` reads the
panels named in :data:`PANELS` from ``deploy/grafana/dashboards/tracestore.json`` by title,
substitutes the dashboard variables as Grafana does with its saved selection (All: the variable's
``allValue``; ``$__rate_interval``: :func:`rate_interval`), and runs each target's expression with
``query_range`` over [t0, t1] at a 1 s step. One row per panel: per target, each series' and the
node's statistics (:func:`stats`; the node: the series summed, or their max for a
``max by`` query) and a decimated series (seconds from t0). The "Backlog" row
also carries the verdict ``flat`` (:func:`backlog_verdict`). Prometheus is stopped (SIGTERM, wait,
SIGKILL) when the context exits, on errors too.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "dashboards" / "tracestore.json"
PANELS = (
    "Backlog",
    "Oldest backlog record",
    "Ingest throughput",
    "Ingest by pod",
    "Sidecar CPU",
    "Shared-memory staging",
    "Write-ahead spool",
    "Unguided trajectories",
    "Memory budget",
    "Sidecars up",
)
NAMESPACE = "bench"
JOB = "tracestore"
SCRAPE_S = 1.0
STEP_S = 1.0
POINTS = 60  # decimated series per target, about
FLAT_SLACK = 0.10  # growth over the window, of the mean backlog, that still reads as flat
FLAT_FLOOR = 64 << 20  # bytes per sidecar: a shard commit's sawtooth


def rate_interval(scrape_s: float, step_s: float) -> str:
    """Grafana's ``$__rate_interval`` for a Prometheus data source: max(4 x scrape interval, step +
    scrape interval), in whole seconds."""
    return f"{math.ceil(max(4 * scrape_s, step_s + scrape_s))}s"


_VAR = re.compile(r"\$(\w+)|\$\{(\w+)(?::\w+)?\}")


def _regex_value(v: str) -> str:
    # a regex-escaped value inside a PromQL double-quoted string: its backslashes doubled
    return re.escape(v).replace("\\", "\\\\")


def substitute(expr: str, values: dict[str, str | list[str]], rate: str) -> str:
    """Grafana's interpolation of a Prometheus query: ``$__rate_interval`` becomes ``rate``; a
    variable given as a ``str`` is put in as is (an All selection's ``allValue``), a list of values
    as one escaped value or an escaped ``(a|b)`` group. KeyError names an unknown variable."""
    expr = expr.replace("${__rate_interval}", rate).replace("$__rate_interval", rate)

    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise KeyError(f"the query uses ${name}, which is not a dashboard variable")
        v = values[name]
        if isinstance(v, str):
            return v
        if len(v) == 1:
            return _regex_value(v[0])
        return "(" + "|".join(_regex_value(x) for x in v) + ")"

    return _VAR.sub(one, expr)


def saved_selection(dash: dict[str, Any]) -> dict[str, str | list[str]]:
    """Each query variable's saved selection: All with an ``allValue`` gives that value; explicit
    values give the list. ValueError for an All without ``allValue`` (it would need the label
    values looked up)."""
    out: dict[str, str | list[str]] = {}
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        cur = var.get("current", {}).get("value", [])
        cur = [cur] if isinstance(cur, str) else list(cur)
        if "$__all" in cur:
            if not var.get("allValue"):
                raise ValueError(f"variable {var['name']}: All is selected and there is no allValue")
            out[var["name"]] = var["allValue"]
        else:
            out[var["name"]] = cur
    return out


def find_panels(dash: dict[str, Any], titles: tuple[str, ...] = PANELS) -> dict[str, dict[str, Any]]:
    """The panels titled ``titles`` (rows' nested panels included); ValueError names any missing."""
    found: dict[str, dict[str, Any]] = {}

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            if p.get("title") in titles and p.get("targets"):
                found.setdefault(p["title"], p)
            walk(p.get("panels", []))

    walk(dash.get("panels", []))
    missing = [t for t in titles if t not in found]
    if missing:
        raise ValueError(f"{DASHBOARD.name} has no panel titled {missing} (with queries)")
    return found


def slope(ts: list[float], vs: list[float]) -> float:
    """Least-squares slope of ``vs`` over ``ts`` (per second); nan with fewer than two points."""
    n = len(ts)
    if n < 2:
        return float("nan")
    mt, mv = sum(ts) / n, sum(vs) / n
    den = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (v - mv) for t, v in zip(ts, vs, strict=True)) / den if den else float("nan")


def stats(ts: list[float], vs: list[float]) -> dict[str, Any]:
    """Samples, mean of the first and of the last third, max, least-squares slope per second."""
    n = len(vs)
    third = max(1, n // 3)

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else float("nan")

    return {"samples": n, "first_third_mean": mean(vs[:third]), "last_third_mean": mean(vs[-third:]),
            "max": max(vs, default=float("nan")), "slope_per_s": slope(ts, vs)}  # fmt: skip


def decimate(ts: list[float], vs: list[float], points: int = POINTS) -> list[tuple[float, float]]:
    """About ``points`` (t, v) pairs, evenly strided, the last one kept."""
    stride = max(1, math.ceil(len(ts) / points))
    keep = list(range(0, len(ts), stride))
    if ts and keep[-1] != len(ts) - 1:
        keep.append(len(ts) - 1)
    return [(round(ts[i], 2), vs[i]) for i in keep]


def backlog_verdict(ts: list[float], node: list[float], budget: float, sidecars: int = 1) -> dict[str, Any]:
    """Whether the Backlog panel's node line is ``flat``: its least-squares growth over the window
    (slope x window) is at most :data:`FLAT_SLACK` of its mean, or at most ``FLAT_FLOOR`` bytes per
    sidecar (a shard commit's sawtooth); a line that keeps climbing is not flat however much
    budget is left. ``room_60s`` is bench_line's ``sustained`` rule on the sidecars' terms: the
    backlog stayed under half of the summed budget, or its half-to-half growth would not fill the
    budget left above its max within 60 s more."""
    if len(ts) < 2 or budget <= 0:
        return {"flat": False, "flat_rule": "no data"}
    window = ts[-1] - ts[0]
    mean = sum(node) / len(node)
    growth = slope(ts, node) * window
    mid = (ts[0] + ts[-1]) / 2
    a = [v for t, v in zip(ts, node, strict=True) if t < mid]
    b = [v for t, v in zip(ts, node, strict=True) if t >= mid]
    rate = ((sum(b) / len(b) if b else 0.0) - (sum(a) / len(a) if a else 0.0)) / max(window / 2, 1e-9)
    peak = max(node)
    far = peak < budget / 2
    return {"flat": bool(growth <= max(FLAT_SLACK * mean, FLAT_FLOOR * sidecars)),
            "growth_over_window_bytes": growth, "room_60s": bool(far or rate * 60 < budget - peak),
            "far_from_budget": far, "growth_Bps": rate, "budget_bytes": budget,
            "slope_x_window_of_budget": growth / budget,
            "flat_rule": f"least-squares growth over the window <= max({FLAT_SLACK:g} x mean, "
                         f"{FLAT_FLOOR >> 20} MiB x sidecars)"}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LineDashboard:
    """``with LineDashboard(binary, workdir) as d: d.start(ports); ...; rows = d.evaluate(t0, t1)``.

    ``binary`` None: disabled (``start`` does nothing, ``evaluate`` returns ``[]``). The panels are
    looked up when it is made (ValueError names a missing one), before any run."""

    def __init__(self, binary: str | None, workdir: Path, dashboard: Path = DASHBOARD) -> None:
        self.binary, self.workdir = binary, Path(workdir)
        self.proc: subprocess.Popen[bytes] | None = None
        self.base = ""
        self.pods: list[str] = []
        if binary is None:
            return
        if shutil.which(binary) is None:
            raise FileNotFoundError(f"--prometheus {binary}: no such executable")
        self.dash = json.loads(dashboard.read_text())
        self.panels = find_panels(self.dash)
        self.values = saved_selection(self.dash)
        self.rate = rate_interval(SCRAPE_S, STEP_S)

    def __enter__(self) -> LineDashboard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- Prometheus

    def start(self, metrics_ports: list[int], timeout: float = 60.0) -> None:
        """Prometheus scraping ``127.0.0.1:<port>`` for each port (pod ``sidecar-<j>``); returns
        once every target is up. RuntimeError (with its log's tail) if it is not by ``timeout``."""
        if self.binary is None:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.pods = [f"sidecar-{j}" for j in range(len(metrics_ports))]
        static = [{"targets": [f"127.0.0.1:{p}"], "labels": {"namespace": NAMESPACE, "pod": pod}}
                  for p, pod in zip(metrics_ports, self.pods, strict=True)]  # fmt: skip
        config = {"global": {"scrape_interval": f"{SCRAPE_S:g}s", "scrape_timeout": f"{SCRAPE_S:g}s",
                             "evaluation_interval": f"{SCRAPE_S:g}s"},
                  "scrape_configs": [{"job_name": JOB, "static_configs": static}]}  # fmt: skip
        (self.workdir / "prometheus.yml").write_text(json.dumps(config, indent=1))  # JSON is YAML
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        log = open(self.workdir / "prometheus.log", "wb")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={self.workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.workdir / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
             "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"Prometheus exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                active = self._get("/api/v1/targets", state="active")["data"]["activeTargets"]
                last = sorted((t["labels"].get("pod", "?"), t["health"]) for t in active)
                if len(active) == len(self.pods) and all(t["health"] == "up" for t in active):
                    return
            except (OSError, ValueError, KeyError) as exc:
                last = exc
            time.sleep(0.25)
        raise RuntimeError(f"Prometheus targets not all up after {timeout} s (last: {last!r}):\n{self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        path = self.workdir / "prometheus.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, wait ``timeout`` s, then SIGKILL."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def _get(self, path: str, **params: Any) -> Any:
        url = f"{self.base}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:  # 400/422 carry a JSON error body
            return json.loads(exc.read())

    # -- the panels

    def query_range(self, expr: str, t0: float, t1: float) -> list[dict[str, Any]]:
        r = self._get("/api/v1/query_range", query=expr, start=f"{t0:.3f}", end=f"{t1:.3f}", step=f"{STEP_S:g}")
        if r.get("status") != "success":
            raise RuntimeError(f"Prometheus refused {expr}: {r.get('errorType')}: {r.get('error')}")
        result: list[dict[str, Any]] = r["data"]["result"]
        return result

    def evaluate(self, t0: float, t1: float) -> list[dict[str, Any]]:
        """One row per panel of :data:`PANELS` over [t0, t1] (wall-clock seconds); waits until
        Prometheus has scraped past ``t1``. Times in the rows are seconds from ``t0``."""
        if self.binary is None:
            return []
        wait = t1 + 2 * SCRAPE_S + 0.2 - time.time()
        if wait > 0:
            time.sleep(wait)
        rows = []
        for title in PANELS:
            panel = self.panels[title]
            targets = []
            for t in panel["targets"]:
                expr = substitute(t["expr"], self.values, self.rate)
                agg = "max" if expr.lstrip("( ").startswith("max") else "sum"  # an age's node view: its max
                series: list[dict[str, Any]] = []
                by_t: dict[float, float] = {}
                for s in self.query_range(expr, t0, t1):
                    pts = [(float(ts) - t0, float(v)) for ts, v in s["values"] if math.isfinite(float(v))]
                    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                    for x, y in pts:
                        by_t[x] = y if x not in by_t else max(by_t[x], y) if agg == "max" else by_t[x] + y
                    labels = {k: v for k, v in s["metric"].items() if k != "__name__"}
                    series.append({"labels": labels, **stats(xs, ys), "points": decimate(xs, ys)})
                nx = sorted(by_t)
                ny = [by_t[x] for x in nx]
                targets.append({"ref": t.get("refId"), "legend": t.get("legendFormat"), "expr": expr,
                                "node_of_series": agg,
                                "series": series, "node": {**stats(nx, ny), "points": decimate(nx, ny)},
                                "_node": (nx, ny)})  # fmt: skip
            first = targets[0]["node"]
            row = {"panel": title, "unit": panel.get("fieldConfig", {}).get("defaults", {}).get("unit"),
                   "window_s": t1 - t0, "step_s": STEP_S, "scrape_s": SCRAPE_S, "rate_interval": self.rate,
                   "pods": self.pods, "series": len(targets[0]["series"]),
                   **{f"node_{k}": v for k, v in first.items() if k != "points"}, "targets": targets}  # fmt: skip
            rows.append(row)
        by_title = {r["panel"]: r for r in rows}
        budget_t = [t for t in by_title["Memory budget"]["targets"] if t["ref"] == "B"]
        budget = budget_t[0]["node"]["max"] if budget_t else float("nan")
        nx, ny = by_title["Backlog"]["targets"][0]["_node"]
        by_title["Backlog"].update(backlog_verdict(nx, ny, budget if budget == budget else 0.0, len(self.pods)))
        for r in rows:
            for t in r["targets"]:
                t.pop("_node")
        return rows
